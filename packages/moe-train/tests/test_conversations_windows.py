"""Windows of conversations: packed first fit (each conversation whole in one window, its own document id, no label
crossing into the next, the efficiency a hand count gives) or one per window; the host-side label counts the loss
divides by; the batch order (a seeded permutation of the windows per epoch, the same on every rank and run); the
validation split and its fixed windows."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from moe_train.config import ConfigError

sys.path.insert(0, str(Path(__file__).parent))  # the tests run in importlib mode: the shared helpers' directory
from test_conversations import SEQ_LEN, conversation_windows, prepare, write_jsonl, write_tokenizer

WORDS = ["how", "are", "you", "the", "answer", "is", "42", "fine", "hello", "there", "be", "kind", "what", "plus"]
COUNT = 60


def _conversations(count: int, seed: int = 0) -> list[dict]:
    """Conversations of 1 or 2 turns, of about 10 to 70 tokens."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        messages = [{"role": "system", "content": " ".join(rng.choices(WORDS, k=rng.randrange(4)))}]
        for _ in range(rng.randrange(1, 3)):
            messages.append({"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randrange(1, 5)))})
            messages.append({"role": "assistant", "content": " ".join(rng.choices(WORDS, k=rng.randrange(1, 5)))})
        out.append({"messages": messages})
    return out


@pytest.fixture(scope="module")
def chat(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat")
    return {
        "source": write_jsonl(root / "chat.jsonl", _conversations(COUNT)),
        "tokenizer": write_tokenizer(root / "tokenizer"),
        "cache": root / "cache",
    }


def _prepare(chat: dict[str, Path], **extra: str):
    return prepare(chat["source"], chat["tokenizer"], chat["cache"], **extra)


@pytest.fixture(scope="module")
def one_per_window(chat: dict[str, Path]) -> list[tuple[list[int], list[int]]]:
    return conversation_windows(_prepare(chat))


def test_packed_windows_hold_whole_conversations(chat, one_per_window) -> None:
    prepared = _prepare(chat, **{"data.packing": "true"})
    stream = prepared.train
    batch = stream.windows(np.arange(len(stream)))
    assert len(stream) < 0.7 * COUNT  # packing put several in a window
    seen = []
    for row in range(len(stream)):
        ids, labels, docs = (t[row].tolist() for t in (batch.input_ids_BS, batch.labels_BS, batch.document_ids_BS))
        used = sum(d != -1 for d in docs)
        assert all(d == -1 for d in docs[used:])  # padding only at the tail: no label, the pad id
        assert all(label == -100 for label in labels[used:]) and all(i == prepared.eos_id for i in ids[used:])
        at = 0
        while at < used:  # each conversation whole, as it is in a window of its own
            doc = docs[at]
            want_ids, want_labels = one_per_window[doc]
            end = at + len(want_ids)
            assert docs[at:end] == [doc] * len(want_ids) and (end == SEQ_LEN or docs[end] != doc)
            assert ids[at:end] == want_ids and labels[at:end] == want_labels
            seen.append(doc)
            at = end
        for i, label in enumerate(labels):  # no label reaches into the next conversation
            if label != -100:
                assert docs[i] == docs[i + 1] and label == ids[i + 1]
    assert sorted(seen) == list(range(COUNT))
    tokens = sum(len(ids) for ids, _ in one_per_window)
    assert prepared.packing_efficiency == pytest.approx(tokens / (len(stream) * SEQ_LEN))
    assert batch.document_ids_BS.dtype == batch.labels_BS.dtype == batch.input_ids_BS.dtype == torch.int64


def test_one_conversation_per_window_without_packing(chat, one_per_window) -> None:
    prepared = _prepare(chat)
    assert len(prepared.train) == COUNT
    tokens = sum(len(ids) for ids, _ in one_per_window)
    assert prepared.packing_efficiency == pytest.approx(tokens / (COUNT * SEQ_LEN))


@pytest.mark.parametrize("packing", ["true", "false"])
def test_labelled_tokens_count_the_global_batch(chat, packing: str) -> None:
    stream = _prepare(chat, **{"data.packing": packing}).train
    for step in range(6):
        whole = stream.batch(step, 8, 0, 8)
        assert stream.labelled_tokens(step, 8) == int((whole.labels_BS != -100).sum())
        # ranks' slices of the global batch are its rows
        parts = [stream.batch(step, 8, start, 2) for start in range(0, 8, 2)]
        for name in ("input_ids_BS", "labels_BS", "document_ids_BS"):
            assert torch.equal(torch.cat([getattr(p, name) for p in parts]), getattr(whole, name))


def test_the_batch_order_is_a_seeded_permutation_per_epoch(chat) -> None:
    stream = _prepare(chat, **{"data.packing": "true"}).train
    windows, batch = len(stream), 5
    order = np.concatenate([stream.global_windows(step, batch) for step in range(3 * windows // batch + 1)])
    epochs = [order[e * windows : (e + 1) * windows] for e in range(3)]
    assert all(sorted(epoch.tolist()) == list(range(windows)) for epoch in epochs)  # every window once an epoch
    assert not np.array_equal(epochs[0], epochs[1])  # reshuffled
    # the same in another process: a fresh stream over the cached entry
    again = _prepare(chat, **{"data.packing": "true"}).train
    assert all(np.array_equal(again.global_windows(s, batch), stream.global_windows(s, batch)) for s in range(30))
    other = _prepare(chat, **{"data.packing": "true", "train.seed": "99"}).train
    assert not np.array_equal(other.global_windows(0, windows), stream.global_windows(0, windows))


def test_valid_fraction_holds_out_the_last_conversations(chat, one_per_window) -> None:
    prepared = _prepare(chat, **{"data.valid_fraction": "0.2"})
    held = round(0.2 * COUNT)
    assert len(prepared.train) == COUNT - held and len(prepared.valid) == held
    assert conversation_windows(prepared)[: COUNT - held] == one_per_window[: COUNT - held]
    valid = prepared.valid
    rows = valid.windows(np.arange(held))
    for row, (ids, labels) in enumerate(one_per_window[COUNT - held :]):
        assert rows.input_ids_BS[row, : len(ids)].tolist() == ids and rows.labels_BS[row, : len(ids)].tolist() == labels
    first, second = list(valid.eval_batches(2, 4)), list(valid.eval_batches(2, 4))
    assert len(first) == 2 and all(torch.equal(a.labels_BS, b.labels_BS) for a, b in zip(first, second, strict=True))
    halves = list(valid.eval_batches(2, 4, start=2, count=2))
    assert all(torch.equal(h.input_ids_BS, f.input_ids_BS[2:]) for h, f in zip(halves, first, strict=True))
    with pytest.raises(ConfigError, match=r"fewer than one batch of 64; add validation data"):
        valid.eval_batches(1, 64)
    assert prepared.fingerprint != _prepare(chat).fingerprint


def test_a_second_run_reads_the_cache(chat, monkeypatch) -> None:
    _prepare(chat)
    import moe_train.conversation_cache as cache

    monkeypatch.setattr(cache, "_build_entry", lambda *a, **k: pytest.fail("built again"))
    assert len(_prepare(chat, **{"data.seq_len": "128"}).train) == COUNT  # the entry serves every window length


def test_valid_source_is_its_own_conversations(chat, one_per_window, tmp_path: Path) -> None:
    records = _conversations(COUNT)
    valid_file = write_jsonl(tmp_path / "valid.jsonl", records[:7])
    prepared = _prepare(chat, **{"data.valid_source": str(valid_file)})
    assert len(prepared.train) == COUNT and len(prepared.valid) == 7
    rows = prepared.valid.windows(np.arange(7))
    for row, (ids, labels) in enumerate(one_per_window[:7]):
        assert rows.input_ids_BS[row, : len(ids)].tolist() == ids and rows.labels_BS[row, : len(ids)].tolist() == labels
    assert set(rows.document_ids_BS[:, 0].tolist()) == set(range(7))
