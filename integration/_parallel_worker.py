"""One rank of test_parallel_equivalence.py: ``python _parallel_worker.py OUT_DIR``.

Reads ``OUT_DIR/cases.json`` (a list of {"name", "preset", "overrides"}) and trains each case with moe-train in
this one process group, one after the other, each a scenario of its own (``_rank_scenarios.py``: the test of a case
that failed fails with its traceback, the others pass); rank 0 writes each case's metrics to ``OUT_DIR/<name>/``. A case
with ``"skip_grad_sync": true`` turns off moe_parallel's gradient completion, one with ``"muon_shardwise": true`` has
Muon orthogonalise each rank's pieces apart: controls that must NOT match.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

import moe_parallel.grads
import moe_train.optim
from _rank_scenarios import Scenarios
from moe_train.config import load_config
from moe_train.trainer import prepare, train


def run_case(case: dict, out_dir: Path, world: int) -> None:
    finalize, muon = moe_parallel.grads.GradientSync.finalize, moe_train.optim.MuonWithAdamW
    if case.get("skip_grad_sync"):
        moe_parallel.grads.GradientSync.finalize = lambda self, params: None
    if case.get("muon_shardwise"):
        moe_train.optim.MuonWithAdamW = functools.partial(muon, whole_matrices=False)
    try:
        overrides = {**case["overrides"], "run.output_dir": str(out_dir / case["name"])}
        train(prepare(load_config(case["preset"], overrides), world))
    finally:
        moe_parallel.grads.GradientSync.finalize, moe_train.optim.MuonWithAdamW = finalize, muon


def main(out_dir: Path) -> None:
    cases = json.loads((out_dir / "cases.json").read_text())
    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")  # what prepare would join: every case's meshes are built in it
    scenarios = Scenarios(out_dir)
    for case in cases:
        scenarios.run(case["name"], run_case, case, out_dir, world)
    scenarios.finish()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
