"""Launching a benchmark script as several gloo ranks on this machine (torchrun's environment, no torchrun)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path


def launch_ranks(script: str, world: int, rank_dir: Path, *args: str, timeout: float = 600) -> list[dict]:
    """Run ``python script --rank-dir rank_dir *args`` on ``world`` local ranks, wait for all, and return what each
    wrote to ``rank_dir/rank{r}.json``; exit if a rank fails."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world)}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
        procs.append(subprocess.Popen([sys.executable, script, "--rank-dir", str(rank_dir), *args], env=env))
    if any(p.wait(timeout=timeout) for p in procs):
        raise SystemExit("a rank failed")
    return [json.loads((rank_dir / f"rank{r}.json").read_text()) for r in range(world)]
