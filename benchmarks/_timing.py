"""Head-to-head timing for the benchmark scripts: two functions interleaved in one process, taking turns at going
first, so that neither always runs in the other's wake (a rotation through several variants changes what each
costs). Imported by the scripts beside it and by benchmarks/gpu/suite.py."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def head_to_head(
    a: Callable[[], object],
    b: Callable[[], object],
    reps: int,
    warmup: int,
    sync: Callable[[], None] = lambda: None,
) -> tuple[list[float], list[float]]:
    """Seconds of ``a`` and of ``b`` in each of ``reps`` repetitions after ``warmup`` untimed ones; ``sync`` waits
    for the device before each clock read."""
    for _ in range(warmup):
        a()
        b()
    times: tuple[list[float], list[float]] = ([], [])
    for rep in range(reps):
        order = ((0, a), (1, b)) if rep % 2 == 0 else ((1, b), (0, a))
        for index, fn in order:
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times[index].append(time.perf_counter() - start)
    return times


def spread(values: list[float]) -> dict[str, float]:
    """Median and range."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def ratio_spread(numerator: list[float], denominator: list[float]) -> dict[str, float]:
    """Median and range of the per-repetition ratios."""
    return spread([n / d for n, d in zip(numerator, denominator, strict=True)])
