"""What a model declares so that moe-parallel can split it without knowing its classes: the parallel plan.

A model hands :func:`~moe_parallel.parallelize` a :class:`ParallelPlan` (moe_models keeps ``MoETransformer``'s
beside the model, as torchtitan keeps each model's ``parallelize`` next to it). Everything is named by module or
parameter path (``layers.3.attention.q_proj``), so moe-parallel never reads a model attribute by name; the only
classes it knows are the MoE pieces it parallelises (moe_dispatch's router and dispatchers, moe_experts' experts).

This module imports nothing but torch, so a model package can declare its plan without pulling in the rest.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from torch.distributed.tensor.parallel import ParallelStyle


class LayoutError(ValueError):
    """A parallel layout (or a model under it) that cannot work; ``field`` is the ParallelConfig field to change.

    ``str(err)`` is ``"{field}={value!r}: {reason}"``; the reason says what would fit.
    """

    def __init__(self, field: str, value: object, reason: str) -> None:
        super().__init__(f"{field}={value!r}: {reason}")
        self.field, self.value, self.reason = field, value, reason

    def __reduce__(self):  # type: ignore[no-untyped-def]
        # pickling (multiprocessing, torch.distributed) rebuilds from the constructor's arguments
        return type(self), (self.field, self.value, self.reason)


@dataclass(frozen=True)
class MoEBlockPlan:
    """A routed MoE block at ``path``: the attribute names of its router (:class:`~moe_dispatch.TopKRouter`), token
    dispatcher (swapped for an expert-parallel one) and experts (:class:`~moe_experts.GroupedExperts`, swapped for
    this rank's share)."""

    path: str
    router: str = "router"
    dispatcher: str = "dispatcher"
    experts: str = "experts"

    def experts_path(self) -> str:
        return f"{self.path}.{self.experts}" if self.path else self.experts

    def router_path(self) -> str:
        return f"{self.path}.{self.router}" if self.path else self.router


@dataclass(frozen=True)
class ParallelPlan:
    """How to split one model; every name is a module path (``""`` is the root) or a parameter path."""

    # tensor + sequence parallelism: module path -> DTensor style, applied with parallelize_module on the root
    tensor_parallel: Mapping[str, ParallelStyle] = field(default_factory=dict)
    # parameters left whole on every tp rank that see only that rank's tokens or heads: gradients summed over tp
    tp_partial_grads: tuple[str, ...] = ()
    # module path -> first output column whose gradient is summed over tp in the backward (an output slice every
    # tp rank uses whole, e.g. MLA's rotary key, computed by a module whose other columns feed split heads)
    tp_sum_grad_columns: Mapping[str, int] = field(default_factory=dict)
    # model field -> size that tp must divide (head counts, FFN widths of tensor-parallel layers)
    tp_divides: Mapping[str, int] = field(default_factory=dict)
    # model field -> why this model cannot run with tp > 1
    tp_unsupported: Mapping[str, str] = field(default_factory=dict)
    # FSDP2 units on the data-parallel mesh, innermost first; the root is always a unit after them
    fsdp_units: tuple[str, ...] = ()
    moe_blocks: tuple[MoEBlockPlan, ...] = ()
    # (parameter, parameter sharing its storage): re-tied after materialisation
    tied_parameters: tuple[tuple[str, str], ...] = ()

    def experts_paths(self) -> list[str]:
        return [block.experts_path() for block in self.moe_blocks]


def submodule(root, path: str):
    """``root.get_submodule(path)`` with a message naming the plan entry when the path is wrong."""
    try:
        return root.get_submodule(path)
    except AttributeError:
        raise ValueError(f"the parallel plan names module {path!r}, which the model does not have") from None
