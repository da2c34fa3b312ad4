from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch


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


def _launch_gloo_workers(worker: Path, world: int, out: Path, timeout: float = 150) -> list:
    """Start ``python worker out`` on ``world`` local ranks with torchrun's environment, wait for all,
    and return what each rank saved as ``out/rank{r}.pt`` (a failing rank's output is in the error)."""
    port = _free_port()
    procs = []
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
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(worker), str(out)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
            )
        )
    logs = []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=timeout)[0].decode(errors="replace"))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for rank, (proc, log) in enumerate(zip(procs, logs, strict=True)):
        assert proc.returncode == 0, f"rank {rank} exited with {proc.returncode}:\n{log[-4000:]}"
    # our own workers' results, written a moment ago
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture(scope="session")
def launch_gloo_workers():
    """Multi-process tests spawn their process group once per module through this (see above)."""
    return _launch_gloo_workers
