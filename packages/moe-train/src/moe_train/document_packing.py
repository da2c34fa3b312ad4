"""Documents packed into fixed windows of ``seq_len`` tokens, each document whole and starting its own positions at 0
(a first piece of issue 33's packing: the plan and the per-token document ids and positions; the attention mask that
keeps documents apart and the data path come later).

:func:`pack_first_fit` places the documents in their order, each into the first window with room for it (first fit),
so the plan depends on the lengths alone: the same data packs the same way on every run and rank. A search over a
tree of the windows' free space finds that window in ``O(log n)``, so a million documents pack in seconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

PADDING = -1  # the document id of a window's unused tail


@dataclass(frozen=True)
class PackedWindows:
    seq_len: int
    lengths: tuple[int, ...]  # of every document, in input order
    windows: tuple[tuple[int, ...], ...]  # the documents of each window, in the order they sit in it

    @property
    def efficiency(self) -> float:
        """The share of the windows' tokens that are documents' (the rest is padding)."""
        return sum(self.lengths) / (len(self.windows) * self.seq_len) if self.windows else 1.0

    def document_ids(self, window: int) -> list[int]:
        """The document of each of the window's ``seq_len`` tokens (:data:`PADDING` past the last)."""
        ids = [doc for doc in self.windows[window] for _ in range(self.lengths[doc])]
        return ids + [PADDING] * (self.seq_len - len(ids))

    def positions(self, window: int) -> list[int]:
        """Each token's position in its own document (0 on the padding tail)."""
        pos = [i for doc in self.windows[window] for i in range(self.lengths[doc])]
        return pos + [0] * (self.seq_len - len(pos))


def pack_first_fit(lengths: Sequence[int], seq_len: int) -> PackedWindows:
    """Each document, in order, into the first window with ``lengths[i]`` tokens free. A document longer than
    ``seq_len`` or empty is a ValueError naming it (truncating is the caller's choice)."""
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len}: must be >= 1")
    for index, length in enumerate(lengths):
        if not 1 <= length <= seq_len:
            raise ValueError(f"document {index}: {length} tokens, must be 1 to seq_len={seq_len}")
    free = _FreeSpace(max(len(lengths), 1), seq_len)
    placed: list[list[int]] = []
    for index, length in enumerate(lengths):
        window = free.first_with(length)
        if window == len(placed):
            placed.append([])
        placed[window].append(index)
    return PackedWindows(seq_len, tuple(lengths), tuple(tuple(w) for w in placed))


class _FreeSpace:
    """The free tokens of ``count`` windows (all ``seq_len`` at first) in a max tree: the leftmost window with at
    least ``n`` free is a walk from the root."""

    def __init__(self, count: int, seq_len: int) -> None:
        self.size = 1 << (count - 1).bit_length()
        self.tree = [0] * (2 * self.size)
        for leaf in range(count):
            self.tree[self.size + leaf] = seq_len
        for node in range(self.size - 1, 0, -1):
            self.tree[node] = max(self.tree[2 * node], self.tree[2 * node + 1])

    def first_with(self, n: int) -> int:
        """The leftmost window with ``n`` tokens free, which then has ``n`` fewer."""
        node = 1
        while node < self.size:
            node = 2 * node if self.tree[2 * node] >= n else 2 * node + 1
        self.tree[node] -= n
        window = node - self.size
        node //= 2
        while node:
            self.tree[node] = max(self.tree[2 * node], self.tree[2 * node + 1])
            node //= 2
        return window
