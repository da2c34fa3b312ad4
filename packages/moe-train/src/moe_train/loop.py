"""The training step and evaluation over a :class:`~moe_parallel.StagedModel`, the same code for every layout (one
stage without a pipeline). A step that writes no metrics makes one host synchronisation outside the model's
layers: the flag saying whether the loss or the gradient norm stopped being finite on any rank, or any rank was
asked to stop (:meth:`TrainLoop.step`); the metrics wait on the device (:mod:`moe_train.step_metrics`)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moe_dispatch import DelayedLink, ExpertParallelDispatcher
from moe_models import StageRouting, next_token_loss, training_flops_per_token
from moe_models.loss import IGNORE_INDEX
from moe_parallel import StagedModel, all_reduce_mean, full_value, local_grad
from moe_train.faults import NonFiniteError, NonFiniteGuard, StopRequest
from moe_train.metrics import peak_tflops
from moe_train.optim import lr_at, set_lr
from moe_train.qk_clip import QKClip
from moe_train.setup import Setup
from moe_train.step_metrics import DeviceInterval, PendingMetrics


def exposed_ep_communication_clock(parallel: StagedModel, device: torch.device) -> DelayedLink | None:
    """A link that delays nothing, given to every expert-parallel dispatcher of this rank to count the host's time
    blocked on their collectives (``ep_comm_wait_s`` in metrics.jsonl): on gloo that is the communication the step
    did not hide. None on a GPU, where the host does not wait for NCCL, and without expert parallelism."""
    if device.type != "cpu":
        return None
    dispatchers = [
        module.dispatcher
        for stage in parallel.stages
        for module in stage.modules()
        if isinstance(getattr(module, "dispatcher", None), ExpertParallelDispatcher)
    ]
    if not dispatchers:
        return None
    clock = DelayedLink()
    for dispatcher in dispatchers:
        dispatcher.link = clock
    return clock


class NextTokenLoss:
    """The one loss of a training step, called by the model's last stage with its output (the logits, with the MTP
    depths' after them) and the micro-batch's labels; keeps the step's LM and MTP loss sums on the device.
    ``positions_S``: the positions this rank computes under context parallelism. ``labelled_per_share`` (set for each
    step by :meth:`reset`): the per-token loss's divisor (moe_models.causal_lm_loss's ``labelled_tokens``); None: the
    mean over the micro-batch's positions, which is the same thing when every position has a label.

    ``indexer_loss_coeff`` (model.dsa_indexer_loss_coeff; None / 0: none): the output's last item is then the DSA
    indexers' KL loss summed over layers (``ModelOutput.indexer_loss``), added times the coefficient (its gradient
    reaches the indexers alone) and kept, unscaled, for the metrics."""

    def __init__(
        self,
        mtp_loss_scaling_factor: float,
        positions_S: torch.Tensor | None = None,
        indexer_loss_coeff: float | None = None,
    ) -> None:
        self.factor, self.positions, self.indexer_coeff = mtp_loss_scaling_factor, positions_S, indexer_loss_coeff
        self.lm_sum = self.mtp_sum = self.indexer_sum = torch.zeros(())
        self.labelled_per_share: float | None = None

    def reset(self, device: torch.device, labelled_per_share: float | None = None) -> None:
        self.lm_sum, self.mtp_sum = torch.zeros((), device=device), torch.zeros((), device=device)
        self.indexer_sum = torch.zeros((), device=device)
        self.labelled_per_share = labelled_per_share

    def __call__(self, output: torch.Tensor | tuple[torch.Tensor, ...], labels_BS: torch.Tensor) -> torch.Tensor:
        outputs = output if isinstance(output, tuple) else (output,)
        if self.indexer_coeff:
            *outputs, indexer_loss = outputs
        logits, *mtp = outputs
        loss = next_token_loss(logits, mtp, labels_BS, self.factor, self.positions, self.labelled_per_share)
        self.lm_sum = self.lm_sum + full_value(loss.lm)
        if loss.mtp:
            self.mtp_sum = self.mtp_sum + full_value(torch.stack(loss.mtp).mean())
        if not self.indexer_coeff:
            return loss.total
        self.indexer_sum = self.indexer_sum + indexer_loss.detach()
        return loss.total + self.indexer_coeff * indexer_loss


@dataclass(frozen=True)
class StepResult:
    step: int  # 1-based: the steps done
    records: list[dict[str, Any]]  # metrics written at this step (none on a step that logs nothing)
    stop_asked: bool  # some rank was asked to stop (a signal)
    error: NonFiniteError | None  # raise once the records are written


class TrainLoop:
    """One optimizer step over the rank's share of the global batch, its pending metrics and evaluation."""

    def __init__(self, setup: Setup, optimizer: torch.optim.Optimizer, start: int) -> None:
        cfg, ctx, parallel = setup.cfg, setup.ctx, setup.parallel
        self.setup, self.cfg, self.ctx, self.parallel, self.optimizer = setup, cfg, ctx, parallel, optimizer
        self.steps_done = start
        self.params = [p for p in setup.model.parameters() if p.requires_grad]
        self.routers = parallel.routers()
        # under context parallelism the positions of every sequence this rank computes (None: all of them)
        self.positions = parallel.positions(cfg.data.seq_len, ctx.device)
        # CUDA graphs replay casts recorded at capture: autocast's cache of cast weights must not outlive a call
        self.autocast = torch.autocast(
            ctx.device.type,
            dtype=setup.dtype,
            enabled=setup.dtype != torch.float32,
            cache_enabled=not cfg.run.cuda_graphs,
        )
        self.comm_clock = exposed_ep_communication_clock(parallel, ctx.device)
        self.guard = NonFiniteGuard(cfg.train.skip_nonfinite_steps)
        self.routing = StageRouting()
        self.loss = NextTokenLoss(cfg.model.mtp_loss_scaling_factor, self.positions, cfg.model.dsa_indexer_loss_coeff)
        self.qk_clip = None  # the step's forwards report their attention logit maxima, the update is clipped
        if cfg.train.qk_clip:
            self.qk_clip = QKClip.for_run(parallel, optimizer, cfg.train.qk_clip_threshold, cfg.train.qk_clip_alpha)
        # the DSA dense warm-up trains the indexers alone (moe_train.trainer froze the rest): no expert bias update
        self.updates_expert_bias = cfg.model.moe_router_enable_expert_bias and not cfg.model.dsa_indexer_dense_warmup
        # the ranks of one data-parallel replica (tp, pp, cp) read the same sequences: this rank's first row
        self.first_row = parallel.dp_index * setup.micro_batch * setup.grad_accum
        self.peak, self.peak_source = peak_tflops(ctx.device, setup.dtype, cfg.run.peak_tflops)
        tokens_per_step = cfg.train.global_batch_size * cfg.data.seq_len
        self.metrics = PendingMetrics(
            stage_factor=setup.layout.pp,
            router_rows=parallel.router_rows(),
            num_routers=len(cfg.model.router_layers()),
            pairs_per_router=tokens_per_step / ctx.world_size * cfg.model.moe_router_topk,
            tokens_per_step=tokens_per_step,
            flops_per_token=training_flops_per_token(cfg.model, cfg.data.seq_len),
            world_size=ctx.world_size,
            peak_tflops=self.peak,
            indexer_loss=bool(cfg.model.dsa_indexer_loss_coeff),
        )

    @property
    def hidden_dtype(self) -> torch.dtype:
        """What stages send each other: the residual stream keeps the parameters' dtype (autocast computes in its
        own, the residual additions promote back), or FSDP's gather dtype."""
        if self.cfg.parallel.mixed_precision_param == "bf16":
            return torch.bfloat16
        return torch.bfloat16 if self.cfg.train.params_dtype == "bf16" else torch.float32

    def _batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """This rank's rows of step ``step``'s global batch (its micro-batches one after another), on the device: the
        token ids, the labels and (packed documents) the document ids."""
        micro, device = self.setup.micro_batch, self.ctx.device
        parts = [
            self.setup.data.train.batch(step, self.cfg.train.global_batch_size, self.first_row + m * micro, micro)
            for m in range(self.setup.grad_accum)
        ]
        ids, labels = (
            torch.cat([getattr(p, name) for p in parts]).to(device) for name in ("input_ids_BS", "labels_BS")
        )
        if parts[0].document_ids_BS is None:
            return ids, labels, None
        return ids, labels, torch.cat([p.document_ids_BS for p in parts]).to(device)

    def labelled_per_share(self, step: int) -> float:
        """The per-token loss's divisor at step ``step``: the global batch's labelled tokens over the equal shares
        the batch is cut into (every data-parallel rank's micro-batches, each split over the context-parallel ranks),
        so that the shares' mean is the mean over the global batch's labelled tokens (loss.causal_lm_loss)."""
        cfg = self.cfg
        labelled = self.setup.data.train.labelled_tokens(step, cfg.train.global_batch_size)
        shares = cfg.train.global_batch_size // self.setup.micro_batch * self.setup.layout.cp
        return max(labelled, 1) / shares

    def step(self, step: int, last_saved: Path | None, stop: StopRequest, write_metrics: bool) -> StepResult:
        """Optimizer step ``step`` (0-based). ``write_metrics``: reduce and return the pending records (a log step,
        a checkpoint or the end follows); they are also returned when the step is not finite or a stop was asked."""
        parallel, optimizer, accum = self.parallel, self.optimizer, self.setup.grad_accum
        started = time.perf_counter()
        if self.comm_clock is not None:
            self.comm_clock.reset()
        lanes = parallel.lanes
        turns_before = None if lanes is None else lanes.switches
        delayed_before = 0 if lanes is None else lanes.deferred_runs
        lr = lr_at(step, self.cfg.train)
        set_lr(optimizer, lr)
        optimizer.zero_grad(set_to_none=True)
        inputs, labels, documents = self._batch(step)
        self.routing.clear()
        # packed documents label some tokens only (and a different number in each micro-batch): a per-token loss
        self.loss.reset(self.ctx.device, None if documents is None else self.labelled_per_share(step))
        extra = {} if documents is None else {"document_ids_BS": documents}
        loss_fn = self.loss
        if self.qk_clip is not None:
            extra["attention_logit_max"], loss_fn = True, self.qk_clip.track(self.loss)
        with self.autocast, parallel.loss_context():
            parallel.forward_backward(
                inputs,
                labels,
                accum,
                loss_fn,
                self.hidden_dtype,
                positions_S=self.positions,
                routing=self.routing,
                **extra,
            )
        turns = None if lanes is None else lanes.switches - turns_before
        delayed = None
        if lanes is not None and self.cfg.parallel.delay_wgrad_compute:
            delayed = lanes.deferred_runs - delayed_before
        held = parallel.stage_indices
        aux_sum = sum((self.routing.aux_loss[i] for i in held), torch.zeros((), device=self.ctx.device))
        load_LE = torch.cat([self.routing.tokens_per_expert_LE[i] for i in held])
        # the accumulated gradient is a sum over micro-batches; dividing it (not each loss) also scales the
        # load-balancing gradients the routers attach inside the backward
        grads = [g for g in map(local_grad, self.params) if g is not None]
        if accum > 1:
            torch._foreach_div_(grads, float(accum))
        parallel.finalize_grads()
        clip = self.cfg.train.clip_grad if self.cfg.train.clip_grad > 0 else math.inf
        grad_norm = parallel.clip_grad_norm_(clip, self.params)
        losses = (self.loss.lm_sum / accum, aux_sum / accum, self.loss.mtp_sum / accum, self.loss.indexer_sum / accum)
        # before the update: a step that is not finite must not apply
        not_finite_here = ~(torch.isfinite(losses[0]) & torch.isfinite(grad_norm.to(losses[0].device)))
        not_finite, stop_asked = stop.asked_on_any_rank(not_finite_here)
        error = self.guard.check(
            step + 1,
            not_finite,
            lambda: (self.global_mean(losses[0]), float(grad_norm)),
            str(last_saved) if last_saved else None,
        )
        update = DeviceInterval(self.ctx.device)
        if not self.guard.skipping:
            with update:
                optimizer.step()
                if self.qk_clip is not None:
                    self.qk_clip.clip_(step + 1)
                if self.updates_expert_bias:
                    # counts the forwards returned, so a recomputed layer is not counted twice; summed over every
                    # rank's tokens (the routers' stats_group) so all ranks apply the same update
                    for router, counts_E in zip(self.routers, load_LE, strict=True):
                        router.update_expert_bias(counts_E)
        else:
            optimizer.zero_grad(set_to_none=True)
        self.steps_done = step + 1
        elapsed = time.perf_counter() - started
        waited = None if self.comm_clock is None else self.comm_clock.waited_s
        self.metrics.add(
            step + 1, lr, elapsed, self.guard.skipping, losses, grad_norm, load_LE, update, waited, turns, delayed
        )
        records = self.metrics.records() if write_metrics or not_finite or stop_asked else []
        if self.qk_clip is not None:
            self.qk_clip.annotate(records)
        if records and not self.guard.skipping and self.evaluates(step + 1):
            records[-1]["val_loss"] = self.evaluate()
        return StepResult(step + 1, records, stop_asked, error)

    def global_mean(self, value: torch.Tensor) -> float:
        """The mean over data-parallel replicas of a sum over pipeline stages (each rank holds its stages' part)."""
        return float(all_reduce_mean(value) * self.setup.layout.pp)

    def evaluates(self, step: int) -> bool:
        every = self.cfg.train.eval_interval
        return self.setup.data.valid is not None and every > 0 and (step % every == 0 or step == self.cfg.train.steps)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean next-token loss over ``train.eval_iters`` fixed validation batches (the same at every evaluation),
        each data-parallel replica computing its slice of each; over the labelled tokens for packed documents."""
        setup, cfg, device, parallel = self.setup, self.cfg, self.ctx.device, self.parallel
        total = torch.zeros((), device=device)
        labelled = torch.zeros((), device=device)
        batches = 0
        setup.model.eval()
        try:
            for micro in range(setup.grad_accum):
                first = self.first_row + micro * setup.micro_batch
                for batch in setup.data.valid.eval_batches(
                    cfg.train.eval_iters, cfg.train.global_batch_size, first, setup.micro_batch
                ):
                    ids, labels = batch.input_ids_BS.to(device), batch.labels_BS.to(device)
                    documents = batch.document_ids_BS
                    extra = {} if documents is None else {"document_ids_BS": documents.to(device)}
                    with self.autocast:
                        out = parallel.forward(ids, self.hidden_dtype, positions_S=self.positions, **extra)
                        if out is not None:  # the last stage's ranks alone have logits
                            logits = out[0] if isinstance(out, tuple) else out
                            with parallel.loss_context():
                                if documents is None:
                                    loss = next_token_loss(logits, (), labels, 0.0, self.positions)
                                else:  # a sum, and its labels counted where it was taken: a per-token mean below
                                    loss = next_token_loss(logits, (), labels, 0.0, self.positions, 1.0)
                                    local_labels = labels if self.positions is None else labels[:, self.positions]
                                    labelled += (local_labels != IGNORE_INDEX).sum()
                                total += full_value(loss.lm.float())
                    batches += 1
        finally:
            setup.model.train()
        if documents is not None:
            return self.global_mean(total) / max(self.global_mean(labelled), 1e-12)
        return self.global_mean(total / batches)
