"""What a training or evaluation step reads: a batch of token windows and their labels (shared by the text and the
conversation streams)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Batch:
    input_ids_BS: torch.Tensor
    labels_BS: torch.Tensor  # -100 where a position has no label
    # each token's document (conversation) index, -1 on padding: attention stays within a document; None for
    # data.format=text, whose windows run across documents
    document_ids_BS: torch.Tensor | None = None
