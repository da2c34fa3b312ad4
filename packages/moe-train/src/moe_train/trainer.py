"""The training loop: AdamW over any moe_parallel layout (FSDP2, expert, expert-tensor, tensor and pipeline
parallel), with metrics, evaluation, progress, periodic checkpoints and resume (:mod:`moe_train.resume`),
preemption and non-finite steps handled (:mod:`moe_train.faults`). What it runs on is built by
:mod:`moe_train.setup`."""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch

from moe_memory import MemoryPolicy
from moe_parallel import hidden_matrix_splits
from moe_precision import PrecisionConfig
from moe_train.checkpoint import CheckpointWriter, load_checkpoint, package_versions
from moe_train.config import ConfigError, ExperimentConfig
from moe_train.faults import NonFiniteError, StopRequest, agree_on_failure
from moe_train.loggers import RunLoggers
from moe_train.loop import TrainLoop
from moe_train.metrics import MetricsLog
from moe_train.muon import grouping_message
from moe_train.optim import build_optimizer
from moe_train.output_lock import OutputDirLock
from moe_train.plots import heatmap_svg, line_chart_svg
from moe_train.resume import (
    ResumePoint,
    check_output_dir,
    checkpoint_dir,
    find_resume_point,
    print_notes,
    start_history,
)

# what runs a training is built by moe_train.setup; ``from moe_train.trainer import prepare, train`` keeps working
from moe_train.setup import Setup, prepare  # noqa: F401
from moe_train.write_errors import OutputWriteError, write_whole, writing


@dataclass(frozen=True)
class TrainSummary:
    steps: int  # the last step done
    first_loss: float | None  # None when not finite
    last_loss: float | None
    median_tokens_per_s: float
    wall_time_s: float
    output_dir: str
    checkpoint: str | None
    status: str = "completed"  # completed | stopped (signal, run.exit_interval) | diverged (non-finite)
    resumed_from: str | None = None


class Progress:
    """One line per log interval on rank 0: step, loss, learning rate, throughput and time left."""

    def __init__(
        self, total_steps: int, interval: int, enabled: bool, stream: TextIO | None = None, first_step: int = 0
    ) -> None:
        self.total, self.interval, self.enabled, self.stream = total_steps, interval, enabled, stream
        self.first = first_step + 1  # a resumed run's first step
        self.start = time.perf_counter()

    def message(self, text: str) -> None:
        if self.enabled:
            print(text, file=self.stream or sys.stdout, flush=True)

    def shows(self, step: int) -> bool:
        """Whether step ``step``'s line is printed (on rank 0; evaluation steps are too)."""
        return step % self.interval == 0 or step in (self.first, self.total)

    def step(self, record: dict[str, Any]) -> None:
        step = record["step"]
        if not self.enabled or (not self.shows(step) and "val_loss" not in record):
            return
        now = time.perf_counter()
        if step == self.first:  # the first step pays one-off costs (allocations, warm-up): the rate starts after it
            self.start = now
        eta = (now - self.start) / max(step - self.first, 1) * (self.total - step)
        eta_text = "--:--" if step == self.first and self.total > step else f"{int(eta) // 60}:{int(eta) % 60:02d}"
        self.message(
            f"step {step:>{len(str(self.total))}}/{self.total}  loss {record['loss']:.4f}  "
            f"aux {record['aux_loss']:.4f}  "
            + (f"mtp {record['mtp_loss']:.4f}  " if record["mtp_loss"] else "")
            + (f"indexer {record['indexer_loss']:.4f}  " if "indexer_loss" in record else "")
            + (f"val {record['val_loss']:.4f}  " if "val_loss" in record else "")
            + ("(skipped: not finite)  " if record.get("skipped") else "")
            + f"lr {record['lr']:.2e}  gnorm {record['grad_norm']:.3f}  "
            f"{record['tokens_per_s'] / 1e3:.1f}k tok/s  {record['tflops_per_gpu']:.3f} TFLOPS  "
            f"MFU {100 * record['mfu']:.1f}%  eta {eta_text}"
        )


def train(setup: Setup) -> TrainSummary:
    """Run (or continue, from ``setup.resume``) the training loop; checkpoints as ``run.*`` says. Stops early, with
    a checkpoint, on SIGTERM / SIGINT or at ``run.exit_interval``; raises :class:`NonFiniteError` when the loss or
    gradient norm stops being finite (after skipping up to ``train.skip_nonfinite_steps`` such steps) and
    :class:`~moe_train.write_errors.OutputWriteError` when a file of the run cannot be written (a full disk).

    The main rank holds the output directory's lock (:mod:`moe_train.output_lock`) for the whole run, taken before
    anything is read or written (a :class:`ConfigError` naming the holder's PID when another run has it) and
    released however the run ends; the directory is checked again once held, as another run may have written into it
    since :func:`prepare` looked."""
    lock, failure = None, None
    try:
        if setup.ctx.is_main:
            try:
                lock = OutputDirLock(setup.cfg.run.output_dir).acquire()
                check_output_dir(setup.cfg, locked=True)
                _check_resume_point_unchanged(setup)
            except ConfigError as err:
                failure = err
        agree_on_failure(failure, setup.ctx.device)
        return _run(setup)
    finally:
        if lock is not None:
            lock.release()


def _check_resume_point_unchanged(setup: Setup) -> None:
    """The resume point (and the history it abandons) :func:`prepare` chose, chosen again under the lock: another
    run may have written a checkpoint in between."""
    now = find_resume_point(setup.cfg)

    def key(point: ResumePoint | None) -> tuple[object, ...] | None:
        return None if point is None else (point.checkpoint, point.abandoned)

    if key(now) != key(setup.resume):
        was = setup.resume.checkpoint.path if setup.resume else "a fresh start"
        raise ConfigError(
            f"run.output_dir={setup.cfg.run.output_dir!r}: another run wrote into it while this one was being built "
            f"(the resume point was {was}, is now {now.checkpoint.path if now else 'a fresh start'}); start again"
        )


def _run(setup: Setup) -> TrainSummary:
    cfg, ctx = setup.cfg, setup.ctx
    started = time.perf_counter()
    out_dir = Path(cfg.run.output_dir)
    model = setup.model
    if cfg.model.dsa_indexer_dense_warmup:
        freeze_all_but_indexers(model)
    # over the parameters that require a gradient; Muon gathers the matrices the layout splits
    optimizer = build_optimizer(model, cfg.train, hidden_matrix_splits(setup.parallel))
    writer = CheckpointWriter(
        checkpoint_dir(cfg),
        keep_last=cfg.run.keep_last,
        async_save=cfg.run.async_checkpoint,
        parallel=setup.parallel,
        process_group=setup.checkpoint_group,
    )
    start = 0
    if setup.resume is not None:
        same_world = setup.resume.meta.get("world_size") == ctx.world_size  # per-rank generators only map 1:1
        start = load_checkpoint(setup.resume.checkpoint.path, model, optimizer, setup.parallel, restore_rng=same_world)
    loop = TrainLoop(setup, optimizer, start)
    logs, failure = None, None
    if ctx.is_main:
        try:
            with writing(checkpoint_dir(cfg), "the run did not start"):
                print_notes(start_history(cfg, setup.resume))
            with writing(out_dir / "config.json", "the run did not start"):
                out_dir.mkdir(parents=True, exist_ok=True)
                write_whole(out_dir / "config.json", json.dumps(cfg.to_dict(), indent=2))
            with writing(out_dir / "metrics.jsonl", "the run did not start"):
                logs = _RunLogs(cfg, out_dir, start)
        except OutputWriteError as err:
            failure = err
    # also the barrier: the output directory is cleared before any rank writes a checkpoint into it
    agree_on_failure(failure, ctx.device)
    progress = Progress(cfg.train.steps, cfg.run.log_interval, ctx.is_main, first_step=start)
    progress.message(_start_message(setup, loop))
    if setup.resume is not None:
        progress.message(f"resumed from {setup.resume.checkpoint.path} at step {start}")
    status, stop_reason = "completed", ""
    try:
        with StopRequest() as stop:
            for step in range(start, cfg.train.steps):
                done = step + 1
                saves = bool(cfg.run.checkpoint_interval and done % cfg.run.checkpoint_interval == 0)
                exits = bool(cfg.run.exit_interval and done % cfg.run.exit_interval == 0)
                last = done == cfg.train.steps
                shown = progress.shows(done) or loop.evaluates(done)
                result = loop.step(step, writer.last, stop, write_metrics=shown or saves or exits or last)
                if logs is not None:
                    logs.write(result.records, writer.last)
                for record in result.records:
                    progress.step(record)
                if result.error is not None:
                    raise result.error
                if last:
                    break
                if result.stop_asked:
                    status, stop_reason = "stopped", f"{stop.signal_name}"
                elif exits:
                    status, stop_reason = "stopped", f"run.exit_interval={cfg.run.exit_interval}"
                if status == "stopped" or saves:
                    writer.save(done, model, optimizer, _checkpoint_meta(setup, done))
                if status == "stopped":
                    break
            if cfg.run.save_checkpoint and status == "completed":
                writer.save(loop.steps_done, model, optimizer, _checkpoint_meta(setup, loop.steps_done))
            checkpoint = writer.wait()
    except NonFiniteError:
        _finish(setup, loop, logs, out_dir, "diverged", None, time.perf_counter() - started)
        raise
    summary = _finish(setup, loop, logs, out_dir, status, checkpoint, time.perf_counter() - started)
    if not ctx.is_main:  # only the main rank keeps the metrics the messages quote
        return summary
    if status == "stopped":
        progress.message(
            f"stopped after step {loop.steps_done} ({stop_reason}); checkpoint {checkpoint}; continue with "
            "--run.resume auto"
        )
    else:
        progress.message(
            f"done: {summary.steps} steps in {summary.wall_time_s:.1f}s, loss {_loss_text(summary.first_loss)} -> "
            f"{_loss_text(summary.last_loss)}, median {summary.median_tokens_per_s / 1e3:.1f}k tok/s; "
            f"metrics in {out_dir / 'metrics.jsonl'}, checkpoint {checkpoint}"
        )
    return summary


def freeze_all_but_indexers(model: torch.nn.Module) -> None:
    """DeepSeek-V3.2's dense warm-up (model.dsa_indexer_dense_warmup): every parameter but the DSA indexers'
    (``*.attention.indexer.*``) stops requiring a gradient, so the backward computes none for them, the optimizer
    (built after this, over the parameters that require one) holds none of them and the gradient clipping ignores
    them. The checkpoints then hold the indexers alone (moe_train.checkpoint leaves frozen tensors out, as for LoRA):
    a resumed run rebuilds the rest as this one did (model.from_hf, or the seed)."""
    for name, param in model.named_parameters():
        param.requires_grad_(".indexer." in f".{name}")


class _RunLogs:
    """The main rank's metrics file, TensorBoard and W&B loggers."""

    def __init__(self, cfg: ExperimentConfig, out_dir: Path, start: int) -> None:
        self.out_dir = out_dir
        self.metrics = MetricsLog(out_dir / "metrics.jsonl", resume_step=start)
        self.loggers = RunLoggers(
            out_dir, cfg.to_dict(), wandb_project=cfg.run.wandb_project, run_name=out_dir.name, resume_step=start
        )

    def write(self, records: list[dict[str, Any]], last_saved: Path | None) -> None:
        for record in records:
            kept = f"the last complete checkpoint is {last_saved}" if last_saved else "no checkpoint was written"
            stopped = f"the run stopped at step {record['step']} and {kept}; continue with --run.resume auto"
            with writing(self.metrics.path, stopped):
                self.metrics.write(record)
            self.loggers.log(record["step"], record)


def _start_message(setup: Setup, loop: TrainLoop) -> str:
    cfg = setup.cfg
    n_params = sum(p.numel() for p in loop.params)  # DTensors count globally; etp > 1 experts count their slice
    return (
        f"moe-train: {cfg.model.family} {n_params / 1e6:.2f}M params, {setup.ctx.world_size} rank(s) on "
        f"{setup.ctx.device.type}, global batch {cfg.train.global_batch_size} x {cfg.data.seq_len} tokens "
        f"(micro {setup.micro_batch}, accumulation {setup.grad_accum}), peak {loop.peak:.3f} TFLOPS "
        f"({loop.peak_source}), {cfg.train.params_dtype} params, "
        + (
            grouping_message(loop.optimizer)  # which parameters Muon takes, which AdamW: printed once, at start-up
            if cfg.train.optimizer == "muon"
            else f"AdamW states {cfg.train.optimizer_states_dtype}"
        )
        + (f", master weights {cfg.train.master_weights_dtype}" if cfg.train.params_dtype != "fp32" else "")
        + (", DSA dense warm-up: the indexers alone train" if cfg.model.dsa_indexer_dense_warmup else "")
        + _memory_message(setup.memory)
        + _precision_message(cfg.precision, setup.precision_modules, setup.precision_native)
        + _data_message(setup)
    )


def _data_message(setup: Setup) -> str:
    """How conversations were packed, and what was skipped (data.bad_records / data.truncation skip): never silent."""
    data = setup.data
    text = ""
    if data.packing_efficiency is not None:
        how = "packed" if setup.cfg.data.packing else "one per window"
        text += f", conversations {how} at {100 * data.packing_efficiency:.1f}% of the windows' tokens"
    if data.skipped:
        text += ", skipped " + ", ".join(f"{count} {reason}" for reason, count in sorted(data.skipped.items()))
    return text


def _checkpoint_meta(setup: Setup, step: int) -> dict[str, Any]:
    cfg, data = setup.cfg, setup.data
    return {
        "config": cfg.to_dict(),
        "versions": package_versions(),
        "world_size": setup.ctx.world_size,
        "layout": dataclasses.asdict(setup.layout),
        # batches are a function of (seed, step): the step is the data position
        "data": {"fingerprint": data.fingerprint, "samples_consumed": step * cfg.train.global_batch_size},
    }


def _finish(
    setup: Setup,
    loop: TrainLoop,
    logs: _RunLogs | None,
    out_dir: Path,
    status: str,
    checkpoint: Path | None,
    wall_time_s: float,
) -> TrainSummary:
    records = [r for r in logs.metrics.records if "loss" in r] if logs is not None else []
    losses = [r["loss"] for r in records]
    summary = TrainSummary(
        steps=loop.steps_done,
        first_loss=_finite_or_none(losses[0]) if losses else None,
        last_loss=_finite_or_none(losses[-1]) if losses else None,
        median_tokens_per_s=statistics.median(r["tokens_per_s"] for r in records[1:] or records) if records else 0.0,
        wall_time_s=wall_time_s,
        output_dir=str(out_dir),
        checkpoint=str(checkpoint) if checkpoint else None,
        status=status,
        resumed_from=str(setup.resume.checkpoint.path) if setup.resume else None,
    )
    if logs is not None:
        saved = f"its checkpoint is {checkpoint}" if checkpoint else "no checkpoint was written"
        with writing(out_dir / "summary.json", f"the run ended ({status}) and {saved}, but its summary did not"):
            logs.metrics.close()
            logs.loggers.close()
            if records:
                _write_pictures(out_dir, logs.metrics.records, loop.metrics.last_load_LE)
            write_whole(out_dir / "summary.json", json.dumps(summary.__dict__, indent=2, allow_nan=False))
    return summary


def _loss_text(value: float | None) -> str:
    return "not finite" if value is None else f"{value:.4f}"


def _finite_or_none(value: float) -> float | None:
    return value if value is not None and math.isfinite(value) else None  # resumed records may hold None


def _precision_message(precision: PrecisionConfig, modules: int, native: bool) -> str:
    """What the precision section changed: the recipe (emulated or native) on how many modules, the dispatch format."""
    text = ""
    if precision.enabled:
        text += f", {precision.recipe} ({'native' if native else 'emulated'}) on {modules} linears / expert projections"
    if precision.dispatch_fp8:
        text += ", FP8 token dispatch"
    return text


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


def _write_pictures(out_dir: Path, records: list[dict[str, Any]], load_LE: torch.Tensor | None) -> None:
    steps = [r["step"] for r in records if "loss" in r]
    valid = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    extra = [("validation", [s for s, _ in valid], [v for _, v in valid])] if valid else []
    (out_dir / "loss.svg").write_text(
        line_chart_svg(
            steps,
            [r["loss"] if r["loss"] is not None else math.nan for r in records if "loss" in r],
            "training loss" + (" and validation loss" if valid else ""),
            "step",
            "cross-entropy (nats/token)",
            extra=extra,
        )
    )
    if load_LE is None:
        return
    (out_dir / "expert_load.svg").write_text(
        heatmap_svg(
            load_LE.tolist(), "tokens per expert at the last step, as a multiple of the layer mean", "layer", "expert"
        )
    )
