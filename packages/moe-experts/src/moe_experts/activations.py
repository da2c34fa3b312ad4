"""Activations applied to the first expert projection's output ``h`` (``[N, 2F]`` gated, ``[N, F]`` not).

Every activation is an :class:`Activation`: the function, whether it is gated, and the column layout of the
gated input (which fixes how the first projection ``w_gate_up`` stores gate and up):

============== ======= ============= ===========================================================================
name           gated   layout        ``act(h)``
============== ======= ============= ===========================================================================
``swiglu``     yes     halves        ``silu(g) * u``, ``g = h[:, :F]``, ``u = h[:, F:]``
``geglu``      yes     halves        ``gelu_tanh(g) * u``
``swiglu_oai`` yes     interleaved   GPT-OSS: ``g = h[:, 0::2].clamp(max=7)``, ``u = h[:, 1::2].clamp(-7, 7)``,
                                     ``(u + 1) * g * sigmoid(1.702 * g)``
``squared_relu`` no    -             ``relu(h) ** 2`` (Primer / Nemotron)
``gelu``       no      -             ``gelu(h)`` (exact, erf)
============== ======= ============= ===========================================================================

Non-gated activations take ``[N, F]``: :class:`~moe_experts.grouped.GroupedExperts` then stores its first
projection (still called ``w_gate_up_EH2F`` so checkpoints keep one name) with width ``F`` instead of ``2F``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

SWIGLU_OAI_ALPHA = 1.702
SWIGLU_OAI_LIMIT = 7.0

Layout = Literal["halves", "interleaved", "none"]


def swiglu(gate_up_N2F: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, gate in the first F columns and up in the last F."""
    gate, up = gate_up_N2F.chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu_weighted_forward(h_N2F: torch.Tensor, probs_N: torch.Tensor | None) -> torch.Tensor:
    """``swiglu(h) * probs[:, None]`` in one buffer (the same ops in the same order, in place: the same bits)."""
    gate, up = h_N2F.chunk(2, dim=-1)
    out_NF = F.silu(gate).mul_(up)
    return out_NF if probs_N is None else out_NF.mul_(probs_N[:, None])


def swiglu_weighted_backward(
    h_N2F: torch.Tensor, probs_N: torch.Tensor | None, grad_out_NF: torch.Tensor, need_h: bool, need_p: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The unfused SwiGLU chain's backward written out: the ops autograd runs, in its order and dtypes (so the
    gradients are the same bits), without building a graph, and the gate and up gradients written into one buffer
    instead of concatenated (the chunk's backward). About a third less time than autograd.grad on CPU."""
    gate, up = h_N2F.chunk(2, dim=-1)
    silu_gate = F.silu(gate)
    grad_p = None
    if probs_N is None:
        grad_act = grad_out_NF
    else:
        grad_prod = grad_out_NF.to(torch.promote_types(h_N2F.dtype, probs_N.dtype))  # the cast's backward
        if need_p:
            grad_p = (grad_prod * (silu_gate * up)).sum(1)
        grad_act = (grad_prod * probs_N[:, None]).to(h_N2F.dtype)
    if not need_h:
        return None, grad_p
    grad_h = torch.empty(h_N2F.shape, dtype=h_N2F.dtype, device=h_N2F.device)
    grad_gate, grad_up = grad_h.chunk(2, dim=-1)
    torch.mul(grad_act, silu_gate, out=grad_up)
    torch.ops.aten.silu_backward.grad_input(grad_act * up, gate, grad_input=grad_gate)
    return grad_h, grad_p


def geglu(gate_up_N2F: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up, gate in the first F columns and up in the last F."""
    gate, up = gate_up_N2F.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def swiglu_oai(
    gate_up_N2F: torch.Tensor, alpha: float = SWIGLU_OAI_ALPHA, limit: float = SWIGLU_OAI_LIMIT
) -> torch.Tensor:
    """GPT-OSS clamped SwiGLU on INTERLEAVED columns (gate = even columns, up = odd columns)."""
    gate, up = gate_up_N2F[..., 0::2], gate_up_N2F[..., 1::2]
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(alpha * gate))


def squared_relu(h_NF: torch.Tensor) -> torch.Tensor:
    """relu(h) ** 2 (non-gated)."""
    return torch.square(F.relu(h_NF))


def gelu(h_NF: torch.Tensor) -> torch.Tensor:
    """Exact (erf) gelu (non-gated)."""
    return F.gelu(h_NF)


@dataclass(frozen=True)
class Activation:
    """An expert activation: ``fn`` maps the first projection's output to ``[N, F]``.

    ``layout``: ``"halves"`` (gate = first F columns, up = last F), ``"interleaved"`` (gate = even columns, up =
    odd columns, as GPT-OSS) or ``"none"`` (non-gated, input width F).
    """

    name: str
    fn: Callable[[torch.Tensor], torch.Tensor]
    layout: Layout
    # optional written-out ``fn(h) * probs[:, None]`` and its backward (the same bits as autograd through the chain),
    # which :class:`~moe_experts.fused.WeightedActivation` uses instead of recomputing the chain under autograd
    weighted_forward: Callable[..., torch.Tensor] | None = None
    weighted_backward: Callable[..., tuple[torch.Tensor | None, torch.Tensor | None]] | None = None

    @property
    def gated(self) -> bool:
        return self.layout != "none"

    @property
    def width_factor(self) -> int:
        """Width of the first projection's output in units of F: 2 for gated activations, 1 otherwise."""
        return 2 if self.gated else 1

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return self.fn(h)


ACTIVATIONS: dict[str, Activation] = {
    a.name: a
    for a in (
        Activation("swiglu", swiglu, "halves", swiglu_weighted_forward, swiglu_weighted_backward),
        Activation("geglu", geglu, "halves"),
        Activation("swiglu_oai", swiglu_oai, "interleaved"),
        Activation("squared_relu", squared_relu, "none"),
        Activation("gelu", gelu, "none"),
    )
}


def get_activation(name: str) -> Activation:
    """The activation called ``name``; a ValueError lists the known ones."""
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"activation={name!r}: choose one of {tuple(ACTIVATIONS)}") from None


def gate_up_columns(layout: Layout, ffn_hidden_size: int, start: int, stop: int) -> torch.Tensor:
    """Indices of the first-projection columns that hold FFN units ``[start, stop)`` (gate and up, in the
    order of the local layout) for a first projection of ``ffn_hidden_size`` units in ``layout``.

    Used to shard the FFN dimension (expert tensor parallelism): a shard of units ``[start, stop)`` stores exactly
    these columns, in this order, so its own layout is the same kind as the full one.
    """
    units = torch.arange(start, stop)
    if layout == "none":
        return units
    if layout == "halves":
        return torch.cat([units, ffn_hidden_size + units])
    if layout == "interleaved":
        return torch.stack([2 * units, 2 * units + 1], dim=-1).flatten()
    raise ValueError(f"unknown layout {layout!r}")
