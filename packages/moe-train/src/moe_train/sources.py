"""Where training text comes from: the ``data.source`` (and ``data.valid_source``) a user names, resolved to a
list of files and read as a stream of documents.

A source is ``stdlib`` (the Python standard library's source files), one file (``.txt``: the whole file is one
document; ``.jsonl``: one JSON object per line, its ``data.text_field`` is one document; ``.parquet``: one row per
document, same field; ``.txt.gz`` / ``.jsonl.gz`` are read through gzip; text is read as UTF-8, undecodable
bytes become U+FFFD), a directory of such files (found
recursively, in sorted order of their relative paths; other files are skipped), or a dataset saved with HuggingFace
``datasets``' ``save_to_disk`` (a ``DatasetDict`` gives its ``train`` split). Empty documents (and null fields)
are skipped: they would only add a separator.
"""

from __future__ import annotations

import gzip
import json
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from moe_train.config import ConfigError

STDLIB = "stdlib"
# suffix -> format; the longest suffix wins (".jsonl.gz" before ".gz")
FORMATS = {
    ".txt": "text",
    ".txt.gz": "text",
    ".jsonl": "jsonl",
    ".jsonl.gz": "jsonl",
    ".ndjson": "jsonl",
    ".parquet": "parquet",
}
HF_DATASET = "hf_dataset"
# the files save_to_disk writes next to its .arrow shards
HF_DATASET_MARKERS = ("dataset_info.json", "state.json")
HF_DATASET_DICT_MARKER = "dataset_dict.json"
READ_BATCH_ROWS = 1024


@dataclass(frozen=True)
class Source:
    """A resolved source. ``field`` is the config key it came from, for error messages."""

    field: str  # "data.source" | "data.valid_source"
    spec: str  # as the user wrote it
    kind: str  # "stdlib" | "files" | "hf_dataset"
    files: tuple[Path, ...]  # the documents' files, in reading order (for hf_dataset: the split's directory files)
    text_field: str
    hf_dir: Path | None = None  # the Dataset's directory (a DatasetDict's train split)

    def describe(self) -> str:
        return f"{self.field}={self.spec!r}"


def stdlib_sources() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    # site-packages lives under the stdlib on some layouts; it is not the standard library
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts)


def _format(path: Path) -> str | None:
    name = path.name.lower()
    matches = [suffix for suffix in FORMATS if name.endswith(suffix)]
    return FORMATS[max(matches, key=len)] if matches else None


def _known() -> str:
    return ", ".join(s for s in FORMATS if not s.endswith(".gz")) + " (and .gz of .txt/.jsonl)"


def _hf_split_dir(path: Path, field: str, spec: str) -> Path | None:
    """The directory of the Dataset ``save_to_disk`` wrote at ``path``, or None when it is not one."""
    if all((path / marker).is_file() for marker in HF_DATASET_MARKERS):
        return path
    if (path / HF_DATASET_DICT_MARKER).is_file():
        try:
            splits = json.loads((path / HF_DATASET_DICT_MARKER).read_text())["splits"]
        except (ValueError, KeyError, OSError):
            splits = sorted(p.name for p in path.iterdir() if p.is_dir())
        if "train" not in splits:
            raise ConfigError(
                f"{field}={spec!r}: this DatasetDict has no 'train' split (splits: {', '.join(splits)}); "
                f"point {field} at the split's directory, e.g. {path / splits[0]}"
                if splits
                else f"{field}={spec!r}: this DatasetDict has no splits"
            )
        return path / "train"
    return None


def resolve_source(spec: str, text_field: str, field: str = "data.source") -> Source:
    """The files behind ``spec``; a missing path, an unknown format or a directory without data is a
    :class:`ConfigError` naming ``field``."""
    if spec == STDLIB:
        return Source(field, spec, STDLIB, tuple(stdlib_sources()), text_field)
    path = Path(spec).expanduser()
    if not path.exists():
        raise ConfigError(
            f"{field}={spec!r}: no such file or directory; give a {_known()} file, a directory of them, "
            f"a datasets save_to_disk directory, or 'stdlib'"
        )
    if path.is_dir():
        split = _hf_split_dir(path, field, spec)
        if split is not None:
            files = tuple(sorted(p for p in split.rglob("*") if p.is_file()))
            return Source(field, spec, HF_DATASET, files, text_field, hf_dir=split)
        # hidden files and directories (.git, .DS_Store, editors' backups) are never data
        found = sorted(
            (p for p in path.rglob("*") if p.is_file() and _format(p) is not None),
            key=lambda p: p.relative_to(path).as_posix(),
        )
        found = [p for p in found if not any(part.startswith(".") for part in p.relative_to(path).parts)]
        if not found:
            raise ConfigError(f"{field}={spec!r}: empty corpus: the directory holds no {_known()} files")
        return Source(field, spec, "files", tuple(found), text_field)
    if _format(path) is None:
        raise ConfigError(f"{field}={spec!r}: unknown format {path.suffix or '(no suffix)'!r}; use {_known()}")
    return Source(field, spec, "files", (path,), text_field)


def source_key(source: Source) -> list[object]:
    """What identifies the source's content without reading it: its files' paths, sizes and modification times
    (and the text field), for the token cache's key."""
    entries: list[object] = [source.kind, source.text_field]
    for path in source.files:
        stat = path.stat()
        entries.append([str(path.resolve()), stat.st_size, stat.st_mtime_ns])
    return entries


def iter_documents(source: Source) -> Iterator[str]:
    """The source's non-empty documents, in a fixed order."""
    if source.kind == HF_DATASET:
        assert source.hf_dir is not None
        yield from (doc for doc in _hf_documents(source, source.hf_dir) if doc)
        return
    for path in source.files:
        fmt = "python" if source.kind == STDLIB else _format(path)
        if fmt == "python":
            try:  # unreadable files (permissions, broken links) are skipped, as stdlib_token_file does
                text = path.read_bytes().decode("utf-8", errors="replace")
            except OSError:
                continue
            docs: Iterator[str | None] = iter([text])
        elif fmt == "text":
            with _open_text(path) as file:
                docs = iter([file.read()])
        elif fmt == "jsonl":
            docs = _jsonl_documents(source, path)
        else:
            docs = _parquet_documents(source, path)
        yield from (doc for doc in docs if doc)  # None: a null field, read as an empty document


def _open_text(path: Path) -> IO[str]:
    # undecodable bytes become U+FFFD rather than stopping a long build at one bad file
    if path.name.lower().endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8", errors="replace")
    return open(path, encoding="utf-8", errors="replace")


def _missing_field(source: Source, where: str, fields: list[str]) -> ConfigError:
    return ConfigError(
        f"data.text_field={source.text_field!r}: {where} has no such field (fields: {', '.join(fields) or 'none'}); "
        f"set data.text_field to the one holding the text ({source.describe()})"
    )


def _text_value(source: Source, value: object, where: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ConfigError(
            f"data.text_field={source.text_field!r}: {where} holds {type(value).__name__}, not text; "
            f"set data.text_field to a string field ({source.describe()})"
        )
    return value


def _jsonl_documents(source: Source, path: Path) -> Iterator[str | None]:
    with _open_text(path) as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"{path.name} line {number}"
            try:
                record = json.loads(line)
            except ValueError as err:
                raise ConfigError(f"{source.describe()}: {where} is not JSON ({err})") from None
            if not isinstance(record, dict):
                raise ConfigError(f"{source.describe()}: {where} is a JSON {type(record).__name__}, not an object")
            if source.text_field not in record:
                raise _missing_field(source, where, list(record))
            yield _text_value(source, record[source.text_field], where)


def _parquet_documents(source: Source, path: Path) -> Iterator[str | None]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises ArrowInvalid / OSError subclasses for files that are not Parquet
        raise ConfigError(f"{source.describe()}: {path.name} is not a Parquet file ({err})") from None
    names = parquet.schema_arrow.names
    if source.text_field not in names:
        raise _missing_field(source, path.name, names)
    row = 0
    for batch in parquet.iter_batches(batch_size=READ_BATCH_ROWS, columns=[source.text_field]):
        for value in batch.column(0).to_pylist():
            row += 1
            yield _text_value(source, value, f"{path.name} row {row}")


def _hf_documents(source: Source, split_dir: Path) -> Iterator[str | None]:
    # load_from_disk reads local Arrow files; the variables keep anything datasets may do on import off the network
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import datasets

    try:
        dataset = datasets.load_from_disk(str(split_dir))
    except Exception as err:  # datasets raises FileNotFoundError, ValueError, ArrowInvalid... for broken saves
        raise ConfigError(f"{source.describe()}: not a readable datasets save_to_disk directory ({err})") from None
    if isinstance(dataset, datasets.DatasetDict):  # a DatasetDict nested in a split: not something save_to_disk writes
        raise ConfigError(f"{source.describe()}: {split_dir} holds a DatasetDict; point at one split's directory")
    if source.text_field not in dataset.column_names:
        raise _missing_field(source, f"the dataset at {split_dir}", dataset.column_names)
    row = 0
    columns = dataset.select_columns([source.text_field]).with_format("arrow")
    for table in columns.iter(batch_size=READ_BATCH_ROWS):
        for value in table.column(0).to_pylist():
            row += 1
            yield _text_value(source, value, f"row {row}")
