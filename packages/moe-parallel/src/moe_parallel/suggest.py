"""``check_layout``: a ParallelConfig checked against the world size and the model at once, with suggestions that
hold for both.

:class:`~moe_parallel.layout.ParallelLayout` knows only the world size, and
:func:`~moe_parallel.parallelize.check_plan` takes a layout that already holds: each one's hint (``LayoutError.hint``)
is what its own rule allows. :func:`check_layout` runs both and, when one refuses a parallel size with a hint,
replaces the hint by the values of that size that pass both, found by running those same checks on each candidate
(the model is on the meta device, so this is cheap): no rule is written twice.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from moe_parallel.config import ParallelConfig
from moe_parallel.layout import ParallelLayout, divisors
from moe_parallel.parallelize import check_plan
from moe_parallel.plan import LayoutError, ParallelPlan

# the ParallelConfig fields that size a parallel dimension: every value that fits one divides the world size
SIZES = ("tp", "cp", "dp_replicate", "dp_shard", "pp", "ep", "etp")
# the other worlds tried when nothing fits this one: its divisors and these multiples of it
WORLD_MULTIPLES = range(2, 9)


def check_layout(model: nn.Module, plan: ParallelPlan, config: ParallelConfig, world_size: int) -> ParallelLayout:
    """``config``'s layout over ``world_size`` ranks, checked against ``model`` and its ``plan`` too (ParallelLayout's
    rules, then :func:`~moe_parallel.check_plan`'s); a refused parallel size is told the values that pass both.

    Raises :class:`LayoutError` with the field and value of the first rule broken. When that field is a parallel size
    (tp, cp, dp_replicate, dp_shard, pp, ep, etp) and the rule hinted at values, the hint becomes the values of that
    field with which every check passes, the rest of ``config`` and ``world_size`` as given; when none does, the other
    sizes (or the world size) that one would change instead, found the same way. ``model`` may be on any device, the
    meta device included: each candidate costs one run of the checks.
    """
    try:
        return _checked(model, plan, config, world_size)
    except LayoutError as err:
        if err.field not in SIZES or not err.hint:
            raise
        raise LayoutError(
            err.field, err.value, err.problem, _hint(model, plan, config, world_size, err.field)
        ) from None


def _checked(model: nn.Module, plan: ParallelPlan, config: ParallelConfig, world_size: int) -> ParallelLayout:
    layout = config.layout(world_size)
    check_plan(model, plan, config, layout)
    return layout


def _refusal(
    model: nn.Module, plan: ParallelPlan, config: ParallelConfig, world_size: int, **sizes: int
) -> LayoutError | None:
    """The error the checks raise for ``config`` with ``sizes`` instead of its own, or None when it passes."""
    try:
        _checked(model, plan, dataclasses.replace(config, **sizes), world_size)
    except LayoutError as err:
        return err
    return None


def _candidates(field: str, world_size: int) -> list[int]:
    """Every value of ``field`` that a layout over ``world_size`` ranks could take (``-1``: dp_shard fills)."""
    return divisors(world_size) + ([-1] if field == "dp_shard" else [])


def _refusals(
    model: nn.Module, plan: ParallelPlan, config: ParallelConfig, world_size: int, field: str
) -> dict[int, LayoutError | None]:
    """Each candidate value of ``field`` -> the error the checks raise with it (None: it fits)."""
    return {v: _refusal(model, plan, config, world_size, **{field: v}) for v in _candidates(field, world_size)}


def _given(config: ParallelConfig, world_size: int, field: str) -> str:
    """The settings the suggestion holds for: the world size and the other sizes not at their defaults."""
    defaults = {f.name: f.default for f in dataclasses.fields(ParallelConfig)}
    parts = [f"world_size {world_size}"]
    parts += [
        f"{name}={getattr(config, name)}" for name in SIZES if name != field and getattr(config, name) != defaults[name]
    ]
    if config.etp is None and field != "etp" and (field == "tp" or config.tp != 1):
        parts.append("etp following tp")
    return ", ".join(parts)


def _hint(model: nn.Module, plan: ParallelPlan, config: ParallelConfig, world_size: int, field: str) -> str:
    given = _given(config, world_size, field)
    refusals = _refusals(model, plan, config, world_size, field)
    fits = [v for v, err in refusals.items() if err is None]
    if fits:
        return f"with {given} and this model, {field} can be one of {fits}"
    # nothing fits: the other sizes, or the world size, that one value of this field fits with
    instead = [
        other
        for other in SIZES
        if other != field
        and any(
            _refusal(model, plan, config, world_size, **{field: v, other: o}) is None
            for o in _candidates(other, world_size)
            if o != getattr(config, other)
            for v in _candidates(field, world_size)
        )
    ]
    worlds = sorted({*divisors(world_size), *(world_size * k for k in WORLD_MULTIPLES)} - {world_size})
    if any(None in _refusals(model, plan, config, w, field).values() for w in worlds):
        instead.append("the world size")
    if instead:
        change = instead[0] if len(instead) == 1 else f"{', '.join(instead[:-1])} or {instead[-1]}"
        return f"no {field} fits {given} and this model: change {change}"
    # nor does changing one of those: name the other settings that refused this field's values (their problems: their
    # own hints are one rule's view)
    others = {err.field: err for err in refusals.values() if err is not None and err.field != field}
    refused = "; ".join(f"{err.field}={err.value!r}: {err.problem}" for err in others.values())
    return f"no {field} fits {given} and this model, nor after changing one other size or the world size" + (
        f"; its values are also refused by {refused}" if refused else ""
    )
