"""The per-token loss (``labelled_tokens``): shares of a batch cut any way average to the mean cross-entropy over the
batch's labelled tokens, written out here with F.cross_entropy over the labelled positions alone."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_models import causal_lm_loss, next_token_loss
from moe_models.loss import IGNORE_INDEX
from moe_models.model import ModelOutput

VOCAB = 11


def _batch(seed: int, rows: int, seq: int, labelled_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, seq, VOCAB, generator=gen, dtype=torch.float32)
    labels = torch.randint(0, VOCAB, (rows, seq), generator=gen)
    unlabelled = torch.rand(rows, seq, generator=gen) >= labelled_fraction
    return logits, labels.masked_fill(unlabelled, IGNORE_INDEX)


def _reference_mean(logits_BSV: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
    keep = labels_BS != IGNORE_INDEX
    return F.cross_entropy(logits_BSV[keep], labels_BS[keep])


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 1000),
    shares=st.sampled_from([1, 2, 4]),
    cp=st.sampled_from([1, 2]),
    fractions=st.lists(st.floats(0.05, 1.0), min_size=4, max_size=4),
)
def test_shares_average_to_the_mean_over_labelled_tokens(
    seed: int, shares: int, cp: int, fractions: list[float]
) -> None:
    seq = 8
    parts = [_batch(seed + i, 1, seq, f) for i, f in enumerate(fractions)]  # rows with very different label counts
    logits = torch.cat([p[0] for p in parts])
    labels = torch.cat([p[1] for p in parts])
    labelled = int((labels != IGNORE_INDEX).sum())
    per_share = max(labelled, 1) / (shares * cp)
    values = []
    rows = logits.shape[0] // shares
    for share in range(shares):
        part = slice(share * rows, (share + 1) * rows)
        for rank in range(
            cp
        ):  # a context-parallel rank's positions: every cp-th pair of chunks, as load balancing cuts
            positions = torch.arange(rank, seq, cp)
            values.append(next_token_loss(logits[part][:, positions], (), labels[part], 0.0, positions, per_share).lm)
    got = torch.stack(values).mean()
    if labelled:
        torch.testing.assert_close(got, _reference_mean(logits, labels), rtol=1e-6, atol=1e-7)
    else:
        assert got == 0


def test_a_mean_per_micro_batch_is_not_the_mean_over_labelled_tokens() -> None:
    """What the per-token loss fixes: micro-batches with 1 and 8 labels weigh their tokens 8:1 in a mean of means."""
    logits, labels = _batch(0, 2, 8, 1.0)
    labels[0, 1:] = IGNORE_INDEX
    means = [F.cross_entropy(logits[i], labels[i]) for i in range(2)]  # the per-micro-batch mean, ignore_index -100
    mean_of_means = torch.stack(means).mean()
    per_token = torch.stack(
        [next_token_loss(logits[i : i + 1], (), labels[i : i + 1], 0.0, None, 9 / 2).lm for i in range(2)]
    )
    truth = _reference_mean(logits, labels)
    torch.testing.assert_close(per_token.mean(), truth, rtol=1e-6, atol=1e-7)
    assert abs(float(mean_of_means - truth)) > 1e-3


def test_mtp_depths_take_the_labels_further_on() -> None:
    logits, labels = _batch(3, 2, 8, 0.6)
    mtp = (torch.randn_like(logits), torch.randn_like(logits))
    output = ModelOutput(logits, torch.zeros(()), torch.zeros(0, 1), mtp)
    loss = causal_lm_loss(output, labels, 0.5, labelled_tokens=5.0)
    for depth, depth_logits in enumerate(mtp, start=1):
        targets = torch.full_like(labels, IGNORE_INDEX)
        targets[:, :-depth] = labels[:, depth:]
        expected = F.cross_entropy(depth_logits.flatten(0, 1), targets.flatten(), reduction="sum") / 5.0
        torch.testing.assert_close(loss.mtp[depth - 1], expected, rtol=1e-6, atol=1e-7)
    lm = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / 5.0
    torch.testing.assert_close(loss.total, lm + 0.5 * (loss.mtp[0] + loss.mtp[1]) / 2, rtol=1e-6, atol=1e-7)
