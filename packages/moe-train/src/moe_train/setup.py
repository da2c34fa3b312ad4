"""Everything checked and built before a run writes anything: the config against this launch, the meta-built model
and its plan, the layout, the data, and this rank's part of the model split over the layout and materialised
(:func:`prepare`). :mod:`moe_train.trainer` runs the loop on what this returns."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from moe_experts import BACKENDS, BackendUnavailableError, resolve_backend
from moe_memory import MemoryPolicy, check_memory_options
from moe_models import ModelConfig, build_model
from moe_models.hf import CheckpointSource
from moe_parallel import (
    DistributedContext,
    ParallelConfig,
    ParallelLayout,
    ParallelPlan,
    StagedModel,
    build_meshes,
    check_layout,
    init_distributed,
    microbatch_rule,
    parallelize_stages,
)
from moe_train.compile import compile_problem
from moe_train.config import ConfigError, ExperimentConfig, PeftConfig, RunConfig, TrainConfig, config_error
from moe_train.cuda_graphs import cuda_graphs_problem, graph_run_regions
from moe_train.data import PreparedData, prepare_data
from moe_train.dtypes import torch_dtype
from moe_train.loggers import check_wandb_available
from moe_train.peft import AdapterSource, add_adapters, check_precision_for_adapters
from moe_train.precision import dispatch_wire
from moe_train.resume import ResumePoint, check_output_dir, find_resume_point
from moe_train.transforms import ModelTransforms, memory_settings


@dataclass
class Setup:
    """Everything validated and built before anything is written to the output directory."""

    cfg: ExperimentConfig
    ctx: DistributedContext
    layout: ParallelLayout
    # this rank's stages of the model (one without pp), split over the layout: ``parallel.model``; ``parallel``
    # holds what the training step needs
    model: nn.Module
    parallel: StagedModel
    dtype: torch.dtype
    micro_batch: int
    grad_accum: int
    data: PreparedData
    memory: MemoryPolicy = field(default_factory=MemoryPolicy)  # what is recomputed and offloaded
    resume: ResumePoint | None = None  # the checkpoint the run continues from
    checkpoint_group: Any = None  # the process group asynchronous checkpoint writes talk over
    precision_modules: int = 0  # linears and expert projections running the precision recipe (this rank's)
    precision_native: bool = False  # the recipe's GEMMs run natively (else emulated)


def _resolve_device(cfg: ExperimentConfig) -> str:
    if cfg.run.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("run.device='cuda' but no CUDA device is visible; use run.device=cpu or auto")
    if cfg.run.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.run.device


def checked_meta_model(
    model_config: ModelConfig,
    parallel_config: ParallelConfig,
    world_size: int,
    run: RunConfig | None = None,
    seq_len: int | None = None,
    peft: PeftConfig | None = None,
) -> tuple[ParallelLayout, nn.Module, ParallelPlan]:
    """The layout, the model built on the meta device and its plan, checked against each other (``check_plan``) and,
    with ``run``, against its recompute and offload settings, before anything is allocated; errors become
    :class:`ConfigError`. ``seq_len``: the run's sequence length, which the pipeline stages are balanced at (None:
    the model's default). ``peft``: adapters added and the base frozen before the plan is made, so that the plan
    splits each adapter as the weight it adapts (:mod:`moe_train.peft`). Shared by ``train`` and ``plan``."""
    try:
        with torch.device("meta"):
            model = build_model(model_config)
        if peft is not None:
            add_adapters(model, peft)
        plan = model.parallel_plan(seq_len)
        # suggested values of a refused size pass every rule at once, the model's and the world's
        layout = check_layout(model, plan, parallel_config, world_size)
        if run is not None:
            check_memory_options(model, model.module_kinds(), *memory_settings(run))
    except BackendUnavailableError as err:
        raise ConfigError(f"model.moe_expert_backend={model_config.moe_expert_backend!r}: {err}") from None
    except ValueError as err:  # ModelConfigError, LayoutError, MemoryConfigError
        raise config_error(err) from None
    return layout, model, plan


def _check_expert_backend_dtype(cfg: ExperimentConfig, experts_dtype: torch.dtype) -> None:
    """A named expert back end whose kernels do not take the dtype the experts compute in (bf16 under autocast or
    with bf16 parameters, else fp32) is a config error here rather than a failure in the first step."""
    name = cfg.model.moe_expert_backend
    backend = BACKENDS.get(name)
    if backend is None or backend.takes(experts_dtype):
        return
    takes = ", ".join(str(d).removeprefix("torch.") for d in backend.dtypes or ())
    raise ConfigError(
        f"model.moe_expert_backend={name!r}: its kernels take {takes} only, and this run computes the experts in "
        f"{str(experts_dtype).removeprefix('torch.')} (run.dtype={cfg.run.dtype!r}); set run.dtype bf16, or use "
        "backend torch or auto"
    )


def _check_delayed_wgrad_backend(cfg: ExperimentConfig, experts_dtype: torch.dtype) -> None:
    """``parallel.delay_wgrad_compute`` with an expert back end that has no separate weight-gradient kernel (te,
    grouped_gemm; ``auto`` where it picks one) would delay nothing: a config error rather than a silent no-op."""
    if not cfg.parallel.delay_wgrad_compute:
        return
    name = cfg.model.moe_expert_backend
    backend = resolve_backend(name, experts_dtype) if name == "auto" else BACKENDS.get(name)
    if backend is not None and backend.wgrad is None:
        raise ConfigError(
            f"parallel.delay_wgrad_compute=true: the experts' back end {backend.name!r} (model.moe_expert_backend="
            f"{name!r}) has no separate weight-gradient kernel to delay; set model.moe_expert_backend torch, or "
            "parallel.delay_wgrad_compute false"
        )


# train.micro_batch_size 0: at most this many sequences per forward, whatever the layout
DEFAULT_MICRO_BATCH_SIZE = 4


def default_micro_batch_size(global_batch_size: int) -> int:
    """``train.micro_batch_size`` 0: the largest divisor of the global batch up to :data:`DEFAULT_MICRO_BATCH_SIZE`.
    It depends on the batch alone, not on the layout: balancing losses are computed per micro-batch, so runs under
    different layouts compute the same losses only with the same micro-batches."""
    return max(d for d in range(1, min(global_batch_size, DEFAULT_MICRO_BATCH_SIZE) + 1) if global_batch_size % d == 0)


def micro_batching(train_config: TrainConfig, layout: ParallelLayout) -> tuple[int, int]:
    """(sequences per micro-batch, micro-batches per step) on each data-parallel rank: ``train.micro_batch_size``
    (0: :func:`default_micro_batch_size`), gradient accumulation filling the rank's share of the global batch."""
    global_batch = train_config.global_batch_size
    micro = train_config.micro_batch_size or default_micro_batch_size(global_batch)
    if global_batch % (micro * layout.dp):
        default = "" if train_config.micro_batch_size else ", the default"
        share = global_batch // layout.dp if global_batch % layout.dp == 0 else 0
        fits = [d for d in range(1, share + 1) if share % d == 0]
        fix = (
            f"set train.micro_batch_size to one of {fits} (equal micro-batch sizes train alike under every layout)"
            if fits
            else f"make train.global_batch_size a multiple of the data-parallel size {layout.dp}"
        )
        raise ConfigError(
            f"train.global_batch_size={global_batch} is not a multiple of train.micro_batch_size ({micro}{default}) x "
            f"data-parallel size ({layout.dp}); {fix}"
        )
    return micro, global_batch // (micro * layout.dp)


def _check_trainer_layout(cfg: ExperimentConfig, layout: ParallelLayout) -> None:
    """What the trainer needs of a layout beyond the model fitting it."""
    if layout.cp > 1 and cfg.data.seq_len % (2 * layout.cp * layout.tp):
        sp = f" x parallel.tp={layout.tp}" if layout.tp > 1 else ""
        raise ConfigError(
            f"data.seq_len={cfg.data.seq_len} is not divisible by 2 x parallel.cp={layout.cp}{sp} = "
            f"{2 * layout.cp * layout.tp} (context parallelism cuts every sequence into 2 x cp load-balanced chunks"
            + (", sequence parallelism each rank's share into tp" if layout.tp > 1 else "")
            + ")"
        )
    if cfg.data.seq_len % layout.tp:
        raise ConfigError(
            f"data.seq_len={cfg.data.seq_len} is not divisible by parallel.tp={layout.tp} (sequence parallel "
            "splits every sequence over the tp ranks)"
        )


def _checkpoint_source(cfg: ExperimentConfig) -> CheckpointSource:
    """The HuggingFace checkpoint the weights come from, its names and shapes checked against the model config."""
    try:
        return CheckpointSource(cfg.model_from_hf, cfg.model)
    except (ValueError, OSError) as err:  # HFCheckpointError is a ValueError
        hint = "; model.* overrides must not change the checkpoint's sizes" if "shape" in str(err) else ""
        raise ConfigError(f"model.from_hf={cfg.model_from_hf!r}: {err}{hint}") from None


@dataclass
class RunChecks:
    """What :func:`check_run` found: everything about a run that can be known without joining a process group."""

    device_type: str
    native_precision: bool
    resume: ResumePoint | None
    data: PreparedData
    source: CheckpointSource | None  # model.from_hf's files, open (close it when not building)
    layout: ParallelLayout
    model: nn.Module  # on the meta device
    plan: ParallelPlan
    micro_batch: int
    grad_accum: int
    dtype: torch.dtype


def check_run(cfg: ExperimentConfig, world_size: int) -> RunChecks:
    """Every check of a run of ``world_size`` ranks that needs no process group, in order, before anything is written
    to the output directory (the token cache aside): ``ConfigError`` for the first that fails. Each rank runs it
    before joining the group, and ``moe-train launch`` runs it once before starting any."""
    device_type = _resolve_device(cfg)
    check_precision_for_adapters(cfg)
    try:
        native_precision = cfg.precision.native_on(device_type)
    except ValueError as err:  # PrecisionConfigError
        raise config_error(err) from None
    check_output_dir(cfg)
    resume = find_resume_point(cfg)
    if cfg.run.wandb_project:
        try:
            check_wandb_available(cfg.run.wandb_project)
        except ValueError as err:
            raise ConfigError(str(err)) from None
    data = prepare_data(
        cfg.data, seed=cfg.train.seed, model_vocab_size=cfg.model.vocab_size, model_from_hf=cfg.model_from_hf
    )
    if (
        data.valid is not None
        and cfg.train.eval_interval
        and len(data.valid.eval_offsets()) < cfg.train.global_batch_size
    ):
        raise ConfigError(
            f"train.eval_interval={cfg.train.eval_interval}: the validation data holds "
            f"{len(data.valid.eval_offsets())} windows of data.seq_len={cfg.data.seq_len}, fewer than one batch of "
            f"train.global_batch_size={cfg.train.global_batch_size}; add validation data or raise data.valid_fraction"
        )
    source = _checkpoint_source(cfg) if cfg.model_from_hf else None  # names, shapes and file headers checked
    try:
        layout, model, plan = checked_meta_model(
            cfg.model, cfg.parallel, world_size, cfg.run, cfg.data.seq_len, cfg.peft
        )
        _check_trainer_layout(cfg, layout)
        problem = compile_problem(cfg, layout) or cuda_graphs_problem(cfg, layout, device_type)
        if problem is not None:
            raise ConfigError(problem)
        micro, grad_accum = micro_batching(cfg.train, layout)
        reason = microbatch_rule(cfg.parallel, layout, grad_accum)
        if reason is not None:
            raise ConfigError(
                f"train.global_batch_size={cfg.train.global_batch_size}: {grad_accum} micro-batches of "
                f"train.micro_batch_size={micro} per data-parallel rank, and {reason}; raise the batch or lower the "
                "micro-batch size"
            )
        auto = torch.bfloat16 if device_type == "cuda" else torch.float32
        dtype = auto if cfg.run.dtype == "auto" else torch_dtype(cfg.run.dtype)
        experts_dtype = torch.bfloat16 if cfg.train.params_dtype == "bf16" else dtype
        _check_expert_backend_dtype(cfg, experts_dtype)
        _check_delayed_wgrad_backend(cfg, experts_dtype)
    except BaseException:
        if source is not None:
            source.close()
        raise
    return RunChecks(device_type, native_precision, resume, data, source, layout, model, plan, micro, grad_accum, dtype)


def prepare(cfg: ExperimentConfig, world_size: int) -> Setup:
    """Validate the config against this launch (:func:`check_run`), join the process group and build this rank's
    part of the model.

    The model is built on the meta device, split over the layout (expert, tensor parallelism, recompute, FSDP), and
    only then materialised: each rank allocates and fills its own shards, from fresh initial values or from the
    HuggingFace checkpoint.
    """
    checked = check_run(cfg, world_size)
    try:
        return _build(cfg, checked)
    except BaseException:
        if checked.source is not None:
            checked.source.close()
        raise


def _build(cfg: ExperimentConfig, checked: RunChecks) -> Setup:
    """:func:`prepare` once the run is checked."""
    device_type, native_precision = checked.device_type, checked.native_precision
    resume, data, layout, model, plan = checked.resume, checked.data, checked.layout, checked.model, checked.plan
    source, micro, grad_accum, dtype = checked.source, checked.micro_batch, checked.grad_accum, checked.dtype
    if resume is not None and resume.meta.get("data", {}).get("fingerprint") not in (None, data.fingerprint):
        # not refused: continuing a run on new data is a thing people do on purpose; but it is not a resume
        print(
            f"moe-train: note: {resume.checkpoint.path} was trained on other data than data.source={cfg.data.source!r} "
            "(another token-file fingerprint); its batches from here on differ from the original run's",
            file=sys.stderr,
        )
    ctx = init_distributed(cfg.parallel.backend, device_type, cfg.parallel.timeout)
    torch.manual_seed(cfg.train.seed)  # anything else drawing from the global generator draws alike on every rank
    if cfg.train.params_dtype == "bf16":
        # cast while the model is still on the meta device: each rank only ever
        # allocates bf16 shards, which materialize fills with the fp32 initial values rounded to nearest. The
        # routers keep their expert_bias buffers in fp32 (TopKRouter._apply) and compute in their own router dtype
        model.to(torch.bfloat16)
    meshes = build_meshes(layout, ctx.device.type, cfg.parallel.timeout) if ctx.world_size > 1 else None
    # with pp > 1 applied once per stage (checked on the whole model above): a stage may lack a kind
    transforms = ModelTransforms(cfg, native_precision, part=layout.pp > 1)
    parallel = parallelize_stages(
        model, meshes, cfg.parallel, plan, before_fsdp=transforms, dispatch_wire=dispatch_wire(cfg.precision)
    )
    base = source or model.initial_weights(cfg.train.seed)
    lora = cfg.peft.method == "lora"
    try:
        parallel.materialize(AdapterSource(base, model, cfg.train.seed) if lora else base, ctx.device)
    finally:
        if source is not None:
            source.close()
    if cfg.run.cuda_graphs:  # one process on CUDA (cuda_graphs_problem): checked, then captured at first use
        graph_run_regions(parallel, tuple(cfg.run.cuda_graphs), (micro, cfg.data.seq_len), cfg.model.vocab_size, dtype)
    checkpoint_group = None
    if cfg.run.async_checkpoint and ctx.world_size > 1:
        # background writes talk over a group of their own, never interleaved with the training step's collectives
        checkpoint_group = torch.distributed.new_group(backend="gloo", timeout=cfg.parallel.timeout)
    return Setup(
        cfg,
        ctx,
        layout,
        parallel.model,
        parallel,
        dtype,
        micro,
        grad_accum,
        data,
        transforms.memory,
        resume=resume,
        checkpoint_group=checkpoint_group,
        precision_modules=transforms.precision_modules,
        precision_native=native_precision,
    )
