"""LoRA on the routed experts: one grouped adapter per projection, applied inside the grouped-GEMM path, per expert.

A projection ``[N, K] @ w_EKM`` (rows in expert order) gains ``scaling * (x @ A_e^T) @ B_e^T`` for each expert ``e``'s
rows, with ``lora_A_ERK`` ``[E, r, K]`` and ``lora_B_EMR`` ``[E, M, r]`` (PEFT's per-expert ``lora_A`` / ``lora_B``
weight layouts, stacked over the experts) and ``scaling = alpha / r``: two more grouped GEMMs of rank ``r`` through
the same back end as the base projection, so every expert's update is its own. ``A`` starts as PEFT's (Kaiming
uniform, ``a = sqrt(5)``), ``B`` at zero: the adapted experts start as the base ones.

:func:`add_expert_lora_` replaces :class:`GroupedExperts`' ``fc1`` / ``fc2`` in place (the parameters are the
adapter's; the base weights stay on the experts, under their checkpoint names); :func:`merged_expert_weights` folds
the adapters into the base weights (``w + scaling * A^T B^T``) for an export. Freezing the base is the caller's
(``requires_grad_(False)`` on everything else). The adapted projection takes rows, not row indices
(``gathers_rows = False``): the adapter reads its input twice.

Under expert tensor parallelism each adapter is split as the weight it adapts: ``fc1``'s output columns (the rank's
gate/up columns) split ``lora_B_EMR`` along ``M`` with ``lora_A_ERK`` whole; ``fc2``'s input rows split
``lora_A_ERK`` along ``K`` with ``lora_B_EMR`` whole (:func:`adapter_local_slice`). The whole factor of each pair then
gets only this rank's part of its gradient (:data:`ETP_PARTIAL`): the layout sums it over the etp ranks.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from moe_experts.backends import GroupedMM
from moe_experts.grouped import ExpertLinear, GroupedExperts

PROJECTIONS = ("fc1", "fc2")  # the first (gate/up) and the down projection
# adapter parameters left whole on every etp rank whose gradient each rank holds a part of (module docstring)
ETP_PARTIAL = ("fc1.lora_A_ERK", "fc2.lora_B_EMR")


def _local(t: torch.Tensor) -> torch.Tensor:
    # expert-parallel adapters are DTensors sharded along the experts: the grouped GEMMs take this rank's experts
    return t.to_local() if hasattr(t, "to_local") else t


class LoRAExpertLinear(ExpertLinear):
    """An expert projection ``K -> M`` for ``E`` experts with a rank-``r`` adapter per expert (module docstring)."""

    gathers_rows = False

    def __init__(
        self, num_experts: int, in_features: int, out_features: int, rank: int, alpha: float, dropout: float = 0.0
    ) -> None:
        super().__init__()
        if rank < 1:
            raise ValueError(f"rank={rank}: must be >= 1")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout={dropout}: must be in [0, 1)")
        self.rank, self.alpha, self.scaling = rank, alpha, alpha / rank
        self.lora_A_ERK = nn.Parameter(torch.empty(num_experts, rank, in_features))
        self.lora_B_EMR = nn.Parameter(torch.empty(num_experts, out_features, rank))
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        if self.lora_A_ERK.is_meta:
            return
        for a_RK in self.lora_A_ERK:  # PEFT's init of each expert's A; B = 0: no change at the start
            nn.init.kaiming_uniform_(a_RK, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B_EMR)

    def forward(
        self, x_NK: torch.Tensor, w_EKM: torch.Tensor, tokens_per_expert_E: torch.Tensor, gmm: GroupedMM
    ) -> torch.Tensor:
        dtype = x_NK.dtype
        a_EKR = _local(self.lora_A_ERK).to(dtype).transpose(1, 2).contiguous()
        b_ERM = _local(self.lora_B_EMR).to(dtype).transpose(1, 2).contiguous()
        h_NR = gmm(self.dropout(x_NK), a_EKR, tokens_per_expert_E)
        return gmm(x_NK, w_EKM, tokens_per_expert_E) + gmm(h_NR, b_ERM, tokens_per_expert_E) * self.scaling

    def delta_EKM(self) -> torch.Tensor:
        """The adapter as a weight update in the base weight's ``[E, K, M]`` layout: ``scaling * A^T B^T``."""
        return torch.bmm(self.lora_A_ERK.transpose(1, 2), self.lora_B_EMR.transpose(1, 2)) * self.scaling

    def extra_repr(self) -> str:
        experts, out_features, rank = self.lora_B_EMR.shape
        return f"experts={experts}, in={self.lora_A_ERK.shape[-1]}, out={out_features}, rank={rank}, alpha={self.alpha}"


def add_expert_lora_(
    experts: GroupedExperts,
    rank: int,
    alpha: float,
    dropout: float = 0.0,
    projections: tuple[str, ...] = PROJECTIONS,
) -> list[LoRAExpertLinear]:
    """Give ``experts``' projections named in ``projections`` a grouped adapter each, in place; returns the adapted
    projections, sized for ``experts``' own (local) experts and FFN slice (module docstring)."""
    unknown = [p for p in projections if p not in PROJECTIONS]
    if unknown:
        raise ValueError(f"projections={projections}: unknown {unknown}; choose from {PROJECTIONS}")
    if rank % 8 and experts.requested_backend != "loop":
        raise ValueError(
            f"rank={rank}: grouped GEMMs need 16-byte rows (a multiple of 8 in bf16); use a multiple of 8, or the "
            "loop experts back end"
        )
    width = experts.activation.width_factor * experts.local_ffn_hidden_size
    shapes = {"fc1": (experts.hidden_size, width), "fc2": (experts.local_ffn_hidden_size, experts.hidden_size)}
    device = _local(experts.w_gate_up_EH2F).device
    adapted = []
    for name in projections:
        if isinstance(getattr(experts, name), LoRAExpertLinear):
            raise ValueError(f"{name} already has an adapter")
        with torch.device(device):
            module = LoRAExpertLinear(experts.num_experts, *shapes[name], rank, alpha, dropout)
        setattr(experts, name, module)
        adapted.append(module)
    return adapted


def merged_expert_weights(experts: GroupedExperts) -> dict[str, torch.Tensor]:
    """The experts' projection weights with their adapters folded in (``w + scaling * A^T B^T``), by parameter name;
    projections without an adapter are left out."""
    weights = {"fc1": "w_gate_up_EH2F", "fc2": "w_down_EFH"}
    merged = {}
    for name, weight in weights.items():
        module = getattr(experts, name)
        if isinstance(module, LoRAExpertLinear):
            base = getattr(experts, weight)
            merged[weight] = (base + module.delta_EKM().to(base.dtype)).detach()
    return merged


def adapter_local_slice(experts: GroupedExperts, name: str, whole_expert: torch.Tensor) -> torch.Tensor:
    """This etp rank's part of one expert's full-width value of adapter parameter ``name`` (``fc1.lora_B_EMR``...,
    expert dimension dropped), split as the weight it adapts (module docstring)."""
    if experts.etp_size == 1 or name in ETP_PARTIAL:
        return whole_expert
    if name == "fc2.lora_A_ERK":  # [r, F]: the rank's rows of the down projection
        fl = experts.local_ffn_hidden_size
        return whole_expert[:, experts.etp_rank * fl : (experts.etp_rank + 1) * fl]
    if name == "fc1.lora_B_EMR":  # [2F, r]: the rank's gate/up columns
        return whole_expert.index_select(0, experts.local_gate_up_columns().to(whole_expert.device))
    raise ValueError(f"{name} is not an expert adapter parameter")


def initial_expert_adapter(
    experts: GroupedExperts, projection: str, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """One expert's full-width (``etp_size = 1``) initial adapter of ``projection``, as PEFT starts it: ``A`` Kaiming
    uniform (``a = sqrt(5)``) drawn from ``generator``, ``B`` zero; by parameter name, expert dimension dropped."""
    module = getattr(experts, projection)
    rank = module.rank
    width = experts.activation.width_factor * experts.ffn_hidden_size
    k, m = {"fc1": (experts.hidden_size, width), "fc2": (experts.ffn_hidden_size, experts.hidden_size)}[projection]
    a = torch.empty(rank, k)
    bound = 1.0 / math.sqrt(k)  # kaiming_uniform_(a=sqrt(5)) on [r, K]: U(-1/sqrt(K), 1/sqrt(K))
    a.uniform_(-bound, bound, generator=generator)
    return {f"{projection}.lora_A_ERK": a, f"{projection}.lora_B_EMR": torch.zeros(m, rank)}
