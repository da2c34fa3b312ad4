"""What a forward saves for backward, in the form :func:`moe_memory.estimate.estimate_memory` takes it: tensors
(bytes, a readable name), the modules that save them with the recompute / offload scopes they run inside, and the
recomputable modules with their inputs and outputs, which the estimate then applies recompute and offload to.

moe-memory writes down no module's saves itself: the package that owns a module declares what it saves for backward
next to its code, in each device / back-end variant it has, and is tested against
:class:`moe_memory.measure.SavedTensorBytes` on its real modules:

- ``moe_dispatch.saved_bytes``: the router and the token dispatcher (and the rows routing puts on a rank),
- ``moe_experts.saved_bytes``: the grouped experts and the shared expert,
- ``moe_models.saved_bytes``: norms, attention, rotary embeddings, the dense MLP, embedding, head, loss and MTP, and
  how a decoder layer composes all of them.

The model's :class:`~moe_memory.shapes.ModelShape` carries its declarations (``ModelShape.saved_bytes``, set by
``moe_models.memory.model_shape``): an object with the two methods of :class:`SavedBytesDeclarations`, which record
into a :class:`ForwardSaves`. Declared saves are plain records (:class:`DeclaredSave`: module, tensor, bytes,
description), so the declaring packages need nothing of moe-memory.

**Activations** counted this way are what the modules actually save, as :class:`~moe_memory.measure.SavedTensorBytes`
measures it: a tensor saved by several operations, or views of one storage, count once, under the first module that
saves it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from moe_memory.shapes import LayerShape, ModelShape, PipelineShare, RunShape


@dataclass(frozen=True)
class Save:
    key: str
    module: str
    path: tuple[str, ...]  # enclosing recompute / offload scopes, innermost last (the module itself included)


@dataclass(frozen=True)
class Scope:
    """A module that can be recomputed: its kind, the path token its saves carry, its inputs and outputs."""

    kind: str
    token: str
    parent: tuple[str, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    module: str  # what its kept inputs are counted under


class DeclaredSave(Protocol):
    """One tensor a package declares its module saves for backward (each package's own ``SavedBytes`` record)."""

    @property
    def module(self) -> str: ...  # the estimate's module name (moe_memory.estimate.MODULES)

    @property
    def tensor(self) -> str: ...  # names the tensor: the same name wherever it is saved again

    @property
    def nbytes(self) -> int: ...

    @property
    def description(self) -> str: ...


class ForwardSaves:
    """Tensors (by key: bytes, a readable name) and who saves them, in forward order; and the bytes of the dispatcher
    buffers one exchange of the layer holds in flight."""

    def __init__(self) -> None:
        self.nbytes: dict[str, int] = {}
        self.names: dict[str, str] = {}
        self.saves: list[Save] = []
        self.scopes: list[Scope] = []
        self.dispatcher_buffer_bytes = 0

    def tensor(self, key: str, nbytes: float, name: str | None = None) -> str:
        self.nbytes[key] = math.ceil(nbytes)
        self.names[key] = name or key
        return key

    def save(self, module: str, *keys: str, path: tuple[str, ...] = ()) -> None:
        for key in keys:
            assert key in self.nbytes, key
            self.saves.append(Save(key, module, (*path, module)))

    def add(self, declared: Iterable[DeclaredSave], path: tuple[str, ...] = ()) -> None:
        """Record a package's declared saves: each tensor's bytes the first time it is named, and who saves it."""
        for save in declared:
            if save.tensor not in self.nbytes:
                self.tensor(save.tensor, save.nbytes, save.description)
            self.save(save.module, save.tensor, path=path)

    def scope(
        self,
        kind: str,
        token: str,
        parent: tuple[str, ...],
        inputs: Iterable[str],
        outputs: Iterable[str],
        module: str | None = None,
    ) -> None:
        inputs, outputs = tuple(inputs), tuple(outputs)
        assert all(key in self.nbytes for key in inputs + outputs), (kind, inputs, outputs)
        self.scopes.append(Scope(kind, token, parent, inputs, outputs, module or token))


@dataclass(frozen=True)
class RankSizes:
    """Token and row counts of one rank."""

    batch: int  # sequences of the micro-batch
    positions: int  # positions of each sequence the rank computes: S / cp
    tokens: int  # B x S / cp: inside attention / dense MLP, the embedding and the loss
    local_tokens: int  # B x S / (cp tp): the sequence-parallel share (norms, MoE routing)
    activation_bytes: int
    cp: int = 1  # under context parallelism attention sees the keys of all cp ranks: cp x tokens


class SavedBytesDeclarations(Protocol):
    """What a model's modules save for backward, declared by the packages that own them (module docstring)."""

    def layer(self, saves: ForwardSaves, model: ModelShape, layer: LayerShape, sizes: RankSizes, run: RunShape) -> None:
        """Record what one decoder layer of shape ``layer`` saves (and its dispatcher buffers) into ``saves``."""
        ...

    def model_level(
        self, saves: ForwardSaves, model: ModelShape, sizes: RankSizes, run: RunShape, share: PipelineShare | None
    ) -> None:
        """Record what the model saves around its layers (of a pipeline rank: the parts its stages hold)."""
        ...
