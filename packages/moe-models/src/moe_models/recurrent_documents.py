"""Packed documents for the recurrent token mixers (Gated DeltaNet, Mamba-2): each document computed alone.

A recurrent layer's convolution window and state would carry one document into the next, so with packed rows
(``document_ids_BS``, as :mod:`moe_models.documents` describes them) every document of every row is computed alone,
from zero states. The document boundaries are read back to the host (one synchronisation) and the documents batched
by length: those of lengths in (2^(k-1), 2^k] form one batch, each padded at its end to the batch's longest. The layer
is causal, so the padding changes nothing before it; the outputs are put back in the packed rows' places. Rows holding
one document each (or padding alone) are computed as they stand, with no gather.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ["PackedDocuments", "per_document"]


class PackedDocuments:
    """Where each document of packed rows goes in the batches of documents of similar lengths, and back.

    ``count``: the number of documents (the padding run of a row counts as one); ``gathers``: per batch, int64
    ``[D, L]``, the flat ``[B * S]`` position of each document's tokens (D documents padded to the longest, L; padding
    points at ``B * S``, a zero row appended); ``scatter``: int64 ``[B * S]``, each token's row in the batches' outputs
    flattened and concatenated in order."""

    def __init__(self, document_ids_BS: torch.Tensor) -> None:
        batch, seq = document_ids_BS.shape
        starts_BS = torch.ones_like(document_ids_BS, dtype=torch.bool)
        starts_BS[:, 1:] = document_ids_BS[:, 1:] != document_ids_BS[:, :-1]  # a row's first token starts one
        starts_D = starts_BS.flatten().nonzero().squeeze(-1).cpu()  # the one synchronisation
        lengths_D = torch.diff(starts_D, append=torch.tensor([batch * seq]))
        self.count = len(starts_D)
        device = document_ids_BS.device
        buckets_D = torch.ceil(torch.log2(lengths_D.double())).long()  # lengths in (2^(k-1), 2^k] batch together
        scatter = torch.empty(batch * seq, dtype=torch.long)
        self.gathers: list[torch.Tensor] = []
        offset = 0
        for bucket in buckets_D.unique().tolist():
            picked = buckets_D == bucket
            starts, lengths = starts_D[picked], lengths_D[picked]
            width = int(lengths.max())
            steps_L = torch.arange(width)
            valid_DL = steps_L < lengths[:, None]
            flat_DL = starts[:, None] + steps_L
            self.gathers.append(torch.where(valid_DL, flat_DL, batch * seq).to(device))
            scatter[flat_DL[valid_DL]] = offset + torch.arange(flat_DL.numel()).view_as(flat_DL)[valid_DL]
            offset += flat_DL.numel()
        self.scatter = scatter.to(device)


def per_document(
    mix: Callable[..., torch.Tensor], inputs_BS_: Sequence[torch.Tensor], document_ids_BS: torch.Tensor | None
) -> torch.Tensor:
    """``mix(*inputs_BS_)`` (a causal computation over whole rows from zero states, every input and its output
    ``[B, S, ...]``) with each document of ``document_ids_BS`` computed alone, the output in the packed rows' places;
    without documents, or with one document per row, ``mix`` of the rows as they stand."""
    if document_ids_BS is None:
        return mix(*inputs_BS_)
    documents = PackedDocuments(document_ids_BS)
    batch, seq = inputs_BS_[0].shape[:2]
    if documents.count <= batch:  # one document per row (or empty rows): as unpacked rows
        return mix(*inputs_BS_)
    flat = [torch.cat([t.flatten(0, 1), t.new_zeros(1, *t.shape[2:])]) for t in inputs_BS_]  # + the padding row
    outputs = [mix(*(t[gather_DL] for t in flat)).flatten(0, 1) for gather_DL in documents.gathers]
    return torch.cat(outputs)[documents.scatter].unflatten(0, (batch, seq))
