"""Per-step metrics: throughput, TFLOPS per GPU (Megatron FLOPs convention), MFU, JSONL output."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, TextIO

import torch

from moe_train.write_errors import write_whole

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


def _finite_or_null(value: Any) -> Any:
    """``value`` with every non-finite float (NaN, inf) replaced by None, inside dicts and lists too."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite_or_null(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite_or_null(v) for v in value]
    return value


def _json_line(record: dict[str, Any]) -> str:
    return json.dumps(_finite_or_null(record), allow_nan=False) + "\n"


def _null_to_nan(record: dict[str, Any]) -> dict[str, Any]:
    """A record read back: top-level nulls (this log's non-finite values) become NaN, so fields stay numeric."""
    return {k: math.nan if v is None else v for k, v in record.items()}


def _kept_records(path: Path, resume_step: int) -> list[dict[str, Any]]:
    """The records of an earlier session's log up to ``resume_step``.

    Lines with a later step were written after the checkpoint the run resumes from, and the resumed run writes
    those steps again. A line that does not parse (the last one, cut by a kill mid-write) is dropped; a record
    without a step is kept, as nothing says it is stale.
    """
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and not (isinstance(record.get("step"), int) and record["step"] > resume_step):
            kept.append(record)
    return kept


class MetricsLog:
    """Appends one JSON object per line to ``metrics.jsonl`` and keeps the history for the summary and pictures.

    Training steps and other records (``{"step": s, "val_loss": v}``) share the file, in the order written.
    Non-finite floats are written as ``null`` (bare ``NaN`` is not JSON) and read back as NaN on resume; the
    records held in memory keep the values as written.

    ``resume_step > 0`` continues an earlier session's file: its lines with ``step <= resume_step`` are kept
    (the file is rewritten atomically without the later ones) and loaded into :attr:`records`, so the summary
    and pictures cover the whole run. ``resume_step == 0`` starts a new file.
    """

    def __init__(self, path: Path, resume_step: int = 0) -> None:
        self.path = path
        self.records: list[dict[str, Any]] = []
        if resume_step > 0 and path.exists():
            self.records = [_null_to_nan(record) for record in _kept_records(path, resume_step)]
            # a kill during the rewrite leaves the old file or the new one, never half of one; re-encoding
            # (not copying the lines) also turns the bare NaN of files written before this fix into null
            # (a full disk leaves the old file whole, and no half-written copy beside it)
            write_whole(path, "".join(_json_line(record) for record in self.records), fsync=True)
            mode = "a"
        else:
            mode = "w"
        self._file: TextIO = open(path, mode)  # noqa: SIM115 - closed in close()

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        self._file.write(_json_line(record))
        self._file.flush()

    def series(self, key: str) -> tuple[list[float], list[float]]:
        """``(steps, values)`` of the records that have ``key`` and a step, e.g. for a line chart."""
        pairs = [(r["step"], r[key]) for r in self.records if key in r and "step" in r]
        return [s for s, _ in pairs], [v for _, v in pairs]

    def close(self) -> None:
        self._file.close()
