"""The training loop: AdamW on byte-level data over any moe_parallel layout (FSDP2, expert, expert-tensor and
tensor parallel), with metrics, progress and a final checkpoint."""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch
from torch import nn

from moe_experts import BackendUnavailableError
from moe_memory import MemoryPolicy, apply_memory_policy, check_memory_options
from moe_models import ModelConfig, build_model, causal_lm_loss, training_flops_per_token
from moe_models.hf import CheckpointSource
from moe_parallel import (
    DistributedContext,
    ParallelConfig,
    ParallelLayout,
    ParallelModel,
    ParallelPlan,
    all_reduce_mean,
    build_meshes,
    check_plan,
    init_distributed,
    local_grad,
    materialize,
    parallelize,
)
from moe_train.checkpoint import save_checkpoint
from moe_train.config import ConfigError, ExperimentConfig, RunConfig, config_error
from moe_train.data import PreparedData, prepare_data
from moe_train.metrics import MetricsLog, peak_tflops
from moe_train.optim import build_optimizer, lr_at, set_lr
from moe_train.plots import heatmap_svg, line_chart_svg


@dataclass
class Setup:
    """Everything validated and built before anything is written to the output directory."""

    cfg: ExperimentConfig
    ctx: DistributedContext
    layout: ParallelLayout
    model: nn.Module  # split over the layout in place; ``parallel`` holds what the training step needs
    parallel: ParallelModel
    dtype: torch.dtype
    micro_batch: int
    grad_accum: int
    data: PreparedData  # training (and validation) token streams, built before the model
    memory: MemoryPolicy = field(default_factory=MemoryPolicy)  # what is recomputed and offloaded


@dataclass(frozen=True)
class TrainSummary:
    steps: int
    first_loss: float
    last_loss: float
    median_tokens_per_s: float
    wall_time_s: float
    output_dir: str
    checkpoint: str | None


def _resolve_device(cfg: ExperimentConfig) -> str:
    if cfg.run.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("run.device='cuda' but no CUDA device is visible; use run.device=cpu or auto")
    if cfg.run.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.run.device


def checked_meta_model(
    model_config: ModelConfig, parallel_config: ParallelConfig, world_size: int, run: RunConfig | None = None
) -> tuple[ParallelLayout, nn.Module, ParallelPlan]:
    """The layout, the model built on the meta device and its plan, checked against each other (``check_plan``) and,
    with ``run``, against its recompute and offload settings, before anything is allocated; errors become
    :class:`ConfigError`. Shared by ``train`` and ``plan``."""
    try:
        layout = parallel_config.layout(world_size)
        with torch.device("meta"):
            model = build_model(model_config)
        plan = model.parallel_plan()
        check_plan(model, plan, parallel_config, layout)
        if run is not None:
            check_memory_options(model, model.module_kinds(), *memory_options(run))
    except BackendUnavailableError as err:
        raise ConfigError(f"model.moe_expert_backend={model_config.moe_expert_backend!r}: {err}") from None
    except ValueError as err:  # ModelConfigError, LayoutError, MemoryConfigError
        raise config_error(err) from None
    return layout, model, plan


def memory_options(run: RunConfig) -> tuple[list[str], list[str], int]:
    """The run's recompute and offload settings, as moe_memory's policy functions take them."""
    return run.recompute_modules, run.offload_modules, run.offload_min_tensor_bytes


def _check_trainer_layout(cfg: ExperimentConfig, layout: ParallelLayout) -> None:
    """What the trainer needs of a layout beyond the model fitting it."""
    if cfg.data.seq_len % layout.tp:
        raise ConfigError(
            f"data.seq_len={cfg.data.seq_len} is not divisible by parallel.tp={layout.tp} (sequence parallel "
            "splits every sequence over the tp ranks)"
        )
    if cfg.run.save_checkpoint and layout.etp > 1:
        default = " (parallel.etp defaults to parallel.tp)" if cfg.parallel.etp is None else ""
        raise ConfigError(
            f"run.save_checkpoint=true with parallel.etp={layout.etp}{default}: checkpoints of expert-tensor-parallel "
            "runs are not implemented yet; set parallel.etp=1 or run.save_checkpoint=false"
        )


def _checkpoint_source(cfg: ExperimentConfig) -> CheckpointSource:
    """The HuggingFace checkpoint the weights come from, its names and shapes checked against the model config."""
    try:
        return CheckpointSource(cfg.model_from_hf, cfg.model)
    except (ValueError, OSError) as err:  # HFCheckpointError is a ValueError
        hint = "; model.* overrides must not change the checkpoint's sizes" if "shape" in str(err) else ""
        raise ConfigError(f"model.from_hf={cfg.model_from_hf!r}: {err}{hint}") from None


def prepare(cfg: ExperimentConfig, world_size: int, *, build_on_meta: bool = True) -> Setup:
    """Validate the config against this launch, join the process group and build this rank's part of the model.

    The model is built on the meta device, split over the layout (expert, tensor parallelism, recompute, FSDP), and
    only then materialised: each rank allocates and fills its own shards, from fresh initial values or from the
    HuggingFace checkpoint. ``build_on_meta=False`` builds the whole model with values first (as every rank did
    before; the same values, kept to check that both ways train alike).
    """
    device_type = _resolve_device(cfg)
    layout, model, plan = checked_meta_model(cfg.model, cfg.parallel, world_size, cfg.run)
    _check_trainer_layout(cfg, layout)
    micro = cfg.train.micro_batch_size or cfg.train.global_batch_size // layout.dp
    if micro == 0 or cfg.train.global_batch_size % (micro * layout.dp):
        raise ConfigError(
            f"train.global_batch_size={cfg.train.global_batch_size} is not a multiple of "
            f"train.micro_batch_size ({micro}) x data-parallel size ({layout.dp})"
        )
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(
        cfg.run.dtype, torch.bfloat16 if device_type == "cuda" else torch.float32
    )
    source = _checkpoint_source(cfg) if cfg.model_from_hf else None
    data = prepare_data(
        cfg.data, seed=cfg.train.seed, model_vocab_size=cfg.model.vocab_size, model_from_hf=cfg.model_from_hf
    )
    ctx = init_distributed(cfg.parallel.backend, device_type)
    torch.manual_seed(cfg.train.seed)  # anything else drawing from the global generator draws alike on every rank
    if not build_on_meta:
        with torch.device(ctx.device):
            model = build_model(cfg.model, seed=cfg.train.seed)
    if cfg.train.params_dtype == "bf16":
        # cast while the model is still on the meta device (or right after the eager build): each rank only ever
        # allocates bf16 shards, which materialize fills with the fp32 initial values rounded to nearest. The
        # routers keep their expert_bias buffers in fp32 (TopKRouter._apply) and compute in their own router dtype
        model.to(torch.bfloat16)
    meshes = build_meshes(layout, ctx.device.type) if ctx.world_size > 1 else None
    memory = MemoryPolicy()

    def recompute_and_offload(modules: nn.Module) -> None:
        nonlocal memory
        memory = apply_memory_policy(modules, modules.module_kinds(), *memory_options(cfg.run))

    parallel = parallelize(model, meshes, cfg.parallel, plan, before_fsdp=recompute_and_offload)
    if build_on_meta or source is not None:
        try:
            materialize(model, plan, source or model.initial_weights(cfg.train.seed), ctx.device)
        finally:
            if source is not None:
                source.close()
    grad_accum = cfg.train.global_batch_size // (micro * layout.dp)
    return Setup(cfg, ctx, layout, model, parallel, dtype, micro, grad_accum, data, memory)


class Progress:
    """One line per log interval on rank 0: step, loss, learning rate, throughput and time left."""

    def __init__(self, total_steps: int, interval: int, enabled: bool, stream: TextIO | None = None) -> None:
        self.total, self.interval, self.enabled, self.stream = total_steps, interval, enabled, stream
        self.start = time.perf_counter()

    def message(self, text: str) -> None:
        if self.enabled:
            print(text, file=self.stream or sys.stdout, flush=True)

    def step(self, record: dict[str, Any]) -> None:
        step = record["step"]
        if not self.enabled or (step % self.interval and step not in (1, self.total)):
            return
        now = time.perf_counter()
        if step == 1:  # the first step pays one-off costs (allocations, warm-up): the rate starts after it
            self.start = now
        eta = (now - self.start) / max(step - 1, 1) * (self.total - step)
        eta_text = "--:--" if step == 1 and self.total > 1 else f"{int(eta) // 60}:{int(eta) % 60:02d}"
        self.message(
            f"step {step:>{len(str(self.total))}}/{self.total}  loss {record['loss']:.4f}  "
            f"aux {record['aux_loss']:.4f}  "
            + (f"mtp {record['mtp_loss']:.4f}  " if record["mtp_loss"] else "")
            + f"lr {record['lr']:.2e}  gnorm {record['grad_norm']:.3f}  "
            f"{record['tokens_per_s'] / 1e3:.1f}k tok/s  {record['tflops_per_gpu']:.3f} TFLOPS  "
            f"MFU {100 * record['mfu']:.1f}%  eta {eta_text}"
        )


def train(setup: Setup) -> TrainSummary:
    cfg, ctx = setup.cfg, setup.ctx
    started = time.perf_counter()
    out_dir = Path(cfg.run.output_dir)
    progress = Progress(cfg.train.steps, cfg.run.log_interval, ctx.is_main)
    model, parallel = setup.model, setup.parallel
    optimizer = build_optimizer(model, cfg.train)
    stream = setup.data.train
    peak, peak_source = peak_tflops(ctx.device, setup.dtype, cfg.run.peak_tflops)
    flops_per_token = training_flops_per_token(cfg.model, cfg.data.seq_len)
    tokens_per_step = cfg.train.global_batch_size * cfg.data.seq_len
    per_rank = setup.micro_batch * setup.grad_accum
    params = [p for p in model.parameters() if p.requires_grad]
    autocast = torch.autocast(ctx.device.type, dtype=setup.dtype, enabled=setup.dtype != torch.float32)
    n_params = sum(p.numel() for p in params)  # DTensors count globally; etp > 1 experts count this rank's slice

    log: MetricsLog | None = None
    if ctx.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
        log = MetricsLog(out_dir / "metrics.jsonl")
    progress.message(
        f"moe-train: {cfg.model.family} {n_params / 1e6:.2f}M params, {ctx.world_size} rank(s) on {ctx.device.type}, "
        f"global batch {cfg.train.global_batch_size} x {cfg.data.seq_len} tokens "
        f"(micro {setup.micro_batch}, accumulation {setup.grad_accum}), peak {peak:.3f} TFLOPS ({peak_source}), "
        f"{cfg.train.params_dtype} params, AdamW states {cfg.train.optimizer_states_dtype}"
        + (f", master weights {cfg.train.master_weights_dtype}" if cfg.train.params_dtype != "fp32" else "")
        + _memory_message(setup.memory)
    )
    load_LE = None
    for step in range(cfg.train.steps):
        step_start = time.perf_counter()
        lr = lr_at(step, cfg.train)
        set_lr(optimizer, lr)
        optimizer.zero_grad(set_to_none=True)
        lm_sum = torch.zeros((), device=ctx.device)
        aux_sum = torch.zeros((), device=ctx.device)
        mtp_sum = torch.zeros((), device=ctx.device)
        for micro in range(setup.grad_accum):
            # the ranks of one data-parallel replica (tp) read the same sequences
            first = parallel.dp_index * per_rank + micro * setup.micro_batch
            batch = stream.batch(step, cfg.train.global_batch_size, first, setup.micro_batch)
            inputs, labels = batch.input_ids_BS.to(ctx.device), batch.labels_BS.to(ctx.device)
            with autocast:
                out = model(inputs)
            loss = causal_lm_loss(out, labels, cfg.model.mtp_loss_scaling_factor)
            loss.total.backward()  # the routers' balancing losses ride along on their probabilities
            lm_sum += loss.lm
            if loss.mtp:
                mtp_sum += torch.stack(loss.mtp).mean()
            aux_sum += out.aux_loss.detach()
            load_LE = out.tokens_per_expert_LE if micro == 0 else load_LE + out.tokens_per_expert_LE
        clip = cfg.train.clip_grad if cfg.train.clip_grad > 0 else math.inf
        # the accumulated gradient is a sum over micro-batches; dividing it (not each loss) also scales
        # the load-balancing gradients the routers attach inside the backward
        grads = [g for g in map(local_grad, params) if g is not None]
        if setup.grad_accum > 1:
            torch._foreach_div_(grads, float(setup.grad_accum))
        parallel.finalize_grads()
        grad_norm = parallel.clip_grad_norm_(clip, params)
        optimizer.step()
        if cfg.model.moe_router_enable_expert_bias:
            # counts the forwards returned, so a recomputed layer is not counted twice; summed over every rank's
            # tokens (the routers' stats_group) so all ranks apply the same update
            for router, counts_E in zip(model.routers(), load_LE, strict=True):
                router.update_expert_bias(counts_E)
        loss = all_reduce_mean(lm_sum / setup.grad_accum).item()
        aux = all_reduce_mean(aux_sum / setup.grad_accum).item()
        mtp = all_reduce_mean(mtp_sum / setup.grad_accum).item()
        load = all_reduce_mean(load_LE.float())
        step_time = time.perf_counter() - step_start
        tokens_per_s = tokens_per_step / step_time
        tflops = flops_per_token * tokens_per_s / ctx.world_size / 1e12
        record = {
            "step": step + 1,
            "loss": loss,
            "aux_loss": aux,
            "mtp_loss": mtp,  # mean over MTP depths, unscaled; 0 without MTP
            "lr": lr,
            "grad_norm": grad_norm.item(),
            "tokens_per_s": tokens_per_s,
            "tflops_per_gpu": tflops,
            "mfu": tflops / peak,
            "step_time_s": step_time,
            "expert_load_max_over_mean": (load.max(dim=1).values / load.mean(dim=1)).mean().item(),
            # (token, expert) pairs dropped by a capacity factor, over all layers
            "dropped_fraction": 1.0
            - load.sum().item() / (tokens_per_step / ctx.world_size * cfg.model.moe_router_topk * len(load)),
        }
        if log is not None:
            log.write(record)
        progress.step(record)

    checkpoint = None
    if cfg.run.save_checkpoint:
        checkpoint = str(save_checkpoint(out_dir / "checkpoints", model, optimizer, cfg.train.steps))
    records = log.records if log is not None else []
    summary = TrainSummary(
        steps=cfg.train.steps,
        first_loss=records[0]["loss"] if records else float("nan"),
        last_loss=records[-1]["loss"] if records else float("nan"),
        median_tokens_per_s=statistics.median(r["tokens_per_s"] for r in records[1:] or records) if records else 0.0,
        wall_time_s=time.perf_counter() - started,
        output_dir=str(out_dir),
        checkpoint=checkpoint,
    )
    if log is not None:
        log.close()
        _write_pictures(out_dir, records, load)
        (out_dir / "summary.json").write_text(json.dumps(summary.__dict__, indent=2))
    progress.message(
        f"done: {summary.steps} steps in {summary.wall_time_s:.1f}s, loss {summary.first_loss:.4f} -> "
        f"{summary.last_loss:.4f}, median {summary.median_tokens_per_s / 1e3:.1f}k tok/s; "
        f"metrics in {out_dir / 'metrics.jsonl'}, checkpoint {checkpoint}"
    )
    return summary


def _memory_message(memory: MemoryPolicy) -> str:
    """``, recomputing layernorm (8 modules), offloading ...`` for the start-up line: kinds, not every module."""
    parts = []
    for verb, chosen in (("recomputing", memory.recomputed), ("offloading", memory.offloaded)):
        if chosen:
            counts: dict[str, int] = {}
            for selector in chosen.values():
                counts[selector] = counts.get(selector, 0) + 1
            parts.append(f"{verb} " + ", ".join(f"{k} ({n} modules)" for k, n in counts.items()))
    return "".join(f", {p}" for p in parts)


def _write_pictures(out_dir: Path, records: list[dict[str, Any]], load_LE: torch.Tensor) -> None:
    steps = [r["step"] for r in records]
    (out_dir / "loss.svg").write_text(
        line_chart_svg(steps, [r["loss"] for r in records], "training loss", "step", "cross-entropy (nats/byte)")
    )
    (out_dir / "expert_load.svg").write_text(
        heatmap_svg(
            load_LE.tolist(), "tokens per expert at the last step, as a multiple of the layer mean", "layer", "expert"
        )
    )
