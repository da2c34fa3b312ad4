"""LoRA on a model's linear projections, shared and routed experts (issue 33; the layouts' split of each adapter
is declared in :mod:`moe_models.parallel_plan`, the trainer's ``peft`` section reads this module).

:func:`add_lora_` gives every module whose name matches a target pattern (fnmatch, e.g. ``"*.attention.*_proj"``,
``"*.mlp.experts"``) an adapter in place: an ``nn.Linear`` becomes a :class:`LoRALinear` (``W x + b + (alpha / r)
B A x``, PEFT's ``lora_A`` ``[r, in]`` and ``lora_B`` ``[out, r]``), a :class:`~moe_experts.GroupedExperts` gets one
grouped adapter per projection (:func:`moe_experts.add_expert_lora_`), :class:`~moe_experts.SharedExperts` one
adapter per HuggingFace projection (``gate_proj``, ``up_proj``, ``down_proj``: :class:`LoRASharedExperts`).
:func:`initial_adapter_value` gives an adapter parameter's starting value by name (PEFT's: ``A`` Kaiming uniform,
``B`` zero) from a seed alone, so that a model adapted on the meta device materialises alike under every layout.
:func:`freeze_base_` leaves only the adapters trainable; :func:`merged_state_dict` is the model's state dict with
the adapters folded into the weights they adapt, loadable into the same model without adapters.
"""

from __future__ import annotations

import fnmatch
import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from moe_experts import GroupedExperts, SharedExperts, add_expert_lora_, merged_expert_weights

# every projection of the decoder layers' attention and dense MLPs, the shared and the routed experts (not the router,
# the embeddings or the output layer)
DEFAULT_TARGETS = ("*attention.*_proj", "*mlp.*_proj", "*mlp.shared_experts", "*mlp.experts")
ADAPTER_MARK = "lora_"  # in the name of every adapter parameter


class LoRALinear(nn.Linear):
    """An ``nn.Linear`` with a low-rank update (module docstring); made in place by :func:`add_lora_`."""

    lora_A: nn.Parameter  # [r, in]
    lora_B: nn.Parameter  # [out, r]
    scaling: float
    # a probability, not a Dropout module: tensor parallelism's styles partition every submodule of the linear
    lora_dropout_p: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dropped = F.dropout(x, self.lora_dropout_p, self.training) if self.lora_dropout_p else x
        update = F.linear(F.linear(dropped, self.lora_A.to(x.dtype)), self.lora_B.to(x.dtype))
        return super().forward(x) + update * self.scaling

    def merged_weight(self) -> torch.Tensor:
        return (self.weight + (self.lora_B @ self.lora_A).to(self.weight.dtype) * self.scaling).detach()


class LoRAAdapter(nn.Module):
    """A bare low-rank update ``(alpha / r) B A x`` (``lora_A`` ``[r, in]``, ``lora_B`` ``[out, r]``), for a projection
    that is not an ``nn.Linear`` of its own (a shared expert's gate, up or down part)."""

    def __init__(self, in_features: int, out_features: int, rank: int, alpha: float, dropout: float) -> None:
        super().__init__()
        self.lora_A = nn.Parameter(torch.empty(rank, in_features))
        self.lora_B = nn.Parameter(torch.zeros(out_features, rank))
        if not self.lora_A.is_meta:
            nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.scaling = alpha / rank
        self.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(self.lora_dropout(x), self.lora_A.to(x.dtype)), self.lora_B.to(x.dtype)) * self.scaling

    def delta(self) -> torch.Tensor:
        """The update as a ``[out, in]`` weight (``nn.Linear``'s layout)."""
        return (self.lora_B @ self.lora_A) * self.scaling


class LoRASharedExperts(SharedExperts):
    """:class:`~moe_experts.SharedExperts` with an adapter on each of its HuggingFace projections; made in place by
    :func:`add_lora_`. The fused ``[H, 2F]`` gate/up weight keeps its layout: each half gets its own update."""

    lora_gate_proj: LoRAAdapter
    lora_up_proj: LoRAAdapter
    lora_down_proj: LoRAAdapter

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        dtype = x_TH.dtype
        gate_NF, up_NF = (x_TH @ self.w_gate_up_H2F.to(dtype)).chunk(2, dim=-1)
        gate_NF = gate_NF + self.lora_gate_proj(x_TH)
        up_NF = up_NF + self.lora_up_proj(x_TH)
        h_NF = F.silu(gate_NF) * up_NF
        out = h_NF @ self.w_down_FH.to(dtype) + self.lora_down_proj(h_NF)
        if self.w_gate_H1 is not None:
            out = torch.sigmoid(x_TH @ self.w_gate_H1.to(dtype)) * out
        return out

    def merged_weights(self) -> dict[str, torch.Tensor]:
        """``w_gate_up_H2F`` and ``w_down_FH`` with the adapters folded in."""
        gate_up = torch.cat([self.lora_gate_proj.delta().T, self.lora_up_proj.delta().T], dim=1)
        return {
            "w_gate_up_H2F": (self.w_gate_up_H2F + gate_up.to(self.w_gate_up_H2F.dtype)).detach(),
            "w_down_FH": (self.w_down_FH + self.lora_down_proj.delta().T.to(self.w_down_FH.dtype)).detach(),
        }


def _adapt_shared_(module: SharedExperts, rank: int, alpha: float, dropout: float) -> LoRASharedExperts:
    hidden, ffn = module.hidden_size, module.ffn_hidden_size
    with torch.device(module.w_gate_up_H2F.device):
        adapters = {
            "lora_gate_proj": LoRAAdapter(hidden, ffn, rank, alpha, dropout),
            "lora_up_proj": LoRAAdapter(hidden, ffn, rank, alpha, dropout),
            "lora_down_proj": LoRAAdapter(ffn, hidden, rank, alpha, dropout),
        }
    module.__class__ = LoRASharedExperts
    for name, adapter in adapters.items():
        module.add_module(name, adapter)
    return module  # type: ignore[return-value]


def _adapt_linear_(module: nn.Linear, rank: int, alpha: float, dropout: float) -> LoRALinear:
    device = module.weight.device
    module.__class__ = LoRALinear
    adapted: LoRALinear = module  # type: ignore[assignment]
    adapted.lora_A = nn.Parameter(torch.empty(rank, module.in_features, device=device))
    adapted.lora_B = nn.Parameter(torch.zeros(module.out_features, rank, device=device))  # starts as the base
    if not adapted.lora_A.is_meta:
        nn.init.kaiming_uniform_(adapted.lora_A, a=math.sqrt(5))  # PEFT's init
    adapted.scaling = alpha / rank
    adapted.lora_dropout_p = dropout
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
                f"targets: {name} is a {type(module).__name__}; LoRA adapts nn.Linear projections, shared and routed "
                "experts"
            )
    for name in names:
        module = modules[name]
        if isinstance(module, GroupedExperts):
            add_expert_lora_(module, rank, alpha, dropout)
        elif isinstance(module, SharedExperts):
            _adapt_shared_(module, rank, alpha, dropout)
        else:
            _adapt_linear_(module, rank, alpha, dropout)  # type: ignore[arg-type]
    return names


def _adaptable(module: nn.Module) -> bool:
    return type(module) in (nn.Linear, SharedExperts) or isinstance(module, GroupedExperts)


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
        elif isinstance(module, LoRASharedExperts):
            state.update({f"{prefix}{weight}": value for weight, value in module.merged_weights().items()})
    return state


def adapter_seed(seed: int, name: str) -> int:
    """The generator seed of adapter parameter (or grouped-experts module) ``name``: the run's seed and the name
    alone, so that every layout draws the same values."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def initial_adapter_value(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The starting value of a ``lora_A`` ``[r, in]`` (Kaiming uniform, ``a = sqrt(5)``: U(-1/sqrt(in), 1/sqrt(in)),
    PEFT's) or ``lora_B`` (zero: the adapted model starts as the base) parameter ``name``, on the CPU."""
    if name.endswith("lora_B"):
        return torch.zeros(shape)
    if not name.endswith("lora_A") or len(shape) != 2:
        raise ValueError(f"{name}: not a LoRA adapter matrix")
    generator = torch.Generator().manual_seed(adapter_seed(seed, name))
    bound = 1.0 / math.sqrt(shape[1])
    return torch.empty(shape).uniform_(-bound, bound, generator=generator)
