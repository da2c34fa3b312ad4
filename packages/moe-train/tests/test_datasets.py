"""``data.source`` files and datasets, ``data.tokenizer``, the token cache and the validation split, checked
against references computed here: the tokenizers library's own ``encode`` of each document, joined by hand."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random
import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moe_train import cli
from moe_train import data as data_module
from moe_train.config import ConfigError, DataConfig, load_config
from moe_train.data import TokenStream, prepare_data, stdlib_token_file
from moe_train.packing import pack, token_files
from moe_train.sources import resolve_source
from moe_train.tokenization import byte_tokenizer, default_tokenizer, load_tokenizer

EOS = "<|endoftext|>"
WORDS = ["the", "a", "router", "expert", "token", "sends", "each", "to", "its", "top", "two", "of", "eight"]
WORDS += [
    "experts",
    "and",
    "sums",
    "weighted",
    "outputs",
    "naïve",
    "café",
    "déjà",
    "über",
    "日本",
    "🙂",
    "x=1;",
    "def",
    "f(x):",
    "return",
]
NUM_DOCS = 24


def _documents(count: int = NUM_DOCS, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    docs = []
    for _ in range(count):
        lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(rng.randint(1, 5))]
        docs.append("\n".join(lines))
    return docs


DOCS = _documents()


def _write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({"id": i, field: d}) + "\n" for i, d in enumerate(docs)))
    return path


def _write_parquet(path: Path, docs: list[str], field: str = "text") -> Path:
    pq.write_table(pa.table({"id": list(range(len(docs))), field: docs}), path)
    return path


def _write_text_dir(path: Path, docs: list[str]) -> Path:
    path.mkdir()
    for i, doc in enumerate(docs):
        (path / f"doc{i:03d}.txt").write_text(doc, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import datasets

    root = tmp_path_factory.mktemp("corpus")
    hf = datasets.Dataset.from_dict({"text": DOCS, "id": list(range(NUM_DOCS))})
    hf.save_to_disk(str(root / "hf"))
    datasets.DatasetDict({"train": hf, "test": hf.select(range(2))}).save_to_disk(str(root / "hf_dict"))
    return {
        "jsonl": _write_jsonl(root / "docs.jsonl", DOCS),
        "parquet": _write_parquet(root / "docs.parquet", DOCS),
        "text_dir": _write_text_dir(root / "text", DOCS),
        "hf": root / "hf",
        "hf_dict": root / "hf_dict",
    }


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE of ~300 ids trained on the corpus, its end-of-text token first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(DOCS, trainer)
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    tok.save(str(path))
    return path


def _reference(tokenizer_path: Path, docs: list[str]) -> np.ndarray:
    """Each document through the tokenizers library's own encode, followed by the end-of-text id."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    eos = tok.token_to_id(EOS)
    return np.array([i for doc in docs for i in [*tok.encode(doc, add_special_tokens=False).ids, eos]])


def _prepare(source: Path | str, cache: Path, **fields: object):
    return prepare_data(DataConfig(source=str(source), cache_dir=str(cache), **fields), seed=0, log=None)


# ------------------------------------------------------------------------------------------------- tokens


def test_token_file_is_each_document_encoded_then_eos(corpus, tokenizer_file: Path, tmp_path: Path) -> None:
    prepared = _prepare(corpus["jsonl"], tmp_path, seq_len=16, tokenizer=str(tokenizer_file))
    assert prepared.eos_id == 0 and prepared.separator == (0,)
    assert prepared.vocab_size_needed == 300
    assert prepared.train.tokens.dtype == np.uint16  # 300 ids do not fit a byte
    np.testing.assert_array_equal(prepared.train.tokens, _reference(tokenizer_file, DOCS))
    assert prepared.valid is None
    # a directory holding tokenizer.json names the same tokenizer
    again = _prepare(corpus["jsonl"], tmp_path, seq_len=16, tokenizer=str(tokenizer_file.parent))
    np.testing.assert_array_equal(again.train.tokens, prepared.train.tokens)


@pytest.mark.parametrize("fmt", ["parquet", "text_dir", "hf", "hf_dict"])
def test_every_format_gives_the_same_tokens(fmt: str, corpus, tokenizer_file: Path, tmp_path: Path) -> None:
    jsonl = _prepare(corpus["jsonl"], tmp_path, seq_len=16, tokenizer=str(tokenizer_file))
    other = _prepare(corpus[fmt], tmp_path, seq_len=16, tokenizer=str(tokenizer_file))
    np.testing.assert_array_equal(other.train.tokens, jsonl.train.tokens)
    assert other.train.path != jsonl.train.path  # cached apart (other files), yet the same data:
    assert other.fingerprint == jsonl.fingerprint


def test_byte_level_documents_end_with_a_blank_line(corpus, tmp_path: Path) -> None:
    prepared = _prepare(corpus["parquet"], tmp_path, seq_len=16)
    expected = b"".join(doc.encode("utf-8") + b"\n\n" for doc in DOCS)
    assert prepared.train.tokens.dtype == np.uint8 and prepared.train.tokens.tobytes() == expected
    assert (prepared.eos_id, prepared.separator, prepared.vocab_size_needed) == (None, (10, 10), 256)


def test_directories_are_read_recursively_in_sorted_order(tmp_path: Path) -> None:
    root = tmp_path / "mixed"
    (root / "b" / "inner").mkdir(parents=True)
    (root / ".git").mkdir()
    (root / "a.txt").write_text("first")
    _write_jsonl(root / "b" / "inner" / "c.jsonl", ["third", "", "fourth"])  # the empty record is skipped
    (root / "b" / "b.txt").write_text("second")
    (root / "b" / "notes.md").write_text("not data")
    (root / ".git" / "x.txt").write_text("hidden")
    _write_parquet(root / "d.parquet", ["fifth"])
    prepared = _prepare(root, tmp_path / "cache", seq_len=4)
    assert prepared.train.tokens.tobytes() == b"first\n\nsecond\n\nthird\n\nfourth\n\nfifth\n\n"


def test_gzip_text_and_null_fields(tmp_path: Path) -> None:
    import gzip

    with gzip.open(tmp_path / "docs.jsonl.gz", "wt") as file:
        file.write('{"text": "zipped"}\n{"text": null}\n\n{"text": "lines"}\n')
    prepared = _prepare(tmp_path / "docs.jsonl.gz", tmp_path / "cache", seq_len=4)
    assert prepared.train.tokens.tobytes() == b"zipped\n\nlines\n\n"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(docs=st.lists(st.text(min_size=1, max_size=40), min_size=1, max_size=8))
def test_packing_round_trip(docs: list[str], tokenizer_file: Path, tmp_path_factory) -> None:
    """Cutting the packed file at the recorded document ends gives back each document: its ids (which decode
    to its text) and the separator."""
    tok = load_tokenizer(str(tokenizer_file))
    for tokenizer in (tok, byte_tokenizer()):
        out = tmp_path_factory.mktemp("pack") / "tokens"
        ends = pack(docs, tokenizer, out)
        tokens = np.fromfile(out, dtype=tokenizer.dtype)
        assert len(ends) == len(docs) and ends[-1] == len(tokens)
        starts = [0, *ends[:-1]]
        sep = len(tokenizer.separator)
        for doc, start, end in zip(docs, starts, ends, strict=True):
            ids = tokens[start : end - sep]
            assert tuple(tokens[end - sep : end]) == tokenizer.separator
            if tokenizer is tok:
                from tokenizers import Tokenizer

                assert Tokenizer.from_file(str(tokenizer_file)).decode(ids.tolist()) == doc
            else:
                assert ids.tobytes().decode("utf-8") == doc


# ------------------------------------------------------------------------------------------------ windows


def test_training_windows_are_slices_of_the_token_file(corpus, tokenizer_file: Path, tmp_path: Path) -> None:
    prepared = _prepare(corpus["jsonl"], tmp_path, seq_len=12, tokenizer=str(tokenizer_file))
    tokens = _reference(tokenizer_file, DOCS)
    stream = prepared.train
    offsets = stream.global_offsets(3, 8)
    whole = stream.batch(3, 8, 0, 8)
    expected = np.stack([tokens[o : o + 13] for o in offsets])
    np.testing.assert_array_equal(whole.input_ids_BS.numpy(), expected[:, :-1])
    np.testing.assert_array_equal(whole.labels_BS.numpy(), expected[:, 1:])
    assert whole.input_ids_BS.dtype == torch.int64
    ranks = [stream.batch(3, 8, start, 2) for start in range(0, 8, 2)]
    assert torch.equal(torch.cat([r.input_ids_BS for r in ranks]), whole.input_ids_BS)
    # a pure function of (seed, step): a stream opened again reads the same batch
    again = TokenStream(stream.path, 12, seed=0).batch(3, 8, 0, 8)
    assert torch.equal(again.labels_BS, whole.labels_BS)


def test_stdlib_windows_are_the_ones_read_before(data_cache: Path) -> None:
    prepared = prepare_data(DataConfig(cache_dir=str(data_cache), seq_len=32), seed=1234, log=None)
    before = TokenStream(stdlib_token_file(data_cache), 32, 1234)
    assert prepared.train.path == stdlib_token_file(data_cache)
    for step in (0, 7):
        assert torch.equal(prepared.train.batch(step, 4, 0, 4).input_ids_BS, before.batch(step, 4, 0, 4).input_ids_BS)
    assert prepared.fingerprint == prepare_data(DataConfig(cache_dir=str(data_cache)), seed=0, log=None).fingerprint


def test_eval_batches_are_fixed_non_overlapping_windows(tmp_path: Path) -> None:
    path = tmp_path / "tokens.u16"
    np.arange(1000, dtype=np.uint16).tofile(path)
    stream = TokenStream(path, seq_len=10, seed=5)
    assert stream.tokens.dtype == np.uint16
    batches = list(stream.eval_batches(3, 4))
    assert len(batches) == 3
    inputs = torch.cat([b.input_ids_BS for b in batches])
    starts = inputs[:, 0].tolist()
    assert starts == sorted(starts) and all(b - a >= 10 for a, b in itertools.pairwise(starts))  # no token twice
    assert starts[-1] > 500  # spread over the file, not its first 120 tokens
    assert torch.equal(torch.cat([b.labels_BS for b in batches]), inputs + 1)
    other_seed = TokenStream(path, seq_len=10, seed=6).eval_batches(3, 4)
    assert all(torch.equal(a.input_ids_BS, b.input_ids_BS) for a, b in zip(batches, other_seed, strict=True))
    halves = [list(stream.eval_batches(3, 4, start, 2)) for start in (0, 2)]
    assert torch.equal(torch.cat([halves[0][0].input_ids_BS, halves[1][0].input_ids_BS]), batches[0].input_ids_BS)
    everything = list(stream.eval_batches(None, 4))  # (1000 - 1) // 10 = 99 windows: 24 whole batches
    assert len(everything) == 24 and len(list(stream.eval_batches(1000, 4))) == 24
    with pytest.raises(ConfigError, match="fewer than one batch of 200"):
        stream.eval_batches(None, 200)


# -------------------------------------------------------------------------------------------------- cache


def test_a_second_run_reads_the_cache_without_tokenising(
    corpus, tokenizer_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []

    def counting(path: str, eos_token: str = ""):
        tok = load_tokenizer(path, eos_token)
        return dataclasses.replace(tok, encode_batch=lambda texts: calls.append(len(texts)) or tok.encode_batch(texts))

    monkeypatch.setattr(data_module, "load_tokenizer", counting)
    logs: list[str] = []
    cfg = DataConfig(source=str(corpus["jsonl"]), cache_dir=str(tmp_path), seq_len=16, tokenizer=str(tokenizer_file))
    first = prepare_data(cfg, seed=0, log=logs.append)
    assert sum(calls) == NUM_DOCS and any("tokenising" in line for line in logs)
    mtime = first.train.path.stat().st_mtime_ns
    calls.clear()
    logs.clear()
    second = prepare_data(cfg, seed=0, log=logs.append)
    assert calls == [] and logs == []  # no tokeniser call, nothing to say
    assert second.train.path == first.train.path and second.train.path.stat().st_mtime_ns == mtime
    assert second.fingerprint == first.fingerprint
    assert not list(tmp_path.glob(".*.tmp*"))  # built aside, renamed into place
    # another text_field is another entry
    _write_jsonl(tmp_path / "other.jsonl", DOCS, field="body")
    other = prepare_data(
        dataclasses.replace(cfg, source=str(tmp_path / "other.jsonl"), text_field="body"), seed=0, log=None
    )
    assert other.train.path != first.train.path and sum(calls) == NUM_DOCS
    np.testing.assert_array_equal(other.train.tokens, first.train.tokens)


def test_a_changed_source_is_tokenised_again(tmp_path: Path) -> None:
    source = _write_jsonl(tmp_path / "docs.jsonl", DOCS)
    first = _prepare(source, tmp_path / "cache", seq_len=8)
    _write_jsonl(source, [*DOCS[:-1], "changed"])
    second = _prepare(source, tmp_path / "cache", seq_len=8)
    assert second.train.path != first.train.path and second.fingerprint != first.fingerprint
    assert second.train.tokens.tobytes().endswith(b"changed\n\n")


def test_ranks_building_together_share_one_entry(corpus, tokenizer_file: Path, tmp_path: Path) -> None:
    tok = load_tokenizer(str(tokenizer_file))
    builds: list[int] = []
    counting = dataclasses.replace(tok, encode_batch=lambda texts: builds.append(1) or tok.encode_batch(texts))
    source = resolve_source(str(corpus["parquet"]), "text")
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(token_files(tmp_path, source, None, 0.0, counting)))
        for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 3 and len({r.train for r in results}) == 1
    assert len(builds) == 1  # the others waited on the lock, then found the entry
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == [results[0].directory.name]


# ----------------------------------------------------------------------------------------------- validation


def test_valid_fraction_holds_out_the_last_documents(corpus, tokenizer_file: Path, tmp_path: Path) -> None:
    prepared = _prepare(corpus["jsonl"], tmp_path, seq_len=8, tokenizer=str(tokenizer_file), valid_fraction=0.25)
    held_out = round(0.25 * NUM_DOCS)
    np.testing.assert_array_equal(prepared.train.tokens, _reference(tokenizer_file, DOCS[:-held_out]))
    np.testing.assert_array_equal(prepared.valid.tokens, _reference(tokenizer_file, DOCS[-held_out:]))
    assert prepared.valid.path != prepared.train.path and prepared.valid.tokens.dtype == np.uint16
    # disjoint, and together the whole corpus
    whole = _reference(tokenizer_file, DOCS)
    np.testing.assert_array_equal(np.concatenate([prepared.train.tokens, prepared.valid.tokens]), whole)
    assert next(iter(prepared.valid.eval_batches(1, 2))).input_ids_BS.shape == (2, 8)


def test_valid_source_is_its_own_token_file(corpus, tokenizer_file: Path, tmp_path: Path) -> None:
    valid_docs = _documents(6, seed=1)
    valid = _write_parquet(tmp_path / "valid.parquet", valid_docs)
    prepared = _prepare(
        corpus["hf"], tmp_path / "cache", seq_len=8, tokenizer=str(tokenizer_file), valid_source=str(valid)
    )
    np.testing.assert_array_equal(prepared.train.tokens, _reference(tokenizer_file, DOCS))
    np.testing.assert_array_equal(prepared.valid.tokens, _reference(tokenizer_file, valid_docs))


# ------------------------------------------------------------------------------------------------ tokenizers


def test_default_tokenizer(tokenizer_file: Path, tmp_path: Path) -> None:
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    assert default_tokenizer(DataConfig(), str(checkpoint)) == ""  # no tokenizer.json: byte level
    (checkpoint / "tokenizer.json").write_bytes(tokenizer_file.read_bytes())
    assert default_tokenizer(DataConfig(), str(checkpoint)) == str(checkpoint / "tokenizer.json")
    assert default_tokenizer(DataConfig(tokenizer="bytes"), str(checkpoint)) == ""
    assert default_tokenizer(DataConfig(tokenizer="/x/tokenizer.json"), str(checkpoint)) == "/x/tokenizer.json"
    assert default_tokenizer(DataConfig(), "") == ""


def test_eos_comes_from_tokenizer_config_or_data_eos_token(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "</s>": 1, "<|endoftext|>": 2, "a": 3, "b": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    assert load_tokenizer(str(tmp_path)).eos_id == 1  # the first common name
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|endoftext|>"}}))
    assert load_tokenizer(str(tmp_path)).eos_id == 2
    assert load_tokenizer(str(tmp_path), eos_token="b").eos_id == 4


def test_transformers_tokenizer_without_tokenizer_json(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    directory = tmp_path / "bert"
    directory.mkdir()
    (directory / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nhello\nworld\n##s\n")
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "BertTokenizer"}))
    (tmp_path / "docs.txt").write_text("hello worlds hello")
    with pytest.raises(ConfigError, match="no end-of-text token found.*data.eos_token"):
        _prepare(tmp_path / "docs.txt", tmp_path / "cache", seq_len=2, tokenizer=str(directory))
    prepared = _prepare(
        tmp_path / "docs.txt", tmp_path / "cache", seq_len=2, tokenizer=str(directory), eos_token="[SEP]"
    )
    assert prepared.train.tokens.tolist() == [5, 6, 7, 5, 3] and prepared.vocab_size_needed == 8


# ---------------------------------------------------------------------------------------------------- errors


def _fails(match: str, source: Path | str, cache: Path, **fields: object) -> str:
    with pytest.raises(ConfigError, match=match) as err:
        _prepare(source, cache, **fields)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_source_errors(tmp_path: Path) -> None:
    _fails(r"data.source='/no/such.jsonl': no such file or directory", "/no/such.jsonl", tmp_path)
    (tmp_path / "table.csv").write_text("a,b\n")
    _fails(r"data.source=.*table.csv.*unknown format '.csv'; use .txt", tmp_path / "table.csv", tmp_path)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "README.md").write_text("no data")
    _fails(r"data.source=.*empty.*empty corpus: the directory holds no .txt", tmp_path / "empty", tmp_path)
    blank = _write_jsonl(tmp_path / "blank.jsonl", ["", ""])
    _fails(
        r"data.source=.*blank.jsonl.*empty corpus: no document has any text with data.text_field='text'",
        blank,
        tmp_path,
    )
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n[1, 2]\n')
    _fails(r"bad.jsonl line 2 is a JSON list, not an object", tmp_path / "bad.jsonl", tmp_path)
    (tmp_path / "notjson.jsonl").write_text("{oops\n")
    _fails(r"notjson.jsonl line 1 is not JSON", tmp_path / "notjson.jsonl", tmp_path)
    (tmp_path / "fake.parquet").write_text("not parquet")
    _fails(r"fake.parquet is not a Parquet file", tmp_path / "fake.parquet", tmp_path)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "hf"])
def test_a_missing_text_field_names_data_text_field(fmt: str, corpus, tmp_path: Path) -> None:
    message = _fails(
        r"data.text_field='content': .* has no such field \(fields: ", corpus[fmt], tmp_path, text_field="content"
    )
    assert "set data.text_field" in message and "text" in message.split("fields: ")[1]


def test_a_non_text_field_is_an_error(corpus, tmp_path: Path) -> None:
    _fails(r"data.text_field='id': docs.jsonl line 1 holds int, not text", corpus["jsonl"], tmp_path, text_field="id")


def test_tokenizer_errors(corpus, tokenizer_file: Path, tmp_path: Path) -> None:
    src = corpus["jsonl"]
    _fails(r"data.tokenizer='/no/tok.json': no such file or directory", src, tmp_path, tokenizer="/no/tok.json")
    (tmp_path / "garbage.json").write_text('{"not": "a tokenizer"}')
    _fails(
        r"data.tokenizer=.*garbage.json.*is not a HuggingFace tokenizers file",
        src,
        tmp_path,
        tokenizer=str(tmp_path / "garbage.json"),
    )
    _fails(
        r"data.eos_token='<nope>' is not a token of data.tokenizer",
        src,
        tmp_path,
        tokenizer=str(tokenizer_file),
        eos_token="<nope>",
    )
    _fails(r"data.eos_token='</s>' needs data.tokenizer", src, tmp_path, eos_token="</s>")


def test_data_too_short_for_a_window(corpus, tokenizer_file: Path, tmp_path: Path) -> None:
    tiny = _write_jsonl(tmp_path / "tiny.jsonl", ["abc"])
    _fails(
        r"data.seq_len=16: longer than the 5-token training data \(data.source=.*tiny.jsonl", tiny, tmp_path, seq_len=16
    )
    total = len(_reference(tokenizer_file, DOCS))
    _fails(
        rf"data.seq_len={total}: longer than the .* less data.valid_fraction=0.5",
        corpus["jsonl"],
        tmp_path,
        seq_len=total,
        tokenizer=str(tokenizer_file),
        valid_fraction=0.5,
    )
    last = len(_reference(tokenizer_file, DOCS[-1:]))  # 0.01 of 24 documents: the last one is held out
    _fails(
        rf"data.valid_fraction=0.01: {last} validation tokens, too few for a window .*raise data.valid_fraction",
        corpus["jsonl"],
        tmp_path,
        seq_len=last,
        tokenizer=str(tokenizer_file),
        valid_fraction=0.01,
    )
    two = _write_jsonl(tmp_path / "two.jsonl", ["first document", "second"])
    _fails(
        r"data.valid_fraction=0.9: holding out 2 of the 2 documents leaves none to train on",
        two,
        tmp_path,
        seq_len=2,
        valid_fraction=0.9,
    )


def test_a_vocabulary_larger_than_the_model_names_model_vocab_size(corpus, tokenizer_file: Path, tmp_path) -> None:
    cfg = DataConfig(source=str(corpus["jsonl"]), cache_dir=str(tmp_path), tokenizer=str(tokenizer_file))
    with pytest.raises(
        ConfigError,
        match=r"model.vocab_size=256: data.tokenizer=.* needs at least 300; set "
        r"model.vocab_size=300 or more",
    ):
        prepare_data(cfg, seed=0, model_vocab_size=256, log=None)
    assert not any(tmp_path.iterdir())  # checked before anything is read or written


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"data.valid_fraction": "1.0"}, "data.valid_fraction=1.0: must be in [0, 1)"),
        ({"data.valid_fraction": "-0.1"}, "data.valid_fraction=-0.1: must be in [0, 1)"),
        ({"data.valid_fraction": "0.1", "data.valid_source": "v.jsonl"}, "both name the validation data"),
        ({"data.source": ""}, "data.source='': name the training data"),
        ({"data.text_field": ""}, "data.text_field='': name the record field"),
        ({"model.vocab_size": "200"}, "model.vocab_size=200: byte-level data needs at least 256"),
    ],
)
def test_config_checks_that_read_no_files(overrides: dict[str, str], expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config("tiny", overrides)
    assert expected in str(err.value)


def test_vocab_size_below_256_is_fine_with_a_tokenizer() -> None:
    cfg = load_config("tiny", {"model.vocab_size": "200", "data.tokenizer": "/somewhere/tokenizer.json"})
    assert cfg.data.tokenizer == "/somewhere/tokenizer.json"  # its size is checked when it is loaded


# -------------------------------------------------------------------------------------------------- the CLI


def _train_args(tmp_path: Path, **extra: str) -> list[str]:
    args = {
        "train.steps": "2",
        "model.num_layers": "1",
        "run.output_dir": str(tmp_path / "run"),
        "data.cache_dir": str(tmp_path / "cache"),
        "run.save_checkpoint": "false",
        **extra,
    }
    return ["train", "--config", "tiny", *[t for k, v in args.items() for t in (f"--{k}", v)]]


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({"data.source": "/no/such/dir"}, "data.source='/no/such/dir': no such file or directory"),
        ({"data.text_field": "body"}, "data.text_field='body': docs.jsonl line 1 has no such field"),
        ({"data.tokenizer": "TOKENIZER"}, "model.vocab_size=256: data.tokenizer="),
    ],
)
def test_cli_data_errors_are_one_line_exit_2_and_write_nothing(
    extra: dict[str, str], expected: str, corpus, tokenizer_file: Path, tmp_path: Path, capsys
) -> None:
    extra = {"data.source": str(corpus["jsonl"]), **extra}
    extra = {k: str(tokenizer_file) if v == "TOKENIZER" else v for k, v in extra.items()}
    assert cli.main(_train_args(tmp_path, **extra)) == cli.EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after "tokenising ..." when it got that far
    assert err.startswith("moe-train: error: ") and expected in err
    assert not (tmp_path / "run").exists()


def test_cli_trains_on_jsonl_with_a_tokenizer(corpus, tokenizer_file: Path, tmp_path: Path) -> None:
    args = _train_args(
        tmp_path,
        **{
            "data.source": str(corpus["jsonl"]),
            "data.tokenizer": str(tokenizer_file),
            "model.vocab_size": "320",
            "data.seq_len": "32",
            "train.global_batch_size": "4",
            "data.valid_fraction": "0.1",
        },
    )
    assert cli.main(args) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all(math.isfinite(r["loss"]) for r in records)
    # the first loss is close to uniform over the model's 320 ids
    assert abs(records[0]["loss"] - math.log(320)) < 1.0
