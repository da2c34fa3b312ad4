"""How long one step of a pipeline schedule takes, given each stage's forward and backward time: what a layout
planner ranks pipeline layouts by (the bubble is what this adds to the busiest rank's own work).

The multi-stage schedules (Interleaved1F1B, ZBV, DualPipeV) are simulated from torch's own compute-only action list
(``pipeline_order``, read from the schedule built on stand-in stages as :func:`~moe_parallel.schedules.
inflight_microbatches` does): each rank runs its actions in list order, an action starting once the rank is free and
its inputs exist. Forward of stage s, micro-batch i waits for the forward of stage s - 1; a full or input-gradient
backward waits for its own forward and the next stage's backward; a weight-gradient backward for its input-gradient
one. Communication costs nothing here (the planner adds it to the stage times). The one-stage schedules' action lists
are not what their runtime executes (benchmarks/pipeline_bubble.py), so 1F1B and GPipe take the textbook bound: every
stage's work once plus ``m - 1`` times the slowest stage's, exact when the stages are equal. Long steps (more than
:data:`STEADY_ROUNDS` rounds of ``pp`` micro-batches) are simulated at that length and two rounds less, and extended
along the line through them: by then each round (or pair of rounds, where the schedule's pattern spans two) adds the
same time. Against simulating every action, over random unequal stages: within 0.1% (the test's bound), exact in most.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from moe_parallel.schedules import SCHEDULES, _StandInStage, stage_rank, style

STEADY_ROUNDS = 12  # rounds of pp micro-batches after which a step grows by the same time per round (or two)


@functools.cache
def _action_lists(schedule: str, pp: int, vpp: int, microbatches: int) -> tuple[tuple[tuple[str, int, int], ...], ...]:
    """Each pipeline rank's compute actions, ``(kind, stage, micro-batch)`` with kind F, B (full), I or W."""
    from torch.distributed.pipelining import schedules

    stages = [_StandInStage(pp * vpp, pp, i) for i in range(vpp)]
    order = getattr(schedules, SCHEDULES[schedule].torch_class)(stages, microbatches).pipeline_order
    names = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}
    lists = []
    for rank in range(pp):
        actions = []
        for action in order.get(rank, []):
            if action is None:
                continue
            parts = action.sub_actions if getattr(action, "sub_actions", None) else (action,)
            for part in parts:
                kind = names.get(part.computation_type.name)
                if kind is not None:
                    actions.append((kind, part.stage_index, part.microbatch_index))
        lists.append(tuple(actions))
    return tuple(lists)


@functools.cache
def _execution(
    schedule: str, pp: int, vpp: int, microbatches: int
) -> tuple[tuple[int, str, int, tuple[int, ...]], ...]:
    """The actions in an order they can run in, each ``(rank, kind, stage, indices of the actions it waits for)``:
    which action waits for which does not depend on how long they take, so this is found once per schedule."""
    lists = _action_lists(schedule, pp, vpp, microbatches)
    last = pp * vpp - 1
    index: dict[tuple[str, int, int], int] = {}
    order: list[tuple[int, str, int, tuple[int, ...]]] = []
    at = [0] * pp

    def needs(kind: str, stage: int, mb: int) -> list[tuple[str, int, int]] | None:
        if kind == "F":
            wanted = [("F", stage - 1, mb)] if stage > 0 else []
        elif kind == "W":
            wanted = [("I", stage, mb)]
        else:  # the next stage's backward, whole or its input-gradient half
            later = (
                []
                if stage == last
                else [("B", stage + 1, mb) if ("B", stage + 1, mb) in index else ("I", stage + 1, mb)]
            )
            wanted = [("F", stage, mb), *later]
        return wanted if all(w in index for w in wanted) else None

    remaining = sum(len(actions) for actions in lists)
    while remaining:
        progressed = False
        for rank, actions in enumerate(lists):
            while at[rank] < len(actions):
                kind, stage, mb = actions[at[rank]]
                wanted = needs(kind, stage, mb)
                if wanted is None:
                    break
                index[(kind, stage, mb)] = len(order)
                order.append((rank, kind, stage, tuple(index[w] for w in wanted)))
                at[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("the schedule's action list cannot advance: an action waits for one never run")
    return tuple(order)


def _simulate(
    schedule: str, pp: int, vpp: int, microbatches: int, forward: Sequence[float], backward: Sequence[float]
) -> float:
    cost = {"F": list(forward), "B": list(backward), "I": [b / 2 for b in backward], "W": [b / 2 for b in backward]}
    free = [0.0] * pp
    done: list[float] = []
    for rank, kind, stage, waits in _execution(schedule, pp, vpp, microbatches):
        start = free[rank]
        for w in waits:
            if done[w] > start:
                start = done[w]
        free[rank] = start + cost[kind][stage]
        done.append(free[rank])
    return max(free)


def pipeline_step_time(
    schedule: str, pp: int, vpp: int, microbatches: int, forward: Sequence[float], backward: Sequence[float]
) -> float:
    """The time from the first forward to the last backward of a step of ``microbatches`` micro-batches through
    ``pp * vpp`` stages, stage ``s`` taking ``forward[s]`` and ``backward[s]`` per micro-batch (module docstring)."""
    stages = pp * vpp
    if len(forward) != stages or len(backward) != stages:
        raise ValueError(
            f"forward and backward need one time per stage ({stages}), got {len(forward)}, {len(backward)}"
        )
    if style(schedule) == "single":
        per_stage = [f + b for f, b in zip(forward, backward, strict=True)]
        return sum(per_stage) + (microbatches - 1) * max(per_stage)
    if microbatches > STEADY_ROUNDS * pp and microbatches % pp == 0:
        # past the warm-up, every further round of pp micro-batches adds the same time (or, where the schedule's
        # pattern spans two rounds, every two the same): simulate two shorter steps and extend the line through them
        # (torch builds its action lists in time that grows with the square of the micro-batches)
        short, longer = (STEADY_ROUNDS - 2) * pp, STEADY_ROUNDS * pp
        at_short, at_longer = (_simulate(schedule, pp, vpp, m, forward, backward) for m in (short, longer))
        return at_longer + (at_longer - at_short) / 2 * (microbatches - longer) / pp
    return _simulate(schedule, pp, vpp, microbatches, forward, backward)


@functools.cache
def stage_inflight(schedule: str, pp: int, vpp: int, microbatches: int) -> tuple[int, ...]:
    """Per stage, the most micro-batches whose forward it has run and whose backward it has not finished at once,
    from the schedule's action list (1F1B's ``min(m, pp - stage)`` and GPipe's ``m`` by definition). The last stage
    of the 1F1B family runs each micro-batch's backward right after its forward: what its loss saves lives once."""
    if style(schedule) == "single":
        return tuple(microbatches if schedule == "GPipe" else min(microbatches, pp - s) for s in range(pp))
    alive = [0] * (pp * vpp)
    peak = [0] * (pp * vpp)
    for actions in _action_lists(schedule, pp, vpp, microbatches):
        for kind, stage, _ in actions:
            alive[stage] += 1 if kind == "F" else -1 if kind in ("B", "W") else 0
            peak[stage] = max(peak[stage], alive[stage])
    return tuple(peak)


def rank_work(schedule: str, pp: int, vpp: int, per_stage: Sequence[float]) -> list[float]:
    """Each pipeline rank's share of ``per_stage`` (one value per stage, summed over the stages the rank holds)."""
    work = [0.0] * pp
    for stage, value in enumerate(per_stage):
        work[stage_rank(schedule, pp, stage)] += value
    return work
