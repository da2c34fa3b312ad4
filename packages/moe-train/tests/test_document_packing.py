"""First-fit packing against a plain first fit written out (a scan of every window), document ids and positions
counted by hand, and the errors; the efficiency on a long-tailed length distribution is printed (-s)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_train.document_packing import PADDING, pack_first_fit


def _first_fit_by_scan(lengths: list[int], seq_len: int) -> list[list[int]]:
    windows: list[list[int]] = []
    free: list[int] = []
    for index, length in enumerate(lengths):
        target = next((w for w, room in enumerate(free) if room >= length), len(windows))
        if target == len(windows):
            windows.append([])
            free.append(seq_len)
        windows[target].append(index)
        free[target] -= length
    return windows


@settings(max_examples=200, deadline=None)
@given(seq_len=st.integers(1, 64), data=st.data())
def test_first_fit_places_each_document_where_a_scan_would(seq_len, data):
    lengths = data.draw(st.lists(st.integers(1, seq_len), max_size=60))
    packed = pack_first_fit(lengths, seq_len)
    assert [list(w) for w in packed.windows] == _first_fit_by_scan(lengths, seq_len)
    for window in range(len(packed.windows)):
        ids, pos = packed.document_ids(window), packed.positions(window)
        assert len(ids) == len(pos) == seq_len
        assert sorted(i for i in ids if i != PADDING) == sorted(
            d for d in packed.windows[window] for _ in range(lengths[d])
        )
    assert packed.efficiency == (sum(lengths) / (len(packed.windows) * seq_len) if lengths else 1.0)


def test_ids_and_positions_by_hand():
    packed = pack_first_fit([3, 4, 2, 1], seq_len=6)
    # 3 -> window 0 (3 free); 4 -> window 1 (2 free); 2 -> window 0 (1 free); 1 -> window 0 (0 free)
    assert packed.windows == ((0, 2, 3), (1,))
    assert packed.document_ids(0) == [0, 0, 0, 2, 2, 3]
    assert packed.positions(0) == [0, 1, 2, 0, 1, 0]
    assert packed.document_ids(1) == [1, 1, 1, 1, PADDING, PADDING]
    assert packed.positions(1) == [0, 1, 2, 3, 0, 0]
    assert packed.efficiency == pytest.approx(10 / 12)


def test_documents_that_cannot_be_packed_are_named():
    with pytest.raises(ValueError, match="document 1: 9 tokens, must be 1 to seq_len=8"):
        pack_first_fit([3, 9], seq_len=8)
    with pytest.raises(ValueError, match="document 0: 0 tokens"):
        pack_first_fit([0], seq_len=8)
    with pytest.raises(ValueError, match="seq_len=0"):
        pack_first_fit([1], seq_len=0)


def test_efficiency_on_long_tailed_conversation_lengths():
    # log-normal lengths (median ~330 tokens, a long tail cut at the window), the shape of chat SFT sets
    rng = random.Random(0)
    lengths = [min(4096, max(1, round(rng.lognormvariate(5.8, 0.9)))) for _ in range(20_000)]
    packed = pack_first_fit(lengths, seq_len=4096)
    print(f"first-fit efficiency, 20,000 log-normal documents into 4,096-token windows: {packed.efficiency:.4f}")
    assert packed.efficiency > 0.95
