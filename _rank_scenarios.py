"""Scenarios of a multi-rank test worker run one by one, each one's outcome recorded on every rank under its name: the
test asking for a scenario fails with that name and the failing ranks' tracebacks while the other tests pass.

Every test session can import this module: the root conftest.py puts its folder on ``sys.path``, and its launcher
(the ``launch_gloo_scenarios`` fixture) on the workers' ``PYTHONPATH``.

A worker (one process per rank, torchrun's environment)::

    dist.init_process_group("gloo")  # and any set-up every scenario shares: groups, meshes
    scenarios = Scenarios(out_dir)
    scenarios.run("name", fn, *args)  # fn(*args)'s value is what the test gets from this rank
    ...
    scenarios.finish()  # barrier and destroy_process_group when the group is whole

Between scenarios a worker issues no collective (they belong in set-up, before the first, or in a scenario): once the
group is unusable ``run`` only records that the scenario did not run.

A test module::

    @pytest.fixture(scope="module")
    def outcomes(tmp_path_factory, launch_gloo_scenarios):
        return launch_gloo_scenarios(WORKER, 2, tmp_path_factory.mktemp("name"))

    def test_something(outcomes):
        ranks = outcomes["name"]  # each rank's value, or pytest.fail with the scenario's name and tracebacks

After each scenario the ranks agree over a gloo group of their own: an all-reduce of (failed, scenario index) with a
timeout, so every rank knows before the next scenario starts. The group is taken as unusable, and the rest recorded
as not run, when that agreement fails or times out (a rank stuck in a collective its peers never joined, or dead),
when the ranks are at different scenarios, or when a scenario failed with a distributed error (a collective timed out,
a peer's connection closed): its collectives may have left the ranks out of step. A failure on some ranks only, every
rank then agreeing, leaves no collective pending: the next scenario runs.
"""

from __future__ import annotations

import gc
import os
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

OK, FAILED, NOT_RUN, STARTED = "ok", "failed", "not run", "started"
# how long a rank waits for the others at the end of a scenario: the most one rank may lag behind another there
AGREE_TIMEOUT_S = 60.0
# a distributed failure seen as a plain RuntimeError (gloo's own exceptions)
_DISTRIBUTED_MESSAGES = ("gloo/transport", "Connection closed by peer", "Connection reset by peer", "Timed out")


def _outcome_path(out_dir: Path, rank: int, index: int) -> Path:
    return Path(out_dir) / f"rank{rank}" / f"{index:03d}.pt"


class Scenarios:
    """Runs a worker's scenarios one by one on this rank, recording each one's outcome in ``out_dir/rank{r}/``.
    Without a process group: one rank, nothing to agree on (``Outcomes(out_dir, [None], [""])`` reads it back)."""

    def __init__(self, out_dir: Path, agree_timeout: float = AGREE_TIMEOUT_S) -> None:
        import torch.distributed as dist

        grouped = dist.is_available() and dist.is_initialized()
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if grouped else (0, 1)
        self._out_dir = Path(out_dir)
        (self._out_dir / f"rank{self.rank}").mkdir(parents=True, exist_ok=True)
        # the agreement's own group: a rank that failed before a collective its peers wait in must not pair with it
        self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=agree_timeout)) if grouped else None
        self._index = 0
        self.broken: str | None = None  # why the process group is unusable, once it is

    def run(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, its value or its traceback recorded under ``name``; its value, or None when it
        failed or did not run."""
        index, self._index = self._index, self._index + 1
        if self.broken is not None:
            self._save(index, {"name": name, "status": NOT_RUN, "error": self.broken})
            return None
        self._save(index, {"name": name, "status": STARTED})  # a rank killed in it still names it
        start = time.perf_counter()
        result, flag = None, 0
        try:
            result = fn(*args, **kwargs)
            outcome = {"name": name, "status": OK, "result": result}
        except Exception as err:
            flag = 2 if _is_distributed(err) else 1
            outcome = {"name": name, "status": FAILED, "error": traceback.format_exc()}
        outcome["seconds"] = time.perf_counter() - start
        try:
            self._save(index, outcome)
        except Exception:  # a value torch.save cannot write
            flag, result = max(flag, 1), None
            self._save(index, {**outcome, "status": FAILED, "result": None, "error": traceback.format_exc()})
        self._agree(name, index, flag)
        return result

    def finish(self) -> None:
        """Leave the process group: after a barrier when it is whole; at once, exiting, when it is not (a rank stuck
        in a collective is freed when this process's connections close)."""
        import torch.distributed as dist

        if self._group is None:
            return
        if self.broken is not None:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)  # every outcome is on disk; gloo's teardown with a peer gone can abort or hang
        gc.collect()  # a failed collective's traceback cycle holds the group (moe_parallel.shutdown_distributed)
        dist.barrier()
        dist.destroy_process_group()

    def _save(self, index: int, outcome: dict) -> None:
        import torch

        path = _outcome_path(self._out_dir, self.rank, index)
        torch.save(outcome, path.with_suffix(".tmp"))
        path.with_suffix(".tmp").replace(path)

    def _agree(self, name: str, index: int, flag: int) -> None:
        import torch
        import torch.distributed as dist

        if self._group is None:
            return
        # MAX of (flag, index, -index): the worst failure, and the same index on every rank
        values = torch.tensor([flag, index, -index], dtype=torch.int64)
        try:
            dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self._group)
        except Exception as err:
            first_line = str(err).strip().splitlines()[0] if str(err).strip() else ""
            self.broken = (
                f"the ranks did not all finish scenario {name!r}: some rank is stuck in a collective or gone "
                f"({type(err).__name__}: {first_line})"
            )
            return
        worst, highest, lowest = values.tolist()
        if highest != index or -lowest != index:
            self.broken = f"the ranks were at different scenarios after {name!r} (indices {-lowest} to {highest})"
        elif worst == 2:
            self.broken = f"scenario {name!r} failed with a distributed error: the ranks may be out of step"


def _is_distributed(err: BaseException) -> bool:
    import torch.distributed as dist

    return isinstance(err, dist.DistError) or any(m in str(err) for m in _DISTRIBUTED_MESSAGES)


class Outcomes:
    """What every rank of a scenario worker recorded, read back by the test process: ``outcomes[name]`` is the list
    of each rank's value, or fails the calling test."""

    def __init__(self, out_dir: Path, exits: list[str | None], logs: list[str]) -> None:
        """``exits[r]``: None when rank r exited cleanly, else how it ended; ``logs[r]``: its output."""
        import torch

        self.exits, self.logs = exits, logs
        self.by_rank: list[dict[str, dict]] = []
        self.order: list[str] = []
        for rank in range(len(exits)):
            recorded = {}
            for path in sorted((Path(out_dir) / f"rank{rank}").glob("*.pt")):
                outcome = torch.load(path, weights_only=True)  # tensors, containers and plain values only
                recorded[outcome["name"]] = outcome
                if outcome["name"] not in self.order:
                    self.order.append(outcome["name"])
            self.by_rank.append(recorded)

    def names(self) -> list[str]:
        """Every scenario some rank recorded, in the order run."""
        return list(self.order)

    def __getitem__(self, name: str) -> list:
        import pytest

        problems = self.problems(name)
        if problems:
            pytest.fail(problems, pytrace=False)
        return [recorded[name]["result"] for recorded in self.by_rank]

    def problems(self, name: str) -> str:
        """Why scenario ``name`` has no value from every rank (the text a test fails with), or "" when it has."""
        failed, not_run, missing = [], [], []
        for rank, recorded in enumerate(self.by_rank):
            outcome = recorded.get(name)
            if outcome is None or outcome["status"] == STARTED:
                missing.append((rank, outcome is not None))
            elif outcome["status"] == FAILED:
                failed.append((rank, outcome["error"]))
            elif outcome["status"] == NOT_RUN:
                not_run.append((rank, outcome["error"]))
        if failed:
            text = [f"scenario {name!r} failed on rank {', '.join(str(r) for r, _ in failed)}"]
            text += [f"--- rank {rank} ---\n{error.rstrip()}" for rank, error in failed]
            text += [self._missing(name, rank, started) for rank, started in missing]
            # a distributed failure on one rank is often explained by another's output (it crashed, or left early)
            shown = {rank for rank, _ in failed} | {rank for rank, _ in missing}
            text += [self._others(name, rank) for rank in range(len(self.exits)) if rank not in shown]
            return "\n".join(text)
        if missing:
            return "\n".join(self._missing(name, rank, started) for rank, started in missing)
        if not_run:
            return f"scenario {name!r} did not run: {not_run[0][1]}"
        # a rank that ended badly without a failure of its own recorded: after its scenarios, or outside them
        unexplained = [
            rank
            for rank, end in enumerate(self.exits)
            if end is not None and all(o["status"] == OK for o in self.by_rank[rank].values())
        ]
        if unexplained:
            return "\n".join(
                f"scenario {name!r} ran, but rank {rank} then {self.exits[rank]}:\n{self._tail(rank)}"
                for rank in unexplained
            )
        return ""

    def _missing(self, name: str, rank: int, started: bool) -> str:
        where = "started scenario" if started else "recorded nothing for scenario"
        end = self.exits[rank] or "exited cleanly"
        return f"rank {rank} {where} {name!r} and {end}; the end of its output:\n{self._tail(rank)}"

    def _others(self, name: str, rank: int) -> str:
        outcome = self.by_rank[rank].get(name)
        status = outcome["status"] if outcome else "nothing recorded"
        end = self.exits[rank] or "exited cleanly"
        return f"rank {rank} ({status} in {name!r}) {end}; the end of its output:\n{self._tail(rank)}"

    def _tail(self, rank: int) -> str:
        return self.logs[rank][-4000:]
