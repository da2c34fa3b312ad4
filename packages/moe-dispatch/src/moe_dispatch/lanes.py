"""Two micro-batches in flight in one process: the backward of one and the forward of the next take turns at their
expert-parallel all-to-alls, so that each one's exchange travels while the other computes (Megatron-Core's combined
1F1B, ``--overlap-moe-expert-parallel-comm``; the overlapped forward-backward pairs of DeepSeek's DualPipe).

:meth:`Lanes.run` runs the backward on the calling thread (the *main* lane) and the forward on a second thread (the
*side* lane), never both at once: a lane runs until it has started an all-to-all, then :meth:`Lanes.switch` hands
the turn to the other lane and waits for it back. The main lane goes first::

    main  (backward A)  B_comb ─┐        ┌─ experts' B ─ B_disp ─┐        ┌─ attention's B ...
    side  (forward  B)          └ attn ─ F_disp ┘                └ experts ─ F_comb ┘

Every switch happens at a collective every rank issues, so every rank runs the same sequence of turns and issues
its collectives in the same order on each process group: no second process group is needed, and nothing runs
concurrently on the host but a collective's transfer (gloo's threads on CPU, the NCCL stream on a GPU). The result
is the one the micro-batches give one after another: the forward of one and the backward of the other share no
tensor, and only the backward accumulates gradients. They do share the process's random number generators: each lane
keeps its own generator states across its turns (set back when its turn comes), so that a backward recomputing a
forward under its saved states (activation checkpointing's ``fork_rng``) and the other lane's forward (dropout) each
draw what they would alone; the forward's states are the process's after :meth:`Lanes.run`, as after the forward
that runs last in turn.

The backward lane may also leave work for later (:meth:`Lanes.defer`): the experts' weight gradients with
``parallel.delay_wgrad_compute`` (``moe_experts.delayed_wgrad``), run by :meth:`Lanes.run_deferred` where the
backward would otherwise wait for an exchange, so that they too compute while the gradients travel, and in any case
before :meth:`Lanes.run` returns.

When one lane finishes, the other runs alone to its end without switching. An exception in either lane ends the
other at its next switch and is raised by :meth:`Lanes.run`.

The side thread starts with the caller's grad mode, autocast state and CUDA device, which are thread-local.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")
_MAIN, _SIDE = "main", "side"


class OtherLaneFailed(RuntimeError):
    """Raised in a lane at its next switch when the other lane raised: :meth:`Lanes.run` raises the original."""


def _thread_state() -> Callable[[], contextlib.ExitStack]:
    """What a new thread must enter to compute as the calling thread does (grad mode, autocast, CUDA device)."""
    grad = torch.is_grad_enabled()
    cache = torch.is_autocast_cache_enabled()
    autocasts = [
        (device, torch.get_autocast_dtype(device)) for device in ("cpu", "cuda") if torch.is_autocast_enabled(device)
    ]
    cuda_device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def enter() -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        stack.enter_context(torch.set_grad_enabled(grad))
        for device, dtype in autocasts:
            stack.enter_context(torch.autocast(device, dtype=dtype, cache_enabled=cache))
        if cuda_device is not None:
            torch.cuda.set_device(cuda_device)
        return stack

    return enter


def _rng_states() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """The CPU generator's state and, once CUDA is initialised, every device's."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng_states(states: tuple[torch.Tensor, list[torch.Tensor] | None]) -> None:
    cpu, cuda = states
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


class Lanes:
    """Two computations taking turns at their collectives (module docstring). One object serves every step: a
    dispatcher whose ``lanes`` attribute holds it calls :meth:`switch` after each all-to-all it starts, forward and
    backward, which does nothing outside :meth:`run`."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._turn: str | None = None  # the lane that may run; None outside run()
        self._alone = False  # one lane has ended: the other runs without switching
        self._failed = False
        self._side_thread: int | None = None
        self._rng: dict[str, tuple] = {}  # each lane's generator states while the other has the turn
        self._deferred: list[Callable[[], None]] = []  # the backward lane's work left for later (defer)
        self.switches = 0  # turns handed over since construction (tests, benchmarks)
        self.deferred_runs = 0  # closures run later than they were handed over (tests, benchmarks)

    def defer(self, work: Callable[[], None]) -> None:
        """Run ``work`` (the backward lane's) at the next :meth:`run_deferred`, at the latest as :meth:`run`'s main
        lane ends; at once outside :meth:`run`."""
        if self._turn is None:
            work()
            return
        assert threading.get_ident() != self._side_thread, "the forward lane leaves nothing for later"
        self._deferred.append(work)

    def run_deferred(self) -> None:
        """Run the work :meth:`defer` queued, in the order it came (the backward lane calls it before it waits for
        an exchange)."""
        while self._deferred:
            self._deferred.pop(0)()
            self.deferred_runs += 1

    def switch(self) -> None:
        """Hand the turn to the other lane and wait for it back; a no-op outside :meth:`run` or once a lane ended."""
        with self._cond:
            if self._turn is None:
                return
            if self._failed:  # the other lane raised (or was interrupted) while this one ran
                raise OtherLaneFailed("the other micro-batch in flight raised")
            if self._alone:
                return
            me = _SIDE if threading.get_ident() == self._side_thread else _MAIN
            self._rng[me] = _rng_states()
            self._turn = _MAIN if me == _SIDE else _SIDE
            self.switches += 1
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._turn == me or self._alone)
            if self._failed:
                raise OtherLaneFailed("the other micro-batch in flight raised")
            _set_rng_states(self._rng[me])

    def run(self, main: Callable[[], object], side: Callable[[], T]) -> T:
        """``main()`` on this thread and ``side()`` on another, taking turns, main first; returns ``side()``'s
        result once both have ended."""
        if self._turn is not None:
            raise RuntimeError("Lanes.run is already running: one pair of micro-batches at a time")
        enter = _thread_state()
        result: list[T] = []
        errors: list[BaseException] = []

        def side_lane() -> None:
            try:
                with self._cond:
                    self._cond.wait_for(lambda: self._turn == _SIDE or self._alone)
                    if self._failed:
                        return
                    _set_rng_states(self._rng[_SIDE])
                with enter():
                    result.append(side())
            except BaseException as error:  # handed to the caller's thread
                errors.append(error)
            finally:
                with self._cond:
                    self._rng[_SIDE] = _rng_states()
                self._end(failed=bool(errors))

        with self._cond:
            self._turn, self._alone, self._failed = _MAIN, False, False
            self._rng = {_SIDE: _rng_states()}  # the forward draws on from where the previous one left off
        thread = threading.Thread(target=side_lane, name="moe-side-lane", daemon=True)
        thread.start()
        self._side_thread = thread.ident
        main_error: BaseException | None = None
        try:
            main()
            self.run_deferred()
        except BaseException as error:
            main_error = error
        self._deferred.clear()
        self._end(failed=main_error is not None)
        thread.join()
        with self._cond:
            self._turn, self._side_thread = None, None
            _set_rng_states(self._rng.pop(_SIDE))
            self._rng.clear()
        side_error = next((e for e in errors if not isinstance(e, OtherLaneFailed)), None)
        if main_error is not None and not (isinstance(main_error, OtherLaneFailed) and side_error is not None):
            raise main_error
        if side_error is not None:
            raise side_error
        return result[0]

    def _end(self, failed: bool) -> None:
        with self._cond:
            self._alone = True
            self._failed = self._failed or failed
            self._cond.notify_all()
