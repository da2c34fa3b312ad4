"""The first thing a new user runs: ``moe-train`` with no arguments trains the tiny preset."""

import json
import time
from pathlib import Path

KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "tflops_per_gpu", "mfu"}


def test_moe_train_without_arguments_trains_tiny_and_halves_the_loss(tmp_path: Path, run) -> None:
    started = time.perf_counter()
    done = run(["moe-train"], cwd=tmp_path, timeout=600)
    wall = time.perf_counter() - started
    assert done.returncode == 0, done.stderr[-2000:]
    out = tmp_path / "outputs" / "tiny"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    config = json.loads((out / "config.json").read_text())
    assert [r["step"] for r in records] == list(range(1, config["train"]["steps"] + 1))
    assert all(r.keys() >= KEYS for r in records)
    assert records[-1]["loss"] <= 0.5 * records[0]["loss"], (records[0]["loss"], records[-1]["loss"])
    assert (out / "checkpoints" / f"step_{config['train']['steps']}" / ".metadata").is_file()
    assert "done:" in done.stdout
    assert wall < 180, f"default run took {wall:.0f}s, the budget is 3 minutes"
