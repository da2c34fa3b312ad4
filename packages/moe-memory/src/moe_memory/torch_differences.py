"""How the installed torch's activation checkpointing differs from torch 2.13's, found by trying it (``moe-train env``
prints each difference as one line).

torch 2.11's non-reentrant ``torch.utils.checkpoint`` saves one empty placeholder tensor per recomputed region
besides its inputs; 2.13 saves the inputs alone. The placeholder holds no bytes, and this package's estimates and
measurements count bytes, so nothing here changes with it: only a count of saved tensors sees it.
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint


@functools.cache
def checkpoint_placeholders() -> int:
    """Empty tensors the non-reentrant checkpoint saves for one recomputed region (torch 2.11: 1; 2.13: 0)."""
    empty = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal empty
        empty += t.numel() == 0
        return t

    x = torch.ones(2, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        checkpoint(torch.sin, x, use_reentrant=False)
    return empty


def torch_differences() -> list[str]:
    """One line per difference from torch 2.13 in what this package uses, and how it is handled."""
    if checkpoint_placeholders():
        return [
            "torch.utils.checkpoint (non-reentrant) saves an empty placeholder tensor per recomputed region: 0 bytes, "
            "memory estimates and measurements count bytes"
        ]
    return []
