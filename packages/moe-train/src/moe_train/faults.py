"""What stops a run early: a preemption signal (SIGTERM, SIGINT), the planned exit of ``run.exit_interval``, and a loss
or gradient norm that is no longer finite."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType

import torch
import torch.distributed as dist


class NonFiniteError(RuntimeError):
    """Training produced a non-finite loss or gradient norm more often than ``train.skip_nonfinite_steps`` allows."""


class StopRequest:
    """Turns SIGTERM and SIGINT into a request to stop after the current step (the trainer then saves and exits 0).

    A second SIGINT interrupts at once (Ctrl-C twice), as without this handler. Under torchrun every rank receives the
    signal, but not at the same step: :meth:`agreed` makes all ranks stop after the same one.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signal_name is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal_name = signal.Signals(signum).name

    def asked_on_any_rank(self, not_finite_here: torch.Tensor) -> tuple[bool, bool]:
        """(the step's loss or gradient norm is not finite on some rank, some rank was asked to stop), from this
        rank's boolean ``not_finite_here`` (a device tensor): one small all-reduce and one read-back, the training
        step's only host synchronisation outside the model when it writes no metrics. Under torchrun every rank
        receives a signal, but not at the same step: this makes all ranks stop after the same one."""
        asked = torch.tensor(self.signal_name is not None, device=not_finite_here.device)
        flags = torch.stack([not_finite_here.reshape(()), asked]).float()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        not_finite, stop_asked = (bool(v) for v in flags.tolist())
        if stop_asked and self.signal_name is None:
            self.signal_name = "a signal to another rank"
        return not_finite, stop_asked


class NonFiniteGuard:
    """Counts steps whose loss or gradient norm is not finite: each is skipped (no update) while at most
    ``allowed`` have been; the next raises :class:`NonFiniteError` naming the step."""

    def __init__(self, allowed: int) -> None:
        self.allowed, self.skipped, self.skipping = allowed, 0, False

    def check(
        self, step: int, not_finite: bool, values: Callable[[], tuple[float, float]], last_saved: str | None
    ) -> NonFiniteError | None:
        """None when the step is fine or may be skipped (:attr:`skipping` says which); the error to raise once the
        step's metrics are written when the run must stop. ``values``: the step's (loss, gradient norm), read only
        for that error."""
        self.skipping = not_finite
        if not not_finite:
            return None
        self.skipped += 1
        if self.skipped > self.allowed:
            loss, grad_norm = values()
            saved = f"the last checkpoint is {last_saved}" if last_saved else "no checkpoint was written"
            return NonFiniteError(
                f"step {step}: loss {loss} / gradient norm {grad_norm} is not finite "
                f"({self.skipped} such steps, train.skip_nonfinite_steps={self.allowed}); nothing was saved after it, "
                f"{saved}; lower train.lr, raise train.warmup_steps, or allow skips with train.skip_nonfinite_steps"
            )
        return None


class OtherRankFailed(RuntimeError):
    """Another rank failed at a point all ranks pass together, and reports why itself: this rank stops quietly."""


def any_rank(flag: bool, device: torch.device | None = None) -> bool:
    """Whether ``flag`` holds on any rank (one small all-reduce when distributed). ``device``: where the process
    group's collectives run (None: CUDA under NCCL, else the CPU)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    if device is None:
        on_cuda = dist.get_backend() == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
    value = torch.tensor([float(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def agree_on_failure(error: BaseException | None, device: torch.device | None = None) -> None:
    """Raise on every rank if any rank failed (one small all-reduce): the failed rank its own ``error``, the others
    :class:`OtherRankFailed`. Where only the main rank writes (the run's files, a checkpoint's ``meta.json``), this
    replaces the barrier after the write, so that a full disk on the main rank stops every rank instead of leaving
    them waiting in the barrier."""
    failed = any_rank(error is not None, device)
    if error is not None:
        raise error
    if failed:
        raise OtherRankFailed("another rank failed")
