"""Packed documents: rows of several documents whose tokens never see each other.

A packed row carries its documents' ids, ``document_ids_BS`` (int64 ``[B, S]`` over the whole sequences): tokens with
equal ids in a row are one document, a document's tokens are contiguous, and -1 marks padding (the padding run is one
more document). With them the model computes each document as if it were alone in its row: attention lets a query see
only the keys of its own document (:class:`~moe_models.attention.CoreAttention`), and each token's rotary position is
its position in its document (:func:`document_positions`).
"""

from __future__ import annotations

import torch


def document_positions(document_ids_BS: torch.Tensor) -> torch.Tensor:
    """Each token's position in its document (0 at the document's first token), int64 ``[B, S]``: the sequence position
    minus that of the last document start at or before it. Computed on the ids' device; nothing is read back."""
    ids = document_ids_BS
    seq = ids.shape[-1]
    index_S = torch.arange(seq, device=ids.device)
    starts_BS = torch.ones_like(ids, dtype=torch.bool)
    starts_BS[..., 1:] = ids[..., 1:] != ids[..., :-1]
    last_start_BS = torch.where(starts_BS, index_S, torch.zeros_like(index_S)).cummax(dim=-1).values
    return index_S - last_start_BS
