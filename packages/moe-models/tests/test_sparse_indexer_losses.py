"""DeepSeek Sparse Attention's indexer losses (dense warm-up and sparse stage) against a per-query hand computation,
and the sparse core's memory: linear in the sequence, never an [S, S] tensor."""

from __future__ import annotations

import torch
from _dsa_cases import F64, random_selection, small_indexer, small_inputs
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode

from moe_memory import SavedTensorBytes
from moe_models.sparse_attention import dense_indexer_loss, sparse_attention, sparse_indexer_loss

# ----------------------------------------------------------------------------- the indexer losses


def _hand_loss(index_scores, q, k, scale, selection) -> torch.Tensor:
    """Per query: each head's softmax over the query's key set, summed over heads and divided by the sum, against
    softmax of the indexer's scores over the same set; KL summed over the set, averaged over the queries.
    ``selection(b, s)``: the query's key set (a list of key indices)."""
    b_len, _, s_len, _ = q.shape
    total = index_scores.new_zeros(())
    for b in range(b_len):
        for s in range(s_len):
            keys = selection(b, s)
            logits = torch.stack([(q[b, :, s] * k[b, :, t]).sum(-1) * scale for t in keys], dim=-1)  # [N, T]
            per_head = torch.exp(logits - logits.max(-1, keepdim=True).values)
            per_head = per_head / per_head.sum(-1, keepdim=True)
            target = per_head.sum(0) / per_head.sum()
            scores = torch.stack([index_scores[b, s, t] for t in keys])
            log_q = scores - torch.logsumexp(scores, dim=0)
            total = total + (target * (target.log() - log_q)).sum()
    return total / (b_len * s_len)


@settings(max_examples=15, deadline=None)
@given(topk=st.integers(1, 5), extra=st.integers(-4, 6), seed=st.integers(0, 2**16))
def test_indexer_losses_match_hand_computation(topk, extra, seed) -> None:
    s = max(1, topk + extra)
    g = torch.Generator().manual_seed(seed)
    indexer = small_indexer(topk, heads=3)
    x, q_latent, cos, sin = small_inputs(g, 2, s)
    q = torch.randn(2, 3, s, 5, generator=g, dtype=F64, requires_grad=True)
    k = torch.randn(2, 3, s, 5, generator=g, dtype=F64, requires_grad=True)
    scale = 0.6

    # dense warm-up: every earlier key
    dense_scores = indexer.scores(x, q_latent, cos, sin)
    loss = dense_indexer_loss(dense_scores, q, k, scale, block_size=2)
    hand = _hand_loss(dense_scores, q, k, scale, lambda b, i: list(range(i + 1)))
    torch.testing.assert_close(loss, hand, rtol=1e-10, atol=1e-12)
    params = list(indexer.parameters())
    grads = torch.autograd.grad(loss, params, retain_graph=True)
    for grad, ref in zip(grads, torch.autograd.grad(hand, params, retain_graph=True), strict=True):
        torch.testing.assert_close(grad, ref, rtol=1e-9, atol=1e-12)
    # the target is detached: the main attention's q and k get nothing from this loss
    assert torch.autograd.grad(loss, [q, k], allow_unused=True) == (None, None)

    # sparse stage: the selected keys only
    indices = indexer(x, q_latent, cos, sin)
    selected = indexer.selected_scores(x, q_latent, cos, sin, indices)
    dense_at = dense_scores.gather(-1, indices.clamp_min(0)).masked_fill(indices < 0, float("-inf"))
    torch.testing.assert_close(selected, dense_at, rtol=1e-12, atol=1e-12)
    loss = sparse_indexer_loss(selected, q, k, indices, scale, block_size=2)

    def chosen(b: int, i: int) -> list[int]:
        return [t for t in indices[b, i].tolist() if t >= 0]

    # the selected scores at their keys' places (the -1 slots into a column dropped after)
    chosen_scores = torch.full((2, s, s + 1), float("-inf"), dtype=F64)
    chosen_scores = chosen_scores.scatter(-1, torch.where(indices < 0, s, indices), selected)[..., :s]
    hand = _hand_loss(chosen_scores, q, k, scale, chosen)
    torch.testing.assert_close(loss, hand, rtol=1e-10, atol=1e-12)
    grads = torch.autograd.grad(loss, params, retain_graph=True)
    for grad, ref in zip(grads, torch.autograd.grad(hand, params, retain_graph=True), strict=True):
        torch.testing.assert_close(grad, ref, rtol=1e-9, atol=1e-12)
    assert torch.autograd.grad(loss, [q, k], allow_unused=True) == (None, None)
    if s <= topk:  # every earlier key selected: the two stages' losses coincide
        torch.testing.assert_close(loss, dense_indexer_loss(dense_scores, q, k, scale), rtol=1e-10, atol=1e-12)
    if topk == 1:  # one selected key: target and indexer are both certain of it
        assert loss == 0


# ----------------------------------------------------------------------------- memory


def _saved_by_sparse_attention(s: int) -> tuple[int, int]:
    q, k, v = (torch.randn(1, 2, s, 8, requires_grad=True) for _ in range(3))
    indices = random_selection(torch.Generator().manual_seed(0), 1, s, s, 4, 0.0)
    with SavedTensorBytes() as saved:
        sparse_attention(q, k, v, indices, block_size=16)
    return saved.total, max(x.nbytes // x.dtype.itemsize for x in saved.storages)


class _LargestTensor(TorchFunctionMode):
    """The largest tensor any torch function returns while active (element count)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_memory_is_linear_in_the_sequence() -> None:
    (short, _), (long, largest) = _saved_by_sparse_attention(256), _saved_by_sparse_attention(512)
    assert 1.8 < long / short < 2.2, (short, long)
    assert largest <= 512 * 4 * 2 * 8 < 512 * 512  # at most the selected [S, topk] keys of the heads, never [S, S]
    s, block = 512, 16
    q, k, v = (torch.randn(1, 2, s, 8) for _ in range(3))
    indices = random_selection(torch.Generator().manual_seed(1), 1, s, s, 4, 0.0)
    with _LargestTensor() as seen:
        sparse_attention(q, k, v, indices, block_size=block)
    assert seen.largest <= s * 4 * 2 * 8, seen.largest
    indexer = small_indexer(4, heads=2, dtype=torch.float32)
    indexer.top_k.block_size = block
    inputs = small_inputs(torch.Generator().manual_seed(2), 1, s, torch.float32)
    with _LargestTensor() as seen:
        indexer(*inputs)
    assert seen.largest <= max(2 * block * s, s * 8), seen.largest  # a block's [H, block, K] scores, not [S, S]
