"""Load-balanced context-parallel positions: a hand count, and for any cp and length the ranks' chunks tile the
sequence and carry equal causal attention work. The key gathering hook's calling convention (its gathering is
checked on gloo ranks: test_parallelize_dist.py, test_packed_documents.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_parallel import load_balanced_positions
from moe_parallel.context_parallel import GatherKeysValues, ascending_runs


def test_rank_r_holds_chunks_r_and_2cp_minus_1_minus_r() -> None:
    assert load_balanced_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert load_balanced_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert load_balanced_positions(16, 4, 3).tolist() == [6, 7, 8, 9]
    assert load_balanced_positions(6, 1, 0).tolist() == list(range(6))


@settings(max_examples=100, deadline=None)
@given(cp=st.integers(1, 8), chunk=st.integers(1, 16))
def test_chunks_tile_the_sequence_with_equal_causal_work(cp: int, chunk: int) -> None:
    seq = 2 * cp * chunk
    parts = [load_balanced_positions(seq, cp, r) for r in range(cp)]
    assert torch.equal(torch.cat(parts).sort().values, torch.arange(seq))
    assert all(torch.equal(p, p.sort().values) and p.numel() == seq // cp for p in parts)
    # a query at position p sees p + 1 keys: every rank computes the same number of (query, key) pairs
    assert len({int((p + 1).sum()) for p in parts}) == 1


@pytest.mark.parametrize(("seq", "cp", "rank"), [(10, 2, 0), (8, 2, 2), (8, 0, 0)])
def test_lengths_and_ranks_that_do_not_fit_are_refused(seq: int, cp: int, rank: int) -> None:
    with pytest.raises(ValueError, match="seq_len|rank"):
        load_balanced_positions(seq, cp, rank)


def test_ascending_runs_sort_the_gathered_chunks() -> None:
    gathered = torch.cat([load_balanced_positions(16, 2, r) for r in range(2)])  # [0..3, 12..15, 4..11]
    runs = ascending_runs(gathered)
    assert runs == [(0, 4), (8, 8), (4, 4)]
    assert torch.equal(torch.cat([gathered.narrow(0, s, n) for s, n in runs]), torch.arange(16))
    assert ascending_runs(torch.tensor([5, 3, 9])) == [(1, 1), (0, 1), (2, 1)]


def test_the_key_gathering_hook_takes_six_arguments_or_seven_with_documents() -> None:
    """(q, k, v, sinks, q_pos, k_pos) or with the whole sequences' document ids after them; anything else, or no
    positions, is refused before any collective."""
    hook = GatherKeysValues(group=None)
    q = k = v = torch.zeros(1, 1, 4, 2)
    documents = torch.zeros(1, 8, dtype=torch.long)
    for args in [(q, k, v, None, None), (q, k, v, None, None, None, documents, documents)]:
        with pytest.raises(TypeError, match=r"k_positions\[, documents\]"):
            hook(None, args, {})
    with pytest.raises(TypeError, match="positionally"):
        hook(None, (q, k, v, None, None, None), {"documents_BS": documents})
    for args in [(q, k, v, None, None, None), (q, k, v, None, None, None, documents)]:
        with pytest.raises(ValueError, match="positions_S"):
            hook(None, args, {})
