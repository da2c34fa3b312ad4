"""How the installed torch differs from torch 2.13 in what these packages use, one line each for ``moe-train env``.

Each library finds its own by trying the API (``moe_experts.grouped_mm_op``: grouped_mm under torch.compile;
``moe_memory.torch_differences``: activation checkpointing); this module finds moe-train's own (DCP) and gathers them
all.

torch 2.11's ``dcp.load`` swallows the storage reader's error when it reads the checkpoint's metadata and raises
``metadata is None`` without it; 2.13 quotes it. A refused ``.metadata`` (:mod:`moe_train.safe_dcp`) is refused on
both, and moe-train's checkpoint loader reads the metadata itself before ``dcp.load`` (``safe_dcp.read_metadata``), so
its error names the cause on both.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import tempfile
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from moe_experts.grouped_mm_op import torch_differences as experts_differences
from moe_memory.torch_differences import torch_differences as memory_differences

_MARKER = "moe-train probe: metadata refused"


class _Refused(Exception):
    pass


class _RefusingReader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        raise _Refused(_MARKER)


@contextlib.contextmanager
def _silent() -> Iterator[None]:
    """DCP logs the reader's error on the root logger (2.13: a warning with its traceback); no-process-group warns."""
    previous = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(previous)


@functools.cache
def dcp_load_names_metadata_errors() -> bool:
    """Whether ``dcp.load``'s error quotes the storage reader's metadata error (torch 2.13: yes; 2.11: no)."""
    with tempfile.TemporaryDirectory() as path, _silent():
        try:
            dcp.load({"x": torch.zeros(1)}, storage_reader=_RefusingReader(path))
        except (Exception, CheckpointException) as err:  # CheckpointException is a BaseException
            return _MARKER in str(err)
    return True


def train_differences() -> list[str]:
    """moe-train's own: one line per difference, and how it is handled."""
    if not dcp_load_names_metadata_errors():
        return [
            "dcp.load drops a storage reader's metadata error ('metadata is None'): moe-train reads the metadata "
            "first (moe_train.safe_dcp.read_metadata), so a refused or damaged checkpoint still says why"
        ]
    return []


def torch_differences() -> list[str]:
    """Every package's differences from torch 2.13, one line each."""
    return [*experts_differences(), *memory_differences(), *train_differences()]
