"""Which decoder layers each pipeline stage runs (which stages each rank holds: :mod:`moe_parallel.schedules`).

The split balances cost (training FLOPs per token): the embedding rides on stage 0 and the head (with MTP) on the
last stage, so those stages get fewer layers when the head is expensive. ``first_layers`` / ``last_layers`` fix
the first and last stage's layer counts (Megatron-Core's ``decoder_first/last_pipeline_num_layers``); the stages
between split the rest by cost. Every stage runs at least one layer.
"""

from __future__ import annotations

from collections.abc import Sequence

from moe_parallel.plan import LayoutError


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
