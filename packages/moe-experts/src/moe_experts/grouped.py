"""Routed experts computed with one grouped GEMM per projection."""

from __future__ import annotations

import math

import torch
from torch import nn

from moe_experts.activations import get_activation
from moe_experts.backends import GroupedMM, loop_grouped_mm, resolve_backend

GROUPED_MM_ROW_ALIGN_BYTES = 16  # torch grouped_mm rejects rows that are not 16-byte aligned


class GroupedExperts(nn.Module):
    """E gated-FFN experts stored as one tensor per projection.

    ``w_gate_up_EH2F`` holds gate (first F columns) and up (last F columns); ``w_down_EFH`` the down
    projection. Input rows must be in expert-major order with ``tokens_per_expert_E`` rows each.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        ffn_hidden_size: int,
        activation: str = "swiglu",
        backend: str = "auto",
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.activation_name = activation
        self.activation = get_activation(activation)
        self.requested_backend = backend
        self.backend = resolve_backend(backend)
        self.w_gate_up_EH2F = nn.Parameter(torch.empty(num_experts, hidden_size, 2 * ffn_hidden_size))
        self.w_down_EFH = nn.Parameter(torch.empty(num_experts, ffn_hidden_size, hidden_size))
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02, num_layers: int = 1) -> None:
        nn.init.normal_(self.w_gate_up_EH2F, std=std)
        # scaled output init (as Megatron's output_layer_init_method) keeps the residual stream stable
        nn.init.normal_(self.w_down_EFH, std=std / math.sqrt(2.0 * num_layers))

    def forward(self, x_NH: torch.Tensor, tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        gmm = self._grouped_mm(x_NH.element_size())
        # experts compute in the activation dtype (bf16 under autocast, whose op lists lack grouped_mm)
        w_gate_up, w_down = self.w_gate_up_EH2F.to(x_NH.dtype), self.w_down_EFH.to(x_NH.dtype)
        hidden_NF = self.activation(gmm(x_NH, w_gate_up, tokens_per_expert_E))
        return gmm(hidden_NF, w_down, tokens_per_expert_E)

    def _grouped_mm(self, element_size: int) -> GroupedMM:
        assert self.backend.gmm is not None  # resolve_backend only returns implemented back ends
        _, hidden, ffn2 = self.w_gate_up_EH2F.shape
        aligned = all(n * element_size % GROUPED_MM_ROW_ALIGN_BYTES == 0 for n in (hidden, ffn2 // 2))
        if self.backend.name != "torch" or aligned:
            return self.backend.gmm
        if self.requested_backend == "auto":
            return loop_grouped_mm
        raise ValueError(
            f"expert backend 'torch' needs hidden_size ({hidden}) and ffn_hidden_size ({ffn2 // 2}) rows of a "
            f"multiple of {GROUPED_MM_ROW_ALIGN_BYTES} bytes ({element_size}-byte elements); "
            "use backend 'loop' or 'auto'"
        )

    def extra_repr(self) -> str:
        e, h, f2 = self.w_gate_up_EH2F.shape
        return (
            f"num_experts={e}, hidden={h}, ffn={f2 // 2}, activation={self.activation_name}, "
            f"backend={self.backend.name}"
        )
