"""Conversations (data.format chat / prompt_completion) tokenised once into a cache entry, as moe_train.packing does
for text: per split, the tokens (the tokenizer's smallest dtype), a uint8 "labelled" mask, each conversation's end
offset, and the (file, record number) it came from, so that a later error can name the record.

The key covers what decides the content without reading it: the sources' paths, sizes and modification times, the
format, the fields, the template's text and special tokens, the tokenizer's files and end-of-text id, data.loss_on and
data.decode_errors. Lengths are not filtered here (data.seq_len and data.truncation apply when the entry is read), so
one entry serves every window length. Under data.bad_records=error the build stops at the first bad record and writes
nothing; under skip the entry records the counts and the first one's message, and a later run with error raises that.
Written aside and renamed into place, under a file lock, as moe_train.packing's entries are.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np

from moe_train.config import ConfigError
from moe_train.conversation_tokens import Encoder
from moe_train.conversations import NOT_OBJECT, BadRecord
from moe_train.packing import SUFFIXES, entry_name, exclusive, publish_entry
from moe_train.sources import Record, Source, iter_records, record_where, source_key

FORMAT_VERSION = 1
META = "meta.json"
BATCH_RECORDS = 512  # records per encode call: enough for the tokenizer's threads, little memory


@dataclass(frozen=True)
class RecordFormat:
    """How records become the encoder's items."""

    # a record's value as messages, or a (prompt, completion) pair; BadRecord when it is not one
    parse: Callable[[dict[str, Any]], Any]
    key: dict[str, Any]  # what decides ``parse``, for the cache key
    columns: tuple[str, ...]  # the fields Parquet and datasets read
    need_all: bool  # a columnar file must have all of ``columns``, else one of them
    missing: Callable[
        [Source, str, list[str]], ConfigError
    ]  # the error for a file without them: (source, where, fields)


@dataclass(frozen=True)
class Split:
    """One split's conversations: conversation ``i`` is ``tokens[starts[i] : starts[i] + lengths[i]]``."""

    tokens: np.ndarray
    labelled: np.ndarray  # uint8, 1 where the token is one the model learns to produce
    starts: np.ndarray  # int64
    lengths: np.ndarray  # int64
    records: np.ndarray  # int64 (conversations, 2): the source file's index and the record's number in it
    source: Source

    def __len__(self) -> int:
        return len(self.lengths)

    def where(self, index: int) -> str:
        file_index, number = self.records[index]
        return f"{self.source.describe()}: {record_where(self.source, int(file_index), int(number))}"

    def take(self, keep: slice | np.ndarray) -> Split:
        return Split(self.tokens, self.labelled, self.starts[keep], self.lengths[keep], self.records[keep], self.source)


@dataclass(frozen=True)
class ConversationEntry:
    directory: Path
    meta: dict[str, Any]
    train: Split
    valid: Split | None  # data.valid_source's; data.valid_fraction's is cut from train by the reader

    @property
    def skipped(self) -> dict[str, int]:
        return dict(self.meta["skipped"])


def cache_key(train: Source, valid: Source | None, encoder: Encoder, records: RecordFormat) -> str:
    payload = {
        "format": FORMAT_VERSION,
        "kind": "conversations",
        "train": source_key(train),
        "valid": source_key(valid) if valid is not None else None,
        "decode_errors": train.decode_errors,
        **encoder.key(),
        **records.key,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def conversation_entry(
    cache_dir: Path,
    train: Source,
    valid: Source | None,
    encoder: Encoder,
    records: RecordFormat,
    bad_records: str,
    log: Callable[[str], None] | None = None,
) -> ConversationEntry:
    """The entry for these sources, built first when there is none."""
    key = cache_key(train, valid, encoder, records)
    entry = cache_dir / f"chat-{entry_name(train, key)}"
    if not (entry / META).is_file():
        cache_dir.mkdir(parents=True, exist_ok=True)
        with exclusive(cache_dir / f".{entry.name}.lock"):
            if not (entry / META).is_file():  # another rank may have built it while this one waited
                _build_entry(entry, key, train, valid, encoder, records, bad_records, log)
    found = _read_entry(entry, train, valid)
    if bad_records == "error" and found.meta["skipped"]:
        raise ConfigError(found.meta["first_skipped"])
    return found


def _build_entry(
    entry: Path,
    key: str,
    train: Source,
    valid: Source | None,
    encoder: Encoder,
    form: RecordFormat,
    bad_records: str,
    log: Callable[[str], None] | None,
) -> None:
    started = time.perf_counter()
    if log is not None:
        log(f"moe-train: tokenising {train.describe()} (data.tokenizer={encoder.tokenizer.name!r}) into {entry}")
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.tmp", dir=entry.parent))
    skipped: Counter[str] = Counter()
    first: list[str] = []
    try:
        splits = {}
        for name, source in (("train", train), ("valid", valid)):
            if source is None:
                continue
            records = iter_records(source, form.columns, partial(form.missing, source), form.need_all)
            splits[name] = _write_split(tmp, name, source, records, encoder, form.parse, bad_records, skipped, first)
        hasher = hashlib.sha256(f"{FORMAT_VERSION} conversations {encoder.tokenizer.dtype.name}".encode())
        for path in sorted(tmp.iterdir()):  # what the run reads: equal for equal data, wherever it is cached
            with open(path, "rb") as file:
                hasher.update(path.name.encode() + hashlib.file_digest(file, "sha256").digest())
        meta = {
            "format": FORMAT_VERSION,
            "key": key,
            "fingerprint": hasher.hexdigest(),
            "dtype": encoder.tokenizer.dtype.name,
            "tokenizer": encoder.tokenizer.name,
            **splits,
            "skipped": dict(sorted(skipped.items())),
            "first_skipped": first[0] if first else "",
        }
        (tmp / META).write_text(json.dumps(meta, indent=2))
        publish_entry(tmp, entry)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if log is not None:
        counts = ", ".join(f"{n} conversations from {name}" for name, n in _counts(splits))
        gone = ", ".join(f"{n} {reason}" for reason, n in sorted(skipped.items()))
        log(
            f"moe-train: {counts}"
            + (f" (skipped {gone})" if gone else "")
            + f" in {time.perf_counter() - started:.1f}s"
        )


def _counts(splits: dict[str, dict[str, Any]]) -> Iterator[tuple[str, int]]:
    for name, split in splits.items():
        yield ("data.source" if name == "train" else "data.valid_source"), split["conversations"]


def _write_split(
    directory: Path,
    name: str,
    source: Source,
    records: Iterator[Record],
    encoder: Encoder,
    parse: Callable[[dict[str, Any]], Any],
    bad_records: str,
    skipped: Counter[str],
    first: list[str],
) -> dict[str, Any]:
    """Append the split's conversations to its files; count (or raise, data.bad_records=error) its bad records."""
    dtype = encoder.tokenizer.dtype
    total, labels, ends, places = 0, 0, [], []
    with (
        open(directory / f"{name}.tokens{SUFFIXES[dtype]}", "wb") as tokens_file,
        open(directory / f"{name}.labelled.u8", "wb") as labelled_file,
    ):
        while batch := list(islice(records, BATCH_RECORDS)):
            items, kept = [], []
            for record in batch:
                try:
                    items.append(_parsed(record, parse))
                    kept.append(record)
                except BadRecord as bad:
                    _bad(source, record, bad, bad_records, skipped, first)
            for record, encoded in zip(kept, encoder.encode(items), strict=True):
                if isinstance(encoded, BadRecord):
                    _bad(source, record, encoded, bad_records, skipped, first)
                    continue
                ids, labelled = encoded
                if ids.min() < 0 or ids.max() >= encoder.tokenizer.vocab_size:
                    raise ValueError(f"tokenizer {encoder.tokenizer.name!r} produced ids outside its vocabulary")
                ids.astype(dtype).tofile(tokens_file)
                labelled.tofile(labelled_file)
                total += len(ids)
                labels += int(labelled[1:].sum())
                ends.append(total)
                places.append((record.file_index, record.number))
    if not ends:
        gone = ", ".join(f"{n} {reason}" for reason, n in sorted(skipped.items()))
        raise ConfigError(
            f"{source.describe()}: no usable conversation"
            + (f" (data.bad_records=skip skipped {gone})" if gone else " (no records)")
            + "; fix the records or name other data"
        )
    np.asarray(ends, dtype=np.int64).tofile(directory / f"{name}.ends.i64")
    np.asarray(places, dtype=np.int64).reshape(-1, 2).tofile(directory / f"{name}.records.i64")
    return {"source": source.spec, "conversations": len(ends), "tokens": total, "labels": labels}


def _parsed(record: Record, parse: Callable[[dict[str, Any]], Any]) -> Any:
    if record.error:
        raise BadRecord(NOT_OBJECT, f"is {record.error}; fix the line")
    if not isinstance(record.value, dict):
        raise BadRecord(NOT_OBJECT, f"is a JSON {type(record.value).__name__}, not an object; fix the line")
    return parse(record.value)


def _bad(
    source: Source, record: Record, bad: BadRecord, bad_records: str, skipped: Counter[str], first: list[str]
) -> None:
    message = (
        f"{source.describe()}: {record_where(source, record.file_index, record.number)}: {bad.message} "
        "(or set --data.bad_records skip to count and skip such records)"
    )
    if bad_records == "error":
        raise ConfigError(message)
    skipped[bad.reason] += 1
    if not first:
        first.append(message)


def _read_entry(entry: Path, train: Source, valid: Source | None) -> ConversationEntry:
    meta = json.loads((entry / META).read_text())
    dtype = np.dtype(meta["dtype"])

    def split(name: str, source: Source) -> Split:
        ends = np.fromfile(entry / f"{name}.ends.i64", dtype=np.int64)
        starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
        return Split(
            tokens=np.memmap(entry / f"{name}.tokens{SUFFIXES[dtype]}", dtype=dtype, mode="r"),
            labelled=np.memmap(entry / f"{name}.labelled.u8", dtype=np.uint8, mode="r"),
            starts=starts,
            lengths=ends - starts,
            records=np.fromfile(entry / f"{name}.records.i64", dtype=np.int64).reshape(-1, 2),
            source=source,
        )

    return ConversationEntry(
        entry, meta, split("train", train), split("valid", valid) if valid is not None and meta.get("valid") else None
    )
