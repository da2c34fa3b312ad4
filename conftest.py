from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parent
# the shared test helpers beside this file (_rank_scenarios.py): importable by every session's tests and workers
sys.path.insert(0, str(ROOT))

from _rank_scenarios import Outcomes  # noqa: E402


@pytest.fixture(autouse=True, scope="session")
def _one_intra_op_thread():
    """Package tests use tiny tensors; on a shared 2-core machine a second OpenMP thread only adds stalls
    (steps of ~3 ms were seen taking 1.6 s while other processes held the cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _spawn_gloo_ranks(worker: Path, world: int, out: Path, timeout: float) -> tuple[list[str | None], list[str]]:
    """Start ``python worker out`` on ``world`` local ranks with torchrun's environment and wait for all (killing
    those left after ``timeout`` seconds); return how each rank ended (None: exit code 0) and its output."""
    port = _free_port()
    procs, logs = [], []
    for rank in range(world):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "GLOO_SOCKET_IFNAME": "lo",
            "OMP_NUM_THREADS": "1",
            # a rank killed by a signal (a crash in gloo or torch) still prints its threads' Python stacks
            "PYTHONFAULTHANDLER": "1",
            # the shared helpers beside this file (_rank_scenarios.py)
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        }
        log = tempfile.TemporaryFile()  # noqa: SIM115 (read and closed below): a file, never a full pipe
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, str(worker), str(out)], env=env, stdout=log, stderr=log))
    deadline = time.monotonic() + timeout
    try:
        while any(proc.poll() is None for proc in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        killed = [proc.poll() is None for proc in procs]
        for proc, kill in zip(procs, killed, strict=True):
            if kill:
                proc.kill()
            proc.wait()
    ends: list[str | None] = [
        f"was killed after {timeout:g} s" if kill else f"exited with {proc.returncode}" if proc.returncode else None
        for proc, kill in zip(procs, killed, strict=True)
    ]
    texts = []
    for rank, log in enumerate(logs):
        log.seek(0)
        texts.append(log.read().decode(errors="replace"))
        log.close()
        # every rank's whole output stays beside its outcomes: a group that failed on one rank is explained by another
        (out / f"rank{rank}.log").write_text(f"{ends[rank] or 'exited with 0'}\n{texts[-1]}")
    return ends, texts


def _launch_gloo_workers(worker: Path, world: int, out: Path, timeout: float = 150) -> list:
    """Start ``python worker out`` on ``world`` local ranks with torchrun's environment, wait for all,
    and return what each rank saved as ``out/rank{r}.pt`` (a failing rank's output is in the error)."""
    ends, logs = _spawn_gloo_ranks(worker, world, out, timeout)
    for rank, (end, log) in enumerate(zip(ends, logs, strict=True)):
        assert end is None, f"rank {rank} {end}:\n{log[-4000:]}"
    # our own workers' results, written a moment ago
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _launch_gloo_scenarios(worker: Path, world: int, out: Path, timeout: float = 150) -> Outcomes:
    """The same for a worker running its scenarios through ``_rank_scenarios.Scenarios``: what each rank recorded
    for each scenario, ``outcomes[name]`` failing the test that asks for a scenario which did not succeed."""
    return Outcomes(out, *_spawn_gloo_ranks(worker, world, out, timeout))


@pytest.fixture(scope="session")
def launch_gloo_workers():
    """Multi-process tests spawn their process group once per module through this (see above)."""
    return _launch_gloo_workers


@pytest.fixture(scope="session")
def launch_gloo_scenarios():
    """Multi-process tests whose worker runs several scenarios: each test asks for its own (_rank_scenarios.py)."""
    return _launch_gloo_scenarios
