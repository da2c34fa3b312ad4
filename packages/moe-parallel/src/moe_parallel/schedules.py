"""The pipeline schedules: the one table of ``pp_schedule`` names, the torch class each runs and how it places
stages on ranks, and the rules derived from it.

Stages are numbered along the model, ``0 .. pp * vpp - 1``. ``single`` schedules (1F1B, GPipe) give rank ``r``
stage ``r``; ``loop`` (interleaved) gives rank ``r`` stages ``r, r + pp, r + 2 pp, ...``; ``v`` (ZBV, DualPipeV)
gives rank ``r`` stages ``r`` and ``2 pp - 1 - r``, so rank 0 holds both the first and the last.
"""

from __future__ import annotations

from typing import NamedTuple

from moe_parallel.plan import LayoutError


class Schedule(NamedTuple):
    torch_class: str  # in torch.distributed.pipelining.schedules
    style: str  # single | loop | v


SCHEDULES: dict[str, Schedule] = {
    "1F1B": Schedule("Schedule1F1B", "single"),
    "GPipe": Schedule("ScheduleGPipe", "single"),
    "Interleaved1F1B": Schedule("ScheduleInterleaved1F1B", "loop"),
    "ZBVZeroBubble": Schedule("ScheduleZBVZeroBubble", "v"),
    "DualPipeV": Schedule("ScheduleDualPipeV", "v"),
}


def schedule_classes() -> dict[str, type]:
    """``pp_schedule`` name -> torch's schedule class, for those the installed torch provides."""
    from torch.distributed.pipelining import schedules

    return {
        name: getattr(schedules, s.torch_class) for name, s in SCHEDULES.items() if hasattr(schedules, s.torch_class)
    }


def available_schedules() -> list[str]:
    """The ``pp_schedule`` values the installed torch provides."""
    return list(schedule_classes())


def check_schedule_name(name: str) -> None:
    if name not in available_schedules():
        raise LayoutError("pp_schedule", name, f"choose one of {', '.join(available_schedules())}")


def style(schedule: str) -> str:
    return SCHEDULES[schedule].style


def stages_per_rank(schedule: str, vpp: int | None) -> int:
    """``vpp`` as the schedule takes it (None: its default)."""
    if vpp is not None:
        return vpp
    return 1 if style(schedule) == "single" else 2


def rank_stages(schedule: str, pp: int, vpp: int, pp_rank: int) -> list[int]:
    """The stages pipeline rank ``pp_rank`` holds, in model order."""
    if style(schedule) == "v":
        return sorted({pp_rank, 2 * pp - 1 - pp_rank})
    return [pp_rank + k * pp for k in range(vpp)]


def stage_rank(schedule: str, pp: int, stage: int) -> int:
    """The pipeline rank holding ``stage`` (the inverse of :func:`rank_stages`)."""
    if style(schedule) == "v" and stage >= pp:
        return 2 * pp - 1 - stage
    return stage % pp


class _StandInStage:
    """What torch's schedule constructors read of a stage, so that their action lists can be had without a process
    group (``pipeline_order``: every rank's list, whichever rank the stand-in claims to be)."""

    def __init__(self, num_stages: int, group_size: int, stage_index: int) -> None:
        self.num_stages, self.group_size, self.group_rank, self.stage_index = num_stages, group_size, 0, stage_index
        self.submod = None
        self.stage_index_to_group_rank: dict[int, int] = {}


def inflight_microbatches(schedule: str, pp: int, vpp: int, microbatches: int) -> list[int] | None:
    """Per pipeline rank, the most stage micro-batches whose activations it holds at once (forward done, weight
    gradient not yet): what its activation memory is a multiple of. From the schedule's own action list for the
    multi-stage schedules; 1F1B's (``min(m, pp - rank)``) and GPipe's (``m``) by their definition, as torch's 1F1B
    action list numbers the last rank's micro-batches from 1. None when the installed torch has no action list."""
    if style(schedule) == "single":
        return [microbatches if schedule == "GPipe" else min(microbatches, pp - r) for r in range(pp)]
    from torch.distributed.pipelining import schedules

    try:
        stages = [_StandInStage(pp * vpp, pp, i) for i in range(vpp)]
        order = getattr(schedules, SCHEDULES[schedule].torch_class)(stages, microbatches).pipeline_order
        kinds = schedules._ComputationType
    except Exception:  # private parts of torch: another version may lay them out otherwise
        return None
    frees = {"FULL_BACKWARD", "BACKWARD_WEIGHT"}  # an input gradient alone keeps what the weight gradient needs
    peaks = []
    for rank in range(pp):
        alive = peak = 0
        for action in order.get(rank, []):
            if action is None:
                continue
            parts = action.sub_actions if getattr(action, "sub_actions", None) else (action,)
            for part in parts:
                kind = part.computation_type
                if kind == kinds.FORWARD:
                    alive += 1
                elif kind.name in frees:
                    alive -= 1
            peak = max(peak, alive)
        peaks.append(peak)
    return peaks
