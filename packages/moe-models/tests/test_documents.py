"""Packed documents: each document of a packed row computes what it computes alone in its own row.

The reference is independent of the masking: every document run by itself (a row of its own, positions from 0, no
document ids). Per family (GQA with QK-norm; sinks and a sliding window; MLA with a dense layer and MTP), a packed batch
with a padding tail gives each document's logits and MTP logits, and the gradients of a loss built from them, as the
documents alone (fp32, relative 1e-5). MoE routing statistics couple the tokens of a batch, so the balancing losses
are off (coefficient 0) and routing is dropless: then a token's expert output is its own. Without the mask the logits
differ. Also: the in-document positions, and the per-row rotary tables they give.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_models import apply_rotary, build_model, document_positions, preset, rotary_cos_sin
from moe_models.forward import rotary_tables

# (family, the documents of each row: lengths, then the padding tail's); a document longer than GPT-OSS's 32-token
# window, documents of one token, rows packed differently
PACKINGS = {
    "tiny-qwen3-moe": [[9, 14, 5], [1, 20, 3]],
    "tiny-gpt-oss": [[40, 17, 3], [12, 48]],
    "tiny-deepseek-v3": [[11, 7, 6], [2, 22]],
}
SEQ = {"tiny-qwen3-moe": 32, "tiny-gpt-oss": 64, "tiny-deepseek-v3": 28}


def _row_ids(lengths: list[int], seq: int) -> list[int]:
    ids = [doc for doc, length in enumerate(lengths) for _ in range(length)]
    return ids + [-1] * (seq - len(ids))


def _document_ids(packing: list[list[int]], seq: int) -> torch.Tensor:
    return torch.tensor([_row_ids(lengths, seq) for lengths in packing])


def _spans(packing: list[list[int]]) -> list[tuple[int, int, int]]:
    """(row, start, end) of every document."""
    out = []
    for row, lengths in enumerate(packing):
        start = 0
        for length in lengths:
            out.append((row, start, start + length))
            start += length
    return out


def test_positions_restart_at_every_document() -> None:
    ids = torch.tensor([[0, 0, 0, 1, 1, 2, -1, -1], [5, 5, 5, 5, 5, 5, 5, 5], [3, 4, 4, 4, 7, 7, -1, -1]])
    assert document_positions(ids).tolist() == [
        [0, 1, 2, 0, 1, 0, 0, 1],
        [0, 1, 2, 3, 4, 5, 6, 7],
        [0, 0, 1, 2, 0, 1, 0, 1],
    ]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(1, 6), min_size=1, max_size=6), min_size=1, max_size=3))
def test_positions_equal_a_count_within_each_run(runs: list[list[int]]) -> None:
    seq = max(sum(r) for r in runs)
    rows = [[doc for doc, length in enumerate(r) for _ in range(length)] for r in runs]
    rows = [row + [-1] * (seq - len(row)) for row in rows]
    want = []
    for row in rows:
        want.append([0 if i == 0 or row[i] != row[i - 1] else None for i in range(seq)])
        for i in range(1, seq):
            if want[-1][i] is None:
                want[-1][i] = want[-1][i - 1] + 1
    assert document_positions(torch.tensor(rows)).tolist() == want


def test_per_row_rotary_tables_rotate_each_row_at_its_own_positions() -> None:
    config = preset("tiny-deepseek-v3")  # YaRN-scaled tables
    positions_BS = torch.tensor([[0, 1, 2, 0, 1], [4, 0, 1, 2, 3]])
    cos_BSF, sin_BSF = rotary_cos_sin(config, positions_BS)
    x = torch.randn(2, 3, 5, config.rotary_dim, generator=torch.Generator().manual_seed(0))
    rotated = apply_rotary(x, cos_BSF, sin_BSF, interleaved=True)
    for row in range(2):
        cos_SF, sin_SF = rotary_cos_sin(config, positions_BS[row])
        assert torch.equal(cos_BSF[row], cos_SF) and torch.equal(sin_BSF[row], sin_SF)
        torch.testing.assert_close(rotated[row], apply_rotary(x[row], cos_SF, sin_SF, interleaved=True))
    # the model's tables: in-document positions, then those computed
    ids = torch.tensor([[0, 0, 0, 1, 1], [2, 3, 3, 3, 3]])
    at = torch.tensor([1, 3, 4])
    got = rotary_tables(config, torch.zeros_like(ids), at, ids, torch.device("cpu"))
    want = rotary_cos_sin(config, document_positions(ids)[:, at])
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def _model(family: str):
    # balancing losses off (they couple the tokens of a batch); the presets route dropless
    config = preset(family, moe_aux_loss_coeff=[0.0])
    assert config.moe_expert_capacity_factor is None
    return config, build_model(config, seed=3)


def _loss_weights(config, batch: int, seq: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(9)
    weights = torch.randn(batch, seq, config.vocab_size, generator=gen)
    mtp = [torch.randn(batch, seq, config.vocab_size, generator=gen) for _ in range(config.mtp_num_layers or 0)]
    return weights, mtp


def _labelled(depth: int, start: int, end: int) -> slice:
    """The positions of a document whose MTP depth ``depth`` (0: the main head) predicts a token of the document."""
    return slice(start, end - depth)


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm().clamp_min(1e-30))


@pytest.mark.parametrize("family", list(PACKINGS))
def test_a_packed_batch_computes_each_document_as_alone(family: str) -> None:
    config, model = _model(family)
    packing, seq = PACKINGS[family], SEQ[family]
    docs_BS = _document_ids(packing, seq)
    ids_BS = torch.randint(0, config.vocab_size, docs_BS.shape, generator=torch.Generator().manual_seed(1))
    weights, mtp_weights = _loss_weights(config, *docs_BS.shape)

    packed = model(ids_BS, document_ids_BS=docs_BS)
    loss = 0.0
    for row, start, end in _spans(packing):
        loss = loss + (weights[row, start:end] * packed.logits[row, start:end]).sum()
        for depth, (w, logits) in enumerate(zip(mtp_weights, packed.mtp_logits, strict=True), start=1):
            at = _labelled(depth, start, end)
            loss = loss + (w[row, at] * logits[row, at]).sum()
    loss.backward()
    packed_grads = _grads(model)
    model.zero_grad(set_to_none=True)

    for row, start, end in _spans(packing):
        alone = model(ids_BS[row : row + 1, start:end])
        rel = _relative(packed.logits[row, start:end], alone.logits[0])
        assert rel < 1e-5, f"document {row}:{start}-{end} logits: relative error {rel:.2e}"
        loss = (weights[row, start:end] * alone.logits[0]).sum()
        for depth, (w, logits) in enumerate(zip(mtp_weights, alone.mtp_logits, strict=True), start=1):
            if end - start > depth:
                at = _labelled(depth, start, end)
                rel = _relative(packed.mtp_logits[depth - 1][row, at], logits[0, : end - start - depth])
                assert rel < 1e-5, f"document {row}:{start}-{end} MTP depth {depth}: relative error {rel:.2e}"
                loss = loss + (w[row, at] * logits[0, : end - start - depth]).sum()
        loss.backward()
    alone_grads = _grads(model)

    assert packed_grads.keys() == alone_grads.keys()
    for name, grad in alone_grads.items():
        rel = _relative(packed_grads[name], grad)
        assert rel < 1e-5, f"{name}: relative error {rel:.2e}"


@pytest.mark.parametrize("family", list(PACKINGS))
def test_without_the_documents_the_later_documents_differ(family: str) -> None:
    config, model = _model(family)
    packing, seq = PACKINGS[family], SEQ[family]
    docs_BS = _document_ids(packing, seq)
    ids_BS = torch.randint(0, config.vocab_size, docs_BS.shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        masked, unmasked = model(ids_BS, document_ids_BS=docs_BS), model(ids_BS)
    for row, start, end in _spans(packing):
        if start == 0:  # a row's first document sees nothing before it either way
            torch.testing.assert_close(masked.logits[row, start:end], unmasked.logits[row, start:end])
        else:
            assert _relative(unmasked.logits[row, start:end], masked.logits[row, start:end]) > 1e-2


def test_documents_of_whole_rows_change_nothing() -> None:
    """One document per row, no padding: the documents' path (blockwise kernel, per-row tables) gives the plain one's
    logits."""
    config, model = _model("tiny-gpt-oss")
    ids_BS = torch.randint(0, config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    docs_BS = torch.tensor([[4] * 48, [0] * 48])
    with torch.no_grad():
        torch.testing.assert_close(model(ids_BS, document_ids_BS=docs_BS).logits, model(ids_BS).logits)


def test_document_ids_of_another_shape_are_refused() -> None:
    _, model = _model("tiny-qwen3-moe")
    ids_BS = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="document_ids_BS"):
        model(ids_BS, torch.arange(4), document_ids_BS=torch.zeros(2, 4, dtype=torch.long))
