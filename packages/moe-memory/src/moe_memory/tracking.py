"""Counting the tensor memory a piece of code allocates: the peak of bytes alive at once.

:class:`LiveTensorBytes` is a dispatch mode that sees every tensor an operator creates while it is active (the
local shards of DTensors included) and follows each storage until it is freed, so its peak is the largest amount of
memory those tensors held at any one time: transient copies count, views do not count twice. It works on any
device, CPU included, where no allocator statistics exist.
"""

from __future__ import annotations

import weakref

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveTensorBytes(TorchDispatchMode):
    """``with LiveTensorBytes() as counter: ...`` then ``counter.peak`` (bytes), ``counter.live`` (still held)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._held: dict[int, int] = {}  # id of a live storage -> its bytes

    def _free(self, key: int) -> None:
        self.live -= self._held.pop(key, 0)

    def _track(self, tensor: torch.Tensor) -> None:
        if isinstance(tensor, DTensor):
            tensor = tensor._local_tensor
        if tensor.device.type == "meta":
            return
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensors without storage of their own
            return
        key = id(storage)
        if key in self._held:
            return
        self._held[key] = storage.nbytes()
        self.live += storage.nbytes()
        self.peak = max(self.peak, self.live)
        # storages keep their Python object while alive, so this fires when the memory is released
        weakref.finalize(storage, self._free, key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._track(leaf)
        return out
