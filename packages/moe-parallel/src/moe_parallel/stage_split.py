"""Which pipeline stages each rank holds, and which decoder layers each stage runs.

Stages are numbered along the model, ``0 .. pp * vpp - 1``. 1F1B and GPipe give rank ``r`` stage ``r``; the
interleaved schedule loops, rank ``r`` holding ``r, r + pp, r + 2 pp, ...``; the V-shaped ones (ZBV, DualPipeV)
give rank ``r`` stages ``r`` and ``2 pp - 1 - r``, so rank 0 holds both the first and the last.

The split balances cost (training FLOPs per token): the embedding rides on stage 0 and the head (with MTP) on the
last stage, so those stages get fewer layers when the head is expensive. ``first_layers`` / ``last_layers`` fix
the first and last stage's layer counts (Megatron-Core's ``decoder_first/last_pipeline_num_layers``); the stages
between split the rest by cost. Every stage runs at least one layer.
"""

from __future__ import annotations

from collections.abc import Sequence

from moe_parallel.plan import LayoutError

SCHEDULE_STYLES = {
    "1F1B": "single",
    "GPipe": "single",
    "Interleaved1F1B": "loop",
    "ZBVZeroBubble": "v",
    "DualPipeV": "v",
}


def stages_per_rank(schedule: str, vpp: int | None) -> int:
    """``vpp`` as the schedule takes it (None: its default)."""
    if vpp is not None:
        return vpp
    return 1 if SCHEDULE_STYLES[schedule] == "single" else 2


def rank_stages(schedule: str, pp: int, vpp: int, pp_rank: int) -> list[int]:
    """The stages pipeline rank ``pp_rank`` holds, in model order."""
    style = SCHEDULE_STYLES[schedule]
    if style == "v":
        return sorted({pp_rank, 2 * pp - 1 - pp_rank})
    return [pp_rank + k * pp for k in range(vpp)]


def stage_rank(schedule: str, pp: int, stage: int) -> int:
    """The pipeline rank holding ``stage`` (the inverse of :func:`rank_stages`)."""
    if SCHEDULE_STYLES[schedule] == "v" and stage >= pp:
        return 2 * pp - 1 - stage
    return stage % pp


def _balanced(costs: Sequence[float], stages: int) -> list[int]:
    """Layer counts of ``stages`` contiguous groups of ``costs`` minimising the most expensive group (each group one
    layer at least); ties go to the split with earlier groups larger."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[s][j]: the least maximum over s groups of the first j layers; cut[s][j]: where the last group starts
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for j in range(s, n - (stages - s) + 1):
            for i in range(j - 1, s - 2, -1):
                value = max(best[s - 1][i], prefix[j] - prefix[i])
                if value < best[s][j] - 1e-9 * abs(value):
                    best[s][j], cut[s][j] = value, i
    counts, j = [], n
    for s in range(stages, 0, -1):
        i = cut[s][j]
        counts.append(j - i)
        j = i
    return counts[::-1]


def split_layers(
    layer_costs: Sequence[float],
    num_stages: int,
    *,
    first_cost: float = 0.0,
    last_cost: float = 0.0,
    first_layers: int | None = None,
    last_layers: int | None = None,
) -> list[tuple[int, ...]]:
    """The decoder layers of each of ``num_stages`` stages (module docstring). Raises :class:`LayoutError` naming
    ``pp``, ``vpp``, ``pp_first_stage_layers`` or ``pp_last_stage_layers`` when the layers cannot be split so."""
    n = len(layer_costs)
    if num_stages > n:
        raise LayoutError(
            "pp",
            num_stages,
            f"{num_stages} pipeline stages (pp x vpp) for a model of {n} layers: every stage needs "
            f"a layer; pp x vpp can be at most {n}",
        )
    fixed = {"pp_first_stage_layers": first_layers, "pp_last_stage_layers": last_layers}
    for name, count in fixed.items():
        if count is not None and not 1 <= count <= n - (num_stages - 1):
            raise LayoutError(
                name,
                count,
                f"leaves the other {num_stages - 1} stages fewer layers than stages (the model has {n} "
                f"layers); it can be 1 to {n - num_stages + 1}",
            )
    if num_stages == 2 and first_layers is not None and last_layers is not None and first_layers + last_layers != n:
        raise LayoutError(
            "pp_last_stage_layers",
            last_layers,
            f"with two stages the first and last hold all {n} layers: "
            f"pp_first_stage_layers + pp_last_stage_layers must be {n}",
        )
    if first_layers is not None and last_layers is not None and first_layers + last_layers > n - (num_stages - 2):
        raise LayoutError(
            "pp_last_stage_layers",
            last_layers,
            f"pp_first_stage_layers + pp_last_stage_layers = "
            f"{first_layers + last_layers} leaves the {num_stages - 2} middle stages fewer than one layer each of the "
            f"model's {n}",
        )
    costs = list(layer_costs)
    start, stop, inner = 0, n, num_stages
    head: list[int] = []
    tail: list[int] = []
    if first_layers is not None:
        head, start, inner = [first_layers], first_layers, inner - 1
    if last_layers is not None:
        tail, stop, inner = [last_layers], n - last_layers, inner - 1
    middle = costs[start:stop]
    if inner > 0:
        # the embedding and head weigh on the stages that hold them, when those are split by cost
        if first_layers is None:
            middle[0] += first_cost
        if last_layers is None:
            middle[-1] += last_cost
        counts = head + _balanced(middle, inner) + tail
    else:
        counts = head + tail
    out, at = [], 0
    for count in counts:
        out.append(tuple(range(at, at + count)))
        at += count
    return out


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
    if SCHEDULE_STYLES[schedule] == "single":
        return [microbatches if schedule == "GPipe" else min(microbatches, pp - r) for r in range(pp)]
    from torch.distributed.pipelining import schedules

    name = {"Interleaved1F1B": "ScheduleInterleaved1F1B", "ZBVZeroBubble": "ScheduleZBVZeroBubble"}.get(
        schedule, "ScheduleDualPipeV"
    )
    try:
        stages = [_StandInStage(pp * vpp, pp, i) for i in range(vpp)]
        order = getattr(schedules, name)(stages, microbatches).pipeline_order
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
