"""Read torch.distributed.checkpoint (DCP) checkpoints without unpickling anything but DCP's own metadata.

DCP's ``FileSystemReader.read_metadata`` reads a checkpoint's ``.metadata`` with ``pickle.load``, so a tampered
``.metadata`` runs whatever it names (``os.system``, ...) as soon as ``moe-train export``, ``moe-train quantize`` or
``--run.resume`` opens the checkpoint; and ``DefaultLoadPlanner.load_bytes`` reads each entry the metadata declares
as ``BytesStorageMetadata`` with ``torch.load(weights_only=False)``, another full unpickle. Here:

- :func:`read_metadata` unpickles ``.metadata`` allowing exactly the globals DCP's metadata pickles name (its
  dataclasses, ``torch.Size``, torch dtypes, ``torch.serialization._get_layout`` for ``torch.strided``,
  ``pathlib.PosixPath`` for ``storage_meta.checkpoint_id``), and lets pickle's ``BUILD`` set the state of fresh
  instances of DCP's dataclasses only (it could otherwise set attributes on any object it holds, a class included,
  for the whole process). It refuses ``BytesStorageMetadata`` entries and stream transforms (moe-train writes
  neither), and data files the metadata names that lie outside the checkpoint directory, are missing, or are
  shorter than the metadata says.
- :class:`SafeFileSystemReader` is DCP's ``FileSystemReader`` reading its metadata so. Its ``read_data`` refuses
  byte entries again and leaves tensors to ``FileSystemReader.read_data``, which reads each with
  ``torch.load(weights_only=True)`` (torch 2.4 to 2.15 at least).

Errors are one line: :class:`UnsafeCheckpointError` (tampered with, or not written by DCP: do not use it) and
:class:`DamagedCheckpointError` (unreadable, truncated or missing files). Inside ``dcp.load`` DCP wraps a storage
reader's errors (a ``CheckpointException``; for the metadata an ``AssertionError`` that quotes it): call
:func:`read_metadata` first to get them as they are, and hand its result to the reader so it is not read twice.
"""

from __future__ import annotations

import os
import pathlib
import pickle
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

__all__ = ["DamagedCheckpointError", "SafeFileSystemReader", "UnsafeCheckpointError", "read_metadata"]

TAMPERED = "this checkpoint was not written by torch.distributed.checkpoint, or was tampered with; do not use it"
DAMAGED = "the checkpoint is damaged: resume from an earlier one or copy it again"


class UnsafeCheckpointError(ValueError):
    """A checkpoint asks for something DCP never writes (a global outside the allow-list, pickled bytes, a file
    outside its directory): tampered with, or not DCP's. One line, naming the file."""


class DamagedCheckpointError(ValueError):
    """A checkpoint's metadata is unreadable, or a data file it names is missing or truncated. One line, naming the
    file."""


class _Refused(Exception):
    """What the unpickler refused; :func:`read_metadata` names the file."""


_LAYOUTS = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}


def _layout(name: str) -> torch.layout:
    """``torch.serialization._get_layout`` (how a ``torch.layout`` pickles), limited to a look-up by name."""
    if not isinstance(name, str) or name not in _LAYOUTS:
        raise _Refused(f"refused an unknown torch layout {name!r}")
    return _LAYOUTS[name]


_DCP_TYPES = (
    Metadata,
    TensorStorageMetadata,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    TensorProperties,
    MetadataIndex,
    StorageMeta,
    _StorageInfo,
)
# (module, name) as the pickle names it -> what it stands for
ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {
    **{(cls.__module__, cls.__qualname__): cls for cls in _DCP_TYPES},
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"): _MEM_FORMAT_ENCODING,  # memory_format
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): _layout,
    # storage_meta.checkpoint_id, a Path; Python 3.13 moved PosixPath to pathlib._local
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("pathlib._local", "PosixPath"): pathlib.PosixPath,
    # a dtype pickles as the global torch.<its name>
    **{("torch", v.__reduce__()): v for v in vars(torch).values() if isinstance(v, torch.dtype)},
}
_BUILDABLE = frozenset(_DCP_TYPES)


class RestrictedUnpickler(pickle._Unpickler):
    """An unpickler that resolves only :data:`ALLOWED_GLOBALS` and runs ``BUILD`` only on fresh DCP dataclasses.

    The pure-Python unpickler, because the C one has no hook for ``BUILD``; it is about 1.4 times slower (measured
    on 23 MB of metadata: 10,000 tensors of 16 chunks)."""

    def find_class(self, module: str, name: str) -> Any:
        try:
            return ALLOWED_GLOBALS[(module, name)]
        except (KeyError, TypeError):
            raise _Refused(f"refused to unpickle {f'{module}.{name}'!r} (not a DCP metadata type)") from None

    def _load_build(self) -> None:
        target = self.stack[-2]  # [..., object, state]
        if type(target) not in _BUILDABLE:
            what = f"class {target.__qualname__}" if isinstance(target, type) else f"a {type(target).__qualname__}"
            raise _Refused(f"refused to set attributes of {what} (only new DCP metadata objects are built)")
        super().load_build()

    dispatch: ClassVar[dict[int, Any]] = {**pickle._Unpickler.dispatch, pickle.BUILD[0]: _load_build}


def read_metadata(path: str | os.PathLike[str]) -> Metadata:
    """The DCP metadata of the checkpoint directory ``path`` (its ``.metadata``), unpickled with
    :class:`RestrictedUnpickler` and checked: only tensor entries, and every data file it names inside ``path``,
    present and long enough. :class:`UnsafeCheckpointError` or :class:`DamagedCheckpointError` otherwise."""
    root = Path(path)
    meta_file = root / ".metadata"

    def unsafe(what: str) -> UnsafeCheckpointError:
        return UnsafeCheckpointError(f"{meta_file}: {what}: {TAMPERED}")

    try:
        with open(meta_file, "rb") as f:
            metadata = RestrictedUnpickler(f).load()
    except _Refused as err:
        raise unsafe(str(err)) from None
    except FileNotFoundError:
        raise DamagedCheckpointError(f"{meta_file}: missing: not a DCP checkpoint, or {DAMAGED}") from None
    except Exception as err:  # EOFError, UnpicklingError, or an allowed type given arguments it does not take
        raise DamagedCheckpointError(
            f"{meta_file}: unreadable DCP metadata ({type(err).__name__}: {' '.join(str(err).split())}): {DAMAGED}"
        ) from None
    if type(metadata) is not Metadata:
        raise unsafe(f"holds a {type(metadata).__qualname__}, not DCP metadata")
    if not isinstance(metadata.state_dict_metadata, dict) or not isinstance(metadata.storage_data, dict):
        raise unsafe("malformed DCP metadata (state_dict_metadata and storage_data must be dicts)")
    if not isinstance(metadata.storage_meta, StorageMeta | None):
        raise unsafe("malformed DCP metadata (storage_meta)")
    for key, entry in metadata.state_dict_metadata.items():
        if type(entry) is BytesStorageMetadata:
            raise unsafe(
                f"entry {key!r} is pickled bytes (BytesStorageMetadata), which DCP would read with a full "
                "unpickle and which moe-train checkpoints never hold"
            )
        if type(entry) is not TensorStorageMetadata:
            raise unsafe(f"entry {key!r} is a {type(entry).__qualname__}, not tensor metadata")

    needed: dict[str, int] = {}  # relative path -> bytes the metadata reads from it
    for index, info in metadata.storage_data.items():
        if type(index) is not MetadataIndex or type(info) is not _StorageInfo:
            raise unsafe("malformed DCP metadata (storage_data must map MetadataIndex to _StorageInfo)")
        path_ok = isinstance(info.relative_path, str) and "\0" not in info.relative_path
        if not path_ok or not all(type(n) is int and n >= 0 for n in (info.offset, info.length)):
            raise unsafe(f"malformed storage entry for {index.fqn!r}")
        if getattr(info, "transform_descriptors", None):
            raise unsafe(f"{index.fqn!r} is stored through stream transforms {info.transform_descriptors!r}")
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)

    resolved_root = root.resolve()
    for relative, end in sorted(needed.items()):
        data_file = root / relative
        if os.path.isabs(relative) or ".." in Path(relative).parts:
            raise unsafe(f"data file {relative!r} lies outside the checkpoint directory")
        if not data_file.resolve().is_relative_to(resolved_root):
            raise unsafe(
                f"data file {relative!r} resolves outside the checkpoint directory, to {str(data_file.resolve())!r}"
            )
        if not data_file.is_file():
            raise DamagedCheckpointError(f"{data_file}: missing (named by {meta_file.name}): {DAMAGED}")
        size = data_file.stat().st_size
        if size < end:
            raise DamagedCheckpointError(
                f"{data_file}: {size} bytes, its metadata reads up to byte {end} (truncated): {DAMAGED}"
            )
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose metadata comes from :func:`read_metadata` (module docstring):
    ``dcp.load(state, storage_reader=SafeFileSystemReader(path))``. ``metadata``: what :func:`read_metadata` already
    returned for ``path``, so that it is not read again."""

    def __init__(self, path: str | os.PathLike[str], metadata: Metadata | None = None) -> None:
        super().__init__(path)
        self._metadata = metadata

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        super().reset(checkpoint_id)
        if checkpoint_id:
            self._metadata = None

    def read_metadata(self, *args: Any) -> Metadata:
        # no **kwargs: DCP then does not fall back to a rank's own __<rank>.metadata when .metadata is refused
        metadata = self._metadata if self._metadata is not None else read_metadata(self.path)
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        for item in plan.items:  # read_metadata refused them already; a planner could still ask
            if item.type == LoadItemType.BYTE_IO:
                raise UnsafeCheckpointError(
                    f"{self.path}: refused to read {item.dest_index.fqn!r} as pickled bytes (torch.load without "
                    "weights_only): moe-train checkpoints hold tensors only"
                )
        return super().read_data(plan, planner)
