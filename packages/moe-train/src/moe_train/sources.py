"""Where training text comes from: the ``data.source`` (and ``data.valid_source``) a user names, resolved to a
list of files and read as a stream of documents.

A source is ``stdlib`` (the Python standard library's source files), one file (``.txt``: the whole file is one
document; ``.jsonl``: one JSON object per line, its ``data.text_field`` is one document; ``.parquet``: one row per
document, same field; ``.txt.gz`` / ``.jsonl.gz`` are read through gzip, a truncated or corrupt one is refused), a
directory of such files (found recursively, in sorted order of their relative paths; other files are skipped), or a
dataset saved with HuggingFace ``datasets``' ``save_to_disk`` (a ``DatasetDict`` gives its ``train`` split). Empty
documents (and null fields) are skipped: they would only add a separator.

Text (.txt, .jsonl and their .gz) is UTF-8: a byte that does not decode stops the build with the file and its byte
offset, unless ``data.decode_errors=replace``, which turns each undecodable run of bytes into U+FFFD (exactly
``bytes.decode("utf-8", errors="replace")``; .txt line ends ``\r\n`` / ``\r`` read as ``\n``, as they always
were) and counts the bytes replaced. Parquet and ``datasets`` strings are UTF-8 already (Arrow checks them).

Chat and prompt/completion data (``data.format``) read whole records instead (:func:`iter_records`): JSONL lines,
Parquet and ``datasets`` rows, each with its place for error messages.

A directory's files, and the files a ``save_to_disk`` directory names, must lie inside it: a symlink or a
``state.json`` entry leading out of it is refused (a single file named as the source may be anywhere).
"""

from __future__ import annotations

import gzip
import json
import os
import re
import sysconfig
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from moe_models.hf.files import resolve_inside
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
DECODE_ERRORS = ("strict", "replace")  # data.decode_errors
# what surrogateescape makes of each undecodable byte: one per byte of every error span that "replace" replaces
_ESCAPED_BYTE = re.compile(r"[\udc80-\udcff]")
_LONE_SURROGATE = re.compile(r"[\ud800-\udfff]")  # in a decoded str: unpaired (a paired escape decodes to one char)


@dataclass(frozen=True)
class Source:
    """A resolved source. ``field`` is the config key it came from, for error messages."""

    field: str  # "data.source" | "data.valid_source"
    spec: str  # as the user wrote it
    kind: str  # "stdlib" | "files" | "hf_dataset"
    files: tuple[Path, ...]  # the documents' files, in reading order (for hf_dataset: the split's directory files)
    text_field: str
    hf_dir: Path | None = None  # the Dataset's directory (a DatasetDict's train split)
    decode_errors: str = "strict"  # data.decode_errors: what undecodable text is ("strict": an error)

    def describe(self) -> str:
        return f"{self.field}={self.spec!r}"

    def file_name(self, path: Path) -> str:
        """``path`` as the user knows it: relative to the source directory, or the file's name."""
        root = Path(self.spec).expanduser()
        return path.relative_to(root).as_posix() if root.is_dir() and path.is_relative_to(root) else path.name


@dataclass
class Replaced:
    """What ``data.decode_errors=replace`` replaced while reading: undecodable bytes, and the files holding them."""

    bytes: int = 0
    files: int = 0


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


def _outside(field: str, spec: str, what: str, fix: str) -> ConfigError:
    return ConfigError(f"{field}={spec!r}: {what}, outside the directory; {fix}")


def _hf_split_dir(path: Path, field: str, spec: str) -> Path | None:
    """The directory of the Dataset ``save_to_disk`` wrote at ``path``, or None when it is not one."""
    if all((path / marker).is_file() for marker in HF_DATASET_MARKERS):
        return path
    if (path / HF_DATASET_DICT_MARKER).is_file():
        try:
            splits = json.loads((path / HF_DATASET_DICT_MARKER).read_text())["splits"]
        except (ValueError, KeyError, OSError):
            splits = sorted(p.name for p in path.iterdir() if p.is_dir())
        if not isinstance(splits, list) or not all(isinstance(split, str) for split in splits):
            raise ConfigError(
                f"{field}={spec!r}: {HF_DATASET_DICT_MARKER} 'splits' is not a list of names; save the dataset again"
            )
        for split in splits:
            if split in ("", ".", "..") or "/" in split or "\\" in split or resolve_inside(path, split) is None:
                raise ConfigError(
                    f"{field}={spec!r}: {HF_DATASET_DICT_MARKER} names split {split!r}, not a folder inside the "
                    "directory; save the dataset again, or point at a split's own directory"
                )
        if "train" not in splits:
            raise ConfigError(
                f"{field}={spec!r}: this DatasetDict has no 'train' split (splits: {', '.join(splits)}); "
                f"point {field} at the split's directory, e.g. {path / splits[0]}"
                if splits
                else f"{field}={spec!r}: this DatasetDict has no splits"
            )
        return path / "train"
    return None


def _check_hf_files(split: Path, field: str, spec: str) -> None:
    """Every file ``datasets.load_from_disk`` would read for ``split`` (its markers, the data files its state.json
    names) lies inside it: checked before datasets opens any of them."""
    fix = "save the dataset again with save_to_disk"
    for marker in HF_DATASET_MARKERS:
        if resolve_inside(split, marker) is None:
            raise _outside(field, spec, f"{split / marker} leads to {os.path.realpath(split / marker)}", fix)
    try:
        entries = json.loads((split / "state.json").read_text()).get("_data_files", [])
    except (ValueError, OSError, AttributeError):
        return  # not a state.json at all: load_from_disk reports that (as a ConfigError, below)
    for entry in entries if isinstance(entries, list) else [entries]:
        filename = entry.get("filename") if isinstance(entry, dict) else None
        if not isinstance(filename, str):
            raise ConfigError(f"{field}={spec!r}: {split / 'state.json'} has a data file entry {entry!r}; {fix}")
        if resolve_inside(split, filename) is None:
            raise _outside(field, spec, f"{split / 'state.json'} names data file {filename!r}", fix)


def resolve_source(spec: str, text_field: str, field: str = "data.source", decode_errors: str = "strict") -> Source:
    """The files behind ``spec``; a missing path, an unknown format, a directory without data or with files that
    lead out of it is a :class:`ConfigError` naming ``field``. ``decode_errors``: data.decode_errors."""
    if decode_errors not in DECODE_ERRORS:
        raise ConfigError(f"data.decode_errors={decode_errors!r}: must be one of {', '.join(DECODE_ERRORS)}")
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
            _check_hf_files(split, field, spec)
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
        for file in found:
            relative = file.relative_to(path)
            if resolve_inside(path, relative) is None:
                fix = f"copy the file into the directory, or name it directly in {field}"
                what = f"entry {relative.as_posix()!r} is a symlink to {os.path.realpath(file)}"
                raise _outside(field, spec, what, fix)
        return Source(field, spec, "files", tuple(found), text_field, decode_errors=decode_errors)
    if _format(path) is None:
        raise ConfigError(f"{field}={spec!r}: unknown format {path.suffix or '(no suffix)'!r}; use {_known()}")
    return Source(field, spec, "files", (path,), text_field, decode_errors=decode_errors)


def source_key(source: Source) -> list[object]:
    """What identifies the source's content without reading it: its files' paths, sizes and modification times
    (and the text field), for the token cache's key."""
    entries: list[object] = [source.kind, source.text_field]
    for path in source.files:
        stat = path.stat()
        entries.append([str(path.resolve()), stat.st_size, stat.st_mtime_ns])
    return entries


def iter_documents(source: Source, replaced: Replaced | None = None) -> Iterator[str]:
    """The source's non-empty documents, in a fixed order. With ``data.decode_errors=replace``, ``replaced`` (when
    given) counts the undecodable bytes and the files holding them."""
    replaced = replaced if replaced is not None else Replaced()
    if source.kind == HF_DATASET:
        assert source.hf_dir is not None
        yield from (doc for doc in _hf_documents(source, source.hf_dir) if doc)
        return
    for path in source.files:
        fmt = "python" if source.kind == STDLIB else _format(path)
        if fmt == "python":
            try:  # unreadable files (permissions, broken links) are skipped, as stdlib_token_file does
                # replaced silently, whatever data.decode_errors says: a few of the standard library's own test
                # files are deliberately not UTF-8, and the default data must build everywhere, as it always has
                text = path.read_bytes().decode("utf-8", errors="replace")
            except OSError:
                continue
            docs: Iterator[str | None] = iter([text])
        elif fmt == "text":
            before = replaced.bytes
            # universal newlines, as the text-mode reading of earlier versions did (their token caches stay valid)
            text = _decode(source, path, _read_all(source, path), 0, replaced)
            docs = iter([text.replace("\r\n", "\n").replace("\r", "\n")])
            replaced.files += replaced.bytes > before
        elif fmt == "jsonl":
            docs = _jsonl_documents(source, path, replaced)
        else:
            docs = _parquet_documents(source, path)
        yield from (doc for doc in docs if doc)  # None: a null field, read as an empty document


def _gzipped(path: Path) -> bool:
    return path.name.lower().endswith(".gz")


def _gzip_error(source: Source, path: Path, err: Exception) -> ConfigError:
    name = source.file_name(path)
    if isinstance(err, EOFError):
        return ConfigError(
            f"{source.describe()}: {name} ends early (a truncated gzip file?); download or compress it again"
        )
    why = str(err).splitlines()[0] if str(err) else type(err).__name__
    return ConfigError(f"{source.describe()}: {name} is not a valid gzip file ({why}); download or compress it again")


def _read_all(source: Source, path: Path) -> bytes:
    if not _gzipped(path):
        return path.read_bytes()
    try:
        with gzip.open(path, "rb") as file:
            return file.read()
    except (EOFError, gzip.BadGzipFile, zlib.error) as err:
        raise _gzip_error(source, path, err) from None


def _binary_lines(source: Source, path: Path) -> Iterator[bytes]:
    """The lines of ``path``, as bytes (split at b"\\n" only), decompressed for .gz."""
    with gzip.open(path, "rb") if _gzipped(path) else open(path, "rb") as file:
        try:
            yield from file
        except (EOFError, gzip.BadGzipFile, zlib.error) as err:  # raised by reading (the consumer's never reach here)
            raise _gzip_error(source, path, err) from None


def _decode(source: Source, path: Path, data: bytes, offset: int, replaced: Replaced, line: int = 0) -> str:
    """``data`` (which starts at byte ``offset`` of ``path``, on ``line`` if given) as UTF-8, per
    ``source.decode_errors``."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        if source.decode_errors == "strict":
            name = source.file_name(path) + (f" line {line}" if line else "")
            stream = " of the decompressed stream" if _gzipped(path) else ""
            raise ConfigError(
                f"{source.describe()}: {name} is not UTF-8 text: byte {offset + err.start}{stream} "
                f"(0x{data[err.start]:02x}) does not decode ({err.reason}); fix the file, or set "
                "--data.decode_errors replace to replace undecodable bytes with U+FFFD"
            ) from None
    # the bytes "replace" turns into U+FFFD are those surrogateescape turns into U+DC80..U+DCFF, one each
    replaced.bytes += _ESCAPED_BYTE.subn("", data.decode("utf-8", errors="surrogateescape"))[1]
    return data.decode("utf-8", errors="replace")


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


def _jsonl_documents(source: Source, path: Path, replaced: Replaced) -> Iterator[str | None]:
    before, name, offset = replaced.bytes, source.file_name(path), 0
    # lines read as bytes, so that an undecodable byte is reported at its offset in the file (of the decompressed
    # stream for .gz)
    for number, raw in enumerate(_binary_lines(source, path), 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            line = _decode(source, path, raw, offset, replaced, number)
        offset += len(raw)
        if not line.strip():
            continue
        where = f"{name} line {number}"
        try:
            record = json.loads(line)
        except ValueError as err:
            raise ConfigError(f"{source.describe()}: {where} is not JSON ({err})") from None
        if not isinstance(record, dict):
            raise ConfigError(f"{source.describe()}: {where} is a JSON {type(record).__name__}, not an object")
        if source.text_field not in record:
            raise _missing_field(source, where, list(record))
        yield _unescaped_surrogates(source, _text_value(source, record[source.text_field], where), where, replaced)
    replaced.files += replaced.bytes > before


def _unescaped_surrogates(source: Source, text: str | None, where: str, replaced: Replaced) -> str | None:
    """JSON's surrogate escapes (``\\udc80``) decode to lone surrogates, which are not text (no UTF-8 encodes
    them): an error under ``decode_errors=strict``, U+FFFD each (counted with the replaced bytes) under ``replace``."""
    if text is None or not (found := _LONE_SURROGATE.search(text)):
        return text
    if source.decode_errors != "replace":
        raise ConfigError(
            f"{source.describe()}: {where} holds an unpaired surrogate escape (U+{ord(found.group()):04X}, character "
            f"{found.start()} of the text), which is not text; fix the file, or set --data.decode_errors replace to "
            "replace it with U+FFFD"
        )
    text, count = _LONE_SURROGATE.subn("\ufffd", text)
    replaced.bytes += count
    return text


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


def _load_hf_split(source: Source, split_dir: Path):  # -> datasets.Dataset
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
    return dataset


def _hf_documents(source: Source, split_dir: Path) -> Iterator[str | None]:
    dataset = _load_hf_split(source, split_dir)
    if source.text_field not in dataset.column_names:
        raise _missing_field(source, f"the dataset at {split_dir}", dataset.column_names)
    row = 0
    columns = dataset.select_columns([source.text_field]).with_format("arrow")
    for table in columns.iter(batch_size=READ_BATCH_ROWS):
        for value in table.column(0).to_pylist():
            row += 1
            yield _text_value(source, value, f"row {row}")


# ------------------------------------------------------------------------------------------- records (data.format)


@dataclass(frozen=True)
class Record:
    """One record of a chat or prompt/completion source: the ``number``-th (1-based: a JSONL line, a Parquet or
    datasets row) of the source's file ``file_index``. ``value`` is what the line parsed to (a dict when it is a
    record at all); ``error`` says why a JSONL line did not parse."""

    file_index: int
    number: int
    value: object
    error: str = ""


def record_where(source: Source, file_index: int, number: int) -> str:
    """A record's place as a user finds it: "chat.jsonl line 3", "part-0.parquet row 7", "row 7" (datasets)."""
    if source.kind == HF_DATASET:
        return f"row {number}"
    path = source.files[file_index]
    return f"{source.file_name(path)} {'line' if _format(path) == 'jsonl' else 'row'} {number}"


def iter_records(
    source: Source, columns: Sequence[str], missing: Callable[[str, list[str]], ConfigError], need_all: bool = False
) -> Iterator[Record]:
    """Every record of ``source`` (JSONL, Parquet, datasets, .gz), in a fixed order. Columnar files read only those
    of ``columns`` they have; one with none of them (``need_all``: without one of them) is ``missing(where, its
    columns)``, raised. JSONL records keep every key; a line that is not JSON is a Record with ``error`` set; blank
    lines are no records."""

    def present(names: list[str], where: str) -> list[str]:
        found = [c for c in columns if c in names]
        if not found or (need_all and len(found) < len(columns)):
            raise missing(where, names)
        return found

    if source.kind == HF_DATASET:
        assert source.hf_dir is not None
        yield from _hf_records(source, source.hf_dir, present)
        return
    for index, path in enumerate(source.files):
        fmt = _format(path)
        if fmt == "jsonl":
            yield from _jsonl_records(source, index, path)
        elif fmt == "parquet":
            yield from _parquet_records(source, index, path, present)
        else:
            raise ConfigError(
                f"{source.describe()}: {source.file_name(path)} is text, not records; data.format=chat and "
                "prompt_completion read .jsonl, .parquet or datasets save_to_disk directories"
            )


def _jsonl_records(source: Source, index: int, path: Path) -> Iterator[Record]:
    offset = 0
    for number, raw in enumerate(_binary_lines(source, path), 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            line = _decode(source, path, raw, offset, Replaced(), number)
        offset += len(raw)
        if not line.strip():
            continue
        try:
            yield Record(index, number, json.loads(line))
        except ValueError as err:
            yield Record(index, number, None, f"not JSON ({err})")


def _parquet_records(
    source: Source, index: int, path: Path, present: Callable[[list[str], str], list[str]]
) -> Iterator[Record]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises ArrowInvalid / OSError subclasses for files that are not Parquet
        raise ConfigError(f"{source.describe()}: {path.name} is not a Parquet file ({err})") from None
    columns = present(parquet.schema_arrow.names, source.file_name(path))
    number = 0
    for batch in parquet.iter_batches(batch_size=READ_BATCH_ROWS, columns=columns):
        for row in batch.to_pylist():
            number += 1
            yield Record(index, number, row)


def _hf_records(source: Source, split_dir: Path, present: Callable[[list[str], str], list[str]]) -> Iterator[Record]:
    dataset = _load_hf_split(source, split_dir)
    columns = present(dataset.column_names, f"the dataset at {split_dir}")
    number = 0
    for table in dataset.select_columns(columns).with_format("arrow").iter(batch_size=READ_BATCH_ROWS):
        for row in table.to_pylist():
            number += 1
            yield Record(0, number, row)
