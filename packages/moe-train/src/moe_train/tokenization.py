"""Text to token ids: byte-level (the default: ids 0..255, documents separated by a blank line, as the stdlib data
always was) or a local HuggingFace tokenizer (``data.tokenizer``: a ``tokenizer.json`` or a directory holding one;
other tokenizer formats load through ``transformers`` when it is installed), whose end-of-text token separates
documents. Nothing here downloads, and nothing outside the tokenizer's directory is read: a tokenizer file there
that is a symlink leading out of it is refused (a HuggingFace hub cache snapshot's links into its ``blobs`` are
fine)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moe_models.hf.files import containment_root, resolve_inside
from moe_train.config import ConfigError, DataConfig

BYTES = "bytes"  # data.tokenizer value that asks for byte-level ids even with model.from_hf
BYTE_SEPARATOR = b"\n\n"
# end-of-text tokens of the common tokenizer families, tried in this order when the tokenizer's own files name none
COMMON_EOS_TOKENS = ("</s>", "<|endoftext|>", "<eos>", "<|end_of_text|>", "[EOS]")
TOKENIZER_FILE = "tokenizer.json"
# files of a transformers tokenizer directory that decide its ids (a model directory's weights do not)
TOKENIZER_FILE_PATTERNS = ("*token*", "*vocab*", "*merges*", "*.model", "*spiece*")
# the files read besides those: the end-of-text token's configuration (both match "*token*" too)
TOKENIZER_CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")


@dataclass(frozen=True)
class Tokenizer:
    """What packing needs of a tokenizer: ids for a batch of texts, and what follows every document."""

    name: str  # "" for byte level, else the path it was loaded from
    vocab_size: int  # every id it can produce is below this
    eos_id: int | None  # None for byte level, whose documents end with BYTE_SEPARATOR
    separator: tuple[int, ...]  # ids appended after each document
    digest: str  # hash of the files that decide its ids, for the token cache's key
    encode_batch: Callable[[list[str]], list[Sequence[int]]]
    # ids and each id's [start, end) character offsets into its text, with no special tokens added (those written in
    # the text, as a chat template writes them, are read as themselves); None: byte level, or a transformers tokenizer
    # without a fast (Rust) version, which has no offsets
    encode_offsets: Callable[[list[str]], list[tuple[Sequence[int], Sequence[tuple[int, int]]]]] | None = None
    directory: Path | None = None  # where its tokenizer_config.json (chat template, special tokens) would be
    # ids to text, special tokens written out (``moe-train generate``)
    decode: Callable[[Sequence[int]], str] = lambda ids: bytes(ids).decode("utf-8", errors="replace")

    @property
    def dtype(self) -> np.dtype:
        """The smallest unsigned integer type holding every id."""
        for dtype in (np.uint8, np.uint16, np.uint32):
            if self.vocab_size <= np.iinfo(dtype).max + 1:
                return np.dtype(dtype)
        raise ConfigError(f"data.tokenizer={self.name!r}: a vocabulary of {self.vocab_size} ids does not fit 32 bits")


def default_tokenizer(data: DataConfig, model_from_hf: str = "") -> str:
    """The tokenizer a run uses: ``data.tokenizer`` when set, else the ``tokenizer.json`` of the
    ``model.from_hf`` checkpoint when it has one, else "" (byte level). ``data.tokenizer=bytes`` is byte level
    even with a checkpoint."""
    if data.tokenizer == BYTES:
        return ""
    if data.tokenizer:
        return data.tokenizer
    if model_from_hf and (Path(model_from_hf) / TOKENIZER_FILE).is_file():
        if resolve_inside(model_from_hf, TOKENIZER_FILE) is None:
            raise ConfigError(
                f"data.tokenizer='' takes the tokenizer of model.from_hf={model_from_hf!r}, whose {TOKENIZER_FILE} "
                f"leads to {os.path.realpath(Path(model_from_hf) / TOKENIZER_FILE)}, outside that directory; copy the "
                "file into it, or name a tokenizer with data.tokenizer"
            )
        return str(Path(model_from_hf) / TOKENIZER_FILE)
    return ""


def _check_inside(name: str, directory: Path, whole: bool) -> None:
    """The files read from the tokenizer's ``directory`` lie inside it: a symlink out of it is refused before anything
    is read. ``whole``: data.tokenizer names the directory, whose tokenizer files are all checked (transformers reads
    them, and config.json); else it names a tokenizer.json, which may be anywhere, and only the configuration files
    read beside it are checked."""
    candidates = [directory / n for n in TOKENIZER_CONFIG_FILES]
    if whole:
        candidates += [directory / TOKENIZER_FILE, directory / "config.json"]
        candidates += [p for pattern in TOKENIZER_FILE_PATTERNS for p in sorted(directory.glob(pattern))]
    for path in dict.fromkeys(candidates):
        if not (path.exists() or path.is_symlink()):
            continue
        if resolve_inside(directory, path.name) is None:
            raise ConfigError(
                f"data.tokenizer={name!r}: {path.name} leads to {os.path.realpath(path)}, outside the tokenizer "
                f"directory {containment_root(directory)}; copy the file into the directory instead of linking to it"
            )
    for key, named in _files_named_by_config(directory):
        if resolve_inside(directory, named) is None:
            raise ConfigError(
                f"data.tokenizer={name!r}: tokenizer_config.json's {key}={named!r} names a file outside the tokenizer "
                f"directory {containment_root(directory)}; copy the file in and name it relative to the directory"
            )


def _files_named_by_config(directory: Path) -> list[tuple[str, str]]:
    """(key, value) of every file tokenizer_config.json names (``vocab_file``, ``merges_file``, ``tokenizer_file``...:
    any ``*_file`` / ``*_files`` key), which transformers opens as given, absolute paths included."""
    try:
        config = json.loads((directory / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(config, dict):
        return []
    named = []
    for key, value in config.items():
        if isinstance(key, str) and key.endswith(("_file", "_files")):
            values = value if isinstance(value, list) else [value]
            named += [(key, v) for v in values if isinstance(v, str) and v]
    return named


def byte_tokenizer() -> Tokenizer:
    def encode_batch(texts: list[str]) -> list[Sequence[int]]:
        return [np.frombuffer(text.encode("utf-8"), dtype=np.uint8) for text in texts]

    return Tokenizer("", 256, None, tuple(BYTE_SEPARATOR), BYTES, encode_batch)


def _digest(paths: Sequence[Path]) -> str:
    hasher = hashlib.sha256()
    for path in sorted(paths):
        hasher.update(path.name.encode() + b"\0")
        with open(path, "rb") as file:
            hasher.update(hashlib.file_digest(file, "sha256").digest())
    return hasher.hexdigest()


def _token_content(value: Any) -> str | None:
    """An ``eos_token`` entry of tokenizer_config.json / special_tokens_map.json: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _configured_eos(directory: Path) -> str | None:
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = directory / name
        if path.is_file():
            try:
                token = _token_content(json.loads(path.read_text()).get("eos_token"))
            except (ValueError, OSError, AttributeError):
                continue
            if token:
                return token
    return None


def _eos_id(
    name: str, token_to_id: Callable[[str], int | None], eos_token: str, directory: Path, own: int | None = None
) -> int:
    """``data.eos_token``, else the tokenizer's configured end-of-text token, else a common name."""
    if eos_token:
        found = token_to_id(eos_token)
        if found is None:
            raise ConfigError(f"data.eos_token={eos_token!r} is not a token of data.tokenizer={name!r}")
        return found
    configured = _configured_eos(directory)
    if configured is not None and token_to_id(configured) is not None:
        return token_to_id(configured)  # type: ignore[return-value]
    if own is not None:
        return own
    for token in COMMON_EOS_TOKENS:
        found = token_to_id(token)
        if found is not None:
            return found
    raise ConfigError(
        f"data.tokenizer={name!r}: no end-of-text token found (no eos_token in tokenizer_config.json, none of "
        f"{', '.join(COMMON_EOS_TOKENS)}); name the token that separates documents with data.eos_token"
    )


def load_tokenizer(path: str, eos_token: str = "") -> Tokenizer:
    """The tokenizer at ``path`` ("" = byte level). Errors name ``data.tokenizer`` / ``data.eos_token``."""
    if not path:
        if eos_token:
            raise ConfigError(
                f"data.eos_token={eos_token!r} needs data.tokenizer: byte-level data separates documents with a "
                "blank line"
            )
        return byte_tokenizer()
    location = Path(path).expanduser()
    if not location.exists():
        raise ConfigError(f"data.tokenizer={path!r}: no such file or directory; give a tokenizer.json or its directory")
    _check_inside(path, location if location.is_dir() else location.parent, whole=location.is_dir())
    file = location / TOKENIZER_FILE if location.is_dir() else location
    if file.is_file():
        return _load_tokenizers_file(path, file, eos_token)
    return _load_transformers(path, location, eos_token)


def _load_tokenizers_file(name: str, file: Path, eos_token: str) -> Tokenizer:
    import tokenizers

    try:
        tokenizer = tokenizers.Tokenizer.from_file(str(file))
    except Exception as err:  # tokenizers raises plain Exceptions for files it cannot parse
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ConfigError(
            f"data.tokenizer={name!r}: {file.name} is not a HuggingFace tokenizers file ({first})"
        ) from None
    # a saved truncation or padding setting would cut or pad documents; packing wants every token
    tokenizer.no_truncation()
    tokenizer.no_padding()
    eos = _eos_id(name, tokenizer.token_to_id, eos_token, file.parent)
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)  # _fast skips offsets (tokenizers 0.20+)

    def encode_batch(texts: list[str]) -> list[Sequence[int]]:
        # documents get no BOS/EOS from a post-processor: packing adds the separator itself
        return [encoding.ids for encoding in encode(texts, add_special_tokens=False)]

    def encode_offsets(texts: list[str]) -> list[tuple[Sequence[int], Sequence[tuple[int, int]]]]:
        return [(e.ids, e.offsets) for e in tokenizer.encode_batch(texts, add_special_tokens=False)]

    vocab = max(tokenizer.get_vocab_size(with_added_tokens=True), eos + 1)
    return Tokenizer(
        name,
        vocab,
        eos,
        (eos,),
        _digest([file]),
        encode_batch,
        encode_offsets,
        file.parent,
        lambda ids: tokenizer.decode(list(ids), skip_special_tokens=False),
    )


def _load_transformers(name: str, directory: Path, eos_token: str) -> Tokenizer:
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ConfigError(
            f"data.tokenizer={name!r}: no {TOKENIZER_FILE} there (install transformers to load other tokenizer formats)"
        ) from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as err:  # transformers raises OSError, ValueError, KeyError... for directories it cannot read
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ConfigError(f"data.tokenizer={name!r}: not a tokenizer directory ({first})") from None
    tokenizer.model_max_length = 1 << 62  # documents are packed, not fed whole: no warning about their length
    unknown = tokenizer.unk_token_id

    def token_to_id(token: str) -> int | None:
        found = tokenizer.convert_tokens_to_ids(token)
        return None if found is None or (found == unknown and token != tokenizer.unk_token) else found

    eos = _eos_id(name, token_to_id, eos_token, directory, own=tokenizer.eos_token_id)

    def encode_batch(texts: list[str]) -> list[Sequence[int]]:
        return tokenizer(texts, add_special_tokens=False)["input_ids"]

    def encode_offsets(texts: list[str]) -> list[tuple[Sequence[int], Sequence[tuple[int, int]]]]:
        out = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
        return list(zip(out["input_ids"], out["offset_mapping"], strict=True))

    files = [p for pattern in TOKENIZER_FILE_PATTERNS for p in directory.glob(pattern) if p.is_file()]
    vocab = max(len(tokenizer), eos + 1)
    offsets = encode_offsets if tokenizer.is_fast else None
    digest = _digest(list(dict.fromkeys(files)))
    return Tokenizer(
        name, vocab, eos, (eos,), digest, encode_batch, offsets, directory, lambda ids: tokenizer.decode(list(ids))
    )
