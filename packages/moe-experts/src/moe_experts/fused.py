"""Probability-weighted activation ``act(h) * probs[:, None]`` that saves less for backward.

The unfused chain keeps, for SwiGLU, the gate and up halves (views of ``h``), ``silu(gate)`` and ``act(h)`` (the
last for the product with the probabilities): about ``4 * N * F`` elements. :class:`WeightedActivation` saves only
``h`` (``2 * N * F``) and ``probs`` (``N``) and recomputes the activation in backward (Megatron's fused weighted
SwiGLU, ``moe_act`` recompute). The backward runs the very same ops as the unfused chain on the recomputed
values, so its gradients equal the unfused chain's (bit for bit on the same device).

The product is formed in the promoted dtype of ``act(h)`` and ``probs`` (fp32 probabilities make it fp32) and cast
back to ``h``'s dtype, as Megatron does with fp32 probs and bf16 activations.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def weighted_activation_reference(
    h: torch.Tensor, probs_N: torch.Tensor | None, act: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """The unfused chain ``(act(h) * probs[:, None]).to(h.dtype)`` (``act(h)`` without probs)."""
    out = act(h)
    if probs_N is None:
        return out
    return (out * probs_N[:, None]).to(h.dtype)


class WeightedActivation(torch.autograd.Function):
    """``act(h) * probs[:, None]`` saving only ``h`` and ``probs``; backward recomputes ``act(h)``."""

    @staticmethod
    def forward(ctx, h, probs_N, act):
        ctx.act = act
        ctx.save_for_backward(h, probs_N)  # None is allowed and comes back as None
        with torch.no_grad():
            forward = getattr(act, "weighted_forward", None)  # an Activation's written-out chain, where it has one
            if forward is not None and (probs_N is None or probs_N.dtype == h.dtype):
                return forward(h, probs_N)
            return weighted_activation_reference(h, probs_N, act)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        h, probs_N = ctx.saved_tensors
        need_h, need_p = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        backward = getattr(ctx.act, "weighted_backward", None)
        if backward is not None:
            grad_h, grad_p = backward(h, probs_N, grad_out, need_h, need_p and probs_N is not None)
            return grad_h, grad_p, None
        with torch.enable_grad():
            h_ = h.detach().requires_grad_(need_h)
            p_ = None if probs_N is None else probs_N.detach().requires_grad_(need_p)
            out = weighted_activation_reference(h_, p_, ctx.act)
            inputs = [t for t, need in ((h_, need_h), (p_, need_p)) if need and t is not None]
            grads = list(torch.autograd.grad(out, inputs, grad_out)) if inputs and out.requires_grad else []
        grad_h = grads.pop(0) if need_h and grads else None
        grad_p = grads.pop(0) if need_p and grads else None
        if need_h and grad_h is None:
            grad_h = torch.zeros_like(h)
        if need_p and probs_N is not None and grad_p is None:
            grad_p = torch.zeros_like(probs_N)
        return grad_h, grad_p, None


def weighted_activation(
    h: torch.Tensor, probs_N: torch.Tensor | None, act: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """``act(h) * probs[:, None]`` (just ``act(h)`` when ``probs_N`` is None) through :class:`WeightedActivation`:
    gradients of the unfused chain, about half its saved activations for gated activations."""
    if probs_N is not None and probs_N.shape != h.shape[:1]:
        raise ValueError(f"probs_N must have one entry per row: shape {tuple(probs_N.shape)} for {h.shape[0]} rows")
    if torch.compiler.is_compiling():
        # the Function's backward calls autograd.grad, which dynamo cannot trace (it would re-trace the frame every
        # step and run it eagerly); the compiler fuses the plain chain and chooses what to save itself
        return weighted_activation_reference(h, probs_N, act)
    return WeightedActivation.apply(h, probs_N, act)
