"""One rank of test_parallel_equivalence.py: ``python _parallel_worker.py OUT_DIR``.

Reads ``OUT_DIR/cases.json`` (a list of {"name", "preset", "overrides"}) and trains each case with moe-train in
this one process group, one after the other; rank 0 writes each case's metrics to ``OUT_DIR/<name>/``. A case
with ``"skip_grad_sync": true`` turns off moe_parallel's gradient completion: a control that must NOT match; one
with ``"eager": true`` builds the whole model with values before splitting it (the way every rank built it before
the meta build path), which must train exactly as the default meta build does.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

import moe_parallel.grads
from moe_train.config import load_config
from moe_train.trainer import prepare, train


def main(out_dir: Path) -> None:
    cases = json.loads((out_dir / "cases.json").read_text())
    world = int(os.environ["WORLD_SIZE"])
    finalize = moe_parallel.grads.GradientSync.finalize
    for case in cases:
        if case.get("skip_grad_sync"):
            moe_parallel.grads.GradientSync.finalize = lambda self, params: None
        overrides = {**case["overrides"], "run.output_dir": str(out_dir / case["name"])}
        train(prepare(load_config(case["preset"], overrides), world, build_on_meta=not case.get("eager")))
        moe_parallel.grads.GradientSync.finalize = finalize
    rank = torch.distributed.get_rank()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    torch.save({"cases": len(cases)}, out_dir / f"rank{rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
