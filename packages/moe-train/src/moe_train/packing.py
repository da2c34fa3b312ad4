"""Documents to one flat token file: each document's ids followed by the tokenizer's separator, in the
smallest dtype that holds the vocabulary, cached under ``data.cache_dir`` so a second run reads it back instead of
tokenising again.

A cache entry is a directory named by a key over what decides its content without reading it (the sources' paths,
sizes and modification times, ``data.text_field``, the validation split, the tokenizer files' hash, the
separator and FORMAT_VERSION). It is written aside and renamed into place, so a reader only ever sees whole
entries; ranks starting together wait on a file lock while one of them builds, and where the file system has no
locks each builds its own copy and the first rename wins.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from array import array
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moe_train.config import ConfigError
from moe_train.sources import Replaced, Source, iter_documents, source_key
from moe_train.tokenization import Tokenizer

FORMAT_VERSION = 1
META = "meta.json"
SUFFIXES = {np.dtype(np.uint8): ".u8", np.dtype(np.uint16): ".u16", np.dtype(np.uint32): ".u32"}
# documents per encode_batch call, and a bound on their characters: large enough for the tokenizer's threads,
# small enough to keep memory flat
BATCH_DOCUMENTS = 1024
BATCH_CHARS = 8 << 20


@dataclass(frozen=True)
class TokenFiles:
    """A cache entry: the training token file, the validation one (or None) and what was recorded building them."""

    directory: Path
    train: Path
    valid: Path | None
    meta: dict[str, Any]

    @property
    def fingerprint(self) -> str:
        return self.meta["fingerprint"]


def cache_key(train: Source, valid: Source | None, valid_fraction: float, tokenizer: Tokenizer) -> str:
    # data.decode_errors=strict is not part of it (its entries are the ones earlier versions wrote; it gives the same
    # text or stops the build); "replace" is, so that a strict run never reuses an entry whose text was replaced
    payload = {
        "format": FORMAT_VERSION,
        "train": source_key(train),
        "valid": source_key(valid) if valid is not None else None,
        "valid_fraction": valid_fraction,
        "tokenizer": tokenizer.digest,
        "separator": list(tokenizer.separator),
        "dtype": tokenizer.dtype.name,
    }
    if train.decode_errors == "replace":
        payload["decode_errors"] = "replace"
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def entry_name(source: Source, key: str) -> str:
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(source.spec.rstrip("/")).name)[:40] or "data"
    return f"{stem}-{key[:20]}"


def token_files(
    cache_dir: Path,
    train: Source,
    valid: Source | None,
    valid_fraction: float,
    tokenizer: Tokenizer,
    log: Callable[[str], None] | None = None,
) -> TokenFiles:
    """The cache entry for these sources and tokenizer, built first when there is none. ``log`` hears about a
    build, and, with ``data.decode_errors=replace``, how many undecodable bytes it replaced."""
    key = cache_key(train, valid, valid_fraction, tokenizer)
    entry = cache_dir / entry_name(train, key)
    if (entry / META).is_file():
        return _read_entry(entry)
    cache_dir.mkdir(parents=True, exist_ok=True)
    with exclusive(cache_dir / f".{entry.name}.lock"):
        if (entry / META).is_file():  # another rank built it while this one waited
            return _read_entry(entry)
        started = time.perf_counter()
        if log is not None:
            tokens = f"data.tokenizer={tokenizer.name!r}" if tokenizer.name else "byte-level tokens"
            log(f"moe-train: tokenising {train.describe()} ({tokens}) into {entry}")
        tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.tmp", dir=cache_dir))
        replaced = Replaced()
        try:
            meta = _build(tmp, key, train, valid, valid_fraction, tokenizer, replaced)
            publish_entry(tmp, entry)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if log is not None:
            log(
                f"moe-train: {meta['train']['documents']} documents, {meta['train']['tokens']} training tokens"
                + (f", {meta['valid']['tokens']} validation tokens" if meta["valid"] else "")
                + f" in {time.perf_counter() - started:.1f}s"
            )
            if replaced.bytes:
                log(
                    f"moe-train: note: data.decode_errors=replace: {_count(replaced.bytes, 'undecodable byte')} in "
                    f"{_count(replaced.files, 'file')} replaced by U+FFFD"
                )
    return _read_entry(entry)


def publish_entry(tmp: Path, entry: Path) -> None:
    """Rename the built directory ``tmp`` into place as ``entry``; a whole entry already there (another process's
    rename came first) is kept."""
    try:
        os.replace(tmp, entry)
    except OSError:
        if not (entry / META).is_file():
            raise


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" + ("" if number == 1 else "s")


@contextlib.contextmanager
def exclusive(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (released by the OS if the process dies, so it never goes stale)."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): the atomic rename alone keeps entries whole
        yield
        return
    with open(path, "a") as file:
        with contextlib.suppress(OSError):  # file systems without locks: as above
            fcntl.flock(file, fcntl.LOCK_EX)
        yield


def _read_entry(entry: Path) -> TokenFiles:
    meta = json.loads((entry / META).read_text())
    valid = entry / meta["valid"]["file"] if meta["valid"] else None
    return TokenFiles(entry, entry / meta["train"]["file"], valid, meta)


def _batches(documents: Iterable[str]) -> Iterator[list[str]]:
    batch: list[str] = []
    chars = 0
    for doc in documents:
        batch.append(doc)
        chars += len(doc)
        if len(batch) >= BATCH_DOCUMENTS or chars >= BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def pack(documents: Iterable[str], tokenizer: Tokenizer, out: Path) -> array:
    """Write each document's ids and the separator to ``out``; return the end offset of every document."""
    separator = np.asarray(tokenizer.separator, dtype=np.int64)
    ends = array("q")
    total = 0
    with open(out, "wb") as file:
        for batch in _batches(documents):
            pieces = []
            for ids in tokenizer.encode_batch(batch):
                pieces += [np.asarray(ids, dtype=np.int64), separator]
                total += len(ids) + len(separator)
                ends.append(total)
            chunk = np.concatenate(pieces)
            if chunk.size and (chunk.min() < 0 or chunk.max() >= tokenizer.vocab_size):
                raise ValueError(f"tokenizer {tokenizer.name!r} produced ids outside [0, {tokenizer.vocab_size})")
            chunk.astype(tokenizer.dtype).tofile(file)
    return ends


def _empty(source: Source) -> ConfigError:
    field = f" with data.text_field={source.text_field!r}" if source.kind != "stdlib" else ""
    return ConfigError(f"{source.describe()}: empty corpus: no document has any text{field}")


def valid_documents(num_documents: int, valid_fraction: float) -> int:
    """How many of the last documents ``data.valid_fraction`` holds out: round(fraction x documents), at least 1."""
    return max(1, round(valid_fraction * num_documents)) if valid_fraction > 0 else 0


def _build(
    directory: Path,
    key: str,
    train: Source,
    valid: Source | None,
    valid_fraction: float,
    tokenizer: Tokenizer,
    replaced: Replaced | None = None,
) -> dict[str, Any]:
    suffix = SUFFIXES[tokenizer.dtype]
    train_file, valid_file = directory / f"train{suffix}", directory / f"valid{suffix}"
    ends = pack(iter_documents(train, replaced), tokenizer, train_file)
    if not ends:
        raise _empty(train)
    documents, valid_docs = len(ends), 0
    if valid is not None:
        valid_ends = pack(iter_documents(valid, replaced), tokenizer, valid_file)
        if not valid_ends:
            raise _empty(valid)
        valid_docs = len(valid_ends)
    elif valid_fraction > 0:
        valid_docs = valid_documents(documents, valid_fraction)
        if valid_docs >= documents:
            raise ConfigError(
                f"data.valid_fraction={valid_fraction}: holding out {valid_docs} of the {documents} documents leaves "
                "none to train on; lower it or add documents"
            )
        documents -= valid_docs
        _split(train_file, valid_file, ends[documents - 1] * tokenizer.dtype.itemsize)
    files = [train_file] + ([valid_file] if valid_docs else [])
    hasher = hashlib.sha256(f"{FORMAT_VERSION} {tokenizer.dtype.name}".encode())
    for path in files:  # what the run reads, so a copy of the data elsewhere has the same fingerprint
        with open(path, "rb") as file:
            hasher.update(hashlib.file_digest(file, "sha256").digest())
    itemsize = tokenizer.dtype.itemsize
    meta = {
        "format": FORMAT_VERSION,
        "key": key,
        "fingerprint": hasher.hexdigest(),
        "dtype": tokenizer.dtype.name,
        "tokenizer": tokenizer.name,
        "eos_id": tokenizer.eos_id,
        "separator": list(tokenizer.separator),
        "vocab_size": tokenizer.vocab_size,
        "train": {
            "source": train.spec,
            "file": train_file.name,
            "documents": documents,
            "tokens": train_file.stat().st_size // itemsize,
        },
        "valid": {
            "source": valid.spec if valid is not None else f"the last {valid_docs} documents of {train.spec}",
            "file": valid_file.name,
            "documents": valid_docs,
            "tokens": valid_file.stat().st_size // itemsize,
        }
        if valid_docs
        else None,
    }
    (directory / META).write_text(json.dumps(meta, indent=2))
    return meta


def _split(train_file: Path, valid_file: Path, at_byte: int) -> None:
    """Move the bytes of ``train_file`` from ``at_byte`` on into ``valid_file``."""
    with open(train_file, "rb") as src, open(valid_file, "wb") as dst:
        src.seek(at_byte)
        shutil.copyfileobj(src, dst, 16 << 20)
    os.truncate(train_file, at_byte)


def log_to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
