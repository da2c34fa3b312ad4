"""LoRA on a model's linear projections and routed experts (a first piece of issue 33: single process; layouts,
the trainer's ``peft`` section and PEFT export come later).

:func:`add_lora_` gives every module whose name matches a target pattern (fnmatch, e.g. ``"*.attention.*_proj"``,
``"*.mlp.experts"``) an adapter in place: an ``nn.Linear`` becomes a :class:`LoRALinear` (``W x + b + (alpha / r)
B A x``, PEFT's ``lora_A`` ``[r, in]`` and ``lora_B`` ``[out, r]``), a :class:`~moe_experts.GroupedExperts` gets one
grouped adapter per projection (:func:`moe_experts.add_expert_lora_`). :func:`freeze_base_` leaves only the adapters
trainable; :func:`merged_state_dict` is the model's state dict with the adapters folded into the weights they adapt,
loadable into the same model without adapters.
"""

from __future__ import annotations

import fnmatch
import math

import torch
import torch.nn.functional as F
from torch import nn

from moe_experts import GroupedExperts, add_expert_lora_, merged_expert_weights

# every projection of the decoder layers' attention and dense MLPs, and the routed experts (not the router, the
# embeddings, the output layer or the shared experts)
DEFAULT_TARGETS = ("*attention.*_proj", "*mlp.*_proj", "*mlp.experts")
ADAPTER_MARK = "lora_"  # in the name of every adapter parameter


class LoRALinear(nn.Linear):
    """An ``nn.Linear`` with a low-rank update (module docstring); made in place by :func:`add_lora_`."""

    lora_A: nn.Parameter  # [r, in]
    lora_B: nn.Parameter  # [out, r]
    scaling: float
    lora_dropout: nn.Module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = F.linear(F.linear(self.lora_dropout(x), self.lora_A.to(x.dtype)), self.lora_B.to(x.dtype))
        return super().forward(x) + update * self.scaling

    def merged_weight(self) -> torch.Tensor:
        return (self.weight + (self.lora_B @ self.lora_A).to(self.weight.dtype) * self.scaling).detach()


def _adapt_linear_(module: nn.Linear, rank: int, alpha: float, dropout: float) -> LoRALinear:
    device = module.weight.device
    module.__class__ = LoRALinear
    adapted: LoRALinear = module  # type: ignore[assignment]
    adapted.lora_A = nn.Parameter(torch.empty(rank, module.in_features, device=device))
    adapted.lora_B = nn.Parameter(torch.zeros(module.out_features, rank, device=device))  # starts as the base
    if not adapted.lora_A.is_meta:
        nn.init.kaiming_uniform_(adapted.lora_A, a=math.sqrt(5))  # PEFT's init
    adapted.scaling = alpha / rank
    adapted.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()
    return adapted


def add_lora_(
    model: nn.Module, rank: int, alpha: float, dropout: float = 0.0, targets: tuple[str, ...] | None = None
) -> list[str]:
    """Give the modules of ``model`` matching ``targets`` (None: :data:`DEFAULT_TARGETS`, those the model has) an
    adapter each, in place; returns their names. A given pattern that matches nothing, or a module that is neither an
    ``nn.Linear`` nor routed experts, is a ValueError naming ``targets``."""
    if rank < 1:
        raise ValueError(f"rank={rank}: must be >= 1")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout={dropout}: must be in [0, 1)")
    modules = dict(model.named_modules())
    names: list[str] = []
    for pattern in DEFAULT_TARGETS if targets is None else targets:
        matched = [name for name in modules if name and fnmatch.fnmatchcase(name, pattern)]
        if targets is None:  # the defaults take what they can adapt (MLA's up_proj is not a linear of its own)
            matched = [name for name in matched if _adaptable(modules[name])]
        elif not matched:
            raise ValueError(f"targets: {pattern!r} matches no module of the model")
        names.extend(name for name in matched if name not in names)
    if not names:
        raise ValueError(f"targets: none of {DEFAULT_TARGETS} matches a module of the model; name the modules")
    for name in names:
        module = modules[name]
        if not _adaptable(module):
            raise ValueError(
                f"targets: {name} is a {type(module).__name__}; LoRA adapts nn.Linear projections and routed experts"
            )
    for name in names:
        module = modules[name]
        if isinstance(module, GroupedExperts):
            add_expert_lora_(module, rank, alpha, dropout)
        else:
            _adapt_linear_(module, rank, alpha, dropout)  # type: ignore[arg-type]
    return names


def _adaptable(module: nn.Module) -> bool:
    return isinstance(module, GroupedExperts) or type(module) is nn.Linear


def freeze_base_(model: nn.Module) -> int:
    """Leave only the adapters' parameters trainable; returns how many parameters that is."""
    trainable = 0
    for name, param in model.named_parameters():
        param.requires_grad_(ADAPTER_MARK in name)
        trainable += param.numel() if param.requires_grad else 0
    return trainable


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s state dict without its adapters, each folded into the weight it adapts."""
    state = {name: value for name, value in model.state_dict().items() if ADAPTER_MARK not in name}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(module, LoRALinear):
            state[f"{prefix}weight"] = module.merged_weight()
        elif isinstance(module, GroupedExperts):
            state.update({f"{prefix}{weight}": value for weight, value in merged_expert_weights(module).items()})
    return state
