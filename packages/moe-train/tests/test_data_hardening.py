"""Data, dataset and tokenizer directories are read only inside themselves, and broken data is a one-line
``ConfigError``: truncated or corrupt gzip files, undecodable text (with its byte offset, computed here by an
independent UTF-8 validator), and ``data.decode_errors=replace`` giving exactly ``bytes.decode(errors="replace")``
with a count of the bytes replaced (counted here by a codec error handler)."""

from __future__ import annotations

import codecs
import gzip
import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest

from moe_train.config import ConfigError, DataConfig, load_config
from moe_train.data import prepare_data
from moe_train.packing import log_to_stderr, token_files
from moe_train.sources import resolve_source
from moe_train.tokenization import byte_tokenizer, default_tokenizer, load_tokenizer

EOS = "<|endoftext|>"
DOCS = ["the router sends each token to two experts", "naïve café déjà über 日本 🙂", "def f(x):\n    return x"]


def _prepare(source: Path | str, cache: Path, **fields: object):
    return prepare_data(DataConfig(source=str(source), cache_dir=str(cache), seq_len=4, **fields), seed=0, log=None)


def _one_line_error(call, *parts: str) -> str:
    with pytest.raises(ConfigError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message, message
    for part in parts:
        assert part in message, (part, message)
    return message


def _jsonl(docs: list[str]) -> bytes:
    return "".join(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in docs).encode()


# ------------------------------------------------------------------------------- directories stay inside


def test_a_data_directory_with_a_symlink_out_is_refused(tmp_path: Path) -> None:
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret.txt").write_text("not for training")
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (data / "a.txt").write_text(DOCS[0])
    (data / "sub" / "b.txt").symlink_to(tmp_path / "outside" / "secret.txt")
    for field, source in (("data.source", str(data)), ("data.valid_source", str(data))):
        _one_line_error(
            lambda field=field, source=source: resolve_source(source, "text", field),
            f"{field}={source!r}",
            "entry 'sub/b.txt' is a symlink to",
            "outside the directory",
            f"copy the file into the directory, or name it directly in {field}",
        )
    _one_line_error(lambda: _prepare(data, tmp_path / "cache"), "data.source=")
    # named directly, the same file is the user's choice; a link that stays inside is fine
    assert _prepare(tmp_path / "outside" / "secret.txt", tmp_path / "cache").train.tokens.tobytes().startswith(b"not")
    (data / "sub" / "b.txt").unlink()
    (data / "sub" / "b.txt").symlink_to(data / "a.txt")
    assert resolve_source(str(data), "text").files == (data / "a.txt", data / "sub" / "b.txt")


@pytest.fixture(scope="module")
def saved_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import datasets

    root = tmp_path_factory.mktemp("saved")
    datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(str(root / "hf"))
    return root / "hf"


def test_a_save_to_disk_state_naming_files_outside_is_refused(saved_dataset: Path, tmp_path: Path) -> None:
    split = tmp_path / "hf"
    shutil.copytree(saved_dataset, split)
    state = json.loads((split / "state.json").read_text())
    [entry] = state["_data_files"]
    shutil.move(split / entry["filename"], tmp_path / "x.arrow")  # a real arrow file: the old code trained on it
    entry["filename"] = "../x.arrow"
    (split / "state.json").write_text(json.dumps(state))
    _one_line_error(
        lambda: _prepare(split, tmp_path / "cache"),
        f"data.source={str(split)!r}",
        "state.json names data file '../x.arrow', outside the directory",
        "save the dataset again",
    )


def test_a_dataset_dict_split_outside_is_refused(saved_dataset: Path, tmp_path: Path) -> None:
    root = tmp_path / "dict"
    root.mkdir()
    shutil.copytree(saved_dataset, tmp_path / "elsewhere")
    (root / "train").symlink_to(tmp_path / "elsewhere")
    (root / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
    _one_line_error(lambda: _prepare(root, tmp_path / "cache"), "names split 'train', not a folder inside")
    (root / "train").unlink()
    (root / "dataset_dict.json").write_text(json.dumps({"splits": ["../elsewhere", "train"]}))
    _one_line_error(lambda: _prepare(root, tmp_path / "cache"), "names split '../elsewhere', not a folder inside")


def _write_tokenizer(path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({EOS: 0, "[UNK]": 1, "the": 2, "router": 3}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return path


def test_a_tokenizer_file_linked_from_outside_is_refused(tmp_path: Path) -> None:
    outside = _write_tokenizer(tmp_path / "outside" / "tokenizer.json")
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").symlink_to(outside)
    name = str(tmp_path / "tok")
    _one_line_error(
        lambda: load_tokenizer(name),
        f"data.tokenizer={name!r}: tokenizer.json leads to {outside}",
        "outside the tokenizer directory",
        "copy the file into the directory",
    )
    # a tokenizer.json named directly may be anywhere, but the config files read beside it may not lead out
    (tmp_path / "tok" / "tokenizer.json").unlink()
    shutil.copy(outside, tmp_path / "tok" / "tokenizer.json")
    (tmp_path / "outside" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "router"}))
    (tmp_path / "tok" / "tokenizer_config.json").symlink_to(tmp_path / "outside" / "tokenizer_config.json")
    _one_line_error(lambda: load_tokenizer(str(tmp_path / "tok" / "tokenizer.json")), "tokenizer_config.json leads to")
    assert load_tokenizer(str(outside)).eos_id == 3  # its own directory's config: inside


def test_a_from_hf_tokenizer_linked_from_outside_is_refused(tmp_path: Path) -> None:
    outside = _write_tokenizer(tmp_path / "outside" / "tokenizer.json")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "tokenizer.json").symlink_to(outside)
    _one_line_error(
        lambda: default_tokenizer(DataConfig(), str(tmp_path / "model")),
        "data.tokenizer=''",
        f"model.from_hf={str(tmp_path / 'model')!r}",
        "tokenizer.json leads to",
        "name a tokenizer with data.tokenizer",
    )
    assert default_tokenizer(DataConfig(tokenizer="bytes"), str(tmp_path / "model")) == ""


def test_a_hub_cache_tokenizer_snapshot_loads(tmp_path: Path) -> None:
    repo = tmp_path / "models--a--b"
    blob = _write_tokenizer(repo / "blobs" / "0a1b2c")
    snapshot = repo / "snapshots" / "rev"
    snapshot.mkdir(parents=True)
    (snapshot / "tokenizer.json").symlink_to(Path("..") / ".." / "blobs" / blob.name)
    assert default_tokenizer(DataConfig(), str(snapshot)) == str(snapshot / "tokenizer.json")
    tokenizer = load_tokenizer(str(snapshot))
    assert tokenizer.eos_id == 0 and list(tokenizer.encode_batch(["the router"])[0]) == [2, 3]


# ------------------------------------------------------------------------------------------ gzip


@pytest.mark.parametrize("name", ["docs.jsonl.gz", "docs.txt.gz"])
def test_a_truncated_gzip_is_one_line(tmp_path: Path, name: str) -> None:
    body = _jsonl(DOCS * 50) if "jsonl" in name else " ".join(DOCS * 50).encode()
    whole = gzip.compress(body)
    path = tmp_path / name
    path.write_bytes(whole[: len(whole) // 2])
    _one_line_error(
        lambda: _prepare(path, tmp_path / "cache"),
        f"data.source={str(path)!r}: {name} ends early (a truncated gzip file?)",
        "download or compress it again",
    )
    (tmp_path / "ok.txt").write_text(" ".join(DOCS))
    _one_line_error(
        lambda: _prepare(tmp_path / "ok.txt", tmp_path / "cache", valid_source=str(path)),
        f"data.valid_source={str(path)!r}: {name} ends early",
    )


@pytest.mark.parametrize("damage", ["not gzip", "bad data", "bad crc"])
def test_a_corrupt_gzip_is_one_line(tmp_path: Path, damage: str) -> None:
    whole = bytearray(gzip.compress(_jsonl(DOCS * 50)))
    if damage == "not gzip":
        whole = bytearray(_jsonl(DOCS))
    elif damage == "bad data":
        whole[12:40] = b"\xff" * 28
    else:
        whole[-8] ^= 0xFF  # the CRC-32 of the trailer
    path = tmp_path / "docs.jsonl.gz"
    path.write_bytes(bytes(whole))
    _one_line_error(
        lambda: _prepare(path, tmp_path / "cache"),
        "docs.jsonl.gz is not a valid gzip file (",
        "download or compress it again",
    )


# ------------------------------------------------------------------------------------- undecodable text


def _first_invalid_utf8(data: bytes) -> int | None:
    """The offset where the first ill-formed UTF-8 sequence starts (Unicode table 3-7), by hand."""
    i = 0
    while i < len(data):
        b = data[i]
        if b < 0x80:
            i += 1
            continue
        if 0xC2 <= b <= 0xDF:
            ranges = [(0x80, 0xBF)]
        elif b == 0xE0:
            ranges = [(0xA0, 0xBF), (0x80, 0xBF)]
        elif 0xE1 <= b <= 0xEC or 0xEE <= b <= 0xEF:
            ranges = [(0x80, 0xBF), (0x80, 0xBF)]
        elif b == 0xED:
            ranges = [(0x80, 0x9F), (0x80, 0xBF)]
        elif b == 0xF0:
            ranges = [(0x90, 0xBF), (0x80, 0xBF), (0x80, 0xBF)]
        elif 0xF1 <= b <= 0xF3:
            ranges = [(0x80, 0xBF)] * 3
        elif b == 0xF4:
            ranges = [(0x80, 0x8F), (0x80, 0xBF), (0x80, 0xBF)]
        else:
            return i
        following = data[i + 1 : i + 1 + len(ranges)]
        if len(following) < len(ranges):
            return i
        if any(not lo <= c <= hi for c, (lo, hi) in zip(following, ranges, strict=True)):
            return i
        i += 1 + len(ranges)
    return None


def _random_text_then_bytes(seed: int) -> bytes:
    rng = random.Random(seed)
    text = "".join(rng.choice(DOCS) + " " for _ in range(rng.randint(50, 200))).encode()
    return text + rng.randbytes(100_000)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("gz", [False, True])
def test_undecodable_text_names_the_file_and_byte_offset(tmp_path: Path, seed: int, gz: bool) -> None:
    raw = _random_text_then_bytes(seed)
    expected = _first_invalid_utf8(raw)
    assert expected is not None and raw[:expected].decode("utf-8")
    path = tmp_path / ("noise.txt.gz" if gz else "noise.txt")
    path.write_bytes(gzip.compress(raw) if gz else raw)
    where = " of the decompressed stream" if gz else ""
    _one_line_error(
        lambda: _prepare(path, tmp_path / "cache"),
        f"data.source={str(path)!r}: {path.name} is not UTF-8 text: byte {expected}{where} (0x{raw[expected]:02x})",
        "fix the file, or set --data.decode_errors replace to replace undecodable bytes with U+FFFD",
    )


@pytest.mark.parametrize("gz", [False, True])
def test_a_bad_byte_in_jsonl_is_reported_at_its_file_offset(tmp_path: Path, gz: bool) -> None:
    lines = [_jsonl([DOCS[1]]), _jsonl([DOCS[2]]), b'{"text": "ab\xe2\x82 cd"}\n', _jsonl([DOCS[0]])]
    raw = b"".join(lines)
    expected = len(lines[0]) + len(lines[1]) + lines[2].index(b"\xe2")
    assert _first_invalid_utf8(raw) == expected
    root = tmp_path / "dir"
    (root / "sub").mkdir(parents=True)
    path = root / "sub" / ("docs.jsonl.gz" if gz else "docs.jsonl")
    path.write_bytes(gzip.compress(raw) if gz else raw)
    _one_line_error(
        lambda: _prepare(root, tmp_path / "cache"),
        f"data.source={str(root)!r}: sub/{path.name} line 3 is not UTF-8 text: byte {expected}",
        "(0xe2) does not decode",
    )


class _SpanCounter:
    """A codec error handler that replaces like "replace" and adds up the lengths of the spans it replaces."""

    def __init__(self) -> None:
        self.bytes = 0
        codecs.register_error("count-spans-for-test", self)

    def __call__(self, err: UnicodeDecodeError) -> tuple[str, int]:
        self.bytes += err.end - err.start
        return "\ufffd", err.end


def test_replace_gives_the_old_text_and_counts_the_bytes(tmp_path: Path, capsys) -> None:
    root = tmp_path / "data"
    root.mkdir()
    # (no \r: .txt line ends are read as in text mode, see the next test)
    noise = _random_text_then_bytes(3)[:20_000].replace(b"\r", b" ")
    bad_jsonl = b'{"text": "a\xffb"}\n{"text": "ok \xc3\xa9"}\n'
    (root / "a.txt").write_bytes(noise)
    (root / "b.jsonl").write_bytes(bad_jsonl)
    (root / "c.txt").write_text(DOCS[1])  # clean: not counted
    counter = _SpanCounter()
    expected_text = noise.decode("utf-8", errors="count-spans-for-test")
    assert expected_text == noise.decode("utf-8", errors="replace")
    bad_jsonl.decode("utf-8", errors="count-spans-for-test")
    assert counter.bytes > 1000

    source = resolve_source(str(root), "text", decode_errors="replace")
    logs: list[str] = []
    files = token_files(tmp_path / "cache", source, None, 0.0, byte_tokenizer(), logs.append)
    expected = expected_text.encode() + b"\n\n" + "a\ufffdb".encode() + b"\n\nok \xc3\xa9\n\n" + DOCS[1].encode()
    assert np.fromfile(files.train, dtype=np.uint8).tobytes() == expected + b"\n\n"
    note = (
        f"moe-train: note: data.decode_errors=replace: {counter.bytes} undecodable bytes in 2 files replaced by U+FFFD"
    )
    assert logs[-1] == note and sum("note:" in line for line in logs) == 1
    # the default log prints it to stderr; a cache hit reads nothing and says nothing
    token_files(tmp_path / "other-cache", source, None, 0.0, byte_tokenizer(), log_to_stderr)
    assert note in capsys.readouterr().err
    token_files(tmp_path / "other-cache", source, None, 0.0, byte_tokenizer(), log_to_stderr)
    assert capsys.readouterr().err == ""
    # strict, the same source stops at the first file's first bad byte
    _one_line_error(
        lambda: _prepare(root, tmp_path / "strict-cache"),
        f"a.txt is not UTF-8 text: byte {_first_invalid_utf8(noise)} ",
    )


def test_replace_keeps_text_mode_line_ends(tmp_path: Path) -> None:
    """Earlier versions read .txt in text mode: \\r\\n and \\r became \\n. Replace mode (and strict, on good text)
    gives that same text, so their token caches stay valid."""
    raw = b"one\r\ntwo\rthree\xff\r\nfour\n"
    path = tmp_path / "crlf.txt"
    path.write_bytes(raw)
    with open(path, encoding="utf-8", errors="replace") as file:  # what every earlier version read
        old = file.read()
    files = token_files(
        tmp_path / "cache", resolve_source(str(path), "text", decode_errors="replace"), None, 0.0, byte_tokenizer()
    )
    assert np.fromfile(files.train, dtype=np.uint8).tobytes() == old.encode() + b"\n\n"


def test_decode_errors_must_be_strict_or_replace() -> None:
    assert load_config("tiny").data.decode_errors == "strict"
    assert load_config("tiny", {"data.decode_errors": "replace"}).data.decode_errors == "replace"
    _one_line_error(
        lambda: load_config("tiny", {"data.decode_errors": "ignore"}),
        "data.decode_errors='ignore': must be strict",
    )
    _one_line_error(lambda: resolve_source("x.txt", "text", decode_errors="bogus"), "data.decode_errors='bogus'")


def test_a_from_hf_config_json_linked_from_outside_is_refused(tmp_path: Path) -> None:
    from moe_train.config import ConfigError, load_config

    outside = tmp_path / "config.json"
    outside.write_text("{}")
    checkpoint = tmp_path / "model"
    checkpoint.mkdir()
    (checkpoint / "config.json").symlink_to(outside)
    with pytest.raises(ConfigError, match="config.json leads outside the checkpoint directory"):
        load_config("tiny", {"model.from_hf": str(checkpoint)})


def test_a_tokenizer_config_naming_files_outside_is_refused(tmp_path: Path) -> None:
    """transformers opens the files tokenizer_config.json names (vocab_file, merges_file...) as given, absolute paths
    included: a BERT tokenizer directory whose config names a vocabulary elsewhere used to read it."""
    secret = tmp_path / "outside_vocab.txt"
    secret.write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\nsecret\n")
    tok = tmp_path / "tok"
    tok.mkdir()
    config = {"tokenizer_class": "BertTokenizer", "vocab_file": str(secret), "unk_token": "[UNK]"}
    (tok / "tokenizer_config.json").write_text(json.dumps(config))
    _one_line_error(
        lambda: load_tokenizer(str(tok)), f"tokenizer_config.json's vocab_file={str(secret)!r} names a file outside"
    )
    config["vocab_file"] = "../outside_vocab.txt"
    (tok / "tokenizer_config.json").write_text(json.dumps(config))
    _one_line_error(lambda: load_tokenizer(str(tok)), "vocab_file='../outside_vocab.txt' names a file outside")


def test_a_folder_named_snapshots_outside_the_hub_cache_is_not_exempt(tmp_path: Path) -> None:
    """Only a hub cache's repository folder (models--, datasets--, spaces--) lets a snapshot link into ``../../``."""
    data = tmp_path / "home" / "snapshots" / "ds"
    data.mkdir(parents=True)
    (data / "a.txt").write_text(DOCS[0])
    (tmp_path / "home" / "creds.txt").write_text("secret")
    (data / "b.txt").symlink_to(tmp_path / "home" / "creds.txt")  # inside "home", the folder above snapshots/
    _one_line_error(lambda: resolve_source(str(data), "text"), "entry 'b.txt' is a symlink to", "outside the directory")
    hub = tmp_path / "models--org--name" / "snapshots" / "rev"
    hub.mkdir(parents=True)
    (hub.parent.parent / "blobs").mkdir()
    (hub.parent.parent / "blobs" / "0123").write_text(DOCS[0])
    (hub / "a.txt").symlink_to(hub.parent.parent / "blobs" / "0123")
    assert resolve_source(str(hub), "text").files == (hub / "a.txt",)


@pytest.mark.parametrize("mode", ["strict", "replace"])
def test_unpaired_surrogate_escapes_in_jsonl(tmp_path: Path, mode: str) -> None:
    """``"\\udc80"`` is valid JSON but no text: it used to crash the byte tokenizer with a UnicodeEncodeError."""
    path = tmp_path / "s.jsonl"
    path.write_text('{"text": "ok"}\n{"text": "abc \\udc80 def"}\n')
    if mode == "strict":
        _one_line_error(lambda: _prepare(path, tmp_path / "cache"), "s.jsonl line 2 holds an unpaired surrogate")
        return
    files = _prepare(path, tmp_path / "cache", decode_errors="replace")
    tokens = np.fromfile(files.train.path, dtype=np.uint8).tobytes()
    assert "abc \ufffd def".encode() in tokens


def test_a_strict_run_does_not_reuse_what_replace_built(tmp_path: Path) -> None:
    path = tmp_path / "bad.txt"
    path.write_bytes(b"good text \xff more text " * 20)
    _prepare(path, tmp_path / "cache", decode_errors="replace")
    _one_line_error(lambda: _prepare(path, tmp_path / "cache"), "bad.txt is not UTF-8 text: byte 10")
