"""Host read-backs counted on any device: every read of a device value (``.item()``, ``bool()``, ``.tolist()``,
``.cpu()``, ``.numpy()``) and every op whose output size depends on the data (``nonzero``, a boolean-mask index,
``repeat_interleave`` without its output size). On a GPU each waits for the stream to drain and rules out CUDA graphs;
on the CPU they are counted alike, so what a GPU run would read back is known without a GPU.

Counted through a dispatch mode (``aten._local_scalar_dense`` is what ``.item()``, ``int()`` and ``bool()`` of a
tensor dispatch to; the data-dependent ops by name, boolean indices by dtype) and through the tensor methods that read
back without dispatching, patched while the mode is active. Used by ``packages/moe-train/tests/test_host_syncs.py``
(a training step's reads) and :mod:`moe_train.cuda_graphs` (the capture-safety check of the regions a run captures).
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# the model's layers (their forward, the autograd functions of their backward, and what wraps them: quantised GEMMs,
# recompute): code whose read-backs stall every layer
MODEL_PACKAGES = ("moe_models", "moe_dispatch", "moe_experts", "moe_precision", "moe_memory")
# the MoE layer: router, dispatch, experts, combine (and the quantised GEMMs inside the experts)
MOE_LAYER_CODE = ("/moe_dispatch/", "/moe_experts/", "/moe_precision/", "/moe_models/layers.py")

_A = torch.ops.aten
# ops whose output size depends on the values: each waits for the device on a GPU
_DATA_DEPENDENT = {
    _A._local_scalar_dense.default: "item",
    _A.nonzero.default: "nonzero",
    _A.masked_select.default: "masked_select",
    _A._unique2.default: "unique",
    _A.unique_consecutive.default: "unique",
    _A.unique_dim.default: "unique",
}
_INDEXING = (_A.index.Tensor, _A.index_put.default, _A.index_put_.default, _A._index_put_impl_.default)


@dataclass(frozen=True)
class HostRead:
    kind: str  # item, nonzero, bool index, tolist, cpu...
    site: str  # file:line of the innermost frame in the project's packages (or the caller's)
    stack: tuple[str, ...]  # the filenames of the frames

    def in_code(self, fragments: tuple[str, ...]) -> bool:
        return any(fragment in filename for fragment in fragments for filename in self.stack)

    def __str__(self) -> str:
        return f"{self.kind} at {self.site}"


class HostReads(TorchDispatchMode):
    """Every host read while active. ``on_host``: tensors kept on the host by design, whose reads wait for nothing on
    a GPU (AdamW's step counters, as torch's own). ``.cpu()`` counts when called from the model's code (its tensors
    are on the GPU there) or on a tensor that is not on the CPU."""

    METHODS = ("tolist", "cpu", "numpy")

    def __init__(self, on_host: tuple[torch.Tensor, ...] = ()) -> None:
        super().__init__()
        self.reads: list[HostRead] = []
        self.on_host = {id(t) for t in on_host}
        self._originals = {name: getattr(torch.Tensor, name) for name in self.METHODS}

    def _record(self, kind: str, tensor: torch.Tensor | None = None) -> None:
        if tensor is not None and id(tensor) in self.on_host:
            return
        stack = traceback.extract_stack()[:-2]
        ours = [f for f in stack if "/moe_" in f.filename and "torch/" not in f.filename]
        mine = [f for f in stack if "torch/" not in f.filename and f.filename != __file__]
        frame = (ours or mine or stack)[-1]
        self.reads.append(
            HostRead(kind, f"{Path(frame.filename).name}:{frame.lineno}", tuple(f.filename for f in stack))
        )

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func in _DATA_DEPENDENT:
            self._record(_DATA_DEPENDENT[func], args[0])
        elif func in _INDEXING and any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1]):
            self._record("bool index")
        elif func is _A.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            self._record("repeat_interleave")
        return func(*args, **kwargs)

    def __enter__(self) -> HostReads:
        for name, original in self._originals.items():

            def counted(tensor, *args, _name=name, _original=original, **kwargs):  # type: ignore[no-untyped-def]
                from_model = any(f"/{p}/" in f.filename for f in traceback.extract_stack() for p in MODEL_PACKAGES)
                if _name != "cpu" or tensor.device.type != "cpu" or from_model:
                    self._record(_name, tensor)
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, counted)
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, original)
        super().__exit__(*exc)

    def outside_model(self) -> list[HostRead]:
        return [r for r in self.reads if not r.in_code(tuple(f"/{p}/" for p in MODEL_PACKAGES))]

    def in_moe_layers(self) -> list[HostRead]:
        return [r for r in self.reads if r.in_code(MOE_LAYER_CODE)]
