"""What the recurrent kernels' tests (test_gated_delta.py, test_ssd.py) share: the gradients of an output and a final
state under fixed cotangents, and the check of a kernel's output, state and every gradient against the fp64
step-by-step reference's."""

from __future__ import annotations

import torch


def grads_of(x: dict, out: torch.Tensor, state: torch.Tensor, cotangents: tuple) -> tuple[torch.Tensor, ...]:
    """The gradients of ``<out, cotangents[0]> + <state, cotangents[1]>`` with respect to ``x``'s tensors."""
    loss = (out * cotangents[0]).sum() + (state * cotangents[1]).sum()
    leaves = [t for t in x.values() if t is not None]
    return torch.autograd.grad(loss, leaves)


def assert_matches_reference(
    name: str,
    x: dict,
    out: torch.Tensor,
    state: torch.Tensor,
    reference: tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]],
    cotangents: tuple,
    tolerance: float = 1e-9,
) -> None:
    """``out``, ``state`` and the gradients of every tensor of ``x`` equal the reference's (its output, state and
    gradients) within ``tolerance``, each failure naming the kernel ``name`` and what differs."""
    ref_out, ref_state, ref_grads = reference
    close = {"rtol": tolerance, "atol": tolerance}
    torch.testing.assert_close(out, ref_out, **close, msg=lambda m: f"{name} output: {m}")
    torch.testing.assert_close(state, ref_state, **close, msg=lambda m: f"{name} state: {m}")
    names = [n for n, t in x.items() if t is not None]
    for grad_name, grad, ref_grad in zip(names, grads_of(x, out, state, cotangents), ref_grads, strict=True):
        torch.testing.assert_close(grad, ref_grad, **close, msg=lambda m, g=grad_name: f"{name} d{g}: {m}")
