"""Resident-memory probes for the CPU benchmarks (Linux /proc): the peak RSS of a stretch of work."""

from __future__ import annotations

import contextlib
from pathlib import Path


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    except OSError:
        return False
    return True


def set_mmap_threshold(nbytes: int = 65536) -> None:
    """glibc mallopt(M_MMAP_THRESHOLD): what MALLOC_MMAP_THRESHOLD_ does for the child processes, in this one."""
    import ctypes
    import ctypes.util

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(ctypes.util.find_library("c")).mallopt(-3, nbytes)  # M_MMAP_THRESHOLD = -3
