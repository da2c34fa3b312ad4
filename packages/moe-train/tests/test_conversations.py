"""Chat and prompt/completion records to token windows (issue 33): each conversation's ids and labels against
transformers' ``apply_chat_template(..., return_assistant_tokens_mask=True)`` (a template with ``{% generation %}``
markers, and one without, whose assistant turns are found turn by turn), ShareGPT records against the OpenAI messages
they stand for, prompt/completion pairs against ids joined by hand, and the same windows from JSONL, .jsonl.gz,
Parquet and a datasets directory."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from moe_train.config import load_config
from moe_train.data import prepare_data

MARKED = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n"
    "{% generation %}{{ m['content'] }}<|im_end|>\n{% endgeneration %}"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PLAIN = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONVERSATIONS = [
    [
        {"role": "system", "content": "be kind"},
        {"role": "user", "content": "how are you?"},
        {"role": "assistant", "content": "I am fine."},
        {"role": "user", "content": "the answer?"},
        {"role": "assistant", "content": "The answer is 42."},
    ],
    [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hello, how are you?"}],
    [
        {"role": "user", "content": "what is 4 plus 2?"},
        {"role": "assistant", "content": "4 plus 2 is 6."},
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": "fine."},
    ],
]
SHAREGPT_SPEAKERS = {"system": "system", "user": "human", "assistant": "gpt", "tool": "observation"}
SEQ_LEN = 96


def write_tokenizer(directory: Path, template: str | None = MARKED, **config: object) -> Path:
    """A byte-level BPE tokenizer directory with ChatML's special tokens and ``template`` in tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [" ".join(m["content"] for c in CONVERSATIONS for m in c) + " system user assistant tool"] * 20
    tok.train_from_iterator(corpus, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    settings = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", **config}
    if template is not None:
        settings["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    return directory


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def write_jsonl(path: Path, records: list[object]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def prepare(source: Path, tokenizer: Path, cache: Path, **extra: str):
    overrides = {
        "data.format": "chat",
        "data.source": str(source),
        "data.tokenizer": str(tokenizer),
        "data.cache_dir": str(cache),
        "data.seq_len": str(SEQ_LEN),
        "data.packing": "false",
        "model.vocab_size": "320",
        **extra,
    }
    cfg = load_config("tiny", overrides)
    return prepare_data(cfg.data, seed=cfg.train.seed, model_vocab_size=320, log=None)


def conversation_windows(prepared) -> list[tuple[list[int], list[int]]]:
    """Each conversation's (ids, labels), in record order, from one window per conversation (data.packing=false)."""
    stream = prepared.train
    batch = stream.windows(np.arange(len(stream)))
    out = []
    for row in range(len(stream)):
        docs = batch.document_ids_BS[row]
        assert set(docs.tolist()) == {row, -1}  # one conversation, then padding
        length = int((docs == row).sum())
        assert (docs[:length] == row).all() and (batch.labels_BS[row, length - 1 :] == -100).all()
        out.append((batch.input_ids_BS[row, :length].tolist(), batch.labels_BS[row, :length].tolist()))
    return out


def transformers_reference(tokenizer: Path, messages: list[dict], template: str = MARKED) -> tuple[list, list]:
    """ids and the labels answer-only SFT puts on them: token i+1 where transformers marks it as the assistant's."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tokenizer))
    want = hf.apply_chat_template(
        messages, chat_template=template, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids, mask = list(want["input_ids"]), list(want["assistant_masks"])
    labels = [ids[i + 1] if mask[i + 1] else -100 for i in range(len(ids) - 1)] + [-100]
    assert any(mask)
    return ids, labels


def test_chat_labels_are_transformers_assistant_tokens(tokenizer_dir: Path, tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CONVERSATIONS])
    prepared = prepare(source, tokenizer_dir, tmp_path / "cache")
    got = conversation_windows(prepared)
    assert got == [transformers_reference(tokenizer_dir, m) for m in CONVERSATIONS]
    assert prepared.packing_efficiency == pytest.approx(sum(len(ids) for ids, _ in got) / (3 * SEQ_LEN))
    assert prepared.skipped == {} and prepared.separator == ()


def test_a_template_without_markers_gives_the_same_labels(tmp_path: Path) -> None:
    # PLAIN renders what MARKED renders (after a bos_token from the tokenizer's config, as transformers passes it);
    # its assistant turns are found by rendering turn by turn, and must be the ones MARKED marks
    tokenizer = write_tokenizer(tmp_path / "plain", PLAIN, bos_token="<s>")
    source = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CONVERSATIONS])
    got = conversation_windows(prepare(source, tokenizer, tmp_path / "cache"))
    marked_with_bos = "{{ bos_token }}" + MARKED
    want = [transformers_reference(tokenizer, m, marked_with_bos) for m in CONVERSATIONS]
    assert got == want
    assert all(ids[0] == 3 for ids, _ in got)  # <s> (special token 3), the bos_token of tokenizer_config.json


def test_sharegpt_records_are_the_messages_they_stand_for(tokenizer_dir: Path, tmp_path: Path) -> None:
    sharegpt = [
        {"conversations": [{"from": SHAREGPT_SPEAKERS[m["role"]], "value": m["content"]} for m in c]}
        for c in CONVERSATIONS
    ]
    got = conversation_windows(prepare(write_jsonl(tmp_path / "s.jsonl", sharegpt), tokenizer_dir, tmp_path / "c"))
    assert got == [transformers_reference(tokenizer_dir, m) for m in CONVERSATIONS]


def test_loss_on_all_labels_every_next_token(tokenizer_dir: Path, tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CONVERSATIONS])
    for ids, labels in conversation_windows(prepare(source, tokenizer_dir, tmp_path / "c", **{"data.loss_on": "all"})):
        assert labels == [*ids[1:], -100]


def test_prompt_completion_labels_the_completion_and_an_eos(tokenizer_dir: Path, tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    pairs = [("what is 4 plus 2?", " 4 plus 2 is 6."), ("hello there", " how are you?")]
    source = write_jsonl(tmp_path / "pc.jsonl", [{"q": p, "a": c} for p, c in pairs])
    extra = {"data.format": "prompt_completion", "data.prompt_field": "q", "data.completion_field": "a"}
    got = conversation_windows(prepare(source, tokenizer_dir, tmp_path / "cache", **extra))
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eos = tok.token_to_id("<|im_end|>")
    for (prompt, completion), (ids, labels) in zip(pairs, got, strict=True):
        prompt_ids, completion_ids = tok.encode(prompt).ids, tok.encode(completion).ids
        assert ids == prompt_ids + completion_ids + [eos]
        assert labels == [-100] * (len(prompt_ids) - 1) + completion_ids + [eos, -100]


def _parquet(path: Path, records: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(records), path)
    return path


def _datasets_dir(path: Path, records: list[dict]) -> Path:
    import datasets

    datasets.disable_progress_bars()
    datasets.Dataset.from_list(records).save_to_disk(str(path))
    return path


def _gzip(path: Path, records: list[dict]) -> Path:
    with gzip.open(path, "wt") as file:
        file.writelines(json.dumps(r) + "\n" for r in records)
    return path


@pytest.mark.parametrize("writer", [_parquet, _datasets_dir, _gzip], ids=["parquet", "datasets", "jsonl.gz"])
def test_every_source_gives_the_same_windows(writer, tokenizer_dir: Path, tmp_path: Path) -> None:
    # Parquet and datasets give every message every struct field (null where a record has none): those are dropped
    records = [{"messages": m, "id": i} for i, m in enumerate(CONVERSATIONS)]
    name = {"_parquet": "c.parquet", "_datasets_dir": "ds", "_gzip": "c.jsonl.gz"}[writer.__name__]
    got = conversation_windows(prepare(writer(tmp_path / name, records), tokenizer_dir, tmp_path / "cache"))
    assert got == [transformers_reference(tokenizer_dir, m) for m in CONVERSATIONS]


def test_the_template_comes_from_data_chat_template_or_a_named_list(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CONVERSATIONS])
    named = [{"name": "tool_use", "template": PLAIN}, {"name": "default", "template": MARKED}]
    listed = write_tokenizer(tmp_path / "listed", named)
    want = conversation_windows(prepare(source, write_tokenizer(tmp_path / "marked"), tmp_path / "c1"))
    assert conversation_windows(prepare(source, listed, tmp_path / "c2")) == want
    (tmp_path / "marked.jinja").write_text(MARKED)
    untemplated = write_tokenizer(tmp_path / "none", None)
    extra = {"data.chat_template": str(tmp_path / "marked.jinja")}
    assert conversation_windows(prepare(source, untemplated, tmp_path / "c3", **extra)) == want


def test_a_transformers_tokenizer_gives_the_same_offsets(tokenizer_dir: Path) -> None:
    # directories without a tokenizer.json load through transformers; its fast tokenizers give the same ids and offsets
    from moe_train.tokenization import _load_transformers, load_tokenizer

    text = "<|im_start|>user\nhow are you?<|im_end|>\n<|im_start|>assistant\nI am fine.<|im_end|>\n"
    direct = load_tokenizer(str(tokenizer_dir))
    through = _load_transformers(str(tokenizer_dir), tokenizer_dir, "")
    assert direct.encode_offsets is not None and through.encode_offsets is not None
    (ids, offsets), (ids2, offsets2) = direct.encode_offsets([text])[0], through.encode_offsets([text])[0]
    assert list(ids) == list(ids2) and [tuple(o) for o in offsets] == [tuple(o) for o in offsets2]
    assert ids[0] == 1 and text[offsets[0][0] : offsets[0][1]] == "<|im_start|>"  # a special token, read as one
