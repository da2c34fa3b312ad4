"""What every benchmark script shares: its command line (``--quick``, ``--out``), the report's header, head-to-head
timing and the writing of the report. Imported by the scripts beside it (and benchmarks/gpu/suite.py for the timing).

A script builds its parser with :func:`cli`, adds its own options and reads them with :func:`parse`; a full run
writes ``benchmarks/results/<name>.json`` unless ``--out`` says otherwise, a ``--quick`` run (the nox benchmarks
session) writes only where ``--out`` says, never over the committed results. :func:`header` starts the report,
:func:`write` writes it (and any text beside it: a markdown table, an SVG). :func:`head_to_head` times two functions
interleaved in one process, taking turns at going first, so that neither always runs in the other's wake (a rotation
through several changes what each costs: a baseline is compared pair by pair).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


# ----------------------------------------------------------------------------------------------- command line


def cli(name: str, doc: str, quick: str, *, ranks: bool = False) -> argparse.ArgumentParser:
    """The parser of benchmark ``name`` (its results file's stem): ``--out``, ``--quick`` (or ``--smoke``, as the GPU
    suite says; help ``quick``) and, with ``ranks``, the hidden ``--rank-dir`` :func:`launch_ranks` gives each rank."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help=f"JSON to write (full runs: {RESULTS / name}.json)")
    parser.add_argument("--quick", "--smoke", action="store_true", help=quick)
    if ranks:
        parser.add_argument("--rank-dir", type=Path, help=argparse.SUPPRESS)  # set when launched as one rank
    parser.set_defaults(benchmark=name)
    return parser


def parse(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """The arguments, ``out`` resolved: ``--out``, else the committed results file for a full run, else None."""
    args = parser.parse_args()
    if args.out is None and not args.quick:
        args.out = RESULTS / f"{args.benchmark}.json"
    return args


def header(args: argparse.Namespace, **fields: object) -> dict:
    """The report's first keys: the benchmark's name, ``fields`` (what, baseline, inputs, ...), torch's version, the
    date (UTC) and whether it is a quick run."""
    date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    return {"benchmark": args.benchmark, **fields, "torch": torch.__version__, "date": date, "quick": args.quick}


def write(out: Path | None, report: dict, beside: dict[str, str] | None = None) -> None:
    """``report`` as JSON to ``out`` and each text of ``beside`` (suffix -> text) next to it; nothing if ``out`` is
    None."""
    if out is None:
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    for suffix, text in (beside or {}).items():
        out.with_suffix(suffix).write_text(text)
    print(f"wrote {', '.join([str(out), *(str(out.with_suffix(s)) for s in beside or {})])}")


def launch_ranks(script: str, world: int, rank_dir: Path, *args: str, timeout: float = 600) -> list[dict]:
    """Run ``python script --rank-dir rank_dir *args`` on ``world`` local gloo ranks (torchrun's environment, no
    torchrun), wait for all, and return what each wrote to ``rank_dir/rank{r}.json``; exit if a rank fails."""
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


# ----------------------------------------------------------------------------------------------- timing


def device_sync(device: torch.device) -> Callable[[], None]:
    """What waits for ``device`` before a clock read (nothing on the CPU)."""
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def head_to_head(
    a: Callable[[], object], b: Callable[[], object], reps: int, warmup: int, sync: Callable[[], None] = lambda: None
) -> tuple[list[float], list[float]]:
    """Seconds of ``a`` and of ``b`` in each of ``reps`` repetitions after ``warmup`` untimed ones of each,
    interleaved, taking turns at going first; ``sync`` waits for the device before each clock read."""
    for _ in range(warmup):
        a()
        b()
    times: tuple[list[float], list[float]] = ([], [])
    for rep in range(reps):
        for index in (0, 1) if rep % 2 == 0 else (1, 0):
            sync()
            start = time.perf_counter()
            (a, b)[index]()
            sync()
            times[index].append(time.perf_counter() - start)
    return times


def spread(values: list[float]) -> dict[str, float]:
    """Median and range."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def ratio_spread(numerator: list[float], denominator: list[float]) -> dict[str, float]:
    """Median and range of the per-repetition ratios."""
    return spread([n / d for n, d in zip(numerator, denominator, strict=True)])


def quartiles(values: list[float]) -> list[float]:
    """First and third quartiles (the value twice for one value)."""
    if len(values) < 2:
        return [values[0], values[0]]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return [q[0], q[2]]
