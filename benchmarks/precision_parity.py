"""Loss parity of the low-precision recipes against the unquantised run: the default preset (``tiny``), the same
weights, data and steps, under each ``precision.recipe`` (exact emulation on CPU), one process; then the same under
tp=2 x ep=2 (4 gloo ranks, torchrun) with fewer steps, checking that nothing turns non-finite there.

Targets: final loss within 1% of the unquantised run for the FP8 recipes and MXFP8, within 3% for NVFP4. The final
loss is the last step's (every run sees the same batches); the mean over the last 20 steps is reported beside it.
The noise floor: the unquantised run again with ``train.adam_eps`` moved by 1% either way, a rounding-sized change
of fp32 arithmetic, shows how far the final loss moves without any quantisation.
Writes JSON and the curves drawn together (``docs/precision_parity.svg``).

    uv run python benchmarks/precision_parity.py [--quick] [--steps 300] [--tp-ep-steps 100] [--out ...]
    uv run python benchmarks/precision_parity.py --only noise_floor   # add that set to an existing results file
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from moe_precision import RECIPES
from moe_train.plots import line_chart_svg

ROOT = Path(__file__).resolve().parent
TARGETS = {"nvfp4": 0.03}  # the others: 0.01


def train(recipe: str, steps: int, out_dir: Path, ranks: int, extra: list[str]) -> list[dict]:
    """Run ``moe-train train`` (torchrun with ``ranks`` > 1) and return its metrics records."""
    args = [
        "train",
        "--train.steps",
        str(steps),
        "--run.output_dir",
        str(out_dir),
        "--run.save_checkpoint",
        "false",
        "--run.log_interval",
        str(max(1, steps // 10)),
        "--precision.recipe",
        recipe,
        "--precision.emulate",
        "true",
        *extra,
    ]
    if ranks > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "-m", "moe_train"]
    else:
        command = [sys.executable, "-m", "moe_train"]
    env = {**os.environ, "OMP_NUM_THREADS": "1" if ranks > 1 else os.environ.get("OMP_NUM_THREADS", "2")}
    subprocess.run([*command, *args], check=True, env=env, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]


def summarise(records: list[dict], reference: list[dict] | None, target: float) -> dict:
    losses = [r["loss"] for r in records if "loss" in r and "step" in r]
    final, tail = losses[-1], losses[-20:]
    row = {
        "final_loss": final,
        "mean_last_20": sum(tail) / len(tail),
        "all_finite": all(math.isfinite(v) for v in losses),
        "max_grad_norm": max(r.get("grad_norm", 0.0) for r in records),
    }
    if reference is not None:
        ref_losses = [r["loss"] for r in reference if "loss" in r and "step" in r]
        row["rel_diff_final"] = (final - ref_losses[-1]) / ref_losses[-1]
        ref_tail = ref_losses[-20:]
        row["rel_diff_mean_last_20"] = (row["mean_last_20"] - sum(ref_tail) / len(ref_tail)) / (
            sum(ref_tail) / len(ref_tail)
        )
        row["target"] = target
        row["within_target"] = row["all_finite"] and abs(row["rel_diff_final"]) <= target
    return row


def noise_floor(steps: int, work: Path) -> dict:
    """The unquantised run, and again with adam_eps 1.01e-8 and 0.99e-8 (1e-8 by default)."""
    reference = train("none", steps, work / "floor-none", 1, [])
    rows = {}
    for eps in ("1.01e-8", "0.99e-8"):
        records = train("none", steps, work / f"floor-{eps}", 1, ["--train.adam_eps", eps])
        rows[f"adam_eps={eps}"] = summarise(records, reference, 0.01)
        print(f"noise floor adam_eps={eps}: final {rows[f'adam_eps={eps}']['rel_diff_final']:+.4%}", flush=True)
    return {"steps": steps, "what": "recipe none with adam_eps moved by 1%, against recipe none", "results": rows}


def run_set(recipes: list[str], steps: int, ranks: int, extra: list[str], work: Path, label: str) -> dict:
    """Each recipe in turn ("none", the reference, first)."""
    curves, rows, reference = {}, {}, None
    for recipe in recipes:
        start = time.perf_counter()
        records = train(recipe, steps, work / f"{label}-{recipe}", ranks, extra)
        curves[recipe] = [r["loss"] for r in records if "step" in r]
        rows[recipe] = summarise(records, reference, TARGETS.get(recipe, 0.01))
        rows[recipe]["seconds"] = time.perf_counter() - start
        reference = reference or records
        diff = rows[recipe].get("rel_diff_final", 0.0)
        print(f"{label} {recipe:15s} final loss {rows[recipe]['final_loss']:.4f}  {diff:+.4%}", flush=True)
    return {"steps": steps, "ranks": ranks, "args": extra, "results": rows, "curves": curves}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "precision_parity.json")
    parser.add_argument("--svg", type=Path, default=ROOT.parent / "docs" / "precision_parity.svg")
    parser.add_argument("--quick", action="store_true", help="3 steps of three recipes on one process (CI)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--tp-ep-steps", type=int, default=100)
    parser.add_argument("--only", choices=["noise_floor"], help="run this set alone and add it to --out")
    args = parser.parse_args()
    if args.only:
        work = Path(tempfile.mkdtemp(prefix="precision_parity_"))
        try:
            report = json.loads(args.out.read_text())
            report["sets"]["noise_floor"] = noise_floor(args.steps, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}")
        return
    recipes = list(RECIPES)
    work = Path(tempfile.mkdtemp(prefix="precision_parity_"))
    try:
        if args.quick:
            extra = ["--train.global_batch_size", "4", "--data.seq_len", "64"]
            sets = {"one_process": run_set(["none", "fp8_delayed", "nvfp4"], 3, 1, extra, work, "quick")}
        else:
            sets = {"one_process": run_set(recipes, args.steps, 1, [], work, "1p")}
            sets["noise_floor"] = noise_floor(args.steps, work)
            tp_ep = ["--parallel.tp", "2", "--parallel.ep", "2"]
            sets["tp2_ep2"] = run_set(recipes, args.tp_ep_steps, 4, tp_ep, work, "tp2xep2")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report = {
        "benchmark": "precision_parity",
        "what": "final training loss of each precision.recipe (exact emulation) against the unquantised run",
        "baseline": "recipe none (fp32)",
        "preset": "tiny (Qwen3-MoE-style, 4 layers, 8 experts top-2, hidden 128, seq 128, batch 16)",
        "sets": sets,
        "device": "cpu (emulation: quantise, dequantise, fp32 GEMM)",
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "quick": args.quick,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    if not args.quick:
        curves = sets["one_process"]["curves"]
        steps = list(range(1, len(curves["none"]) + 1))
        extra_series = [(name, list(range(1, len(c) + 1)), c) for name, c in curves.items() if name != "none"]
        svg = line_chart_svg(
            steps,
            curves["none"],
            f"tiny preset, {args.steps} steps: loss under each precision recipe",
            "step",
            "loss",
            extra=extra_series,
            label="none (fp32)",
        )
        args.svg.write_text(svg)
        print(f"wrote {args.svg}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
