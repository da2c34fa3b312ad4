"""safetensors checkpoint files: finding them (one file or an index of shards), reading tensors or expert rows of
them lazily, and writing shards. Pickle checkpoints are refused, never unpickled, and so is every file that resolves
outside the checkpoint directory (an index entry like ``../x.safetensors`` or ``/etc/passwd``, a symlink out):
:func:`resolve_inside` is that rule, for model, data and tokenizer directories alike."""

from __future__ import annotations

import json
import os
import re
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from moe_models.hf.errors import HFCheckpointError
from moe_models.hf.state_dict_map import Source

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_PICKLE_PATTERNS = ("pytorch_model*.bin", "*.bin", "*.pt", "*.pth", "*.ckpt")
HUB_SNAPSHOTS = "snapshots"  # a HuggingFace hub cache: models--org--name/snapshots/<revision>/ -> ../../blobs/<hash>
# the hub cache names a repository folder models--org--name (datasets--, spaces-- for the other kinds)
HUB_REPO_PREFIXES = ("models--", "datasets--", "spaces--")


def containment_root(directory: str | Path) -> Path:
    """The folder every file of ``directory`` must resolve inside: ``directory`` itself (symlinks resolved), or,
    for a HuggingFace hub cache snapshot (``models--org--name/snapshots/<revision>``, whose files are symlinks into
    ``../../blobs``), the repository's cache folder ``models--org--name``."""
    resolved = Path(directory).resolve()
    in_hub_cache = resolved.parent.name == HUB_SNAPSHOTS and resolved.parent.parent.name.startswith(HUB_REPO_PREFIXES)
    return resolved.parent.parent if in_hub_cache else resolved


def resolve_inside(directory: str | Path, name: str | Path) -> Path | None:
    """``directory / name`` with ``..`` and symlinks resolved (``Path.resolve``), or None when that lands outside
    :func:`containment_root` of ``directory`` (an absolute ``name`` lands where it points) or cannot be resolved
    (a symlink loop). The file need not exist."""
    try:
        resolved = (Path(directory) / name).resolve()
    except (OSError, RuntimeError, ValueError):  # a symlink loop (RuntimeError before Python 3.13), a NUL byte
        return None
    return resolved if resolved.is_relative_to(containment_root(directory)) else None


def _target(path: Path) -> str:
    """Where ``path`` really is, for an error message (nothing for a name no file system takes, e.g. with a NUL)."""
    try:
        return f" (to {os.path.realpath(path)})"
    except ValueError:
        return ""


def inside_or_refuse(directory: Path, name: str) -> None:
    """A file the checkpoint directory holds under a fixed name (config.json, the index, model.safetensors) stays
    inside it."""
    if (directory / name).exists() and resolve_inside(directory, name) is None:
        raise HFCheckpointError(
            f"{directory / name} resolves to {os.path.realpath(directory / name)}, outside the checkpoint directory "
            f"{containment_root(directory)}: copy the file into the directory instead of linking to it"
        )


def _refuse_pickle(directory: Path) -> None:
    pickles = sorted({p.name for pattern in _PICKLE_PATTERNS for p in directory.glob(pattern)})
    if pickles:
        raise HFCheckpointError(
            f"{directory} holds only pickle checkpoints ({', '.join(pickles[:3])}), which are not read (unpickling "
            "runs code): convert them to safetensors first, e.g. transformers' "
            "AutoModelForCausalLM.from_pretrained(path).save_pretrained(new_path, safe_serialization=True)"
        )
    raise HFCheckpointError(f"{directory} has no {SINGLE_FILE} or {INDEX_FILE}: point at a safetensors checkpoint")


def _safe_open(path: Path) -> Any:
    """``safe_open``, a damaged file (truncated, a bad header) reported in one line instead of safetensors' error."""
    try:
        return safe_open(path, framework="pt", device="cpu")
    except (SafetensorError, OSError, ValueError) as err:
        why = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise HFCheckpointError(
            f"{path} is not a readable safetensors file ({why}): damaged or incomplete; download or export it again"
        ) from None


class CheckpointReader:
    """The tensors of a checkpoint directory, by name; files open on first use and close with the reader."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise HFCheckpointError(f"{self.directory} is not a directory: give the checkpoint directory")
        index = self.directory / INDEX_FILE
        if index.is_file():
            inside_or_refuse(self.directory, INDEX_FILE)
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                if not all(isinstance(f, str) for f in weight_map.values()):
                    raise TypeError("weight_map values must be file names")
                files = set(weight_map.values())
            except (ValueError, KeyError, TypeError, AttributeError) as err:
                raise HFCheckpointError(f"{index} is not a safetensors index ({err}): download it again") from None
            outside = sorted(f for f in files if resolve_inside(self.directory, f) is None)
            if outside:
                key = min(k for k, f in weight_map.items() if f == outside[0])
                more = f" (and {len(outside) - 1} more files)" if len(outside) > 1 else ""
                raise HFCheckpointError(
                    f"{index}: weight_map entry {key!r}: {outside[0]!r}{more}: the index points outside the "
                    f"checkpoint directory {containment_root(self.directory)}{_target(self.directory / outside[0])}; "
                    "its files must lie inside it: download the checkpoint again, or copy the shards in and name "
                    "them relative to the directory"
                )
            self.file_of: dict[str, Path] = {k: self.directory / f for k, f in weight_map.items()}
        elif (self.directory / SINGLE_FILE).is_file():
            inside_or_refuse(self.directory, SINGLE_FILE)
            with _safe_open(self.directory / SINGLE_FILE) as f:
                self.file_of = dict.fromkeys(f.keys(), self.directory / SINGLE_FILE)
        else:
            _refuse_pickle(self.directory)
        self._stack = ExitStack()
        self._open: dict[Path, Any] = {}

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def names(self) -> set[str]:
        return set(self.file_of)

    def _file(self, key: str) -> Any:
        path = self.file_of[key]
        if path not in self._open:
            if not path.is_file():
                raise HFCheckpointError(f"{path.name} (listed in {INDEX_FILE} for {key}) is missing: re-download it")
            self._open[path] = self._stack.enter_context(_safe_open(path))
        return self._open[path]

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._file(key).get_slice(key).get_shape())

    def read_box(self, key: str, box: tuple[slice, ...]) -> torch.Tensor:
        """Only ``box`` (one slice per dimension) of tensor ``key``: safetensors reads just those bytes."""
        return self._file(key).get_slice(key)[box]

    def read(self, source: Source) -> torch.Tensor:
        """The tensor, or only its ``source.rows`` along dim 0, read as contiguous runs of rows."""
        f = self._file(source.key)
        if source.rows is None:
            return f.get_tensor(source.key)
        sliced = f.get_slice(source.key)
        runs, start = [], 0
        rows = source.rows
        for i in range(1, len(rows) + 1):
            if i == len(rows) or rows[i] != rows[i - 1] + 1:
                runs.append(sliced[rows[start] : rows[i - 1] + 1])
                start = i
        return torch.cat(runs) if len(runs) > 1 else runs[0]


def parse_size(size: int | str) -> int:
    """Bytes of ``5GB`` / ``500MB`` / ``10KiB`` / an int."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(I?B)?\s*", size.upper())
    if not match:
        raise ValueError(f"max_shard_size={size!r}: give bytes as an int or a string like '5GB'")
    number, prefix, unit = match.groups()
    base = 1024 if unit == "IB" else 1000
    return int(float(number) * base ** " KMGT".index(prefix or " "))


class ShardWriter:
    """Writes named tensors into shards of at most ``max_bytes`` (a bigger tensor gets a shard alone)."""

    def __init__(self, directory: Path, max_bytes: int) -> None:
        self.directory, self.max_bytes = directory, max_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        tensor = tensor.detach().to("cpu").contiguous()
        size = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + size > self.max_bytes:
            self._flush()
        self._pending[name] = tensor
        self._pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        path = self.directory / f"shard-{len(self._shards):05d}.tmp"
        save_file(self._pending, str(path), metadata={"format": "pt"})
        self._shards.append((path, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def finish(self) -> None:
        """Names the shards model-0000i-of-0000n.safetensors with an index, or model.safetensors if one."""
        if self._pending or not self._shards:
            self._flush()
        if len(self._shards) == 1:
            self._shards[0][0].rename(self.directory / SINGLE_FILE)
            return
        n, weight_map = len(self._shards), {}
        for i, (path, names) in enumerate(self._shards):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            path.rename(self.directory / final)
            weight_map |= dict.fromkeys(names, final)
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
