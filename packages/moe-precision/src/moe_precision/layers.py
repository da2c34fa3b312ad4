"""Quantised stand-ins for a model's linear layers, and :func:`apply_precision`, which swaps them in.

:class:`QuantizedLinear` is an ``nn.Linear`` (tensor-parallel styles and init code still recognise it) whose
forward runs :func:`~moe_precision.gemm.quantized_matmul`. Under tensor parallelism its weight is a DTensor: the
GEMM runs on the local shards, whose per-tensor amaxes are reduced over the tensor-parallel group, and the output
gets the placement ``F.linear`` would give it (column-wise: sharded on the last dimension; row-wise: partial sums).

:class:`QuantizedGroupedLinear` replaces a grouped expert projection (``forward(x_NK, w_EKM, tokens_per_expert_E,
gmm)``, moe-experts' ``ExpertLinear``): one quantised GEMM per expert, as Transformer Engine's ``GroupedLinear``
quantises each expert's split on its own; each expert keeps its own delayed-scaling state.

Both are made in place, by swapping the module's class (as FSDP2's ``fully_shard`` does), so that parameters,
their names and the hooks parallelism put on the module stay.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from moe_precision.gemm import quantized_matmul
from moe_precision.recipes import Recipe, ScalingState


def _output_placement(weight: DTensor, x_placement, out_ndim: int):  # type: ignore[no-untyped-def]
    (w_placement,) = weight.placements
    if w_placement.is_replicate():
        return x_placement
    if w_placement.is_shard(0) and x_placement.is_replicate():
        return Shard(out_ndim - 1)
    if w_placement.is_shard(1) and isinstance(x_placement, Shard):
        return Partial()
    raise ValueError(
        f"a quantised linear cannot compute weight placement {w_placement} with input placement {x_placement}; "
        "tensor parallelism must split it column- or row-wise"
    )


class QuantizedLinear(nn.Linear):
    """``nn.Linear`` with the recipe's quantised GEMMs (module docstring). Made in place from an ``nn.Linear`` by
    :func:`quantize_linear_`, which keeps its parameters and any hooks on it (tensor parallelism's)."""

    recipe: Recipe
    native: bool
    scaling: ScalingState

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if not isinstance(weight, DTensor):
            y = self._matmul(x, weight, None)
            return y if self.bias is None else y + self.bias.to(y.dtype)
        x_placement = x.placements[0] if isinstance(x, DTensor) else Replicate()
        x_local = x.to_local() if isinstance(x, DTensor) else x
        group = weight.device_mesh.get_group()
        y_local = self._matmul(x_local, weight.to_local(), group)
        placement = _output_placement(weight, x_placement, y_local.ndim)
        y = DTensor.from_local(y_local, weight.device_mesh, [placement], run_check=False)
        return y if self.bias is None else y + self.bias

    def _matmul(self, x: torch.Tensor, w_NK: torch.Tensor, group) -> torch.Tensor:  # type: ignore[no-untyped-def]
        x_MK = x.reshape(-1, x.shape[-1])
        y = quantized_matmul(x_MK, w_NK, self.recipe, state=self.scaling, amax_group=group, native=self.native)
        return y.view(*x.shape[:-1], w_NK.shape[0])

    def extra_repr(self) -> str:
        mode = "native" if self.native else "emulated"
        return f"{super().extra_repr()}, recipe={self.recipe.name} ({mode})"


class QuantizedGroupedLinear(nn.Module):
    """A grouped expert projection ``[N, K] @ w_EKM`` per expert's rows with the recipe's quantised GEMMs. Used as a
    mixin over the projection's own class (:func:`quantize_grouped_linear_`), which it keeps as a base, so that
    code addressing the projection by its class (memory policies) still finds it."""

    recipe: Recipe
    native: bool
    scaling: list[ScalingState]
    gathers_rows = False  # it quantises the rows it is given: the experts' first projection must gather them first

    def forward(
        self,
        x_NK: torch.Tensor,
        w_EKM: torch.Tensor,
        tokens_per_expert_E: torch.Tensor,
        gmm: Callable[..., torch.Tensor] | None = None,  # the high-precision kernel, unused: one GEMM per expert
    ) -> torch.Tensor:
        num_experts = w_EKM.shape[0]
        while len(self.scaling) < num_experts:
            self.scaling.append(self.recipe.new_state())
        counts = [int(c) for c in tokens_per_expert_E.tolist()]
        rows = x_NK[: sum(counts)].split(counts)
        outs = [
            quantized_matmul(x_e, w_EKM[e].t(), self.recipe, state=self.scaling[e], native=self.native)
            for e, x_e in enumerate(rows)
        ]
        tail = x_NK.shape[0] - sum(counts)  # rows past the experts' (padding) come out as zeros
        if tail:
            outs.append(x_NK.new_zeros(tail, w_EKM.shape[-1]))
        return torch.cat(outs) if outs else x_NK.new_zeros(0, w_EKM.shape[-1])

    def extra_repr(self) -> str:
        return f"recipe={self.recipe.name} ({'native' if self.native else 'emulated'})"


@functools.cache
def _quantized_grouped_class(cls: type) -> type:
    return type(f"Quantized{cls.__name__}", (QuantizedGroupedLinear, cls), {})


def quantize_linear_(module: nn.Linear, recipe: Recipe, native: bool = False) -> QuantizedLinear:
    """Turn ``module`` (exactly an ``nn.Linear``) into a :class:`QuantizedLinear` in place: same parameters, same
    hooks (as FSDP2 swaps a module's class)."""
    if type(module) is not nn.Linear:
        raise TypeError(f"quantize_linear_ takes an nn.Linear, got {type(module).__name__}")
    module.__class__ = QuantizedLinear
    module.recipe, module.native, module.scaling = recipe, native, recipe.new_state()
    return module  # type: ignore[return-value]


def quantize_grouped_linear_(module: nn.Module, recipe: Recipe, native: bool = False) -> nn.Module:
    """Give a grouped expert projection (``forward(x_NK, w_EKM, tokens_per_expert_E, gmm)``, holding no parameters)
    the recipe's quantised GEMMs in place, its class kept as a base."""
    if any(True for _ in module.parameters(recurse=False)):
        raise TypeError(f"{type(module).__name__} holds parameters: not a grouped projection of the experts' weights")
    if not isinstance(module, QuantizedGroupedLinear):
        module.__class__ = _quantized_grouped_class(type(module))
    module.recipe, module.native, module.scaling = recipe, native, []
    return module


def apply_precision(
    model: nn.Module,
    linear_names: Iterable[str],
    grouped_names: Iterable[str],
    recipe: Recipe,
    native: bool = False,
) -> int:
    """Give the named ``nn.Linear`` modules and grouped expert projections of ``model`` the recipe's quantised GEMMs,
    in place (:func:`quantize_linear_`, :func:`quantize_grouped_linear_`). Parameters and hooks stay, so this may run
    before or after tensor parallelism; after expert parallelism, which builds new expert modules. Returns the number
    of modules changed."""
    changed = 0
    for name in linear_names:
        quantize_linear_(model.get_submodule(name), recipe, native)  # type: ignore[arg-type]
        changed += 1
    for name in grouped_names:
        quantize_grouped_linear_(model.get_submodule(name), recipe, native)
        changed += 1
    return changed
