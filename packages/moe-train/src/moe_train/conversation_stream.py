"""Windows of whole conversations, with labels on the tokens the model learns to produce and each token's
conversation, for answer-only fine-tuning (data.format chat / prompt_completion).

``data.packing=true`` packs the conversations first fit into ``data.seq_len``-token windows
(moe_train.document_packing); ``false`` gives each its own window. The rest of a window is padding: the end-of-text
id, no label, document id -1. ``labels[i]`` is token ``i+1`` when that token belongs to the same conversation and is
labelled, else -100: a conversation's last token predicts nothing, and no label crosses into the next conversation.

Training order: each epoch is a permutation of the windows drawn from ``(train.seed, epoch)``, and global batch
``step`` is windows ``step*G .. (step+1)*G - 1`` of the epochs one after another: the same on every rank, whatever
the batch is cut into. Validation reads fixed windows in their order.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from moe_models.loss import IGNORE_INDEX
from moe_train.batch import Batch
from moe_train.config import ConfigError
from moe_train.conversation_cache import Split
from moe_train.document_packing import PADDING, pack_first_fit

LABEL_CHUNK = 1 << 16  # conversations whose labels are counted at once (a cumulative sum over their tokens)


def _labels_per_conversation(split: Split) -> np.ndarray:
    """How many labels each conversation gives: its labelled tokens after the first."""
    out = np.zeros(len(split), dtype=np.int64)
    for lo in range(0, len(split), LABEL_CHUNK):
        starts, lengths = split.starts[lo : lo + LABEL_CHUNK], split.lengths[lo : lo + LABEL_CHUNK]
        first, last = int(starts.min()), int((starts + lengths).max())
        summed = np.concatenate([[0], np.cumsum(split.labelled[first:last], dtype=np.int64)])
        out[lo : lo + LABEL_CHUNK] = summed[starts + lengths - first] - summed[starts + 1 - first]
    return out


class ConversationStream:
    """Windows of ``seq_len`` tokens over a split's conversations (each at most ``seq_len`` long). ``pad_id`` fills
    the windows' tails; ``what`` names the data in the error for fewer windows than one batch."""

    def __init__(
        self, split: Split, seq_len: int, seed: int, packing: bool, pad_id: int, what: str = "conversations"
    ) -> None:
        self.split, self.seq_len, self.seed, self.pad_id, self.what = split, seq_len, seed, pad_id, what
        lengths = split.lengths.tolist()
        one_each = tuple((i,) for i in range(len(lengths)))
        windows = pack_first_fit(lengths, seq_len).windows if packing else one_each
        sizes = np.fromiter((len(w) for w in windows), dtype=np.int64, count=len(windows))
        self.bounds = np.concatenate([[0], np.cumsum(sizes)])  # window w holds docs[bounds[w]:bounds[w+1]]
        self.docs = np.fromiter((d for w in windows for d in w), dtype=np.int64, count=int(self.bounds[-1]))
        per_conversation = _labels_per_conversation(split)
        self.window_labels = np.add.reduceat(per_conversation[self.docs], self.bounds[:-1]) if windows else sizes
        self.packing_efficiency = float(split.lengths.sum()) / (len(windows) * seq_len) if windows else 1.0
        self._epochs: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        """The number of windows: an epoch."""
        return len(self.bounds) - 1

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._epochs:
            if len(self._epochs) > 4:  # a run moves through epochs in order: the old ones are done with
                self._epochs.pop(min(self._epochs))
            self._epochs[epoch] = np.random.default_rng([self.seed, epoch]).permutation(len(self))
        return self._epochs[epoch]

    def global_windows(self, step: int, global_batch: int) -> np.ndarray:
        """The windows of global batch ``step``."""
        order = np.arange(step * global_batch, (step + 1) * global_batch, dtype=np.int64)
        epochs, within = np.divmod(order, len(self))
        out = np.empty_like(order)
        for epoch in np.unique(epochs):
            chosen = epochs == epoch
            out[chosen] = self._permutation(int(epoch))[within[chosen]]
        return out

    def labelled_tokens(self, step: int, global_batch: int) -> int:
        """The labels (!= -100) of the whole global batch ``step``, from the host-side counts."""
        return int(self.window_labels[self.global_windows(step, global_batch)].sum())

    def windows(self, indices: np.ndarray) -> Batch:
        shape = (len(indices), self.seq_len)
        ids = np.full(shape, self.pad_id, dtype=np.int64)
        labels = np.full(shape, IGNORE_INDEX, dtype=np.int64)
        documents = np.full(shape, PADDING, dtype=np.int64)
        tokens, labelled = self.split.tokens, self.split.labelled
        for row, window in enumerate(indices):
            at = 0
            for doc in self.docs[self.bounds[window] : self.bounds[window + 1]]:
                start, length = int(self.split.starts[doc]), int(self.split.lengths[doc])
                ids[row, at : at + length] = tokens[start : start + length]
                following = tokens[start + 1 : start + length].astype(np.int64)
                labels[row, at : at + length - 1] = np.where(
                    labelled[start + 1 : start + length], following, IGNORE_INDEX
                )
                documents[row, at : at + length] = doc
                at += length
        return Batch(torch.from_numpy(ids), torch.from_numpy(labels), torch.from_numpy(documents))

    def batch(self, step: int, global_batch: int, start: int, count: int) -> Batch:
        """Sequences ``start .. start+count-1`` of global batch ``step``."""
        return self.windows(self.global_windows(step, global_batch)[start : start + count])

    def eval_offsets(self, num_windows: int | None = None) -> np.ndarray:
        """The fixed evaluation windows: all, or ``num_windows`` spread evenly over them."""
        count = len(self) if num_windows is None else min(num_windows, len(self))
        return np.arange(count, dtype=np.int64) * len(self) // max(count, 1)

    def eval_batches(
        self, num_batches: int | None, batch_size: int, start: int = 0, count: int | None = None
    ) -> Iterator[Batch]:
        """``num_batches`` fixed batches of ``batch_size`` windows (as many whole batches as fit when None or more
        than fit), each data-parallel rank taking sequences ``start .. start+count-1`` of each, as
        TokenStream.eval_batches."""
        wanted = len(self) if num_batches is None else min(num_batches * batch_size, len(self))
        whole = wanted // batch_size
        if whole == 0:
            raise ConfigError(
                f"data.seq_len={self.seq_len}: the {self.what} fill {len(self)} windows, fewer than one batch of "
                f"{batch_size}; add validation data or raise data.valid_fraction"
            )
        rows = self.eval_offsets(whole * batch_size).reshape(whole, batch_size)
        stop = batch_size if count is None else start + count
        return (self.windows(row[start:stop]) for row in rows)
