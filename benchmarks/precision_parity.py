"""Loss parity of the low-precision recipes against the unquantised run: the default preset (``tiny``), the same
weights, data and steps, under each ``precision.recipe`` (exact emulation on CPU), one process; then the same under
tp=2 x ep=2 (4 gloo ranks, torchrun) with fewer steps, checking that nothing turns non-finite there.

Targets: final loss within 1% of the unquantised run for the FP8 recipes and MXFP8, within 3% for NVFP4. The final
loss is the last step's (every run sees the same batches); the mean over the last 20 steps is reported beside it.
The noise floor: the unquantised run again with ``train.adam_eps`` moved by 1% either way, a rounding-sized change
of fp32 arithmetic, shows how far the final loss moves without any quantisation.

One run's final loss moves by about 2% under such a change (the byte-level data has plateaus whose end comes a few
steps earlier or later), so the ``seeds`` set repeats every recipe over several ``train.seed`` values (weights and
data order) and compares means over the seeds: the last step's training loss and a held-out loss at the last step
(``train.eval_iters`` fixed validation batches), each against the unquantised runs' mean, with the unquantised runs'
own spread over the seeds beside it.
Writes JSON and the curves drawn together (``docs/precision_parity.svg``).

    uv run python benchmarks/precision_parity.py [--quick] [--steps 300] [--tp-ep-steps 100] [--out ...]
    uv run python benchmarks/precision_parity.py --only noise_floor   # add that set to an existing results file
    uv run python benchmarks/precision_parity.py --only seeds --seeds 1234,1,2 --jobs 2
    uv run python benchmarks/precision_parity.py --only gradient_error
    uv run python benchmarks/precision_parity.py --only all_seeds   # pool every seeds set in the results file

The ``gradient_error`` set looks for a bias behind the differences: at fp32-trained weights (after 0, 50, 100 and 200
steps), one held-out batch's gradient under each recipe against fp32's at the same weights: relative error of the
whole gradient, its norm ratio (a biased recipe would move it away from 1) and the parameter it errs most on.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from _harness import cli, header, parse, write  # benchmarks/_harness.py, beside this script

from moe_precision import RECIPES
from moe_train.plots import line_chart_svg

ROOT = Path(__file__).resolve().parent
TARGETS = {"nvfp4": 0.03}  # the others: 0.01


def train(
    recipe: str, steps: int, out_dir: Path, ranks: int, extra: list[str], threads: int | None = None
) -> list[dict]:
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
    default_threads = "1" if ranks > 1 else os.environ.get("OMP_NUM_THREADS", "2")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads) if threads else default_threads}
    subprocess.run([*command, *args], check=True, env=env, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if 'loss"' in line]


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


def seeds_set(recipes: list[str], steps: int, seeds: list[int], jobs: int, eval_iters: int, work: Path) -> dict:
    """Every recipe at every seed, one process each, ``jobs`` at a time (one thread each, so that every run sums
    alike); the means over the seeds against the unquantised runs' means."""
    runs = [(seed, recipe) for seed in seeds for recipe in recipes]
    extra = [
        "--train.eval_interval",
        str(steps),
        "--train.eval_iters",
        str(eval_iters),
        "--data.valid_fraction",
        "0.05",
    ]

    def one(run: tuple[int, str]) -> tuple[tuple[int, str], dict]:
        seed, recipe = run
        start = time.perf_counter()
        records = train(recipe, steps, work / f"seed{seed}-{recipe}", 1, [*extra, "--train.seed", str(seed)], 1)
        losses = [r["loss"] for r in records if "step" in r and "loss" in r]
        row = {
            "final_loss": losses[-1],
            "mean_last_20": sum(losses[-20:]) / len(losses[-20:]),
            "val_loss": [r["val_loss"] for r in records if r.get("val_loss") is not None][-1],
            "all_finite": all(math.isfinite(v) for v in losses),
            "seconds": time.perf_counter() - start,
        }
        print(f"seed {seed} {recipe:15s} final {row['final_loss']:.4f}  val {row['val_loss']:.4f}", flush=True)
        return run, row

    with ThreadPoolExecutor(jobs) as pool:
        done = dict(pool.map(one, runs))
    per_seed = {recipe: {str(seed): done[(seed, recipe)] for seed in seeds} for recipe in recipes}
    metrics = ("final_loss", "mean_last_20", "val_loss")
    reference = {m: statistics.mean(row[m] for row in per_seed["none"].values()) for m in metrics}
    summary = {}
    for recipe in recipes:
        rows = per_seed[recipe].values()
        means = {m: statistics.mean(row[m] for row in rows) for m in metrics}
        entry: dict = {f"mean_{m}": means[m] for m in metrics}
        entry["all_finite"] = all(row["all_finite"] for row in rows)
        if recipe == "none":  # the seed-to-seed spread of the unquantised runs, relative to their mean
            entry.update(
                {f"rel_spread_{m}": (max(r[m] for r in rows) - min(r[m] for r in rows)) / means[m] for m in metrics}
            )
        else:
            entry.update({f"rel_diff_{m}": (means[m] - reference[m]) / reference[m] for m in metrics})
            entry["per_seed_rel_diff_final"] = {
                seed: (row["final_loss"] - per_seed["none"][seed]["final_loss"]) / per_seed["none"][seed]["final_loss"]
                for seed, row in per_seed[recipe].items()
            }
            entry["target"] = TARGETS.get(recipe, 0.01)
            entry["within_target"] = entry["all_finite"] and all(
                abs(entry[f"rel_diff_{m}"]) <= entry["target"] for m in ("final_loss", "val_loss")
            )
        summary[recipe] = entry
    return {
        "steps": steps,
        "seeds": seeds,
        "eval_iters": eval_iters,
        "threads_per_run": 1,
        "what": "means over the seeds of each recipe against the means of recipe none at the same seeds",
        "summary": summary,
        "per_seed": per_seed,
    }


def all_seeds(sets: dict) -> dict:
    """Every ``seeds*`` set pooled: per recipe, each seed's final and held-out loss against recipe none at that seed,
    their mean, its standard error (sample deviation / sqrt(n)) and how many seeds ended worse; and the difference of
    the means over all seeds a recipe ran, the figure the targets are about."""
    runs: dict[str, dict[str, dict]] = {}
    for name, body in sets.items():
        if name.startswith("seeds") and name != "all_seeds":
            for recipe, rows in body["per_seed"].items():
                runs.setdefault(recipe, {}).update(rows)
    none = runs.get("none", {})
    out: dict = {"what": "every seeds set pooled; rel diffs against recipe none at the same seed", "recipes": {}}
    for recipe, rows in runs.items():
        seeds = sorted((s for s in rows if s in none), key=int)
        if recipe == "none" or len(seeds) < 2:
            continue
        entry: dict = {"seeds": [int(s) for s in seeds], "n": len(seeds), "target": TARGETS.get(recipe, 0.01)}
        for metric in ("final_loss", "val_loss"):
            paired = [(rows[s][metric] - none[s][metric]) / none[s][metric] for s in seeds]
            ours, theirs = (statistics.mean(r[s][metric] for s in seeds) for r in (rows, none))
            entry[metric] = {
                "rel_diff_of_means": (ours - theirs) / theirs,
                "mean_paired_rel_diff": statistics.mean(paired),
                "standard_error": statistics.stdev(paired) / math.sqrt(len(paired)),
                "seeds_worse": sum(d > 0 for d in paired),
                "per_seed": dict(zip(seeds, paired, strict=True)),
            }
        out["recipes"][recipe] = entry
    return out


def gradient_error(checkpoints: tuple[int, ...] = (0, 50, 100, 200)) -> dict:
    """The ``gradient_error`` set (module docstring), in this process."""
    import copy

    from moe_models import build_model, causal_lm_loss
    from moe_precision import PrecisionConfig
    from moe_train.config import load_config
    from moe_train.data import prepare_data
    from moe_train.precision import apply_run_precision

    cfg = load_config("tiny", {})
    model_cfg, batch = cfg.model, cfg.train.global_batch_size
    data = prepare_data(cfg.data, seed=cfg.train.seed, model_vocab_size=model_cfg.vocab_size, model_from_hf=False)
    base = build_model(model_cfg, seed=cfg.train.seed)
    opt = torch.optim.AdamW(base.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)

    def grads(model, at: int) -> tuple[float, dict[str, torch.Tensor]]:
        b = data.train.batch(at, batch, 0, batch)
        model.zero_grad()
        loss = causal_lm_loss(model(b.input_ids_BS), b.labels_BS, model_cfg.mtp_loss_scaling_factor).total
        loss.backward()
        return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    rows, step = {}, 0
    for target in checkpoints:
        while step < target:  # plain fp32 training, clipped as the trainer clips
            grads(base, step)
            torch.nn.utils.clip_grad_norm_(base.parameters(), cfg.train.clip_grad)
            opt.step()
            step += 1
        held_out = 1_000_000 + target  # a batch no training step reads
        loss, ref = grads(base, held_out)
        flat_ref = torch.cat([g.flatten() for g in ref.values()])
        row: dict = {"fp32_loss": loss}
        for recipe in [r for r in RECIPES if r != "none"]:
            model = copy.deepcopy(base)
            apply_run_precision(model, PrecisionConfig(recipe=recipe, emulate=True), model_cfg.num_layers, False)
            _, got = grads(model, held_out)
            flat = torch.cat([got[n].flatten() for n in ref])
            errors = {n: float((got[n] - ref[n]).norm() / ref[n].norm().clamp(min=1e-30)) for n in ref}
            worst = max(errors, key=errors.__getitem__)
            row[recipe] = {
                "rel_error": float((flat - flat_ref).norm() / flat_ref.norm()),
                "norm_ratio": float(flat.norm() / flat_ref.norm()),
                "worst_parameter": worst,
                "worst_rel_error": errors[worst],
            }
        rows[str(target)] = row
        print(
            f"gradient error after {target} steps: "
            + ", ".join(
                f"{r} {v['rel_error']:.3f} (norm x{v['norm_ratio']:.3f})" for r, v in row.items() if r != "fp32_loss"
            ),
            flush=True,
        )
    return {"what": "one held-out batch's gradient under each recipe vs fp32's, at fp32-trained weights", "rows": rows}


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
    parser = cli("precision_parity", __doc__, "3 steps of two recipes on one process (CI)")
    parser.add_argument("--svg", type=Path, default=ROOT.parent / "docs" / "precision_parity.svg")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--tp-ep-steps", type=int, default=100)
    parser.add_argument("--seeds", default="1234,1,2", help="train.seed values of the seeds set")
    parser.add_argument("--recipes", default=",".join(RECIPES), help="recipes of the seeds set ('none' first)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time in the seeds set (one thread each)")
    parser.add_argument("--eval-iters", type=int, default=8, help="validation batches of the held-out loss")
    parser.add_argument(
        "--only",
        choices=["noise_floor", "seeds", "gradient_error", "all_seeds"],
        help="run this set alone and add it to --out (all_seeds: pool the seeds sets already there, no training)",
    )
    args = parse(parser)
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.only:
        work = Path(tempfile.mkdtemp(prefix="precision_parity_"))
        try:
            report = json.loads(args.out.read_text())
            if args.only == "noise_floor":
                report["sets"]["noise_floor"] = noise_floor(args.steps, work)
            elif args.only == "gradient_error":
                report["sets"]["gradient_error"] = gradient_error()
            elif args.only == "seeds":
                recipes = args.recipes.split(",")
                key = "seeds" if recipes == list(RECIPES) else f"seeds_{'_'.join(map(str, seeds))}"
                report["sets"][key] = seeds_set(recipes, args.steps, seeds, args.jobs, args.eval_iters, work)
            if args.only in ("seeds", "all_seeds"):
                report["sets"]["all_seeds"] = all_seeds(report["sets"])
        finally:
            shutil.rmtree(work, ignore_errors=True)
        write(args.out, report)
        return
    recipes = list(RECIPES)
    work = Path(tempfile.mkdtemp(prefix="precision_parity_"))
    try:
        if args.quick:
            extra = ["--train.global_batch_size", "4", "--data.seq_len", "64"]
            # two recipes: the script's paths; every recipe trains in moe-train's test_precision_recipes.py
            sets = {"one_process": run_set(["none", "fp8_delayed"], 3, 1, extra, work, "quick")}
        else:
            sets = {"one_process": run_set(recipes, args.steps, 1, [], work, "1p")}
            sets["noise_floor"] = noise_floor(args.steps, work)
            sets["seeds"] = seeds_set(recipes, args.steps, seeds, args.jobs, args.eval_iters, work)
            sets["all_seeds"] = all_seeds(sets)
            sets["gradient_error"] = gradient_error()
            tp_ep = ["--parallel.tp", "2", "--parallel.ep", "2"]
            sets["tp2_ep2"] = run_set(recipes, args.tp_ep_steps, 4, tp_ep, work, "tp2xep2")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report = header(
        args,
        what="final training loss of each precision.recipe (exact emulation) against the unquantised run",
        baseline="recipe none (fp32)",
        preset="tiny (Qwen3-MoE-style, 4 layers, 8 experts top-2, hidden 128, seq 128, batch 16)",
        sets=sets,
        device="cpu (emulation: quantise, dequantise, fp32 GEMM)",
    )
    write(args.out, report)
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


if __name__ == "__main__":
    main()
