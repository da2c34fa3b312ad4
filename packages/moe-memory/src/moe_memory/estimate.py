"""A per-rank memory estimate of a decoder-only MoE transformer's training step, from plain sizes.

Inputs are plain frozen values (no torch, nothing of the other packages):

- :class:`ModelShape`: hidden size, vocabulary, one :class:`LayerShape` per decoder layer (its token mixer: attention
  :class:`GQAShape` with heads / key-value heads / head dim, sliding window, sinks, QK-norm, output gate, or
  :class:`MLAShape`, with DeepSeek Sparse Attention's top-k or dense, or a linear-attention
  :class:`GatedDeltaNetShape` with its heads, convolution and chunk (Kimi Linear's KDA: :class:`KimiDeltaShape`), or a
  Mamba-2 mixer :class:`Mamba2Shape`; its channel mixer, MoE or dense MLP; a hybrid pattern's layer, Nemotron-H's,
  has only one of the two), the routed experts (:class:`ExpertsShape`: number, top-k, FFN width, gated or not,
  biases, router scoring and losses), the shared-expert and dense FFN widths and whether their activation is gated,
  zero-centred norms, the MTP depth;
- :class:`RunShape`: micro-batch and sequence length, the byte sizes of activations, parameters, gradients, optimizer
  states and master weights, the layout (tp, ep, etp, edp, dp, cp), the capacity factor (None = dropless), the token
  dispatcher, and this rank's parameter element counts (:class:`LocalParameters`, given: the caller knows them exactly,
  e.g. from the split model or ``moe-train plan``).

:func:`estimate_memory` returns a :class:`MemoryEstimate`: bytes of parameters, gradients, optimizer states, master
weights and buffers; the activations saved for backward, by module and layer kind; dispatcher buffers; logits; a
total, and a text table (:meth:`MemoryEstimate.format`, :func:`format_estimates` for several ranks side by side).

**Activations** are what the modules of this code base actually save for backward, tensor by tensor, as measured with
:class:`moe_memory.measure.SavedAtBackwardBytes` (what is still saved when the backward starts): the packages that own
the modules declare their saves next to their code (``moe_dispatch.saved_bytes``, ``moe_experts.saved_bytes``,
``moe_models.saved_bytes``: what each module saves, and how the layouts divide the rows), the model's
:class:`ModelShape` carries them (``saved_bytes``, see :mod:`moe_memory.saved_activations`), and this module composes
them; the inputs are in :mod:`moe_memory.shapes`.

**Recompute and offload** (Megatron-Core's module kinds) act on the list of saved tensors, each with the module
that saves it and the modules it runs inside (its ``path``):

- ``recompute``: a recomputed module (``core_attn``, ``moe_act``, ``layernorm``, ``mla_up_proj``, ``mlp``, ``moe``,
  ``shared_experts``) drops every tensor saved inside it and keeps its inputs (what non-reentrant checkpointing saves);
  ``moe_act``, ``layernorm`` and ``mla_up_proj`` also drop their OUTPUT from every consumer's saved tensors
  (output-discarding recompute). ``layernorm`` is the input and pre-MLP norm of each decoder layer (not the QK norms,
  the MLA latent norms or the final norm), ``mla_up_proj`` the up projections (``q_b_proj`` / ``kv_b_proj``), rotary
  embeddings and q/k assembly of MLA, ``moe`` the whole routed MLP block (router, dispatcher, experts, shared expert).
  ``layer`` a whole decoder layer: only each layer's input stays, and the backward recomputes one layer at a time
  (holding what the other chosen kinds leave of it).
  The memory the backward needs to recompute one module again is :attr:`MemoryEstimate.recompute_bytes` (the largest
  dropped set of one module instance).
- ``offload``: tensors saved by an offloaded module kind (``attn_norm``, ``qkv_linear``, ``core_attn``, ``attn_proj``,
  ``mlp_norm``, ``expert_fc1``, ``moe_act``) of at least ``offload_min_tensor_bytes`` move to host memory
  (:attr:`MemoryEstimate.offloaded_bytes`); a tensor that another, not offloaded, module also saves stays on the
  device too.

Validation and assumptions: against measured forwards of every family's tiny model (``benchmarks/memory_estimate.py``,
moe-models' and the integration tests), fp32 activations match byte for byte in one process and under tp = 2, and
within the routing's spread under ep = 2 (the expected rows); 2-byte activations match with bf16 parameters (no
autocast) on CPU, one process and tp = 2; recompute and offload by kind match ``moe_memory.apply_memory_policy``.
Not validated: CUDA's attention kernels (assumed to save q, k, v, output and logsumexp, unexpanded GQA k/v), autocast
with fp32 parameters (there the residual stream stays fp32 and every projection saves a bf16 cast of its input and of
its weight: not modelled), expert back ends other than torch's ``grouped_mm`` (Transformer Engine saves a transposed
weight copy), the routing of real data (skewed loads put more rows on some ranks than the expected share). The peak
is the sum of everything at the start of the backward (all saved activations, one layer's dispatcher buffers, the
logits the caller holds, the recompute working set), without allocator fragmentation, FSDP / tensor-parallel
communication buffers or the temporaries of single operations.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

from moe_memory.kinds import OFFLOAD_KINDS, OUTPUT_DISCARDING_KINDS, RECOMPUTE_KINDS, WHOLE_LAYER
from moe_memory.saved_activations import ForwardSaves, RankSizes, Save, SavedBytesDeclarations, Scope
from moe_memory.shapes import (
    DEFAULT_OFFLOAD_MIN_TENSOR_BYTES,
    FP32,
    ExpertsShape,
    GatedDeltaNetShape,
    GQAShape,
    KimiDeltaShape,
    LayerShape,
    LocalParameters,
    Mamba2Shape,
    MLAShape,
    ModelShape,
    PipelineShare,
    RunShape,
)

__all__ = [
    "DEFAULT_OFFLOAD_MIN_TENSOR_BYTES",
    "LAST_STAGE_MODULES",
    "MODULES",
    "OFFLOAD_KINDS",
    "OUTPUT_DISCARDING_KINDS",
    "RECOMPUTE_KINDS",
    "ExpertsShape",
    "ForwardSaves",
    "GQAShape",
    "GatedDeltaNetShape",
    "KimiDeltaShape",
    "LayerShape",
    "LocalParameters",
    "MLAShape",
    "Mamba2Shape",
    "MemoryEstimate",
    "ModelShape",
    "PipelineShare",
    "RankSizes",
    "RunShape",
    "SavedBytesDeclarations",
    "SavedTensor",
    "estimate_memory",
    "format_estimates",
    "gib",
    "in_last_stage",
    "mtp_attention",
    "optimizer_state_bytes",
]

# the modules activations are reported by, in forward order
MODULES = (
    "embedding",
    "attn_norm",
    "qkv_linear",
    "qk_norm",
    "latent_norm",
    "mla_up_proj",
    "rope",
    "indexer",  # DeepSeek Sparse Attention's lightning indexer (it selects without gradient: nothing saved today)
    "core_attn",
    "linear_attn",  # a linear-attention layer's own operations (Gated DeltaNet: gates, convolution, delta rule)
    "linear_attn_norm",  # its gated output norm
    "mamba_mixer",  # a Mamba-2 mixer's own operations: time steps, convolution, SSD scan
    "mamba_norm",  # its gated RMSNorm
    "attn_proj",
    "mlp_norm",
    "moe",  # the inputs a recomputed MoE block keeps
    "shared_experts",
    "router",
    "dispatch",
    "expert_fc1",
    "expert_bias",
    "moe_act",
    "expert_fc2",
    "combine",
    "dense_mlp",
    "final_norm",
    "lm_head",
    "mtp_input",
    "mtp_final_norm",
    "loss",
)


# --- outputs --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SavedTensor:
    """One tensor kept for backward: ``nbytes`` per instance, ``count`` instances (the layers of ``where``), counted
    under ``module``, the first module that saves it; ``saved_by`` lists every module that does."""

    module: str
    name: str
    nbytes: int
    count: int
    where: str  # a layer kind ("moe layer x3 (GQA)"...) or "model"
    saved_by: tuple[str, ...] = ()

    @property
    def total(self) -> int:
        return self.nbytes * self.count


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank holds at the start of its backward (module docstring)."""

    parameters: int
    gradients: int
    optimizer_states: int  # AdamW: exp_avg + exp_avg_sq + a 4-byte step per tensor; Muon: a momentum buffer
    master_weights: int
    buffers: int
    activations: tuple[SavedTensor, ...]  # on the device
    offloaded: tuple[SavedTensor, ...]  # in host memory
    dispatcher_buffers: int
    logits: int
    recompute_bytes: int
    notes: tuple[str, ...] = ()
    run: RunShape | None = field(default=None, compare=False)

    @property
    def activation_bytes(self) -> int:
        return sum(t.total for t in self.activations)

    @property
    def offloaded_bytes(self) -> int:
        return sum(t.total for t in self.offloaded)

    def activations_by_module(self) -> dict[str, int]:
        """Module -> bytes over all layers, in forward order."""
        out: dict[str, int] = {}
        for t in self.activations:
            out[t.module] = out.get(t.module, 0) + t.total
        order = {m: i for i, m in enumerate(MODULES)}
        return dict(sorted(out.items(), key=lambda kv: order.get(kv[0], len(order))))

    @property
    def total(self) -> int:
        return (
            self.parameters
            + self.gradients
            + self.optimizer_states
            + self.master_weights
            + self.buffers
            + self.activation_bytes
            + self.dispatcher_buffers
            + self.logits
            + self.recompute_bytes
        )

    def rows(self) -> list[tuple[str, int]]:
        """(label, bytes) rows of the table: the states, the activations by module, the rest and the total."""
        rows = [
            ("parameters", self.parameters),
            ("gradients", self.gradients),
            ("optimizer states", self.optimizer_states),
            ("master weights", self.master_weights),
            ("buffers", self.buffers),
        ]
        rows += [(f"activations: {module}", n) for module, n in self.activations_by_module().items()]
        rows += [
            ("activations (all)", self.activation_bytes),
            ("dispatcher buffers", self.dispatcher_buffers),
            ("logits", self.logits),
        ]
        if self.recompute_bytes:
            rows.append(("recompute working set", self.recompute_bytes))
        if self.offloaded:
            rows.append(("offloaded to host (not in total)", self.offloaded_bytes))
        rows.append(("total", self.total))
        return rows

    def format(self, title: str = "estimate") -> str:
        return format_estimates({title: self})


def gib(n_bytes: float) -> str:
    return f"{n_bytes / 2**30:.2f} GiB"


def _human(n_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n_bytes) < 1024 or unit == "GiB":
            return f"{n_bytes:.0f} {unit}" if unit == "B" else f"{n_bytes:.2f} {unit}"
        n_bytes /= 1024
    raise AssertionError("unreachable")


def format_estimates(estimates: Mapping[str, MemoryEstimate], unit: str = "auto") -> str:
    """A table with one column per estimate (e.g. per rank kind) and one row per item; sizes in binary units
    (``unit="GiB"`` for all in GiB)."""
    labels: list[str] = []
    values: dict[str, dict[str, int]] = {}
    for name, estimate in estimates.items():
        values[name] = {}
        for label, n in estimate.rows():
            if label not in labels:
                labels.append(label)
            values[name][label] = n
    # activation rows in forward order, between the states and the activation total
    order = {f"activations: {m}": i for i, m in enumerate(MODULES)}
    fixed = [lab for lab in labels if lab not in order]
    modules = sorted((lab for lab in labels if lab in order), key=order.__getitem__)
    split = fixed.index("activations (all)")
    labels = fixed[:split] + modules + fixed[split:]
    show = gib if unit == "GiB" else _human
    header = ["", *estimates]
    rows = [header] + [[lab] + [show(values[n].get(lab, 0)) for n in estimates] for lab in labels]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join(
        "  ".join([r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True)]).rstrip()
        for r in rows
    )


def _account(
    f: ForwardSaves, recompute: frozenset[str], offload: frozenset[str], min_bytes: int
) -> tuple[list[tuple[str, str, int, tuple[str, ...]]], list[tuple[str, str, int, tuple[str, ...]]], int]:
    """Apply recompute and offload to one forward: (device entries, host entries, largest recomputed instance), each
    entry (module, key, bytes, saved_by)."""
    active = [s for s in f.scopes if s.kind in recompute]
    whole = next((s for s in active if s.kind == WHOLE_LAYER), None)
    if whole is not None:  # the whole layer keeps its input; recomputing it holds what the other kinds leave of it
        inner = frozenset(recompute - {WHOLE_LAYER})
        outside = ForwardSaves()
        outside.nbytes, outside.names = f.nbytes, f.names
        outside.saves = [Save(key, whole.module, (f"{WHOLE_LAYER}.inputs",)) for key in whole.inputs]
        device, host, working = _account(outside, frozenset(), offload, min_bytes)
        inside, _, _ = _account(f, inner, frozenset(), min_bytes)
        return device, host, max(working, sum(n for _, _, n, _ in inside))
    tokens = {s.token for s in active}
    # the outermost recomputed modules keep their inputs (saved when they run: where their first save was)
    outermost = {s.token: s for s in active if not tokens.intersection(s.parent)}
    saves: list[Save] = []
    working = 0

    def kept_inputs(scope: Scope) -> list[Save]:
        return [Save(key, scope.module, (*scope.parent, f"{scope.kind}.inputs")) for key in scope.inputs]

    for save in f.saves:
        inside = tokens.intersection(save.path)
        if not inside:
            saves.append(save)
        for token in [t for t in save.path if t in inside and t in outermost]:
            saves += kept_inputs(outermost.pop(token))
    for scope in outermost.values():  # recomputed modules that save nothing themselves
        saves += kept_inputs(scope)
    for scope in active:
        if not tokens.intersection(scope.parent):
            dropped = {s.key for s in f.saves if scope.token in s.path} - set(scope.inputs)
            working = max(working, sum(f.nbytes[key] for key in dropped))
    discarded = {key for s in active if s.kind in OUTPUT_DISCARDING_KINDS for key in s.outputs}
    saves = [s for s in saves if s.key not in discarded]
    device: dict[str, list[Save]] = {}
    host: dict[str, list[Save]] = {}
    for save in saves:
        offloaded = f.nbytes[save.key] >= min_bytes and bool(offload.intersection(save.path))
        (host if offloaded else device).setdefault(save.key, []).append(save)

    def entries(table: dict[str, list[Save]]):
        return [
            (found[0].module, key, f.nbytes[key], tuple(dict.fromkeys(s.module for s in found)))
            for key, found in table.items()
        ]

    return entries(device), entries(host), working


# what only the last pipeline stage runs (and the MTP depths' layers): its own micro-batches in flight count them
LAST_STAGE_MODULES = frozenset({"final_norm", "lm_head", "loss", "mtp_input", "mtp_final_norm"})


def in_last_stage(saved: SavedTensor) -> bool:
    """Whether only the last pipeline stage saves this (its head, loss, MTP input and layers)."""
    return saved.module in LAST_STAGE_MODULES or saved.where.startswith("MTP ")


def _check_kinds(recompute: frozenset[str], offload: frozenset[str]) -> None:
    unknown = sorted(recompute - set(RECOMPUTE_KINDS))
    if unknown:
        raise ValueError(f"recompute={sorted(recompute)}: unknown kinds {unknown}; choose from {RECOMPUTE_KINDS}")
    unknown = sorted(offload - set(OFFLOAD_KINDS))
    if unknown:
        raise ValueError(f"offload={sorted(offload)}: unknown kinds {unknown}; choose from {OFFLOAD_KINDS}")


# the recurrent token mixers: (name, the kind of a hybrid pattern's layer of that mixer alone)
_RECURRENT = {
    GatedDeltaNetShape: ("Gated DeltaNet", "linear-attention"),
    KimiDeltaShape: ("KDA", "linear-attention"),
    Mamba2Shape: ("Mamba-2", "mamba"),
}


def _layer_kind_name(layer: LayerShape, count: int, run: RunShape, mtp: bool) -> str:
    """``moe layer x3 (GQA)``, ``dense layer x1 (Gated DeltaNet)``; a hybrid pattern's single-block layers:
    ``mamba-only layer x4 (Mamba-2)``, ``attention-only layer x1 (GQA)``, ``moe-only layer x2``, ``mlp-only layer
    x1``."""
    prefix = "MTP " if mtp else ""
    att = layer.attention
    if att is None:
        return f"{prefix}{'moe' if layer.moe else 'mlp'}-only layer x{count}"
    if isinstance(att, MLAShape):
        what, kind = "MLA" + ("" if att.topk is None else f" sparse top-{att.topk}"), "attention"
    elif isinstance(att, GQAShape):
        window = att.window is not None and att.window < run.seq_len
        what, kind = "GQA" + (" sinks" if att.sinks else "") + (f" window {att.window}" if window else ""), "attention"
    else:
        what, kind = _RECURRENT[type(att)]
    if not layer.channel:
        return f"{prefix}{kind}-only layer x{count} ({what})"
    return f"{prefix}{'moe' if layer.moe else 'dense'} layer x{count} ({what})"


def mtp_attention(model: ModelShape) -> GQAShape | MLAShape:
    """The attention of the MTP depths' layers: ``model.mtp_attention``, else the last layer's, with full attention
    and rotary embeddings (the MTP layers are built like the main ones)."""
    if model.mtp_attention is not None:
        return model.mtp_attention
    attention = model.layers[-1].attention
    if not isinstance(attention, GQAShape | MLAShape):
        what = "has no token mixer" if attention is None else f"is a {_RECURRENT[type(attention)][0]}"
        raise ValueError(f"ModelShape.mtp_attention: the last layer {what}; give the attention of the MTP layers")
    if isinstance(attention, GQAShape):
        attention = dataclasses.replace(attention, window=None, rope=True)
    return attention


def optimizer_state_bytes(
    numel: int, tensors: int, run: RunShape, momentum_numel: int = 0, momentum_tensors: int = 0
) -> tuple[int, int]:
    """(optimizer states, master weights) as the project's optimizers allocate them: per AdamW parameter tensor a
    4-byte step plus exp_avg and exp_avg_sq in the state dtype; per Muon tensor (``momentum_numel`` elements in
    ``momentum_tensors`` of the ``numel`` / ``tensors``) one momentum buffer; a master copy of parameters that are not
    fp32."""
    adamw_numel = numel - momentum_numel
    states = (tensors - momentum_tensors) * FP32 + (2 * adamw_numel + momentum_numel) * run.optimizer_state_bytes
    master = numel * run.master_weights_bytes if run.param_bytes != FP32 else 0
    return states, master


def estimate_memory(
    model: ModelShape,
    run: RunShape,
    *,
    recompute: frozenset[str] = frozenset(),
    offload: frozenset[str] = frozenset(),
    offload_min_tensor_bytes: int = DEFAULT_OFFLOAD_MIN_TENSOR_BYTES,
    pipeline: PipelineShare | None = None,
) -> MemoryEstimate:
    """The memory one rank holds at the start of its backward (module docstring); with ``pipeline``, a pipeline
    rank's, ``model`` holding its stages' layers: its saved activations count ``pipeline.inflight`` times."""
    recompute, offload = frozenset(recompute), frozenset(offload)
    _check_kinds(recompute, offload)
    declarations = model.saved_bytes
    if declarations is None:
        raise ValueError(
            "ModelShape.saved_bytes: the declarations of what the model's modules save for backward are needed "
            "(moe_models.memory.model_shape sets them)"
        )
    positions = run.seq_len // run.cp
    tokens = run.micro_batch * positions
    sizes = RankSizes(run.micro_batch, positions, tokens, tokens // run.tp, run.activation_bytes, run.cp)
    # the same layer shape counts once, times its layers; MTP depths run a MoE layer of the model's attention
    kinds: dict[tuple[LayerShape, bool], int] = {}
    for layer in model.layers:
        kinds[(layer, False)] = kinds.get((layer, False), 0) + 1
    if model.mtp_depth:
        kinds[(LayerShape(mtp_attention(model), moe=True), True)] = model.mtp_depth
    device: list[SavedTensor] = []
    host: list[SavedTensor] = []
    working = 0
    dispatcher = 0
    for (layer, is_mtp), count in kinds.items():
        forward = ForwardSaves()
        declarations.layer(forward, model, layer, sizes, run)
        where = _layer_kind_name(layer, count, run, is_mtp)
        on_device, on_host, recomputed = _account(forward, recompute, offload, offload_min_tensor_bytes)
        device += [SavedTensor(m, forward.names[k], n, count, where, by) for m, k, n, by in on_device]
        host += [SavedTensor(m, forward.names[k], n, count, where, by) for m, k, n, by in on_host]
        working = max(working, recomputed)
        # one layer's exchange in flight: the rows received (and as many sent back in its combine)
        dispatcher = max(dispatcher, forward.dispatcher_buffer_bytes)
    forward = ForwardSaves()
    declarations.model_level(forward, model, sizes, run, pipeline)
    on_device, on_host, recomputed = _account(forward, recompute, offload, offload_min_tensor_bytes)
    device += [SavedTensor(m, forward.names[k], n, 1, "model", by) for m, k, n, by in on_device]
    host += [SavedTensor(m, forward.names[k], n, 1, "model", by) for m, k, n, by in on_host]
    working = max(working, recomputed)
    p = run.params
    trained = p.numel - p.untrained_numel  # what gets a gradient, optimizer states and a master copy
    states, master = optimizer_state_bytes(
        trained, p.tensors - p.untrained_tensors, run, p.momentum_only_numel, p.momentum_only_tensors
    )
    logits = (
        (1 + model.mtp_depth) * sizes.tokens * (model.vocab // run.tp) * sizes.activation_bytes
    )  # vocabulary-parallel under tp
    notes = []
    if pipeline is not None:
        # every micro-batch in flight keeps its own saved tensors (the last stage's own: its head, loss and MTP); the
        # logits live only while the loss runs
        last = pipeline.inflight if pipeline.last_inflight is None else pipeline.last_inflight

        def times(t: SavedTensor) -> SavedTensor:
            return dataclasses.replace(t, count=t.count * (last if in_last_stage(t) else pipeline.inflight))

        device, host = [times(t) for t in device], [times(t) for t in host]
        logits = logits if pipeline.last else 0
        notes.append(f"pipeline: {pipeline.inflight} micro-batches in flight per stage")
    if run.capacity_factor is not None:
        notes.append("expert rows: worst case under the capacity factor")
    elif run.ep * run.etp > 1:
        notes.append("expert rows: expected under uniform routing")
    return MemoryEstimate(
        parameters=p.numel * run.param_bytes,
        gradients=trained * run.grad_bytes,
        optimizer_states=states,
        master_weights=master,
        buffers=p.buffer_bytes,
        activations=tuple(device),
        offloaded=tuple(host),
        dispatcher_buffers=int(dispatcher),
        logits=logits,
        recompute_bytes=working if recompute else 0,
        notes=tuple(notes),
        run=run,
    )
