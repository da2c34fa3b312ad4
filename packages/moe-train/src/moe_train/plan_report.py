"""What ``moe-train plan`` reports: each rank's parameter shard sizes under a layout, at the model's real size.

The model is built on the meta device and split by the same :func:`~moe_parallel.parallelize` training uses, in one
process joined to a fake process group of ``world_size`` ranks (torch's ``fake`` backend, as torchtitan's dry
run): no memory, no communication. That process is rank 0, so its model holds rank 0's view; every other rank's
sizes follow from each tensor's placements and that rank's mesh coordinates, without rebuilding the model:

- a DTensor's local shape comes from torch's own helper given the rank's coordinates (uneven FSDP shards, where
  the last ranks along a dimension hold fewer rows or none, included), or for FSDP's strided shards over tp from
  torch's size formula, which scales to thousands of ranks;
- routed experts with ``etp > 1`` are plain per-rank tensors (or DTensors over ``edp`` only) whose sizes are the
  same on every ep x etp rank, so rank 0's sizes are everyone's;
- anything else (plain tensors, buffers) is whole on every rank.

Ranks whose sizes are all equal form one *rank kind*, printed once.

With ``--memory`` (or ``--device-memory``), each rank kind's memory at the start of its backward follows, from
:func:`moe_memory.estimate.estimate_memory` given that kind's exact parameter counts: parameters, gradients,
optimizer states, master weights, activations by module, dispatcher buffers, logits and the total
(:func:`memory_estimates`, :func:`format_memory`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Placement
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from moe_memory.estimate import (
    DEFAULT_OFFLOAD_MIN_TENSOR_BYTES,
    OFFLOAD_KINDS,
    RECOMPUTE_KINDS,
    LocalParameters,
    MemoryEstimate,
    ModelShape,
    PipelineShare,
    estimate_memory,
    format_estimates,
    optimizer_state_bytes,
)
from moe_models import ModelConfig, count_parameters
from moe_models.memory import model_shape, run_shape
from moe_parallel import (
    ParallelConfig,
    ParallelLayout,
    build_meshes,
    parallelize_stages,
    stage_map,
)
from moe_parallel.layout import ATTENTION_DIMS, EXPERT_DIMS, FLATTENED_DIMS
from moe_parallel.pipeline_time import stage_inflight
from moe_parallel.schedules import inflight_microbatches
from moe_train.config import ConfigError, ExperimentConfig, PeftConfig, RunConfig
from moe_train.dtypes import dtype_bytes
from moe_train.muon import muon_parameters
from moe_train.setup import checked_meta_model, default_micro_batch_size, micro_batching

NON_EXPERT = "non-expert"  # attention, norms, dense MLPs, routers, shared experts, embedding, head
ROUTED_EXPERTS = "routed experts"
PARTS = (NON_EXPERT, ROUTED_EXPERTS)
RANK_MAP_MAX_WORLD = 32  # larger worlds get the shard sizes only, not the rank map's line per rank


@dataclass(frozen=True)
class RankKind:
    """Ranks holding shards of the same sizes, and those sizes (elements, by part and dtype, per rank)."""

    ranks: tuple[int, ...]
    params: dict[tuple[str, torch.dtype], int]  # (part, dtype) -> elements on each of these ranks
    buffers: dict[torch.dtype, int]
    pp_rank: int | None = None  # with pipeline parallelism, the pipeline rank (its stages) these ranks are
    # elements of trainable parameters on each of these ranks (peft.method=lora: the adapters'); None: every one
    trainable: int | None = None
    muon: int = 0  # of the trainable elements, those train.optimizer muon updates (moe_train.muon.uses_muon)

    def param_count(self, part: str | None = None) -> int:
        return sum(n for (p, _), n in self.params.items() if part in (None, p))

    def param_bytes(self, part: str | None = None) -> int:
        return sum(n * dtype.itemsize for (p, dtype), n in self.params.items() if part in (None, p))


@dataclass(frozen=True)
class PlanReport:
    layout: ParallelLayout
    family: str
    num_experts: int
    kinds: list[RankKind]  # by first rank
    distinct_params: dict[str, int]  # part -> elements summed over ranks with replicated copies divided out
    expected_params: int  # moe_models.count_parameters: total + MTP layers (+ adapter_params)
    param_tensors: int = 0  # parameter tensors every rank holds (each, even an empty shard, gets optimizer state)
    trainable_tensors: int | None = None  # of those, the trainable ones (None: every one)
    muon_tensors: int = 0  # of the trainable ones, those train.optimizer muon updates
    adapter_params: int = 0  # peft.method=lora: the adapters' parameters, counted on the whole model
    # pipeline parallelism: moe_parallel.stage_map's rows, each pipeline rank's micro-batches in flight (None: unknown)
    # and the step's micro-batch count
    stages: list[dict] | None = None
    inflight: list[int] | None = None
    microbatches: int = 1
    schedule: str = "1F1B"


def _fake_world(world_size: int) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        raise ConfigError("moe-train plan simulates every rank in one process: run it without torchrun")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)


def _coordinates_by_dim(layout: ParallelLayout) -> dict[str, torch.Tensor]:
    """Mesh dimension name -> each rank's coordinate along it (pp is 1 here: check_plan refuses more)."""
    by_dim: dict[str, list[int]] = defaultdict(list)
    for rank in range(layout.world_size):
        for side, dims in (("attention", ATTENTION_DIMS), ("expert", EXPERT_DIMS)):
            coords = layout.coords(rank, side)
            for dim in dims:
                if dim != "pp" or side == "attention":
                    by_dim[dim].append(coords[dim])
        for name in FLATTENED_DIMS:  # the flattened dimensions context parallelism adds
            by_dim[name].append(layout.flattened_coord(rank, name))
    return {dim: torch.tensor(values) for dim, values in by_dim.items()}


def _strided_shard_length(length: int, mesh_size: int, coordinate: int, split_factor: int) -> int:
    """How many of ``length`` rows a ``_StridedShard(split_factor)`` leaves at ``coordinate``: ``split_factor``
    ceil-sized pieces, each split again into ``mesh_size`` ceil-sized chunks, one from each piece. torch's own size
    formula (its symbolic-size branch); its concrete one lists the rows, O(length) per call and O(mesh_size^2)
    per tensor, too slow for FSDP over tp on thousands of ranks. Tests hold the two equal."""
    piece = -(-length // split_factor)
    rows = 0
    for index in range(split_factor):
        piece_length = max(0, min(piece * (index + 1), length) - piece * index)
        chunk = -(-piece_length // mesh_size)
        rows += max(0, min(chunk * (coordinate + 1), piece_length) - chunk * coordinate)
    return rows


@functools.cache
def _split_once(shape: tuple[int, ...], mesh_size: int, coordinate: int, placement: Placement) -> tuple[int, ...]:
    """The local shape after one mesh dimension's placement, as torch's helper computes it (it walks the mesh
    dimensions one at a time the same way, each step depending only on the shape the earlier ones left)."""
    if isinstance(placement, _StridedShard):
        split = list(shape)
        split[placement.dim] = _strided_shard_length(
            shape[placement.dim], mesh_size, coordinate, placement.split_factor
        )
        return tuple(split)
    return _compute_local_shape_and_global_offset(shape, (mesh_size,), [coordinate], [placement], skip_offset=True)[0]


def _local_numel_table(shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple) -> torch.Tensor:
    """Local element count at every coordinate of the mesh, row-major. Step by step rather than one helper call per
    coordinate, since few steps are distinct."""
    shapes = [shape]
    for mesh_size, placement in zip(mesh_shape, placements, strict=True):
        shapes = [_split_once(s, mesh_size, c, placement) for s in shapes for c in range(mesh_size)]
    return torch.tensor([math.prod(s) for s in shapes], dtype=torch.int64)


def _local_numels(layout: ParallelLayout) -> Callable[[torch.Tensor], torch.Tensor]:
    """A function: tensor on rank 0 -> its local element count on every rank (a tensor of ``world_size``)."""
    coordinates = _coordinates_by_dim(layout)
    tables: dict[tuple, torch.Tensor] = {}  # by (global shape, mesh shape, placements): layers repeat

    def local_numels(tensor: torch.Tensor) -> torch.Tensor:
        if not isinstance(tensor, DTensor):
            return torch.full((layout.world_size,), tensor.numel(), dtype=torch.int64)
        mesh = tensor.device_mesh
        key = (tuple(tensor.shape), tuple(mesh.shape), tuple(tensor.placements))
        if key not in tables:
            tables[key] = _local_numel_table(*key)
        flat = torch.zeros(layout.world_size, dtype=torch.int64)  # each rank's row-major index into the mesh
        for name, size in zip(mesh.mesh_dim_names, mesh.shape, strict=True):
            flat = flat * size + coordinates[name]
        return tables[key][flat]

    return local_numels


def _rank_kinds(
    world_size: int,
    params: dict[tuple[str, torch.dtype], torch.Tensor],
    buffers: dict[torch.dtype, torch.Tensor],
    pp_of_rank: torch.Tensor | None = None,
    trainable: torch.Tensor | None = None,
    muon: torch.Tensor | None = None,  # elements Muon would update, per rank
) -> list[RankKind]:
    columns = [*params, *buffers]
    if not columns:
        return [RankKind(tuple(range(world_size)), {}, {})]
    # ranks of different pipeline ranks are different kinds even when their sizes agree: they run other layers
    extra = [] if pp_of_rank is None else [pp_of_rank]
    extra += [] if trainable is None else [trainable]
    extra += [torch.zeros(world_size, dtype=torch.long) if muon is None else muon]
    table = torch.stack([*params.values(), *buffers.values(), *extra], dim=1)  # rank x (part, dtype)
    rows, kind_of_rank = torch.unique(table, dim=0, return_inverse=True)
    kinds = []
    for index, row in enumerate(rows.tolist()):
        ranks = tuple((kind_of_rank == index).nonzero().flatten().tolist())
        sizes = dict(zip(columns, row[: len(columns)], strict=True))
        rest = row[len(columns) :]
        pp_rank = None if pp_of_rank is None else rest[0]
        mine = None if trainable is None else rest[-2]
        held = ({k: sizes[k] for k in params}, {k: sizes[k] for k in buffers})
        kinds.append(RankKind(ranks, *held, pp_rank, mine, muon=rest[-1]))
    return sorted(kinds, key=lambda kind: kind.ranks[0])


def plan_report(
    model_config: ModelConfig,
    parallel_config: ParallelConfig,
    world_size: int,
    param_dtype: torch.dtype = torch.float32,
    run: RunConfig | None = None,
    seq_len: int | None = None,
    peft: PeftConfig | None = None,
) -> PlanReport:
    """Every rank's parameter and buffer shard sizes when ``parallel_config`` splits the model over ``world_size``
    ranks (module docstring), its parameters in ``param_dtype`` as training casts them (``train.params_dtype``).
    With ``run``, its recompute and offload settings are checked against the model too; with ``peft``, the model
    carries its adapters and each rank kind counts its trainable elements (gradients and optimizer states are kept
    for those only). Raises :class:`ConfigError` for layouts that do not fit."""
    layout, model, plan = checked_meta_model(model_config, parallel_config, world_size, run, seq_len, peft)
    lora = peft is not None and peft.method == "lora"
    adapter_params = sum(p.numel() for p in model.parameters() if p.requires_grad) if lora else 0
    if param_dtype != torch.float32:
        model.to(param_dtype)  # as the trainer does on the meta device; the routers' expert bias stays fp32
    _fake_world(world_size)
    try:
        meshes = build_meshes(layout, "cpu")
        # one process is rank 0: build every pipeline rank's stages in turn, each on a meta model of its own
        pp_of_rank = torch.tensor([layout.coords(r, "attention")["pp"] for r in range(world_size)])
        views = []
        for pp_rank in range(layout.pp):
            if pp_rank:
                _, model, plan = checked_meta_model(
                    model_config, parallel_config, world_size, seq_len=seq_len, peft=peft
                )
                if param_dtype != torch.float32:
                    model.to(param_dtype)
            views.append((parallelize_stages(model, meshes, parallel_config, plan, pp_rank=pp_rank), pp_rank))
        local_numels = _local_numels(layout)
        expert_prefixes = tuple(f"{path}." for path in plan.experts_paths())
        params: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        buffers: dict[torch.dtype, torch.Tensor] = {}
        distinct = dict.fromkeys(PARTS, 0)
        param_tensors = 0
        trainable = torch.zeros(world_size, dtype=torch.long)
        muon = torch.zeros(world_size, dtype=torch.long)
        trainable_tensors = muon_tensors = 0
        for split, pp_rank in views:
            replicas = split.sync.replicas  # parameter id -> ranks holding each distinct piece of it
            mask = (pp_of_rank == pp_rank).long()  # the ranks holding these stages
            held = split.model
            takes_muon = muon_parameters(held)
            muon_tensors = max(muon_tensors, len(takes_muon))
            for name, param in held.named_parameters():
                name = split.global_name(name)
                part = ROUTED_EXPERTS if name.startswith(expert_prefixes) else NON_EXPERT
                per_rank = local_numels(param) * mask
                key = (part, param.dtype)
                params[key] = params[key] + per_rank if key in params else per_rank
                # each distinct piece is held by replicas[...] ranks (the count the gradient norm divides by)
                distinct[part] += int(per_rank.sum()) // replicas[id(param)]
                if param.requires_grad:
                    trainable += per_rank
                if id(param) in takes_muon:
                    muon += per_rank
            param_tensors = max(param_tensors, sum(1 for _ in held.parameters()))
            trainable_tensors = max(trainable_tensors, sum(1 for p in held.parameters() if p.requires_grad))
            for buffer in held.buffers():
                per_rank = local_numels(buffer) * mask
                buffers[buffer.dtype] = buffers[buffer.dtype] + per_rank if buffer.dtype in buffers else per_rank
    finally:
        dist.destroy_process_group()
    counted = count_parameters(model_config)
    stages = stage_map(plan.pipeline, parallel_config, layout) if layout.pp > 1 else None
    return PlanReport(
        layout=layout,
        family=model_config.family,
        num_experts=model_config.num_moe_experts,
        kinds=_rank_kinds(world_size, params, buffers, pp_of_rank, trainable if lora else None, muon),
        distinct_params=distinct,
        expected_params=counted.total + counted.mtp + (adapter_params if lora else 0),
        param_tensors=param_tensors,
        trainable_tensors=trainable_tensors if lora else None,
        muon_tensors=muon_tensors,
        adapter_params=adapter_params if lora else 0,
        stages=stages,
    )


def with_microbatches(report: PlanReport, schedule: str, microbatches: int) -> PlanReport:
    """``report`` with a pipeline's micro-batches per step and how many of them each pipeline rank holds at once."""
    if report.stages is None:
        return report
    pp = report.layout.pp
    inflight = inflight_microbatches(schedule, pp, len(report.stages) // pp, microbatches)
    return dataclasses.replace(report, microbatches=microbatches, inflight=inflight, schedule=schedule)


def rank_ranges(ranks: tuple[int, ...], most: int = 6) -> str:
    """``(0, 1, 2, 5)`` -> ``"0-2, 5"``; past ``most`` runs, the rest as a count."""
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    text = ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs[:most])
    return text + (f", ... ({len(runs) - most} more runs)" if len(runs) > most else "")


def _size(n_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n_bytes < 1024 or unit == "GiB":
            return f"{n_bytes:.0f} {unit}" if unit == "B" else f"{n_bytes:.2f} {unit}"
        n_bytes /= 1024
    raise AssertionError("unreachable")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _cell(n: int, dtype: torch.dtype | None = None, n_bytes: int | None = None) -> str:
    return f"{n:,} = {_size(n * dtype.itemsize if n_bytes is None else n_bytes)}"


def format_report(report: PlanReport) -> str:
    """The shard-size table ``moe-train plan`` prints: one row per rank kind, elements and bytes per rank in each
    (part, dtype) column, then the check against the parameter count."""
    layout = report.layout
    param_keys = sorted({k for kind in report.kinds for k in kind.params}, key=lambda k: (PARTS.index(k[0]), str(k)))
    buffer_keys = sorted({k for kind in report.kinds for k in kind.buffers}, key=str)
    header = ["ranks", "count"]
    header += [f"{part} {_dtype_name(dtype)}" for part, dtype in param_keys]
    header += ["parameters"] + [f"buffers {_dtype_name(dtype)}" for dtype in buffer_keys]
    rows = [header]
    for kind in report.kinds:
        row = [rank_ranges(kind.ranks), str(len(kind.ranks))]
        row += [_cell(kind.params.get(key, 0), key[1]) for key in param_keys]
        row += [_cell(kind.param_count(), n_bytes=kind.param_bytes())]
        row += [_cell(kind.buffers.get(dtype, 0), dtype) for dtype in buffer_keys]
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    per_ep_rank = report.num_experts // layout.ep
    lines = [
        f"parameter shards per rank, split as training splits them (dp={layout.dp} "
        + (f"cp={layout.cp} " if layout.cp > 1 else "")
        + f"tp={layout.tp} | ep={layout.ep} "
        f"etp={layout.etp} edp={layout.edp}; {per_ep_rank} expert{'s' if per_ep_rank > 1 else ''} per ep rank), "
        "elements = bytes:"
    ]
    for row in rows:  # rank ranges left-aligned, numbers right-aligned
        lines.append(
            "  ".join(
                [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)]
            ).rstrip()
        )
    if report.stages is not None:
        lines += format_stage_map(report)
    total = sum(report.distinct_params.values())
    verdict = "matches" if total == report.expected_params else "DOES NOT MATCH"
    lines.append(
        f"over all ranks, each replicated copy once: {total:,} parameters ("
        + ", ".join(f"{part} {n:,}" for part, n in report.distinct_params.items())
        + f"); {verdict} moe_models.count_parameters {report.expected_params - report.adapter_params:,} (MTP "
        + "layers included)"
        + (f" + {report.adapter_params:,} LoRA adapter parameters" if report.adapter_params else "")
    )
    return "\n".join(lines)


def _layer_ranges(layers: list[int]) -> str:
    return rank_ranges(tuple(layers)) if layers else "-"


def format_stage_map(report: PlanReport) -> list[str]:
    """The pipeline's stages: which pipeline rank runs each, its layers, what else it holds, its cost relative to the
    most expensive stage's; then each pipeline rank's micro-batches in flight."""
    layout, stages = report.layout, report.stages
    lines = [
        f"pipeline: {report.schedule}, pp={layout.pp} x {len(stages) // layout.pp} stages per rank = {len(stages)} "
        f"stages, {report.microbatches} micro-batches a step; stages split by cost (training FLOPs per token):"
    ]
    rows = [["stage", "pp rank", "layers", "also holds", "cost"]]
    for r in stages:
        rows.append([str(r["stage"]), str(r["pp_rank"]), _layer_ranges(r["layers"]), ", ".join(r["modules"]) or "-"])
        rows[-1].append(f"{r['cost']:.2f}")
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    if report.inflight is not None:
        lines.append(
            "stage micro-batches whose activations each pipeline rank holds at once (from the schedule's action list): "
            + ", ".join(f"pp rank {r}: {n}" for r, n in enumerate(report.inflight))
        )
    return lines


# --- memory per rank kind -------------------------------------------------------------------------------------------

GIB = 2**30


@dataclass(frozen=True)
class MemoryOptions:
    """What a rank's memory depends on beyond its shards: batch, dtypes (bytes), dispatcher, recompute and offload
    (Megatron module kinds; name patterns cannot be estimated and are left out, see ``skipped``)."""

    micro_batch: int
    seq_len: int
    activation_bytes: int = 2
    optimizer_state_bytes: int = 4
    master_weights_bytes: int = 4
    optimizer: str = "adamw"  # muon: Muon's matrices keep one momentum buffer instead of AdamW's two moments
    dispatcher: str = "alltoall"
    device: str = "cuda"
    recompute: frozenset[str] = frozenset()
    offload: frozenset[str] = frozenset()
    offload_min_tensor_bytes: int = DEFAULT_OFFLOAD_MIN_TENSOR_BYTES
    skipped: tuple[str, ...] = ()  # recompute / offload entries that are name patterns, not kinds


def memory_options(
    recompute_modules: list[str] = (), offload_modules: list[str] = (), **fields: object
) -> MemoryOptions:
    """:class:`MemoryOptions` from the run's recompute / offload lists: kinds are estimated, patterns skipped."""
    recompute = frozenset(m for m in recompute_modules if m in RECOMPUTE_KINDS)
    offload = frozenset(m for m in offload_modules if m in OFFLOAD_KINDS)
    skipped = tuple(m for m in [*recompute_modules, *offload_modules] if m not in recompute | offload)
    return MemoryOptions(recompute=recompute, offload=offload, skipped=skipped, **fields)  # type: ignore[arg-type]


def plan_micro_batching(cfg: ExperimentConfig, layout: ParallelLayout) -> tuple[int, int]:
    """The trainer's micro-batch size and count per data-parallel rank, or, for a global batch that does not split
    over this (real-size) layout, at least one sequence and one micro-batch: the plan sizes layouts before the
    batch is chosen for them."""
    try:
        return micro_batching(cfg.train, layout)
    except ConfigError:
        micro = cfg.train.micro_batch_size or default_micro_batch_size(cfg.train.global_batch_size)
        return micro, max(cfg.train.global_batch_size // (micro * layout.dp), 1)


def plan_memory_options(cfg: ExperimentConfig, layout: ParallelLayout) -> MemoryOptions:
    """The :class:`MemoryOptions` of an experiment config: ``train.micro_batch_size`` (0: the trainer's default,
    ``moe_train.setup.default_micro_batch_size``), ``data.seq_len``, ``run.dtype`` (auto: bf16, as on CUDA; fp32
    only with ``run.device cpu``), the AdamW state and master-weight dtypes, the dispatcher, recompute and offload."""
    micro, _ = plan_micro_batching(cfg, layout)
    on_cpu = cfg.run.device == "cpu"
    activation = (4 if on_cpu else 2) if cfg.run.dtype == "auto" else dtype_bytes(cfg.run.dtype)
    train, run = cfg.train, cfg.run
    return memory_options(
        list(run.recompute_modules),
        list(run.offload_modules),
        micro_batch=micro,
        seq_len=cfg.data.seq_len,
        activation_bytes=activation,
        optimizer_state_bytes=dtype_bytes(train.optimizer_states_dtype),
        master_weights_bytes={"none": 0}.get(train.master_weights_dtype, 4),
        optimizer=train.optimizer,
        dispatcher=cfg.parallel.moe_token_dispatcher_type,
        device="cpu" if on_cpu else "cuda",
        offload_min_tensor_bytes=run.offload_min_tensor_bytes,
    )


def memory_estimates(
    report: PlanReport, model_config: ModelConfig, options: MemoryOptions
) -> list[tuple[RankKind, MemoryEstimate]]:
    """Each rank kind's :class:`~moe_memory.estimate.MemoryEstimate`, from its exact parameter counts: the
    parameter bytes are the kind's shard bytes, gradients in the parameters' dtype."""
    layout, shape = report.layout, model_shape(model_config)
    out = []
    for kind in report.kinds:
        muon = options.optimizer == "muon"
        momentum = {"momentum_only_numel": kind.muon, "momentum_only_tensors": report.muon_tensors} if muon else {}
        numel, n_bytes = kind.param_count(), kind.param_bytes()
        param_bytes = n_bytes // numel if numel and n_bytes % numel == 0 else 4
        params = LocalParameters(
            numel=numel,
            tensors=report.param_tensors,
            buffer_bytes=sum(n * dtype.itemsize for dtype, n in kind.buffers.items()),
            expert_numel=kind.param_count(ROUTED_EXPERTS),
            **momentum,
        )
        run = run_shape(
            model_config,
            params,
            micro_batch=options.micro_batch,
            seq_len=options.seq_len,
            activation_bytes=options.activation_bytes,
            param_bytes=param_bytes,
            grad_bytes=param_bytes,
            optimizer_state_bytes=options.optimizer_state_bytes,
            master_weights_bytes=options.master_weights_bytes,
            layout=layout,
            dispatcher=options.dispatcher,
            device=options.device,
        )
        rank_shape, share = _pipeline_share(report, shape, kind)
        estimate = estimate_memory(
            rank_shape,
            run,
            recompute=options.recompute,
            offload=options.offload,
            offload_min_tensor_bytes=options.offload_min_tensor_bytes,
            pipeline=share,
        )
        if kind.trainable is not None:  # a frozen base: gradients, AdamW states and master copies of adapters only
            states, master = optimizer_state_bytes(
                kind.trainable, report.trainable_tensors or 0, run, *momentum.values()
            )
            estimate = dataclasses.replace(
                estimate, gradients=kind.trainable * param_bytes, optimizer_states=states, master_weights=master
            )
        out.append((kind, estimate))
    return out


def _pipeline_share(report: PlanReport, shape: ModelShape, kind: RankKind) -> tuple[ModelShape, PipelineShare | None]:
    """The part of the model a pipeline rank kind runs (its stages' layers; MTP with the last stage), and its share."""
    if report.stages is None or kind.pp_rank is None:
        return shape, None
    mine = [row for row in report.stages if row["pp_rank"] == kind.pp_rank]
    layers = sorted(i for row in mine for i in row["layers"])
    first = any(row["stage"] == 0 for row in mine)
    last = any(row["stage"] == len(report.stages) - 1 for row in mine)
    inflight = last_inflight = 1
    if report.inflight is not None:  # per stage: the rank's stages share its micro-batches in flight; the last its own
        inflight = math.ceil(report.inflight[kind.pp_rank] / len(mine))
        last_inflight = stage_inflight(report.schedule, report.layout.pp, len(mine), report.microbatches)[-1]
    rank_shape = dataclasses.replace(
        shape, layers=tuple(shape.layers[i] for i in layers), mtp_depth=shape.mtp_depth if last else 0
    )
    return rank_shape, PipelineShare(first=first, last=last, inflight=inflight, last_inflight=last_inflight)


def _bytes_name(n: int) -> str:
    return {1: "int8", 2: "bf16", 4: "fp32", 8: "fp64"}.get(n, f"{n}-byte")


def format_memory(
    estimates: list[tuple[RankKind, MemoryEstimate]],
    options: MemoryOptions,
    device_memory_gib: float | None = None,
) -> str:
    """The memory table (one column per rank kind, GiB), then, with ``device_memory_gib``, the rank kinds whose
    total exceeds it and by how much."""
    o = options
    settings = [
        f"micro-batch {o.micro_batch} x {o.seq_len} tokens",
        f"activations {_bytes_name(o.activation_bytes)}",
        ("Muon momentum + AdamW states " if o.optimizer == "muon" else "AdamW states ")
        + _bytes_name(o.optimizer_state_bytes),
        f"{o.dispatcher} dispatcher",
    ]
    if o.recompute:
        settings.append(f"recompute {', '.join(sorted(o.recompute))}")
    if o.offload:
        settings.append(f"offload {', '.join(sorted(o.offload))} (>= {o.offload_min_tensor_bytes:,} bytes)")
    lines = [
        "memory per rank at the start of the backward, estimated (moe_memory.estimate; " + ", ".join(settings) + "):"
    ]
    if o.skipped:
        lines.append(f"(not estimated: recompute/offload name patterns {', '.join(o.skipped)})")
    for kind, _ in estimates:
        if kind.trainable is not None:
            lines.append(
                f"ranks {rank_ranges(kind.ranks, most=2)}: LoRA, gradients and AdamW states for "
                f"{kind.trainable:,} adapter elements of {kind.param_count():,} (the base is frozen)"
            )
    columns = {f"ranks {rank_ranges(kind.ranks, most=2)}": estimate for kind, estimate in estimates}
    lines.append(format_estimates(columns, unit="GiB"))
    if device_memory_gib is not None:
        limit = device_memory_gib * GIB
        over = [(kind, e) for kind, e in estimates if e.total > limit]
        for kind, estimate in over:
            lines.append(
                f"ranks {rank_ranges(kind.ranks)} ({len(kind.ranks)}): {estimate.total / GIB:.2f} GiB exceeds "
                f"--device-memory {device_memory_gib:g} GiB by {(estimate.total - limit) / GIB:.2f} GiB"
            )
        if not over:
            largest = max(e.total for _, e in estimates)
            lines.append(
                f"every rank fits in --device-memory {device_memory_gib:g} GiB (largest {largest / GIB:.2f} GiB)"
            )
    return "\n".join(lines)
