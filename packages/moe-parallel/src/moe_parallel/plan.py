"""What a model declares so that moe-parallel can split it without knowing its classes: the parallel plan.

A model hands :func:`~moe_parallel.parallelize` a :class:`ParallelPlan` (moe_models keeps ``MoETransformer``'s
beside the model, as torchtitan keeps each model's ``parallelize`` next to it). Everything is named by module or
parameter path (``layers.3.attention.q_proj``), so moe-parallel never reads a model attribute by name; the only
classes it knows are the MoE pieces it parallelises (moe_dispatch's router and dispatchers, moe_experts' experts).

This module imports nothing but torch, so a model package can declare its plan without pulling in the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from torch.distributed.tensor.parallel import ParallelStyle


class LayoutError(ValueError):
    """A parallel layout (or a model under it) that cannot work; ``field`` is the ParallelConfig field to change.

    ``str(err)`` is ``"{field}={value!r}: {reason}"``. ``reason`` is the ``problem`` and, when the check that raised
    it can tell, after ``"; "`` a ``hint``: what its own rule allows (one rule's view: the world size, or the model's
    sizes). :func:`~moe_parallel.check_layout` replaces the hint of a parallel size by the values that pass every
    rule at once.
    """

    def __init__(self, field: str, value: object, reason: str, hint: str = "") -> None:
        self.field, self.value, self.problem, self.hint = field, value, reason, hint
        self.reason = f"{reason}; {hint}" if hint else reason
        super().__init__(f"{field}={value!r}: {self.reason}")

    def __reduce__(self):  # type: ignore[no-untyped-def]
        # pickling (multiprocessing, torch.distributed) rebuilds from the constructor's arguments
        return type(self), (self.field, self.value, self.problem, self.hint)


@dataclass(frozen=True)
class MoEBlockPlan:
    """A routed MoE block at ``path``: the attribute names of its router (:class:`~moe_dispatch.TopKRouter`), token
    dispatcher (swapped for an expert-parallel one) and experts (:class:`~moe_experts.GroupedExperts`, swapped for
    this rank's share)."""

    path: str
    router: str = "router"
    dispatcher: str = "dispatcher"
    experts: str = "experts"

    def experts_path(self) -> str:
        return f"{self.path}.{self.experts}" if self.path else self.experts

    def router_path(self) -> str:
        return f"{self.path}.{self.router}" if self.path else self.router


@dataclass(frozen=True)
class PipelinePlan:
    """How a model splits into pipeline stages: its decoder layers in order, what each costs, and how to build the
    module one stage runs.

    ``build_stage(stage_index, layers, first, last)`` returns an ``nn.Module`` running decoder layers ``layers``
    (indices into :attr:`layers`), plus the embedding when ``first`` and the head (and whatever must sit beside it,
    e.g. MTP) when ``last``; its parameter names are the whole model's, so checkpoints and initial values need no
    mapping. Its ``forward(x, **kwargs)`` takes the token ids (first stage) or the previous stage's output and
    returns a tensor (or, on the last stage, a tuple of tensors for the loss). ``stage_io(stage, batch, seq_len,
    dtype)`` gives example (meta) inputs and outputs of a built stage for ``batch`` sequences of ``seq_len`` local
    tokens, so that no stage has to run a forward to learn its neighbours' shapes.
    """

    layers: tuple[str, ...]  # module paths of the decoder layers, in order
    layer_costs: tuple[float, ...]  # what each costs (training FLOPs per token): the automatic split balances these
    first_cost: float  # the embedding's
    last_cost: float  # the head's, with whatever rides on the last stage (MTP)
    build_stage: Callable[..., object]
    stage_io: Callable[..., tuple[tuple, tuple]]
    # parameters the last stage keeps a copy of when it is not the first (an MTP's embedding lookup): their gradients
    # are summed over the copies after the backward, so all copies step alike
    last_stage_copies: tuple[str, ...] = ()
    # module names for the stage map: what the first and last stage hold besides layers
    first_modules: tuple[str, ...] = ()
    last_modules: tuple[str, ...] = ()
    # model field -> why this model cannot run with pp > 1
    unsupported: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ParallelPlan:
    """How to split one model; every name is a module path (``""`` is the root) or a parameter path."""

    # tensor + sequence parallelism: module path -> DTensor style, applied with parallelize_module on the root
    tensor_parallel: Mapping[str, ParallelStyle] = field(default_factory=dict)
    # parameters left whole on every tp rank that see only that rank's tokens or heads: gradients summed over tp
    tp_partial_grads: tuple[str, ...] = ()
    # module path -> first output column whose gradient is summed over tp in the backward (an output slice every
    # tp rank uses whole, e.g. MLA's rotary key, computed by a module whose other columns feed split heads)
    tp_sum_grad_columns: Mapping[str, int] = field(default_factory=dict)
    # model field -> size that tp must divide (head counts, FFN widths of tensor-parallel layers)
    tp_divides: Mapping[str, int] = field(default_factory=dict)
    # model field -> why this model cannot run with tp > 1
    tp_unsupported: Mapping[str, str] = field(default_factory=dict)
    # parameter path -> dimension it is split along over tp (a per-head parameter beside column-parallel heads, such
    # as attention sinks): distributed as Shard(dim); the module using it takes its local piece
    tp_shard_parameters: Mapping[str, int] = field(default_factory=dict)
    # low-rank adapter parameters of tensor-parallel linears -> the dimension each is split along over tp (None: whole
    # on every rank): a column-parallel weight's adapter splits its output side, a row-parallel one its input side.
    # Kept out of the styles' reach (a style splits every parameter of its linear alike)
    tp_adapter_parameters: Mapping[str, int | None] = field(default_factory=dict)
    # core-attention modules called as (q, k, v, sinks, q_positions, k_positions): with cp > 1 each gets the keys
    # and values of the whole sequence (moe_parallel.context_parallel); empty: the model cannot take cp > 1
    context_parallel: tuple[str, ...] = ()
    # modules called as (values, kind) with per-segment values (dim 0: the sequence segments the rank computes, such as
    # a recurrent layer's chunk-final states): with cp > 1 each returns every cp rank's rows, rank by rank, for the
    # kinds of moe_parallel.context_parallel.SEGMENT_ROWS (others pass unchanged). A model with recurrent layers lists
    # them, as it lists its core attentions
    context_parallel_segments: tuple[str, ...] = ()
    # FSDP2 units on the data-parallel mesh, innermost first; the root is always a unit after them
    fsdp_units: tuple[str, ...] = ()
    moe_blocks: tuple[MoEBlockPlan, ...] = ()
    # (parameter, parameter sharing its storage): re-tied after materialisation
    tied_parameters: tuple[tuple[str, str], ...] = ()
    pipeline: PipelinePlan | None = None  # None: the model cannot be split into pipeline stages

    def experts_paths(self) -> list[str]:
        return [block.experts_path() for block in self.moe_blocks]


def submodule(root, path: str):
    """``root.get_submodule(path)`` with a message naming the plan entry when the path is wrong."""
    try:
        return root.get_submodule(path)
    except AttributeError:
        raise ValueError(f"the parallel plan names module {path!r}, which the model does not have") from None
