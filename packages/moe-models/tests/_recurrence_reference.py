"""What the recurrent kernels' tests (test_gated_delta.py, test_kimi_delta.py, test_ssd.py) share: the gradients of
an output and a final state under fixed cotangents, and the check of a kernel's output, state and every gradient
against the fp64 step-by-step reference's. For the two delta rules (Gated DeltaNet's one log decay per head, Kimi
Delta Attention's one per key channel): the naive fp64 recurrence, the test inputs and the checks both make of their
kernels (against the recurrence, a sequence split with its state carried, bf16 inputs, extreme gates, saved memory)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from _hf_reference import rel_err
from hypothesis import strategies as st

from moe_memory import SavedTensorBytes

F64 = torch.float64


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


# ----------------------------------------------------------------------------------------------- the delta rules


def naive_delta_rule(q, k, v, g, beta, state, *, use_qk_l2norm, scale):
    """S_t = D_t S_{t-1} + beta_t k_t (v_t - (D_t S_{t-1})^T k_t)^T, o_t = S_t^T (scale q_t), one step at a time, with
    D_t = exp(g_t) for g [B, S, N] (the gated delta rule) or diag(exp(g_t)) scaling the state's key rows for
    g [B, S, N, K] (Kimi Delta Attention); q, k [B, S, H, K], v [B, S, N, V], beta [B, S, N], state [B, N, K, V]."""
    if use_qk_l2norm:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    groups = v.shape[2] // q.shape[2]
    q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if state is None:
        state = v.new_zeros(v.shape[0], v.shape[2], k.shape[-1], v.shape[-1])
    if g.dim() == 3:
        g = g.unsqueeze(-1)  # one decay for every key row
    outputs = []
    for t in range(v.shape[1]):
        decayed = g[:, t].exp()[..., None] * state
        predicted = torch.einsum("bnkv,bnk->bnv", decayed, k[:, t])
        write = torch.einsum("bnk,bnv->bnkv", k[:, t], v[:, t] - predicted)
        state = decayed + beta[:, t][..., None, None] * write
        outputs.append(torch.einsum("bnkv,bnk->bnv", state, scale * q[:, t]))
    return torch.stack(outputs, dim=1), state


# log decays from uniforms, per element (with per-channel gates, mixed: some channels of a head keep ~all, some
# ~nothing)
GATES = {
    "near_zero": lambda u: -1e-4 * u,
    "very_negative": lambda u: -20.0 - 5.0 * u,
    "mixed": lambda u: torch.where(u < 0.5, -1e-4 * u, -20.0 * u),
    "typical": lambda u: -F.softplus(4.0 * u - 2.0),
}
BETAS = {"near_zero": lambda u: 1e-4 * u, "near_one": lambda u: 1.0 - 1e-4 * u, "uniform": lambda u: u}


def make_inputs(
    seed,
    batch,
    seq,
    qk_heads,
    groups,
    dim_k,
    dim_v,
    gate,
    beta,
    with_state,
    l2norm,
    dtype=F64,
    device="cpu",
    *,
    per_channel=False,
):
    """Leaves q, k, v, g, beta, state (None without ``with_state``) of a delta rule; g [B, S, N], or [B, S, N, K]
    with ``per_channel``."""
    gen = torch.Generator().manual_seed(seed)
    heads = qk_heads * groups

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=F64)

    def rand(*shape):
        return torch.rand(*shape, generator=gen, dtype=F64)

    # without the L2 norm, keys of norm below ~1 keep I - beta k k^T a contraction, as normalised keys do
    k_scale = 1.0 if l2norm else 0.8 / dim_k**0.5
    tensors = {
        "q": randn(batch, seq, qk_heads, dim_k),
        "k": randn(batch, seq, qk_heads, dim_k) * k_scale,
        "v": randn(batch, seq, heads, dim_v),
        "g": GATES[gate](rand(batch, seq, heads, *((dim_k,) if per_channel else ()))),
        "beta": BETAS[beta](rand(batch, seq, heads)),
        "state": randn(batch, heads, dim_k, dim_v) * 0.5 if with_state else None,
    }
    return {
        name: None if x is None else x.to(dtype=dtype, device=device).requires_grad_() for name, x in tensors.items()
    }


def run_ours(fn, x, **kwargs):
    return fn(
        x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state_BNKV=x["state"], output_final_state=True, **kwargs
    )


@st.composite
def problems(draw, max_qk_heads: int, max_dim: int):
    """make_inputs' arguments after the seed."""
    return {
        "batch": draw(st.integers(1, 2)),
        "seq": draw(st.integers(1, 40)),
        "qk_heads": draw(st.integers(1, max_qk_heads)),
        "groups": draw(st.sampled_from([1, 1, 2])),
        "dim_k": draw(st.integers(2, max_dim)),
        "dim_v": draw(st.integers(2, max_dim)),
        "gate": draw(st.sampled_from(sorted(GATES))),
        "beta": draw(st.sampled_from(sorted(BETAS))),
        "with_state": draw(st.booleans()),
        "l2norm": draw(st.booleans()),
    }


def assert_kernels_match_naive(kernels: list, x: dict, options: dict, seed: int) -> None:
    """Each ``(name, fn, kwargs)`` of ``kernels`` gives the naive recurrence's fp64 output, final state and input
    gradients (under cotangents drawn from ``seed + 1``)."""
    ref_out, ref_state = naive_delta_rule(*x.values(), **options)
    gen = torch.Generator().manual_seed(seed + 1)
    cotangents = (
        torch.randn(ref_out.shape, generator=gen, dtype=F64),
        torch.randn(ref_state.shape, generator=gen, dtype=F64),
    )
    ref_grads = grads_of(x, ref_out, ref_state, cotangents)
    for name, fn, kwargs in kernels:
        out, state = run_ours(fn, x, **options, **kwargs)
        assert out.dtype == F64 and state.dtype == F64
        assert_matches_reference(name, x, out, state, (ref_out, ref_state, ref_grads), cotangents)


def assert_split_gives_the_whole(chunked, recurrent, x: dict, split: int, chunk_size: int) -> None:
    """``x`` split at ``split``, the first part chunked, the rest chunked or recurrent from its final state, gives the
    whole sequence's output and final state."""
    whole_out, whole_state = run_ours(chunked, x, chunk_size=chunk_size, use_qk_l2norm=True)
    first = {n: t if n == "state" else t[:, :split] for n, t in x.items()}
    second = {n: t[:, split:] for n, t in x.items() if n != "state"}
    # a chunked prefill then the rest chunked (context parallelism) or token by token (generation)
    out_1, state_1 = run_ours(chunked, first, chunk_size=chunk_size, use_qk_l2norm=True)
    for fn, kwargs in [(chunked, {"chunk_size": chunk_size}), (recurrent, {})]:
        out_2, state_2 = run_ours(fn, {**second, "state": state_1}, use_qk_l2norm=True, **kwargs)
        torch.testing.assert_close(torch.cat([out_1, out_2], dim=1), whole_out, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(state_2, whole_state, rtol=1e-10, atol=1e-10)


def assert_near_transformers(ours: tuple, theirs: tuple, x: dict, l2norm: bool) -> tuple:
    """Our chunked and recurrent kernels (``ours``) and transformers' (``theirs``, called as its layers call them) on
    the fp32 ``x`` from its state, chunks of 64: outputs and final states within 1e-5 (max-relative). Returns our
    chunked result and transformers'."""
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    hf_kwargs = {"initial_state": x["state"], "output_final_state": True, "use_qk_l2norm_in_kernel": l2norm}
    ref_chunk = theirs[0](*args, chunk_size=64, **hf_kwargs)
    ref_recurrent = theirs[1](*args, **hf_kwargs)
    ours_chunk = run_ours(ours[0], x, chunk_size=64, use_qk_l2norm=l2norm)
    ours_recurrent = run_ours(ours[1], x, use_qk_l2norm=l2norm)
    for result, ref in [(ours_chunk, ref_chunk), (ours_recurrent, ref_recurrent)]:
        assert result[0].shape == ref[0].shape and result[0].dtype == torch.float32
        assert rel_err(result[0], ref[0]) < 1e-5
        assert rel_err(result[1], ref[1]) < 1e-5
    return ours_chunk, ref_chunk


def assert_bf16_computes_in_fp32(kernels: list, x64: dict) -> None:
    """Each ``(fn, kwargs)`` of ``kernels`` on ``x64`` rounded to bf16 gives exactly its fp32 result on the rounded
    inputs: the state in fp32, the output then rounded to bf16."""
    x16 = {n: t.detach().to(torch.bfloat16) for n, t in x64.items()}
    x32 = {n: t.to(torch.float32) for n, t in x16.items()}
    for fn, kwargs in kernels:
        out_16, state_16 = run_ours(fn, x16, use_qk_l2norm=True, **kwargs)
        out_32, state_32 = run_ours(fn, x32, use_qk_l2norm=True, **kwargs)
        assert out_16.dtype == torch.bfloat16 and state_16.dtype == torch.float32
        torch.testing.assert_close(state_16, state_32, rtol=0, atol=0)
        torch.testing.assert_close(out_16, out_32.to(torch.bfloat16), rtol=0, atol=0)


def assert_finite_and_near_fp64(chunked, x: dict) -> None:
    """The chunked kernel (chunk 64) on the fp32 ``x``: output, state and every input gradient finite, and output and
    state within 1e-5 of the naive recurrence in fp64."""
    out, state = run_ours(chunked, x, chunk_size=64, use_qk_l2norm=True)
    grads = torch.autograd.grad(out.square().sum() + state.square().sum(), list(x.values()))
    assert all(t.isfinite().all() for t in (out, state, *grads))
    x64 = {n: t.detach().to(F64) for n, t in x.items()}
    ref_out, ref_state = naive_delta_rule(*x64.values(), use_qk_l2norm=True, scale=None)
    assert rel_err(out.to(F64), ref_out) < 1e-5
    assert rel_err(state.to(F64), ref_state) < 1e-5


def saved_by(chunked, seq: int, *, per_channel: bool = False, chunk_size: int = 64) -> tuple[int, int]:
    """Bytes the chunked kernel saves for backward on fp32 inputs of ``seq`` positions (2 heads of 16), and the
    element count of the largest saved storage."""
    x = make_inputs(0, 1, seq, 2, 1, 16, 16, "typical", "uniform", True, True, torch.float32, per_channel=per_channel)
    with SavedTensorBytes() as saved:
        chunked(*(x[n] for n in ("q", "k", "v", "g", "beta")), chunk_size=chunk_size)
    largest = max(s.nbytes // s.dtype.itemsize for s in saved.storages)
    return saved.total, largest
