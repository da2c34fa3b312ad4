"""Blockwise attention against the whole-score-matrix reference (fp64, outputs and every gradient), SDPA, and its
memory: what it keeps for the backward grows linearly with the sequence. With packed documents: against the reference
with the documents' mask, and against each document attended alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import moe_models.blockwise as blockwise_module
from moe_memory import SavedTensorBytes
from moe_models.attention import CoreAttention
from moe_models.blockwise import blockwise_attention, reference_attention


@st.composite
def problems(draw):
    """Shapes, a window or none, sinks or none, and query / key positions: the whole sequence, or a subset of the
    queries (a context-parallel rank's chunks) against every key."""
    batch, n_kv, groups = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.sampled_from([1, 2, 3]))
    keys, d, dv = draw(st.integers(1, 40)), draw(st.sampled_from([2, 4, 8])), draw(st.sampled_from([2, 4, 6]))
    window = draw(st.one_of(st.none(), st.integers(1, keys + 2)))
    sinks = draw(st.booleans())
    if draw(st.booleans()):
        q_pos = torch.arange(keys)
    else:
        picked = draw(st.lists(st.integers(0, keys - 1), min_size=1, max_size=keys, unique=True))
        q_pos = torch.tensor(sorted(picked))
    block_scores = draw(st.sampled_from([1, 64, 1 << 23]))  # 1: blocks of 16 rows, several per sequence
    return batch, n_kv, groups, keys, d, dv, window, sinks, q_pos, block_scores


@settings(max_examples=60, deadline=None)
@given(problems(), st.integers(0, 2**31 - 1))
def test_matches_the_reference_with_gradients(problem, seed: int) -> None:
    batch, n_kv, groups, keys, d, dv, window, sinks, q_pos, block_scores = problem
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(blockwise_module, "BLOCK_SCORES", block_scores)
        _check_against_reference(batch, n_kv, groups, keys, d, dv, window, sinks, q_pos, seed)


@settings(max_examples=40, deadline=None)
@given(problems(), st.integers(1, 12), st.integers(0, 2**31 - 1))
def test_chunks_match_the_reference_with_gradients(problem, chunk: int, seed: int) -> None:
    """Llama 4's chunked attention: a query sees only the keys of its own chunk of positions (with a window and
    sinks too, and at a context-parallel rank's positions: the chunks are positions, not rows)."""
    batch, n_kv, groups, keys, d, dv, window, sinks, q_pos, block_scores = problem
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(blockwise_module, "BLOCK_SCORES", block_scores)
        _check_against_reference(batch, n_kv, groups, keys, d, dv, window, sinks, q_pos, seed, chunk=chunk)


def test_chunks_are_a_block_diagonal_causal_mask() -> None:
    """By hand: with chunks of 3, query 4 sees keys 3 and 4 only."""
    q = torch.zeros(1, 1, 6, 2)
    v = torch.arange(6, dtype=torch.float32).view(1, 1, 6, 1)
    out = blockwise_attention(q, torch.zeros(1, 1, 6, 2), v, 1.0, chunk=3)  # equal scores: the mean of the seen values
    assert out.flatten().tolist() == [0.0, 0.5, 1.0, 3.0, 3.5, 4.0]


def _check_against_reference(
    batch, n_kv, groups, keys, d, dv, window, sinks, q_pos, seed, documents=None, chunk=None
) -> None:
    gen = torch.Generator().manual_seed(seed)
    n = n_kv * groups

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_()

    q, k, v = rand(batch, n, q_pos.numel(), d), rand(batch, n_kv, keys, d), rand(batch, n_kv, keys, dv)
    sinks_N = rand(n) if sinks else None
    kwargs = {"q_pos_S": q_pos, "k_pos_K": torch.arange(keys), "window": window, "sinks_N": sinks_N, "chunk": chunk}
    if documents is not None:
        kwargs["documents_BS"] = documents
    leaves = [q, k, v] + ([sinks_N] if sinks else [])
    ours = blockwise_attention(q, k, v, 0.7, **kwargs)
    grad_out = torch.randn(ours.shape, generator=gen, dtype=torch.float64)
    ours_grads = torch.autograd.grad(ours, leaves, grad_out)
    ref = reference_attention(q, k, v, 0.7, **kwargs)
    ref_grads = torch.autograd.grad(ref, leaves, grad_out)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-12)
    for name, a, b in zip(("q", "k", "v", "sinks"), ours_grads, ref_grads, strict=False):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11, msg=lambda m, name=name: f"d{name}: {m}")


def _packed_row(draw, keys: int) -> list[int]:
    """A row of documents of random lengths and ids (contiguous, equal ids one document) and a padding tail (-1)."""
    padding = draw(st.integers(0, keys // 3))
    cuts = sorted(draw(st.sets(st.integers(1, keys - padding - 1), max_size=5))) if keys - padding > 1 else []
    bounds = [0, *cuts, keys - padding]
    ids = draw(st.lists(st.integers(0, 1000), min_size=len(bounds) - 1, max_size=len(bounds) - 1, unique=True))
    row = [doc for doc, start, end in zip(ids, bounds, bounds[1:], strict=False) for _ in range(end - start)]
    return row + [-1] * padding


@st.composite
def packed_problems(draw):
    """:func:`problems` with packed rows (each batch row its own documents), the queries at every position, at a
    random subset of them, or at a context-parallel rank's load-balanced chunks (r and 2 cp - 1 - r of 2 cp)."""
    batch, n_kv, groups = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.sampled_from([1, 2, 3]))
    d, dv = draw(st.sampled_from([2, 4, 8])), draw(st.sampled_from([2, 4, 6]))
    layout = draw(st.sampled_from(["whole", "subset", "cp"]))
    if layout == "cp":
        cp, chunk = draw(st.integers(2, 3)), draw(st.integers(1, 8))
        keys, rank = 2 * cp * chunk, draw(st.integers(0, cp - 1))
        q_pos = torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in (rank, 2 * cp - 1 - rank)])
    else:
        keys = draw(st.integers(1, 48))
        q_pos = torch.arange(keys)
        if layout == "subset":
            picked = draw(st.lists(st.integers(0, keys - 1), min_size=1, max_size=keys, unique=True))
            q_pos = torch.tensor(sorted(picked))
    window = draw(st.one_of(st.none(), st.integers(1, keys + 2)))
    documents = torch.tensor([_packed_row(draw, keys) for _ in range(batch)])
    block_scores = draw(st.sampled_from([1, 64, 1 << 23]))
    return batch, n_kv, groups, keys, d, dv, window, draw(st.booleans()), q_pos, documents, block_scores


@settings(max_examples=80, deadline=None)
@given(packed_problems(), st.integers(0, 2**31 - 1))
def test_documents_match_the_reference_with_gradients(problem, seed: int) -> None:
    batch, n_kv, groups, keys, d, dv, window, sinks, q_pos, documents, block_scores = problem
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(blockwise_module, "BLOCK_SCORES", block_scores)
        _check_against_reference(batch, n_kv, groups, keys, d, dv, window, sinks, q_pos, seed, documents)


@settings(max_examples=60, deadline=None)
@given(packed_problems(), st.integers(0, 2**31 - 1))
def test_each_document_attends_as_if_alone(problem, seed: int) -> None:
    """The packed rows' outputs at each document's queries equal that document attended by itself (its own queries
    and keys, no document ids) in the reference: the mask is checked against no mask of documents at all."""
    batch, n_kv, groups, keys, d, dv, window, sinks, q_pos, documents, block_scores = problem
    gen = torch.Generator().manual_seed(seed)
    n = n_kv * groups
    q = torch.randn(batch, n, keys, d, generator=gen, dtype=torch.float64)
    k, v = torch.randn(batch, n_kv, keys, d, generator=gen), torch.randn(batch, n_kv, keys, dv, generator=gen)
    k, v = k.double(), v.double()
    sinks_N = torch.randn(n, generator=gen, dtype=torch.float64) if sinks else None
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(blockwise_module, "BLOCK_SCORES", block_scores)
        out = blockwise_attention(
            q[:, :, q_pos],
            k,
            v,
            0.7,
            q_pos_S=q_pos,
            k_pos_K=torch.arange(keys),
            window=window,
            sinks_N=sinks_N,
            documents_BS=documents,
        )
    for row in range(batch):
        ids = documents[row].tolist()
        starts = [i for i in range(keys) if i == 0 or ids[i] != ids[i - 1]]
        for start, end in zip(starts, [*starts[1:], keys], strict=True):
            alone = reference_attention(
                q[row : row + 1, :, start:end],
                k[row : row + 1, :, start:end],
                v[row : row + 1, :, start:end],
                0.7,
                window=window,
                sinks_N=sinks_N,
            )
            mine = ((q_pos >= start) & (q_pos < end)).nonzero().flatten()
            torch.testing.assert_close(out[row, :, mine], alone[0, :, q_pos[mine] - start], rtol=0, atol=1e-12)


def test_core_attention_takes_documents_as_its_seventh_argument() -> None:
    """With documents the blockwise kernel (the whole sequence, or positions given), equal to the reference."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, heads, 24, 8, generator=gen) for heads in (4, 2, 2))
    documents = torch.tensor([[0] * 10 + [1] * 9 + [-1] * 5, [3] * 24])
    want = reference_attention(q, k, v, 8**-0.5, documents_BS=documents)
    positions = torch.arange(24)
    core = CoreAttention(None)
    torch.testing.assert_close(core(q, k, v, None, None, None, documents), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(core(q, k, v, None, positions, positions, documents), want, rtol=1e-5, atol=1e-6)
    # the second row is one document: as without any
    torch.testing.assert_close(want[1], reference_attention(q, k, v, 8**-0.5)[1])


def test_whole_sequence_attention_with_documents_traces_without_a_graph_break() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 4, 40, 8, generator=gen), torch.randn(2, 2, 40, 8, generator=gen), torch.randn(2, 2, 40, 6)
    sinks = torch.randn(4, generator=gen)
    documents = torch.tensor([[0] * 13 + [1] * 20 + [-1] * 7, [5] * 30 + [6] * 10])

    def attend(q, k, v, sinks, documents):
        return blockwise_attention(q, k, v, 0.5, window=16, sinks_N=sinks, documents_BS=documents)

    torch._dynamo.reset()
    explained = torch._dynamo.explain(attend)(q, k, v, sinks, documents)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    want = reference_attention(q, k, v, 0.5, window=16, sinks_N=sinks, documents_BS=documents)
    torch.testing.assert_close(torch.compile(attend, backend="eager")(q, k, v, sinks, documents), want)


def test_rows_that_see_no_key_give_zeros_or_the_sink_alone() -> None:
    q, k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    early = torch.tensor([0, 1, 2])  # every key stands after every query
    keys_later = torch.arange(10, 15)
    out = blockwise_attention(q, k, v, 0.5, q_pos_S=early, k_pos_K=keys_later)
    assert torch.equal(out, torch.zeros_like(out))
    sinks = torch.zeros(2, requires_grad=True)
    out = blockwise_attention(q, k, v, 0.5, q_pos_S=early, k_pos_K=keys_later, sinks_N=sinks)
    assert torch.equal(out, torch.zeros_like(out))
    out.sum().backward()
    assert torch.equal(sinks.grad, torch.zeros(2))


def test_plain_causal_equals_sdpa_and_core_attention_picks_the_fused_kernel_only_there() -> None:
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 50, 8), torch.randn(2, 2, 50, 8), torch.randn(2, 2, 50, 8)
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(blockwise_attention(q, k, v, 8**-0.5), sdpa, rtol=1e-5, atol=1e-6)
    core = CoreAttention(None)
    assert torch.equal(core(q, k, v), sdpa)  # the whole sequence, no sink, no window: SDPA itself
    # positions given (a context-parallel rank's queries against all keys): the blockwise kernel, same values
    positions = torch.arange(50)
    torch.testing.assert_close(core(q, k, v, None, positions, positions), sdpa, rtol=1e-5, atol=1e-6)
    windowed = CoreAttention(None, window=7)
    torch.testing.assert_close(windowed(q, k, v), reference_attention(q, k, v, 8**-0.5, window=7), rtol=1e-5, atol=1e-6)


def _saved_bytes(seq: int) -> int:
    torch.manual_seed(0)
    leaves = [torch.randn(1, heads, seq, 16, requires_grad=True) for heads in (4, 2, 2)]
    sinks = torch.zeros(4, requires_grad=True)
    with SavedTensorBytes([sinks]) as saved:
        q, k, v = (leaf * 1.0 for leaf in leaves)  # activations, as a layer's projections are
        blockwise_attention(q, k, v, 0.25, window=64, sinks_N=sinks)
    return saved.total


def test_saved_memory_is_linear_in_the_sequence() -> None:
    """q, k, v, the output and one fp32 log-sum-exp per row and head: 4 * (4*16 + 2*16 + 2*16 + 4*16 + 4) bytes per
    token, whatever the length (the whole-matrix path kept 4 * 4 * S fp32 probabilities per token)."""
    per_token = 4 * (4 * 16 + 2 * 16 + 2 * 16 + 4 * 16 + 4)
    for seq in (256, 1024):
        assert _saved_bytes(seq) == per_token * seq


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 300), st.integers(0, 340), st.one_of(st.none(), st.integers(1, 320)), st.sampled_from([16, 32, 256])
)
def test_whole_sequence_key_ranges_are_those_of_the_default_positions(seq, keys, window, rows) -> None:
    """The ranges computed from the sizes alone (no tensor read back, so torch.compile traces the attention) equal
    those searched in the positions 0..S-1 and 0..K-1 (fewer keys than queries and none included)."""
    want = blockwise_module._key_ranges(torch.arange(seq), torch.arange(keys), window, rows)
    assert blockwise_module._whole_sequence_key_ranges(seq, keys, window, rows) == want


def test_whole_sequence_attention_with_window_and_sinks_traces_without_a_graph_break() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 4, 40, 8, generator=gen), torch.randn(1, 2, 40, 8, generator=gen), torch.randn(1, 2, 40, 6)
    sinks = torch.randn(4, generator=gen)

    def attend(q, k, v, sinks):
        return blockwise_attention(q, k, v, 0.5, window=16, sinks_N=sinks)

    torch._dynamo.reset()
    explained = torch._dynamo.explain(attend)(q, k, v, sinks)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    want = reference_attention(q, k, v, 0.5, window=16, sinks_N=sinks)
    torch.testing.assert_close(torch.compile(attend, backend="eager")(q, k, v, sinks), want)
