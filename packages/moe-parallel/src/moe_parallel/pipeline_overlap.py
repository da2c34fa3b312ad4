"""DualPipeV's overlapped actions with expert-parallel communication hidden (``ep_overlap microbatch`` with
``pp_schedule DualPipeV``).

torch's ``ScheduleDualPipeV`` pairs, in its steady state, the forward of one micro-batch on one of the rank's two
stages with the full backward of another micro-batch on the other stage (an ``OVERLAP_F_B`` action), and runs the two
one after the other unless a function is registered for the action (``register_custom_function``): the hook DeepSeek's
DualPipe fills with its overlap. :func:`overlapped_forward_backward` is that function: the backward runs on the
calling thread and the forward on the side lane of :class:`~moe_dispatch.Lanes`, taking turns at their all-to-alls.

Each half does what torch's runtime does for the plain action (``_PipelineScheduleRuntime._step_microbatches``:
wait for the received input or gradient, run the stage, compute or fetch the loss, hand the result to the rank's
other stage); the receives and sends stay the runtime's own actions around this one. That code reads the runtime's
bookkeeping (``fwd_recv_ops``, ``backward_counter``, the losses), which torch keeps private: a torch that changes
it fails here, in the pipeline equivalence rows with overlap. It runs the schedule as ``StagedModel.forward_backward``
calls it: the outputs kept (``return_outputs``), no loss keyword arguments (the context carries neither).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from moe_dispatch import Lanes


def overlapped_forward_backward(lanes: Lanes) -> Callable[[Any, Any], None]:
    """The ``OVERLAP_F_B`` function of a ``ScheduleDualPipeV`` (module docstring)."""

    def run(action: Any, ctx: Any) -> None:
        schedule = ctx.schedule_ref
        forward, backward = action.sub_actions
        stages = {stage.stage_index: stage for stage in schedule._stages}
        lanes.run(lambda: _backward(schedule, stages, backward), lambda: _forward(schedule, stages, forward, ctx))

    return run


def _forward(schedule: Any, stages: dict[int, Any], action: Any, ctx: Any) -> None:
    from torch.distributed.pipelining.schedules import _wait_batch_p2p

    index, micro = action.stage_index, action.microbatch_index
    stage = stages[index]
    schedule._assert_unsharded(stage)
    if not stage.is_first and index - 1 not in stages:  # its input comes from another rank
        assert (index, micro) in schedule.fwd_recv_ops, f"forward of stage {index} micro-batch {micro} before its input"
        _wait_batch_p2p(schedule.fwd_recv_ops.pop((index, micro)))
    output = stage.forward_one_chunk(micro, ctx.arg_mbs[micro], ctx.kwarg_mbs[micro])
    schedule._maybe_compute_loss(stage, output, ctx.target_mbs, micro)
    if index + 1 in stages:
        stages[index + 1].set_local_fwd_input(output, micro)


def _backward(schedule: Any, stages: dict[int, Any], action: Any) -> None:
    from torch.distributed.pipelining.schedules import FULL_BACKWARD, _wait_batch_p2p

    index, micro = action.stage_index, action.microbatch_index
    stage = stages[index]
    schedule._assert_unsharded(stage)
    if not stage.is_last and index + 1 not in stages:  # its output's gradient comes from another rank
        assert (index, micro) in schedule.bwd_recv_ops, f"backward of stage {index} micro-batch {micro} before its grad"
        _wait_batch_p2p(schedule.bwd_recv_ops.pop((index, micro)))
    loss = schedule._maybe_get_loss(stage, micro)
    full = action.computation_type == FULL_BACKWARD  # DualPipeV's pairs; an input-only backward counts at its W
    if full:
        schedule.backward_counter[index] += 1
    last = full and schedule.backward_counter[index] == schedule._n_microbatches
    stage.backward_one_chunk(micro, loss=loss, full_backward=full, last_backward=last)
    if index - 1 in stages:
        stages[index - 1].set_local_bwd_input(stage.get_local_bwd_output(micro), micro)
