"""Measuring the activations a forward keeps for its backward: the bytes autograd saves.

:class:`SavedTensorBytes` is a context manager around a forward (and the loss, if it should count). Through
:func:`torch.autograd.graph.saved_tensors_hooks` it sees every tensor autograd saves for the backward and counts
each *storage* once: views of one tensor (``chunk``, ``transpose``, a slice) and tensors saved by several operations
count once, at the first save. Parameters do not count: their storages (and detached aliases of them, such as
``weight.to(weight.dtype)``) are excluded, both the ones passed in and, when a model is given, the parameters each
module holds while it runs (FSDP2 swaps the unsharded parameters in for the forward, so those storages are the
ones autograd saves). Tensor subclasses count the plain tensors inside (a DTensor its local shard, an asynchronous
collective's result its buffer).

Given a model, each saved storage is attributed to the innermost named submodule executing when it is first saved
(forward pre/post hooks), so the measurement can be compared module by module; what is saved outside any module of
the model (e.g. the loss) is attributed to :data:`OUTSIDE`.

Recompute: non-reentrant :func:`torch.utils.checkpoint.checkpoint` saves the inputs of the checkpointed region
through these (outer) hooks (its ``_NoopSaveInputs`` node), while what the region saves inside goes through the
checkpoint's own hooks and is not seen here: the measurement of a recomputed module is its inputs, as it should be.
Likewise under :class:`~moe_memory.saved_tensors.SavedTensorPolicy` (recompute that discards outputs, offload), which
hands only the tensors it keeps on the device to the hooks outside it: what is measured is what stays on the device.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

OUTSIDE = "<outside>"  # saved while no module of the model was running (the loss, user code)


@dataclass(frozen=True)
class SavedStorage:
    """One storage autograd saved: its bytes (the whole storage), the module that first saved it, and the shape and
    dtype of the first tensor (view) saved from it."""

    nbytes: int
    module: str
    shape: tuple[int, ...]
    dtype: torch.dtype


def _plain_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding ``tensor``'s memory: a wrapper subclass (a DTensor's local shard, the result of an
    asynchronous collective) is unwrapped through ``__tensor_flatten__``, recursively."""
    if not is_traceable_wrapper_subclass(tensor):
        return [tensor]
    names, _ = tensor.__tensor_flatten__()
    inner = [getattr(tensor, name) for name in names]
    return [plain for t in inner if isinstance(t, torch.Tensor) for plain in _plain_tensors(t)]


def _storage_keys(tensor: torch.Tensor) -> list[tuple[int, int, torch.Tensor]]:
    """(data pointer, bytes, plain tensor) of each storage under ``tensor``; nothing for tensors without real
    memory (meta, empty)."""
    keys = []
    for plain in _plain_tensors(tensor):
        if plain.device.type == "meta":
            continue
        try:
            storage = plain.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensors without a storage of their own
            continue
        if storage.nbytes() == 0:
            continue
        keys.append((storage.data_ptr(), storage.nbytes(), plain))
    return keys


class SavedTensorBytes:
    """``with SavedTensorBytes(model.parameters(), model=model) as saved: loss = f(model(x))``, then ``saved.total``
    (bytes), ``saved.by_module`` (module name -> bytes) and ``saved.storages`` (one :class:`SavedStorage` each).

    Args:
        parameters: tensors whose storages never count (the model's parameters).
        model: optional; attributes each storage to the innermost of its named submodules running when the storage
            was first saved (names as ``model.named_modules()``, the root is ``""``), and excludes the parameters
            each module holds while it runs.
    """

    def __init__(self, parameters: Iterable[torch.Tensor] = (), model: nn.Module | None = None) -> None:
        self._parameters = list(parameters)
        self._model = model
        self._excluded: set[int] = set()  # storages of the parameters passed in and of the model's at entry
        self._running: dict[int, int] = {}  # storages of the parameters of the modules running -> how many hold it
        self._seen: dict[int, SavedStorage] = {}  # data pointer -> the storage saved there
        self._stack: list[str] = []  # the modules running, innermost last
        self._held: list[list[int]] = []  # beside each: the pointers of its parameters when it started
        self._handles: list = []
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None

    # --- results ---
    @property
    def storages(self) -> list[SavedStorage]:
        return list(self._seen.values())

    @property
    def total(self) -> int:
        return sum(s.nbytes for s in self._seen.values())

    @property
    def by_module(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for saved in self._seen.values():
            out[saved.module] = out.get(saved.module, 0) + saved.nbytes
        return out

    # --- hooks ---
    @staticmethod
    def _pointers(tensors: Iterable[torch.Tensor]) -> list[int]:
        return [pointer for tensor in tensors for pointer, _, _ in _storage_keys(tensor)]

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        for pointer, nbytes, plain in _storage_keys(tensor):
            if pointer not in self._seen and pointer not in self._excluded and pointer not in self._running:
                module = self._stack[-1] if self._stack else OUTSIDE
                self._seen[pointer] = SavedStorage(nbytes, module, tuple(plain.shape), plain.dtype)
        # a detached alias: returning the tensor itself would tie a saved output to its own grad_fn (a cycle)
        return tensor.detach()

    @staticmethod
    def _unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def _pre_hook(self, name: str):
        def hook(module: nn.Module, args) -> None:
            # the parameters the module holds now (FSDP2's unsharded ones during the forward); forgotten when it
            # returns, since FSDP2 frees them after the forward and their memory may then hold activations. The
            # pointers are kept with the call: by the post-hook FSDP2 may have swapped the sharded ones back
            pointers = self._pointers(module.parameters(recurse=False))
            for pointer in pointers:
                self._running[pointer] = self._running.get(pointer, 0) + 1
            self._stack.append(name)
            self._held.append(pointers)

        return hook

    def _post_hook(self, name: str):
        def hook(module: nn.Module, args, output) -> None:
            # pop this module's entry (the innermost with its name: hooks of a module re-entered run in pairs)
            for i in range(len(self._stack) - 1, -1, -1):
                if self._stack[i] == name:
                    del self._stack[i]
                    for pointer in self._held.pop(i):
                        if self._running.get(pointer, 0) > 1:
                            self._running[pointer] -= 1
                        else:
                            self._running.pop(pointer, None)
                    break

        return hook

    def __enter__(self) -> SavedTensorBytes:
        self._excluded = set(self._pointers(self._parameters))
        if self._model is not None:
            self._excluded.update(self._pointers(self._model.parameters()))
            for name, module in self._model.named_modules():
                self._handles.append(module.register_forward_pre_hook(self._pre_hook(name)))
                self._handles.append(module.register_forward_hook(self._post_hook(name), always_call=True))
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        assert self._hooks is not None
        self._hooks.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._stack.clear()
        self._held.clear()
        self._running.clear()


class SavedAtBackwardBytes(SavedTensorBytes):
    """:class:`SavedTensorBytes` that also knows which saved storages are still alive: :meth:`alive` lists those the
    backward would find (a storage freed after it was saved, such as one only the last chunk of a scan keeps, drops
    out), and a later storage at a freed one's address counts as new rather than as the freed one again."""

    def __enter__(self) -> SavedAtBackwardBytes:
        self._refs: dict[int, StorageWeakRef] = {}
        return super().__enter__()

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        for pointer, _, plain in _storage_keys(tensor):
            if pointer in self._seen and self._refs[pointer].expired():
                del self._seen[pointer]
            if pointer not in self._seen:
                self._refs[pointer] = StorageWeakRef(plain.untyped_storage())
        return super()._pack(tensor)

    def alive(self) -> list[SavedStorage]:
        """The saved storages still alive (what the backward will read)."""
        return [saved for pointer, saved in self._seen.items() if not self._refs[pointer].expired()]
