"""Per-step metrics: throughput, TFLOPS per GPU (Megatron FLOPs convention), MFU, JSONL output."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, TextIO

import torch

# dense BF16 datasheet peaks (TFLOPS) by a substring of torch.cuda.get_device_name()
DATASHEET_BF16_TFLOPS = {"GB200": 2500.0, "B200": 2250.0, "H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0}


def measure_gemm_tflops(device: torch.device, dtype: torch.dtype, size: int = 1024, reps: int = 5) -> float:
    """Best-of-``reps`` rate of a square matmul: the attainable dense GEMM rate on this device."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    best = math.inf
    for _ in range(reps + 1):  # the first run warms up
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e12


def peak_tflops(device: torch.device, dtype: torch.dtype, override: float) -> tuple[float, str]:
    """The MFU denominator and where it came from."""
    if override > 0:
        return override, "run.peak_tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, tflops in DATASHEET_BF16_TFLOPS.items():
            if key in name:
                return tflops, f"{key} dense BF16 datasheet"
    rate = measure_gemm_tflops(device, dtype)
    return rate, f"measured {str(dtype).removeprefix('torch.')} GEMM rate on this {device.type}"


class MetricsLog:
    """Appends one JSON object per step to ``metrics.jsonl`` and keeps the history for the summary."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.records: list[dict[str, Any]] = []
        self._file: TextIO = open(path, "w")  # noqa: SIM115 - closed in close()

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()
