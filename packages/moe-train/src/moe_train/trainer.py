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
from moe_models import StageRouting, causal_lm_loss, next_token_loss, training_flops_per_token
from moe_parallel import PipelineParallelModel, all_reduce_mean, full_value, local_grad
from moe_precision import PrecisionConfig
from moe_train.checkpoint import CheckpointWriter, load_checkpoint, package_versions
from moe_train.config import ConfigError
from moe_train.faults import NonFiniteError, NonFiniteGuard, StopRequest, agree_on_failure
from moe_train.loggers import RunLoggers
from moe_train.metrics import MetricsLog, peak_tflops
from moe_train.optim import build_optimizer, lr_at, set_lr
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

    def step(self, record: dict[str, Any]) -> None:
        step = record["step"]
        if not self.enabled or (
            step % self.interval and step not in (self.first, self.total) and "val_loss" not in record
        ):
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
    optimizer = build_optimizer(model, cfg.train)
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
    loop = _Loop(setup, optimizer, start)
    failure = None
    if ctx.is_main:
        try:
            with writing(checkpoint_dir(cfg), "the run did not start"):
                print_notes(start_history(cfg, setup.resume))
            with writing(out_dir / "config.json", "the run did not start"):
                out_dir.mkdir(parents=True, exist_ok=True)
                write_whole(out_dir / "config.json", json.dumps(cfg.to_dict(), indent=2))
            with writing(out_dir / "metrics.jsonl", "the run did not start"):
                loop.open_logs(out_dir)
        except OutputWriteError as err:
            failure = err
    # also the barrier: the output directory is cleared before any rank writes a checkpoint into it
    agree_on_failure(failure, ctx.device)
    progress = Progress(cfg.train.steps, cfg.run.log_interval, ctx.is_main, first_step=start)
    progress.message(loop.start_message())
    if setup.resume is not None:
        progress.message(f"resumed from {setup.resume.checkpoint.path} at step {start}")
    status, stop_reason = "completed", ""
    try:
        with StopRequest() as stop:
            for step in range(start, cfg.train.steps):
                record = loop.step(step, last_saved=writer.last)
                done = step + 1
                progress.step(record)
                if done == cfg.train.steps:
                    break
                if stop.agreed(ctx.device):
                    status, stop_reason = "stopped", f"{stop.signal_name}"
                elif cfg.run.exit_interval and done % cfg.run.exit_interval == 0:
                    status, stop_reason = "stopped", f"run.exit_interval={cfg.run.exit_interval}"
                if status == "stopped" or (cfg.run.checkpoint_interval and done % cfg.run.checkpoint_interval == 0):
                    writer.save(done, model, optimizer, loop.checkpoint_meta(done))
                if status == "stopped":
                    break
            if cfg.run.save_checkpoint and status == "completed":
                writer.save(loop.steps_done, model, optimizer, loop.checkpoint_meta(loop.steps_done))
            checkpoint = writer.wait()
    except NonFiniteError:
        loop.finish(out_dir, "diverged", None, time.perf_counter() - started)
        raise
    summary = loop.finish(out_dir, status, checkpoint, time.perf_counter() - started)
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


class _Loop:
    """The training step and what it accumulates: the step's batches, update, metrics, logs and evaluation."""

    def __init__(self, setup: Setup, optimizer: torch.optim.Optimizer, start: int) -> None:
        cfg, ctx = setup.cfg, setup.ctx
        self.setup, self.cfg, self.ctx, self.optimizer = setup, cfg, ctx, optimizer
        self.steps_done = start
        self.stream = setup.data.train
        self.peak, self.peak_source = peak_tflops(ctx.device, setup.dtype, cfg.run.peak_tflops)
        self.flops_per_token = training_flops_per_token(cfg.model, cfg.data.seq_len)
        self.tokens_per_step = cfg.train.global_batch_size * cfg.data.seq_len
        self.per_rank = setup.micro_batch * setup.grad_accum
        self.params = [p for p in setup.model.parameters() if p.requires_grad]
        # under context parallelism the positions of every sequence this rank computes (None: all of them)
        self.positions = setup.parallel.positions(cfg.data.seq_len, ctx.device)
        self.autocast = torch.autocast(ctx.device.type, dtype=setup.dtype, enabled=setup.dtype != torch.float32)
        self.guard = NonFiniteGuard(cfg.train.skip_nonfinite_steps)
        self.log: MetricsLog | None = None
        self.loggers: RunLoggers | None = None
        self.load_LE: torch.Tensor | None = None
        parallel = setup.parallel
        self.pipeline = parallel if isinstance(parallel, PipelineParallelModel) else None
        # the metrics each rank holds a part of (a pipeline stage's) are means over the world times this: sums over
        # the stages, means over the data-parallel replicas
        self.stage_factor = setup.layout.pp
        self.routers = parallel.routers() if self.pipeline is not None else setup.model.routers()
        if self.pipeline is not None:
            self.routing = StageRouting()
            self.pipeline_loss = _PipelineLoss(cfg.model.mtp_loss_scaling_factor, self.positions)
            # each router's row among the whole model's, for the expert-load metrics
            self.load_rows = [row for stage in self.pipeline.stages for row in stage.router_rows()]
            self.num_moe_layers = sum(cfg.model.moe_layer_pattern()) + (cfg.model.mtp_num_layers or 0)

    def open_logs(self, out_dir: Path) -> None:
        cfg = self.cfg
        self.log = MetricsLog(out_dir / "metrics.jsonl", resume_step=self.steps_done)
        self.loggers = RunLoggers(
            out_dir,
            cfg.to_dict(),
            wandb_project=cfg.run.wandb_project,
            run_name=out_dir.name,
            resume_step=self.steps_done,
        )

    def start_message(self) -> str:
        cfg, setup = self.cfg, self.setup
        n_params = sum(p.numel() for p in self.params)  # DTensors count globally; etp > 1 experts count their slice
        return (
            f"moe-train: {cfg.model.family} {n_params / 1e6:.2f}M params, {self.ctx.world_size} rank(s) on "
            f"{self.ctx.device.type}, global batch {cfg.train.global_batch_size} x {cfg.data.seq_len} tokens "
            f"(micro {setup.micro_batch}, accumulation {setup.grad_accum}), peak {self.peak:.3f} TFLOPS "
            f"({self.peak_source}), {cfg.train.params_dtype} params, AdamW states {cfg.train.optimizer_states_dtype}"
            + (f", master weights {cfg.train.master_weights_dtype}" if cfg.train.params_dtype != "fp32" else "")
            + _memory_message(setup.memory)
            + _precision_message(cfg.precision, setup.precision_modules, setup.precision_native)
        )

    def _forward_backward(self, step: int) -> tuple[torch.Tensor, ...]:
        """The step's micro-batches forward and backward; sums of the LM, balancing and MTP losses, expert load."""
        setup, cfg, device = self.setup, self.cfg, self.ctx.device
        lm_sum, aux_sum, mtp_sum = (torch.zeros((), device=device) for _ in range(3))
        load_LE = None
        for micro in range(setup.grad_accum):
            # the ranks of one data-parallel replica (tp) read the same sequences
            first = setup.parallel.dp_index * self.per_rank + micro * setup.micro_batch
            batch = self.stream.batch(step, cfg.train.global_batch_size, first, setup.micro_batch)
            inputs, labels = batch.input_ids_BS.to(device), batch.labels_BS.to(device)
            with self.autocast:
                out = setup.model(inputs, self.positions)
            with setup.parallel.loss_context():  # vocabulary-parallel logits under tp
                loss = causal_lm_loss(out, labels, cfg.model.mtp_loss_scaling_factor, self.positions)
                loss.total.backward()  # the routers' balancing losses ride along on their probabilities
                lm_sum += full_value(loss.lm)
                if loss.mtp:
                    mtp_sum += full_value(torch.stack(loss.mtp).mean())
            aux_sum += out.aux_loss.detach()
            load_LE = out.tokens_per_expert_LE if load_LE is None else load_LE + out.tokens_per_expert_LE
        return lm_sum, aux_sum, mtp_sum, load_LE

    def _pipeline_forward_backward(self, step: int) -> tuple[torch.Tensor, ...]:
        """The same micro-batches as :meth:`_forward_backward`, through the pipeline schedule: the rank's share of
        the step in one batch, which the schedule cuts back into them."""
        setup, cfg, device = self.setup, self.cfg, self.ctx.device
        first = setup.parallel.dp_index * self.per_rank
        batches = [
            self.stream.batch(step, cfg.train.global_batch_size, first + m * setup.micro_batch, setup.micro_batch)
            for m in range(setup.grad_accum)
        ]
        inputs = torch.cat([b.input_ids_BS for b in batches]).to(device)
        labels = torch.cat([b.labels_BS for b in batches]).to(device)
        self.routing.clear()
        self.pipeline_loss.reset(device)
        with self.autocast, self.pipeline.loss_context():
            self.pipeline.step(
                inputs,
                labels,
                setup.grad_accum,
                self.pipeline_loss,
                self.hidden_dtype,
                positions_S=self.positions,
                routing=self.routing,
            )
        held = self.pipeline.stage_indices
        aux_sum = sum((self.routing.aux_loss[i] for i in held), torch.zeros((), device=device))
        load_LE = torch.cat([self.routing.tokens_per_expert_LE[i] for i in held])
        return self.pipeline_loss.lm_sum, aux_sum, self.pipeline_loss.mtp_sum, load_LE

    @property
    def hidden_dtype(self) -> torch.dtype:
        """What stages send each other: the residual stream keeps the parameters' dtype (autocast computes in its
        own, the residual additions promote back), or FSDP's gather dtype."""
        if self.cfg.parallel.mixed_precision_param == "bfloat16":
            return torch.bfloat16
        return torch.bfloat16 if self.cfg.train.params_dtype == "bf16" else torch.float32

    def _global_mean(self, value: torch.Tensor) -> torch.Tensor:
        """The mean over data-parallel replicas of a sum over pipeline stages (each rank holds its stages' part)."""
        return all_reduce_mean(value) * self.stage_factor

    def _global_load(self, load_LE: torch.Tensor) -> torch.Tensor:
        """``[all MoE layers, E]`` expert loads averaged over data-parallel replicas."""
        if self.pipeline is None:
            return all_reduce_mean(load_LE.float())
        full = torch.zeros(self.num_moe_layers, load_LE.shape[1], device=load_LE.device)
        full[self.load_rows] = load_LE.float()
        return self._global_mean(full)

    def step(self, step: int, last_saved: Path | None) -> dict[str, Any]:
        setup, cfg, ctx = self.setup, self.cfg, self.ctx
        parallel, optimizer = setup.parallel, self.optimizer
        step_start = time.perf_counter()
        lr = lr_at(step, cfg.train)
        set_lr(optimizer, lr)
        optimizer.zero_grad(set_to_none=True)
        forward_backward = self._forward_backward if self.pipeline is None else self._pipeline_forward_backward
        lm_sum, aux_sum, mtp_sum, load_LE = forward_backward(step)
        clip = cfg.train.clip_grad if cfg.train.clip_grad > 0 else math.inf
        # the accumulated gradient is a sum over micro-batches; dividing it (not each loss) also scales
        # the load-balancing gradients the routers attach inside the backward
        grads = [g for g in map(local_grad, self.params) if g is not None]
        if setup.grad_accum > 1:
            torch._foreach_div_(grads, float(setup.grad_accum))
        parallel.finalize_grads()
        grad_norm = parallel.clip_grad_norm_(clip, self.params).item()
        loss = self._global_mean(lm_sum / setup.grad_accum).item()  # before the update: a NaN step must not apply
        diverged = self.guard.check(step + 1, loss, grad_norm, str(last_saved) if last_saved else None)
        update = not self.guard.skipping
        if update:
            optimizer.step()
            if cfg.model.moe_router_enable_expert_bias:
                # counts the forwards returned, so a recomputed layer is not counted twice; summed over every rank's
                # tokens (the routers' stats_group) so all ranks apply the same update
                for router, counts_E in zip(self.routers, load_LE, strict=True):
                    router.update_expert_bias(counts_E)
        else:
            optimizer.zero_grad(set_to_none=True)
        aux = self._global_mean(aux_sum / setup.grad_accum).item()
        mtp = self._global_mean(mtp_sum / setup.grad_accum).item()
        load = self._global_load(load_LE)
        self.load_LE = load
        step_time = time.perf_counter() - step_start
        tokens_per_s = self.tokens_per_step / step_time
        tflops = self.flops_per_token * tokens_per_s / ctx.world_size / 1e12
        record: dict[str, Any] = {
            "step": step + 1,
            "loss": loss,
            "aux_loss": aux,
            "mtp_loss": mtp,  # mean over MTP depths, unscaled; 0 without MTP
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": tokens_per_s,
            "tflops_per_gpu": tflops,
            "mfu": tflops / self.peak,
            "step_time_s": step_time,
            "expert_load_max_over_mean": (load.max(dim=1).values / load.mean(dim=1)).mean().item(),
            # (token, expert) pairs dropped by a capacity factor, over all layers
            "dropped_fraction": 1.0
            - load.sum().item()
            / (self.tokens_per_step / ctx.world_size * self.stage_factor * cfg.model.moe_router_topk * len(load)),
        }
        if not update:
            record["skipped"] = True
        if update and self._evaluates(step + 1):
            record["val_loss"] = self.evaluate()
        self.steps_done = step + 1
        if self.log is not None:
            kept = f"the last complete checkpoint is {last_saved}" if last_saved else "no checkpoint was written"
            stopped = f"the run stopped at step {step + 1} and {kept}; continue with --run.resume auto"
            with writing(self.log.path, stopped):
                self.log.write(record)
        if self.loggers is not None:
            self.loggers.log(step + 1, record)
        if diverged is not None:
            raise diverged
        return record

    def _evaluates(self, step: int) -> bool:
        every = self.cfg.train.eval_interval
        return self.setup.data.valid is not None and every > 0 and (step % every == 0 or step == self.cfg.train.steps)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean next-token loss over ``train.eval_iters`` fixed validation batches (the same at every evaluation),
        each data-parallel replica computing its slice of each."""
        setup, cfg, device = self.setup, self.cfg, self.ctx.device
        model, valid = setup.model, setup.data.valid
        model.eval()
        total = torch.zeros((), device=device)
        batches = 0
        try:
            for micro in range(setup.grad_accum):
                first = setup.parallel.dp_index * self.per_rank + micro * setup.micro_batch
                for batch in valid.eval_batches(
                    cfg.train.eval_iters, cfg.train.global_batch_size, first, setup.micro_batch
                ):
                    ids, labels = batch.input_ids_BS.to(device), batch.labels_BS.to(device)
                    with self.autocast:
                        if self.pipeline is None:
                            out = model(ids, self.positions)
                            with setup.parallel.loss_context():
                                total += full_value(causal_lm_loss(out, labels, 0.0, self.positions).lm.float())
                        else:  # the last stage's rank alone has logits
                            out = self.pipeline.forward(ids, self.hidden_dtype, positions_S=self.positions)
                            if out is not None:
                                logits = out[0] if isinstance(out, tuple) else out
                                with setup.parallel.loss_context():
                                    loss = next_token_loss(logits, (), labels, 0.0, self.positions)
                                    total += full_value(loss.lm.float())
                    batches += 1
        finally:
            model.train()
        return self._global_mean(total / batches).item()

    def checkpoint_meta(self, step: int) -> dict[str, Any]:
        cfg, data = self.cfg, self.setup.data
        return {
            "config": cfg.to_dict(),
            "versions": package_versions(),
            "world_size": self.ctx.world_size,
            "layout": dataclasses.asdict(self.setup.layout),
            # batches are a function of (seed, step): the step is the data position
            "data": {"fingerprint": data.fingerprint, "samples_consumed": step * cfg.train.global_batch_size},
        }

    def finish(self, out_dir: Path, status: str, checkpoint: Path | None, wall_time_s: float) -> TrainSummary:
        records = [r for r in self.log.records if "loss" in r] if self.log is not None else []
        losses = [r["loss"] for r in records]
        summary = TrainSummary(
            steps=self.steps_done,
            first_loss=_finite_or_none(losses[0]) if losses else None,
            last_loss=_finite_or_none(losses[-1]) if losses else None,
            median_tokens_per_s=statistics.median(r["tokens_per_s"] for r in records[1:] or records)
            if records
            else 0.0,
            wall_time_s=wall_time_s,
            output_dir=str(out_dir),
            checkpoint=str(checkpoint) if checkpoint else None,
            status=status,
            resumed_from=str(self.setup.resume.checkpoint.path) if self.setup.resume else None,
        )
        if self.log is not None:
            saved = f"its checkpoint is {checkpoint}" if checkpoint else "no checkpoint was written"
            with writing(out_dir / "summary.json", f"the run ended ({status}) and {saved}, but its summary did not"):
                self.log.close()
                self.loggers.close()
                if records:
                    _write_pictures(out_dir, self.log.records, self.load_LE)
                write_whole(out_dir / "summary.json", json.dumps(summary.__dict__, indent=2, allow_nan=False))
        return summary


class _PipelineLoss:
    """The loss the pipeline's last stage computes per micro-batch (the schedule calls it with the stage's output
    and the micro-batch's labels: the whole sequences'; ``positions_S``, those the rank computes under context
    parallelism); keeps the step's LM and MTP loss sums for the metrics."""

    def __init__(self, mtp_loss_scaling_factor: float, positions_S: torch.Tensor | None = None) -> None:
        self.factor, self.positions = mtp_loss_scaling_factor, positions_S
        self.lm_sum = self.mtp_sum = torch.zeros(())

    def reset(self, device: torch.device) -> None:
        self.lm_sum, self.mtp_sum = torch.zeros((), device=device), torch.zeros((), device=device)

    def __call__(self, output: torch.Tensor | tuple[torch.Tensor, ...], labels_BS: torch.Tensor) -> torch.Tensor:
        logits, *mtp = output if isinstance(output, tuple) else (output,)
        loss = next_token_loss(logits, mtp, labels_BS, self.factor, self.positions)
        self.lm_sum = self.lm_sum + full_value(loss.lm)
        if loss.mtp:
            self.mtp_sum = self.mtp_sum + full_value(torch.stack(loss.mtp).mean())
        return loss.total


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
