"""The per-step metrics, kept on the device until they are written: a step adds its values as tensors (no
``.item()``, no collective), and :meth:`PendingMetrics.records` reduces every pending step's values across ranks in
two all-reduces and reads them back once. The trainer asks for the records on log steps, before a checkpoint and
when the run ends, so ``metrics.jsonl`` still holds one record per step while a step that logs nothing never waits
for the device (torchtitan reduces its metrics on log steps only, for the same reason)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from moe_parallel import all_reduce_mean


class DeviceInterval:
    """The seconds a block of work took as the device sees it (``with interval: ...``): CUDA events on a GPU, read back
    only with the records (so timing the optimizer never makes the step wait for the device), the host clock on CPU.
    Unentered, it measured nothing (0 s: a skipped step's update)."""

    def __init__(self, device: torch.device | str) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self._events: tuple[Any, Any] | None = None
        self._host = 0.0

    def __enter__(self) -> DeviceInterval:
        if self.cuda:
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()
        else:
            self._host = -time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._events is not None:
            self._events[1].record()
        else:
            self._host += time.perf_counter()

    def seconds(self) -> float:
        if self._events is None:
            return self._host
        self._events[1].synchronize()
        return self._events[0].elapsed_time(self._events[1]) / 1e3


@dataclass(frozen=True)
class _Pending:
    step: int
    lr: float
    step_time_s: float
    skipped: bool
    optimizer: DeviceInterval  # the optimizer's update (with the expert-bias update)
    values: torch.Tensor  # [loss, aux_loss, mtp_loss, indexer_loss, grad_norm]: this rank's part
    load_LE: torch.Tensor  # this rank's routers' kept (token, expert) pairs, rows of the whole model's routers
    ep_comm_wait_s: float | None = None  # the host's time blocked on expert-parallel collectives (gloo runs)
    ep_overlap_turns: int | None = None  # turns the micro-batches in flight took (ep_overlap microbatch)
    ep_delayed_wgrads: int | None = None  # weight gradients computed later (parallel.delay_wgrad_compute)


class PendingMetrics:
    """Steps added but not yet written (module docstring).

    ``stage_factor``: each rank holds its pipeline stages' part of a loss, so the mean over ranks times ``pp`` is the
    mean over data-parallel replicas of the sum over stages. ``router_rows``: where this rank's routers stand among
    the whole model's ``num_routers``. ``pairs_per_router``: (token, expert) pairs a router routes per step on one
    rank without drops. ``indexer_loss``: the records carry ``indexer_loss`` (the DSA indexers train)."""

    def __init__(
        self,
        stage_factor: int,
        router_rows: list[int],
        num_routers: int,
        pairs_per_router: float,
        tokens_per_step: int,
        flops_per_token: float,
        world_size: int,
        peak_tflops: float,
        indexer_loss: bool = False,
    ) -> None:
        self.stage_factor, self.router_rows, self.num_routers = stage_factor, router_rows, num_routers
        self.pairs_per_router, self.tokens_per_step = pairs_per_router, tokens_per_step
        self.flops_per_token, self.world_size, self.peak = flops_per_token, world_size, peak_tflops
        self.indexer_loss = indexer_loss
        self.pending: list[_Pending] = []
        self.last_load_LE: torch.Tensor | None = None  # the last written step's loads, for the picture

    def add(
        self,
        step: int,
        lr: float,
        step_time_s: float,
        skipped: bool,
        losses: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
        grad_norm: torch.Tensor,
        load_LE: torch.Tensor,
        optimizer: DeviceInterval,
        ep_comm_wait_s: float | None = None,
        ep_overlap_turns: int | None = None,
        ep_delayed_wgrads: int | None = None,
    ) -> None:
        """Step ``step``'s values (the LM, balancing, MTP and DSA indexer losses as this rank's micro-batch means),
        the time its optimizer update took, on gloo the time it waited on expert-parallel collectives, and with
        ``ep_overlap microbatch`` the turns its micro-batches in flight took at their all-to-alls (and with
        ``parallel.delay_wgrad_compute`` how many of the experts' weight gradients were computed later)."""
        values = torch.stack([*(v.float().reshape(()) for v in losses), grad_norm.float().reshape(())])
        load = load_LE.detach().float()
        self.pending.append(
            _Pending(
                step,
                lr,
                step_time_s,
                skipped,
                optimizer,
                values,
                load,
                ep_comm_wait_s,
                ep_overlap_turns,
                ep_delayed_wgrads,
            )
        )

    def records(self) -> list[dict[str, Any]]:
        """The pending steps' records, in order; none pending afterwards. A collective: every rank calls it."""
        if not self.pending:
            return []
        values_NK = torch.stack([p.values for p in self.pending])
        # the gradient norm is already global: it is not averaged
        losses_NK = all_reduce_mean(values_NK[:, :4]) * self.stage_factor
        grad_norm_N = values_NK[:, 4]
        load_NLE = values_NK.new_zeros(len(self.pending), self.num_routers, self.pending[0].load_LE.shape[1])
        load_NLE[:, self.router_rows] = torch.stack([p.load_LE for p in self.pending])
        load_NLE = all_reduce_mean(load_NLE) * self.stage_factor
        imbalance_N = (load_NLE.max(dim=2).values / load_NLE.mean(dim=2)).mean(dim=1)
        kept_N = load_NLE.sum(dim=(1, 2)) / (self.pairs_per_router * self.stage_factor * self.num_routers)
        table = torch.cat([losses_NK, grad_norm_N[:, None], imbalance_N[:, None], kept_N[:, None]], dim=1).tolist()
        out = []
        for pending, (loss, aux, mtp, indexer, grad_norm, imbalance, kept) in zip(self.pending, table, strict=True):
            tokens_per_s = self.tokens_per_step / pending.step_time_s
            tflops = self.flops_per_token * tokens_per_s / self.world_size / 1e12
            record: dict[str, Any] = {
                "step": pending.step,
                "loss": loss,
                "aux_loss": aux,
                "mtp_loss": mtp,  # mean over MTP depths, unscaled; 0 without MTP
                # the DSA indexers' KL losses summed over layers, without dsa_indexer_loss_coeff
                **({"indexer_loss": indexer} if self.indexer_loss else {}),
                "lr": pending.lr,
                "grad_norm": grad_norm,
                "tokens_per_s": tokens_per_s,
                "tflops_per_gpu": tflops,
                "mfu": tflops / self.peak,
                "step_time_s": pending.step_time_s,
                # this rank's (rank 0's in the file) optimizer update: its share of the step is the optimizer's cost
                "optimizer_step_s": pending.optimizer.seconds(),
                "expert_load_max_over_mean": imbalance,
                "dropped_fraction": 1.0 - kept,  # (token, expert) pairs dropped by a capacity factor, all layers
            }
            if pending.ep_comm_wait_s is not None:
                # this rank's host blocked on the dispatchers' collectives: the exposed expert-parallel
                # communication, the rest of step_time_s being computation and other communication
                record["ep_comm_wait_s"] = pending.ep_comm_wait_s
            if pending.ep_overlap_turns is not None:  # none: nothing was overlapped across micro-batches
                record["ep_overlap_turns"] = pending.ep_overlap_turns
            if pending.ep_delayed_wgrads is not None:
                record["ep_delayed_wgrads"] = pending.ep_delayed_wgrads
            if pending.skipped:
                record["skipped"] = True
            out.append(record)
        self.last_load_LE = load_NLE[-1]
        self.pending.clear()
        return out
