"""What happens to the tensors autograd saves for backward: kept, discarded and recomputed, or offloaded to host.

:class:`SavedTensorPolicy` is one pair of ``saved_tensors_hooks`` installed around a model's forward. A saved tensor
is handled by the first rule that applies:

1. **discarded**: its storage is the output of an output-discarding recompute module (``layernorm``, ``moe_act``,
   ``mla_up_proj``). The consumer keeps a small token instead; the first unpack in the backward runs the module
   again (no grad, same autocast) and every consumer of that output shares the one recomputed value.
2. **offloaded**: it is saved while an offloaded module runs and is at least ``offload_min_tensor_bytes``. Its
   storage is copied to host memory and the device copy is released; it comes back before its backward. On CUDA
   the host buffers are pinned, the copies run on a side stream (overlapping compute) and, when a group's first
   tensor comes back, the group saved before it (the previous layer, next in the backward) is prefetched. On CPU
   the same path copies into a host store, so tests see the same mechanism and count the bytes that left.
3. **kept**: anything else, handed to the hooks that were active outside (a measurement, say) if any.

Parameters and their casts (the bf16 copy of a weight under autocast) are never offloaded or discarded.
Whole storages move, views are rebuilt on return, so strides and aliasing are exactly as saved.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves

# autograd nodes that only cast or re-view their input: a tensor reached from a parameter through these alone is a
# copy of the weight, not an activation
_CAST_NODES = frozenset(
    {
        "ToCopyBackward0",
        "_ToTorchTensorBackward",
        "ViewBackward0",
        "TBackward0",
        "AliasBackward0",
        "UnsafeViewBackward0",
    }
)


def _is_weight(t: torch.Tensor) -> bool:
    if t.requires_grad and t.grad_fn is None:
        return True  # a leaf that trains: a parameter
    node = t.grad_fn
    while node is not None and type(node).__name__ in _CAST_NODES:
        nexts = [fn for fn, _ in node.next_functions if fn is not None]
        if len(nexts) != 1:
            return False
        node = nexts[0]
        if type(node).__name__ == "AccumulateGrad":
            return True
    return False


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    """``t``'s storage, or None for tensors without one of their own (meta, wrapper subclasses such as the
    asynchronous results of functional collectives): those are kept as they are."""
    if t.device.type == "meta":
        return None
    try:
        storage = t.untyped_storage()
        storage.data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    return storage


def _storage_view(t: torch.Tensor) -> torch.Tensor:
    """A flat tensor over ``t``'s whole storage (what moves), ``t`` being a strided view into it."""
    n = t.untyped_storage().nbytes() // t.element_size()
    return t.new_empty(0).set_(t.untyped_storage(), 0, (n,), (1,))


@dataclass
class SavedTensorStats:
    """Bytes of distinct storages each rule took, summed over forwards since the last :meth:`reset`."""

    discarded_bytes: int = 0
    offloaded_bytes: int = 0
    offloaded_tensors: int = 0

    def reset(self) -> None:
        self.discarded_bytes = self.offloaded_bytes = self.offloaded_tensors = 0


class _Recompute:
    """The outputs of one call of an output-discarding module, recomputed once when first needed back."""

    def __init__(self, run: Callable[[], object]) -> None:
        self.run = run
        self.outputs: list[torch.Tensor] | None = None
        self.pending = 0  # tokens not yet unpacked; the recomputed outputs are dropped when it reaches 0

    def output(self, index: int) -> torch.Tensor:
        if self.outputs is None:
            self.outputs = [x for x in tree_leaves(self.run()) if isinstance(x, torch.Tensor)]
        return self.outputs[index]

    def done(self) -> None:
        self.pending -= 1
        if self.pending <= 0:
            self.outputs = None


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding ``t``'s memory: a DTensor's local shard (tensor parallelism saves DTensors)."""
    return t._local_tensor if isinstance(t, DTensor) else t


@dataclass
class _View:
    """How a saved tensor sits in its storage, to rebuild it over a recomputed or returned copy; for a DTensor, how
    its local shard does, and the DTensor around it."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtensor: tuple | None = None  # (mesh, placements, global shape, global stride)

    @classmethod
    def of(cls, t: torch.Tensor) -> _View:
        local = _local(t)
        spec = (t.device_mesh, t.placements, t.shape, t.stride()) if isinstance(t, DTensor) else None
        return cls(tuple(local.shape), tuple(local.stride()), local.storage_offset(), spec)

    def over(self, flat: torch.Tensor) -> torch.Tensor:
        """The saved tensor over ``flat``: its storage's values, or a tensor whose local shard shares them."""
        local = _local(flat).as_strided(self.size, self.stride, self.offset)
        if self.dtensor is None:
            return local
        mesh, placements, shape, stride = self.dtensor
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


@dataclass
class _Discarded:
    source: _Recompute
    index: int
    view: _View


class _HostCopy:
    """One device storage's copy in host memory, and its way back."""

    def __init__(self, flat: torch.Tensor, stream: torch.cuda.Stream | None) -> None:
        self.device = flat.device
        self.device_ref: torch.Tensor | None = None  # the source, held until the copy has finished
        self.event: torch.cuda.Event | None = None
        self.prefetched: torch.Tensor | None = None
        self.prefetch_event: torch.cuda.Event | None = None
        if stream is None:  # CPU: a plain copy into the host store; the original is released at once
            self.host = flat.clone()
            return
        self.host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        stream.wait_stream(torch.cuda.current_stream(flat.device))  # flat was written on the compute stream
        with torch.cuda.stream(stream):
            self.host.copy_(flat, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(stream)
        self.device_ref = flat

    def release_device(self) -> None:
        """Drop the device copy once the compute stream is ordered after the copy (its memory may then be reused)."""
        if self.device_ref is not None and self.event is not None:
            torch.cuda.current_stream(self.device).wait_event(self.event)
        self.device_ref = None

    def prefetch(self, stream: torch.cuda.Stream) -> None:
        if self.prefetched is not None or self.device.type != "cuda":
            return
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self.prefetched = self.host.to(self.device, non_blocking=True)
            self.prefetch_event = torch.cuda.Event()
            self.prefetch_event.record(stream)

    def on_device(self) -> torch.Tensor:
        if self.device.type != "cuda":
            return self.host
        if self.prefetch_event is not None:  # brought back on the side stream
            current = torch.cuda.current_stream(self.device)
            current.wait_event(self.prefetch_event)
            self.prefetched.record_stream(current)  # allocated on the side stream, used on this one
            self.prefetch_event = None
        elif self.prefetched is None:
            # not prefetched: copy on the compute stream, once for every view of this storage saved
            self.prefetched = self.host.to(self.device, non_blocking=True)
        return self.prefetched


@dataclass
class _Offloaded:
    copy: _HostCopy
    view: _View
    group: tuple[int, int]  # (forward, order of the group in that forward)


@dataclass
class _Outer:
    packed: object  # what the hooks active outside the policy made of a kept tensor
    unpack: Callable[[object], torch.Tensor]


class SavedTensorPolicy:
    """Discard and offload rules for saved tensors (module docstring); ``with policy.hooks(): loss = model(x)``.

    Modules take part through :meth:`register_outputs` (an output-discarding module's outputs) and
    :meth:`offload` (a context around an offloaded module's forward; ``group`` names the layer it belongs to, the
    unit of prefetching).
    """

    def __init__(self, offload_min_tensor_bytes: int = 0) -> None:
        self.offload_min_tensor_bytes = offload_min_tensor_bytes
        self.stats = SavedTensorStats()
        self._discardable: dict[int, tuple[_Recompute, int]] = {}  # storage data_ptr -> outputs, index
        self._host: dict[int, _HostCopy] = {}  # device storage data_ptr -> its host copy (this forward)
        self._offload_group: list[str] = []
        self._forward = 0
        self._group_order: dict[tuple[int, str], int] = {}
        self._next_order = 0
        self._groups: dict[tuple[int, int], list[_HostCopy]] = {}
        self._stream: torch.cuda.Stream | None = None
        self._outer: tuple[Callable, Callable] | None = None
        self._depth = 0

    # -- what modules call --------------------------------------------------------------------------------------
    def register_outputs(self, outputs: object, run: Callable[[], object]) -> None:
        """Let consumers of ``outputs`` (tensors, possibly nested) save tokens instead: ``run()`` recomputes them."""
        source = _Recompute(run)
        for index, out in enumerate(x for x in tree_leaves(outputs) if isinstance(x, torch.Tensor)):
            storage = _storage(_local(out))
            if storage is None or storage.data_ptr() == 0:
                continue
            key = storage.data_ptr()
            self._discardable[key] = (source, index)
            weakref.finalize(storage, self._discardable.pop, key, None)

    @contextlib.contextmanager
    def offload(self, group: str) -> Iterator[None]:
        """Tensors saved inside this context go to host memory (module docstring)."""
        self._offload_group.append(group)
        try:
            yield
        finally:
            self._offload_group.pop()

    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        """Install the rules around one forward (re-entrant: nested calls keep the outer installation)."""
        if self._depth:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
        self._outer = top(False) if top is not None else None
        self._forward += 1
        self._next_order = 0
        # groups of older forwards are only candidates for prefetching (their tokens hold the copies): forget them
        self._groups = {g: c for g, c in self._groups.items() if g[0] >= self._forward - 1}
        self._group_order = {g: o for g, o in self._group_order.items() if g[0] >= self._forward - 1}
        self._depth = 1
        try:
            with saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._depth = 0
            self._outer = None
            for copy in self._host.values():
                copy.release_device()
            self._host.clear()

    # -- the hooks ----------------------------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor) -> object:
        local = _local(t)
        storage = _storage(local)
        if storage is not None and not _is_weight(t):
            found = self._discardable.get(storage.data_ptr())
            if found is not None:
                source, index = found
                if source.pending == 0 and source.outputs is None:
                    self.stats.discarded_bytes += storage.nbytes()
                source.pending += 1
                return _Discarded(source, index, _View.of(t))
            if self._offload_group and storage.nbytes() >= self.offload_min_tensor_bytes:
                return self._offload_tensor(t, local)
        if self._outer is not None:
            pack, unpack = self._outer
            return _Outer(pack(t), unpack)
        return t

    def _offload_tensor(self, t: torch.Tensor, local: torch.Tensor) -> _Offloaded:
        key = local.untyped_storage().data_ptr()
        name = self._offload_group[-1]
        if (self._forward, name) not in self._group_order:
            # a new layer starts offloading: the copies of the layers before it have had a layer of compute to
            # finish, so their device memory goes back now rather than at the end of the forward
            for (forward, _), copies in self._groups.items():
                if forward == self._forward:
                    for earlier in copies:
                        earlier.release_device()
            self._group_order[(self._forward, name)] = self._next_order
            self._next_order += 1
        order = self._group_order[(self._forward, name)]
        group = (self._forward, order)
        copy = self._host.get(key)
        if copy is None:
            stream = None
            if local.is_cuda:
                if self._stream is None:
                    self._stream = torch.cuda.Stream(local.device)
                stream = self._stream
            flat = _storage_view(local)
            copy = _HostCopy(flat, stream)
            self._host[key] = copy
            weakref.finalize(local.untyped_storage(), self._host.pop, key, None)
            self._groups.setdefault(group, []).append(copy)
            self.stats.offloaded_bytes += flat.nbytes
            self.stats.offloaded_tensors += 1
        return _Offloaded(copy, _View.of(t), group)

    def _unpack(self, packed: object) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        if isinstance(packed, _Outer):
            return packed.unpack(packed.packed)
        if isinstance(packed, _Discarded):
            value = packed.source.output(packed.index)
            out = packed.view.over(value.detach())
            packed.source.done()
            return out
        assert isinstance(packed, _Offloaded)
        forward, order = packed.group
        copies = self._groups.pop(packed.group, None)
        if copies is not None and self._stream is not None:
            # this group's backward has begun: bring back the group saved before it, whose backward comes next
            for earlier in self._groups.get((forward, order - 1), []):
                earlier.prefetch(self._stream)
        return packed.view.over(packed.copy.on_device())
