"""One rank of test_memory_estimate.py: ``python _memory_estimate_worker.py OUT_DIR``.

Reads ``OUT_DIR/cases.json`` (a list of {"name", "preset", "overrides"}) and, for each case in this one process group,
measures one training step against the memory estimate for its layout with the harness benchmarks/memory_estimate.py
uses (``benchmarks/_estimate.py``: the model built as ``moe-train train`` does, one forward + loss under
:class:`moe_memory.measure.SavedTensorBytes`, the backward and one optimizer step; the parameter, gradient and
optimizer-state storages this rank allocated). Saves ``OUT_DIR/rank{r}.pt``: {case name: results}.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from _estimate import training_step  # benchmarks/_estimate.py


def run_case(case: dict, world: int) -> dict:
    r = training_step(case["preset"], {"run.output_dir": "unused", **case["overrides"]}, world)
    return {
        "layout": r["layout"],
        "measured_activations": r["measured_activation_bytes"],
        "measured_by_module": r["measured_by_module"],
        "estimated_activations": r["estimated_activation_bytes"],
        "estimated_by_module": r["estimated_by_module"],
        **{f"{side}_{k}": r[k][side] for k in ("params", "grads", "optimizer") for side in ("estimated", "allocated")},
    }


def main(out_dir: Path) -> None:
    cases = json.loads((out_dir / "cases.json").read_text())
    results = {case["name"]: run_case(case, int(os.environ["WORLD_SIZE"])) for case in cases}
    rank = dist.get_rank()
    dist.barrier()
    dist.destroy_process_group()
    torch.save(results, out_dir / f"rank{rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
