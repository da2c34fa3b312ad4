"""Exact softmax attention whose memory grows linearly with the sequence, for every attention variant the families
use: causal by position (queries and keys may be any positions of the sequence, as a context-parallel rank's are),
sliding windows, chunks (Llama 4: a query sees the keys of its own chunk of ``chunk`` positions), learned sinks,
grouped-query heads and a value head size that differs from the query/key one (MLA), and packed documents (a query sees
only the keys of its own document, per batch row).

Queries are processed a block at a time against the range of keys that block may see; only the outputs and one
log-sum-exp per query row are kept for the backward, which recomputes each block's probabilities (the flash-attention
scheme, in plain torch). A sink is one more logit per head in every row's softmax that attends to nothing: it enters
the log-sum-exp, shrinks the outputs, and gets the gradient ``-sum(p_sink * rowsum(dO * O))``.
"""

from __future__ import annotations

import math

import torch

# score elements (fp32) one query block may hold at a time: a block of rows times the keys it sees, over batch and
# heads; bounds the transient memory independently of the sequence length
BLOCK_SCORES = 1 << 23


def _first_key_position(lo_pos: int, window: int | None, chunk: int | None) -> int:
    """The earliest key position a query at ``lo_pos`` may see under the window and the chunks."""
    first = 0 if window is None else lo_pos - window + 1
    return first if chunk is None else max(first, lo_pos // chunk * chunk)


def _key_ranges(
    q_pos_S: torch.Tensor, k_pos_K: torch.Tensor, window: int | None, rows: int, chunk: int | None = None
) -> list[tuple[int, int, int, int]]:
    """``(q_start, q_end, k_start, k_end)`` per query block of at most ``rows`` rows: the keys (sorted by position)
    the block's queries may see lie in ``[k_start, k_end)``."""
    q_pos, k_pos = q_pos_S.cpu(), k_pos_K.cpu()
    out = []
    for start in range(0, q_pos.numel(), rows):
        block = q_pos[start : start + rows]
        lo_pos, hi_pos = int(block.min()), int(block.max())
        k_end = int(torch.searchsorted(k_pos, hi_pos, right=True))
        k_start = int(torch.searchsorted(k_pos, _first_key_position(lo_pos, window, chunk)))
        out.append((start, start + block.numel(), k_start, max(k_end, k_start)))
    return out


def _whole_sequence_key_ranges(
    seq: int, keys: int, window: int | None, rows: int, chunk: int | None = None
) -> list[tuple[int, int, int, int]]:
    """:func:`_key_ranges` for the default positions ``0..S-1`` and ``0..K-1``, from the sizes alone: no tensor is
    read back, so torch.compile traces the attention of a whole sequence without a graph break."""
    out = []
    for start in range(0, seq, rows):
        end = min(start + rows, seq)
        k_end = min(end, keys)  # the keys at positions <= end - 1
        k_start = min(max(_first_key_position(start, window, chunk), 0), keys)
        out.append((start, end, k_start, max(k_end, k_start)))
    return out


def _block_rows(batch: int, heads: int, keys: int, seq: int, window: int | None, chunk: int | None = None) -> int:
    """Query rows per block (a power of two, at least 16): at most 256, so that the masked waste of the causal
    diagonal stays small; about the window (or chunk) under a sliding window (a block then sees about twice the
    window's keys); and few enough to keep a block's scores under :data:`BLOCK_SCORES`."""
    rows = min(256, max(16, BLOCK_SCORES // max(batch * heads * keys, 1)))
    for span in (window, chunk):
        if span is not None:
            rows = min(rows, max(64, span))
    return min(seq, 1 << int(math.log2(rows)))


def _acc(t: torch.Tensor) -> torch.dtype:
    """The dtype softmax statistics and gradients accumulate in: fp32, or fp64 for fp64 inputs."""
    return torch.promote_types(t.dtype, torch.float32)


def _scores(
    q_BNGQD: torch.Tensor,
    k_BNKD: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    window: int | None,
    scale: float,
    q_docs_BQ: torch.Tensor | None = None,
    k_docs_BK: torch.Tensor | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """Masked scores ``[B, Nkv, G, Q, K]`` of a query block against its keys (-inf where not allowed), in fp32 (fp64
    for fp64 inputs). With the block's query and key document ids, a key of another document is not allowed; with
    ``chunk``, a key of another chunk."""
    b, n_kv, g, rows, d = q_BNGQD.shape
    s = (q_BNGQD.reshape(b, n_kv, g * rows, d) @ k_BNKD.transpose(-1, -2)).to(_acc(q_BNGQD)).mul_(scale)
    s = s.view(b, n_kv, g, rows, -1)
    delta_QK = q_pos[:, None] - k_pos[None, :]
    allowed = delta_QK >= 0
    if window is not None:
        allowed &= delta_QK < window
    if chunk is not None:
        allowed &= (q_pos[:, None] // chunk) == (k_pos[None, :] // chunk)
    if q_docs_BQ is not None:
        same_BQK = q_docs_BQ[:, :, None] == k_docs_BK[:, None, :]
        allowed = (allowed & same_BQK).view(b, 1, 1, rows, -1)
    return s.masked_fill_(~allowed, float("-inf"))


class _BlockwiseAttention(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        q_BNSD: torch.Tensor,
        k_BNKD: torch.Tensor,
        v_BNKV: torch.Tensor,
        sinks_N: torch.Tensor | None,
        q_pos_S: torch.Tensor,
        k_pos_K: torch.Tensor,
        window: int | None,
        scale: float,
        ranges: list[tuple[int, int, int, int]],
        q_docs_BS: torch.Tensor | None = None,
        k_docs_BK: torch.Tensor | None = None,
        chunk: int | None = None,
    ) -> torch.Tensor:
        b, n, s, d = q_BNSD.shape
        n_kv, dv = k_BNKD.shape[1], v_BNKV.shape[-1]
        g = n // n_kv
        q5 = q_BNSD.view(b, n_kv, g, s, d)
        acc = _acc(q_BNSD)
        sink_BNG11 = None if sinks_N is None else sinks_N.to(acc).view(1, n_kv, g, 1, 1)
        out = q_BNSD.new_empty(b, n_kv, g, s, dv)
        lse_BNGS = q_BNSD.new_empty(b, n_kv, g, s, dtype=acc)
        for q0, q1, k0, k1 in ranges:
            if k1 == k0:  # the block sees no key: only a sink holds its probability
                out[:, :, :, q0:q1] = 0
                lse_BNGS[..., q0:q1] = float("-inf") if sink_BNG11 is None else sink_BNG11.squeeze(-1)
                continue
            q_docs, k_docs = (None, None) if q_docs_BS is None else (q_docs_BS[:, q0:q1], k_docs_BK[:, k0:k1])
            scores = _scores(
                q5[:, :, :, q0:q1],
                k_BNKD[:, :, k0:k1],
                q_pos_S[q0:q1],
                k_pos_K[k0:k1],
                window,
                scale,
                q_docs,
                k_docs,
                chunk,
            )
            top = scores.amax(dim=-1, keepdim=True)
            if sink_BNG11 is not None:
                top = torch.maximum(top, sink_BNG11)
            top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # rows that see nothing
            probs = scores.sub_(top).exp_()
            total = probs.sum(dim=-1, keepdim=True)
            if sink_BNG11 is not None:
                total = total + (sink_BNG11 - top).exp()
            probs.div_(total.clamp_min(torch.finfo(acc).tiny))
            lse_BNGS[..., q0:q1] = (top + total.log()).squeeze(-1)
            block = probs.to(v_BNKV.dtype).view(b, n_kv, g * (q1 - q0), k1 - k0) @ v_BNKV[:, :, k0:k1]
            out[:, :, :, q0:q1] = block.view(b, n_kv, g, q1 - q0, dv)
        out_BNSV = out.view(b, n, s, dv)
        ctx.save_for_backward(q_BNSD, k_BNKD, v_BNKV, out_BNSV, lse_BNGS, sinks_N)
        # positions and block ranges are small and no outputs: kept on ctx, not counted among the saved activations
        ctx.q_pos, ctx.k_pos, ctx.ranges, ctx.window, ctx.scale = q_pos_S, k_pos_K, ranges, window, scale
        ctx.q_docs, ctx.k_docs, ctx.chunk = q_docs_BS, k_docs_BK, chunk
        return out_BNSV

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_BNSV: torch.Tensor):  # type: ignore[override]
        q_BNSD, k_BNKD, v_BNKV, out_BNSV, lse_BNGS, sinks_N = ctx.saved_tensors
        b, n, s, d = q_BNSD.shape
        n_kv, dv = k_BNKD.shape[1], v_BNKV.shape[-1]
        g, acc = n // n_kv, _acc(q_BNSD)
        q5 = q_BNSD.view(b, n_kv, g, s, d)
        grad5 = grad_BNSV.contiguous().view(b, n_kv, g, s, dv)
        # D = rowsum(dO * O): the softmax backward's row term, sink included (it holds probability but no value)
        rowdot_BNGS = (grad5.to(acc) * out_BNSV.view(b, n_kv, g, s, dv).to(acc)).sum(-1)
        lse = torch.where(torch.isfinite(lse_BNGS), lse_BNGS, torch.zeros_like(lse_BNGS))
        dq = torch.zeros(b, n_kv, g, s, d, dtype=acc, device=q_BNSD.device)
        dk = torch.zeros(k_BNKD.shape, dtype=acc, device=k_BNKD.device)
        dv_ = torch.zeros(v_BNKV.shape, dtype=acc, device=v_BNKV.device)
        for q0, q1, k0, k1 in ctx.ranges:
            rows, keys = q1 - q0, k1 - k0
            if keys == 0:
                continue
            q_blk = q5[:, :, :, q0:q1]
            k_blk, v_blk = k_BNKD[:, :, k0:k1], v_BNKV[:, :, k0:k1]
            docs = (None, None) if ctx.q_docs is None else (ctx.q_docs[:, q0:q1], ctx.k_docs[:, k0:k1])
            q_pos, k_pos = ctx.q_pos[q0:q1], ctx.k_pos[k0:k1]
            scores = _scores(q_blk, k_blk, q_pos, k_pos, ctx.window, ctx.scale, *docs, ctx.chunk)
            probs = scores.sub_(lse[..., q0:q1, None]).exp_()  # [B, Nkv, G, Q, K]
            p_flat = probs.view(b, n_kv, g * rows, keys)
            g_flat = grad5[:, :, :, q0:q1].reshape(b, n_kv, g * rows, dv).to(acc)
            dv_[:, :, k0:k1] += p_flat.transpose(-1, -2) @ g_flat
            dp = (g_flat @ v_blk.to(acc).transpose(-1, -2)).view(b, n_kv, g, rows, keys)
            ds = probs.mul_(dp.sub_(rowdot_BNGS[..., q0:q1, None])).mul_(ctx.scale)
            ds_flat = ds.view(b, n_kv, g * rows, keys)
            dq[:, :, :, q0:q1] = (ds_flat @ k_blk.to(acc)).view(b, n_kv, g, rows, d)
            dk[:, :, k0:k1] += ds_flat.transpose(-1, -2) @ q_blk.reshape(b, n_kv, g * rows, d).to(acc)
        dsinks = None
        if sinks_N is not None:
            p_sink = (sinks_N.to(acc).view(1, n_kv, g, 1) - lse).exp()
            dsinks = -(p_sink * rowdot_BNGS).sum(dim=(0, 3)).reshape(n).to(sinks_N.dtype)
        return (
            dq.view(b, n, s, d).to(q_BNSD.dtype),
            dk.to(k_BNKD.dtype),
            dv_.to(v_BNKV.dtype),
            dsinks,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
        )


def blockwise_attention(
    q_BNSD: torch.Tensor,
    k_BNKD: torch.Tensor,
    v_BNKV: torch.Tensor,
    scale: float,
    *,
    q_pos_S: torch.Tensor | None = None,
    k_pos_K: torch.Tensor | None = None,
    window: int | None = None,
    sinks_N: torch.Tensor | None = None,
    documents_BS: torch.Tensor | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale + mask [+ sink]) v, ``[B, N, S, Dv]``, in memory linear in S.

    ``q`` has N heads, ``k`` / ``v`` N or a divisor of N (query head h uses key head h // (N / Nkv)); ``v``'s head
    size may differ from q/k's. Query i may see key j when ``k_pos[j] <= q_pos[i]`` and, with a ``window``,
    ``q_pos[i] - k_pos[j] < window``; positions default to 0..S-1 and 0..K-1, and ``k_pos_K`` must be ascending.
    ``sinks_N``: one learned logit per query head joining every row's softmax. A row that sees no key and has no sink
    gives zeros. ``documents_BS``: the document id of every position of each batch row's whole sequence (int ``[B, L]``,
    indexed by the positions); query i then sees key j only when also ``documents_BS[b, q_pos[i]] ==
    documents_BS[b, k_pos[j]]``. The ids are only compared on the device (no block is skipped: that would need them
    on the host), so the work is that of the causal / window mask alone. ``chunk``: query i sees key j only when
    ``q_pos[i] // chunk == k_pos[j] // chunk`` too (Llama 4's chunked attention).
    """
    b, n, seq, _ = q_BNSD.shape
    keys = k_BNKD.shape[2]
    rows = _block_rows(b, n, keys, seq, window, chunk)
    whole_sequence = q_pos_S is None and k_pos_K is None
    q_pos_S = torch.arange(seq, device=q_BNSD.device) if q_pos_S is None else q_pos_S
    k_pos_K = torch.arange(keys, device=k_BNKD.device) if k_pos_K is None else k_pos_K
    if whole_sequence:
        ranges = _whole_sequence_key_ranges(seq, keys, window, rows, chunk)
    else:
        ranges = _key_ranges(q_pos_S, k_pos_K, window, rows, chunk)
    q_docs_BS = k_docs_BK = None
    if documents_BS is not None:  # each query's and key's document (slices for the default positions)
        q_docs_BS = documents_BS[:, :seq] if whole_sequence else documents_BS[:, q_pos_S]
        k_docs_BK = documents_BS[:, :keys] if whole_sequence else documents_BS[:, k_pos_K]
    return _BlockwiseAttention.apply(
        q_BNSD.contiguous(),
        k_BNKD.contiguous(),
        v_BNKV.contiguous(),
        sinks_N,
        q_pos_S,
        k_pos_K,
        window,
        scale,
        ranges,
        q_docs_BS,
        k_docs_BK,
        chunk,
    )


def reference_attention(
    q_BNSD: torch.Tensor,
    k_BNKD: torch.Tensor,
    v_BNKV: torch.Tensor,
    scale: float,
    *,
    q_pos_S: torch.Tensor | None = None,
    k_pos_K: torch.Tensor | None = None,
    window: int | None = None,
    sinks_N: torch.Tensor | None = None,
    documents_BS: torch.Tensor | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """:func:`blockwise_attention` written out: the whole ``[S, K]`` score matrix at once (quadratic memory), the
    independent reference the tests hold the kernel to."""
    n, n_kv = q_BNSD.shape[1], k_BNKD.shape[1]
    k = k_BNKD.repeat_interleave(n // n_kv, dim=1)
    v = v_BNKV.repeat_interleave(n // n_kv, dim=1)
    q_pos = torch.arange(q_BNSD.shape[2]) if q_pos_S is None else q_pos_S
    k_pos = torch.arange(k_BNKD.shape[2]) if k_pos_K is None else k_pos_K
    delta = q_pos[:, None] - k_pos[None, :]
    allowed = (delta >= 0) & (delta < window) if window is not None else delta >= 0
    if chunk is not None:
        allowed &= (q_pos[:, None] // chunk) == (k_pos[None, :] // chunk)
    if documents_BS is not None:  # [B, 1, S, K]: the same document in each batch row
        docs = documents_BS.cpu()
        same = docs[:, q_pos.cpu()][:, :, None] == docs[:, k_pos.cpu()][:, None, :]
        allowed = (allowed.cpu() & same).unsqueeze(1)
    acc = torch.promote_types(q_BNSD.dtype, torch.float32)
    logits = (q_BNSD.to(acc) @ k.to(acc).transpose(-1, -2)) * scale
    logits = logits.masked_fill(~allowed.to(logits.device), float("-inf"))
    b, _, s, _ = logits.shape
    if sinks_N is not None:
        logits = torch.cat([logits, sinks_N.to(acc).view(1, n, 1, 1).expand(b, n, s, 1)], dim=-1)
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    if sinks_N is not None:
        probs = probs[..., :-1]
    return (probs @ v.to(acc)).to(v_BNKV.dtype)
