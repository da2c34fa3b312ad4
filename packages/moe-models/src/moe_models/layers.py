"""Building blocks shared by the families: RMSNorm, the dense gated MLP and the MoE block."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moe_dispatch import DispatchResult, LocalDispatcher, RouterConfig, RoutingResult, TopKRouter
from moe_experts import GroupedExperts, SharedExperts, get_activation


def rms_normalised(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps)`` over the last dimension, in fp32: the norm of the gated RMS norms (Qwen3-Next's
    ``linear_attention.GatedRMSNorm``, Kimi Linear's ``kimi_delta.SigmoidGatedRMSNorm``)."""
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back before the weight, as HuggingFace's Llama-family norms.

    ``zero_centered``: the scale is ``1 + weight`` (the weight starts at 0), applied in fp32 before the cast back, as
    Qwen3-Next's norms (Megatron-Core's ``layernorm_zero_centered_gamma``)."""

    def __init__(self, dim: int, eps: float, zero_centered: bool = False) -> None:
        super().__init__()
        self.eps, self.zero_centered = eps, zero_centered
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.zero_centered:
            return (x32 * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * x32.to(x.dtype)


class DenseMLP(nn.Module):
    """MLP of the dense layers: SwiGLU ``down(silu(gate(x)) * up(x))``, or with a non-gated ``activation`` (Nemotron-H's
    ``squared_relu``) ``down(act(up(x)))`` and no ``gate_proj``. A gated activation other than SwiGLU still gives
    SwiGLU here (the families with dense layers use it)."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, activation: str = "swiglu") -> None:
        super().__init__()
        act = get_activation(activation)
        self.activation = None if act.gated else act
        self.gate_proj = nn.Linear(hidden_size, ffn_hidden_size, bias=False) if act.gated else None
        self.up_proj = nn.Linear(hidden_size, ffn_hidden_size, bias=False)
        self.down_proj = nn.Linear(ffn_hidden_size, hidden_size, bias=False)

    def forward(self, x_BSH: torch.Tensor, document_ids_BS: torch.Tensor | None = None) -> tuple[torch.Tensor, None]:
        # document_ids_BS: taken so that a layer calls either MLP alike; each token is on its own here, so packed
        # documents and padding change nothing
        if self.activation is not None:
            return self.down_proj(self.activation.fn(self.up_proj(x_BSH))), None
        return self.down_proj(F.silu(self.gate_proj(x_BSH)) * self.up_proj(x_BSH)), None


def moe_compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype of dispatch, experts and combine: autocast's where it is on (bf16 training), else ``x``'s. The norm
    before the block returns the residual stream's dtype (fp32 parameters: fp32), and grouped GEMMs are on no autocast
    list, so without the cast the whole MoE path would run in fp32 under bf16 autocast (and the bf16-only kernels,
    grouped_gemm's and DeepEP's, would reject it)."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class MoEBlock(nn.Module):
    """Router -> dispatcher -> grouped experts -> combine on a flat view of the tokens, plus an optional shared
    expert every token goes through (DeepSeek-V3), optionally behind a sigmoid gate (Qwen2-MoE)."""

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        router: RouterConfig,
        expert_backend: str = "auto",
        activation: str = "swiglu",
        shared_expert_size: int | None = None,
        bias: bool = False,
        shared_expert_gate: bool = False,
        probs_on_input: bool = False,
    ) -> None:
        super().__init__()
        # Llama 4: each routed row enters its expert scaled by its probability, the outputs summed unweighted
        self.probs_on_input = probs_on_input
        self.router = TopKRouter(hidden_size, router)
        # stateless: safe to share across calls
        self.dispatcher = LocalDispatcher(router.num_experts, permute_backend=router.permute_backend)
        self.experts = GroupedExperts(
            router.num_experts, hidden_size, ffn_hidden_size, activation=activation, backend=expert_backend, bias=bias
        )
        shared = None
        if shared_expert_size:
            shared = SharedExperts(hidden_size, shared_expert_size, gate=shared_expert_gate, activation=activation)
        self.shared_experts = shared

    def forward(
        self, x_BSH: torch.Tensor, document_ids_BS: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, RoutingResult]:
        """``document_ids_BS``: int64 ``[B, S]``, the document of each token of packed rows (-1: padding). Padding
        then weighs in no routing statistic, balancing loss or capacity, and its routed output is zero;
        ``seq_aux_loss`` balances each document (:meth:`~moe_dispatch.TopKRouter.forward`)."""
        x_TH = x_BSH.reshape(-1, x_BSH.shape[-1])
        if document_ids_BS is None:
            routing = self.router(x_TH, seq_len=x_BSH.shape[1])  # tokens are batch-major; logits in router_dtype
        else:
            if document_ids_BS.shape != x_BSH.shape[:2]:
                raise ValueError(
                    f"document_ids_BS has shape {tuple(document_ids_BS.shape)}, not x_BSH's [B, S] "
                    f"{tuple(x_BSH.shape[:2])}"
                )
            routing = self.router(x_TH, seq_len=x_BSH.shape[1], document_ids_T=document_ids_BS.reshape(-1))
        shared_experts = self.shared_experts
        # the shared expert runs while the tokens travel (on a side stream on CUDA; see SharedExperts.start)
        alongside = None if shared_experts is None else (lambda: shared_experts.start(x_TH))
        out_TH, shared = self.dispatcher.exchange(
            x_TH.to(moe_compute_dtype(x_TH)), routing, self._routed_experts, alongside
        )
        if shared is not None:
            out_TH = out_TH + shared.wait()
        return out_TH.view_as(x_BSH), routing

    def _routed_experts(self, dispatched: DispatchResult) -> torch.Tensor:
        """The expert-major rows' outputs ``[N, H]``, weighted by their probabilities (combine sums them)."""
        counts_E, probs_N = dispatched.tokens_per_expert_E, dispatched.row_probs()
        if self.probs_on_input:
            rows_NH = dispatched.tokens_NH * probs_N.unsqueeze(-1).to(dispatched.tokens_NH.dtype)
            return self.experts(rows_NH, counts_E)
        if dispatched.gather_saves_memory:  # the experts gather the rows and save the smaller source instead
            return self.experts(dispatched.source_RH, counts_E, probs_N, row_source_N=dispatched.row_source_N)
        # probabilities applied inside the experts' activation: less saved for backward than weighting the gathered
        # rows in combine
        return self.experts(dispatched.tokens_NH, counts_E, probs_N)
