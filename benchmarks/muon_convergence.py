"""Convergence of Muon (``train.optimizer muon``) against AdamW, each at its tuned learning rate, over several seeds.

Setting (default): the ``tiny`` preset (4 layers, 8 experts, byte-level Python source) trained by moe_train itself
(``load_config('tiny', overrides)`` -> ``prepare`` -> ``train``), fp32 on CPU, 5% of the documents held out
(``data.valid_fraction``) and evaluated at the last step (``train.eval_interval`` = the run's steps,
``train.eval_iters`` fixed batches, the same for every run):

1. lr tuning: seed 1, 100 steps (warmup 10, cosine to lr/10 as the preset), ``train.lr`` in {1e-3, 3e-3, 1e-2,
   3e-2} for each optimizer; each optimizer's best is the lr with the lowest held-out loss at the last step (the
   JSON says whether it lies at an end of the grid). One ``train.lr`` drives both of Muon's rules (Muon's matrices
   via ``muon_adjust_lr_fn match_rms_adamw``, AdamW's embeddings, head, norms and routers), so the sweep tunes the
   pair together.
2. final: seeds {1, 2, 3} x {adamw, muon} at the tuned lrs, 300 steps. A seed fixes the initial weights and the
   batches, so the two optimizers of one seed see the same data in the same order (paired).

Recorded per run: the loss of every step, the final loss (last step, mean of the last 10), the held-out loss and
the wall time; per optimizer the mean, min, max and standard deviation over seeds; Muon/AdamW per seed with their
mean and range; and the step at which Muon's 10-step mean first reaches AdamW's final loss (same seed). No target:
the result is reported whichever way it goes. Wall times (and their ratio) are noisy on a shared 2-core machine.
The loss curves (mean over seeds, min-max band) go to an SVG beside the JSON.

    uv run python benchmarks/muon_convergence.py [--quick] [--out benchmarks/results/muon_convergence.json]

runs everything in one process, the optimizers' runs interleaved (adamw seed 1, muon seed 1, adamw seed 2, ...) so
that drift in the machine's load hits both alike. How the committed results were made instead: one process per
optimizer, one torch thread each, at the same time (so load drift hits both alike too), with ``--run-log`` keeping
finished runs (JSON lines; a rerun takes a run it holds rather than train it again, so an interrupted benchmark
resumes):

    OMP_NUM_THREADS=1 python benchmarks/muon_convergence.py --optimizers adamw --run-log /tmp/adamw.jsonl &
    OMP_NUM_THREADS=1 python benchmarks/muon_convergence.py --optimizers muon --run-log /tmp/muon.jsonl; wait
    cat /tmp/adamw.jsonl /tmp/muon.jsonl > /tmp/runs.jsonl
    python benchmarks/muon_convergence.py --run-log /tmp/runs.jsonl  # trains nothing: summary, JSON, SVG

``--quick`` (CI, a few seconds): a micro model, the same protocol in a few steps; it writes only where ``--out``
says (nothing by default), never over the committed full-run results.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

import torch
from _curves import MICRO, curves_svg, trailing_mean, train_run  # benchmarks/_curves.py, beside this script
from _harness import cli, header, parse, write  # benchmarks/_harness.py, beside this script

OPTIMIZERS = ("adamw", "muon")
BASELINE = "adamw"
MEASURES = ("final_loss_last_step", "final_loss_mean_last_10", "val_loss")
COLOURS = ("#1f77b4", "#d62728")  # AdamW blue, Muon red
MIN_LR_FRACTION = 0.1  # the preset's schedule: cosine from train.lr to train.lr / 10


def overrides_for(optimizer: str, lr: float, seed: int, steps: int, common: dict[str, str]) -> dict[str, str]:
    return {
        **common,
        "train.optimizer": optimizer,
        "train.lr": repr(lr),
        "train.min_lr": repr(lr * MIN_LR_FRACTION),
        "train.seed": str(seed),
        "train.steps": str(steps),
        "train.eval_interval": str(steps),  # one held-out loss, at the last step
        "run.log_interval": str(max(steps // 10, 1)),
    }


class Runner:
    """Trains (optimizer, lr, seed, steps) runs into a scratch directory. With a run log (JSON lines), each finished
    run is appended to it, and a run the log already holds (the same overrides) is taken from it rather than trained
    again: an interrupted benchmark resumes, or finishes with fewer seeds, from what it has."""

    def __init__(self, common: dict[str, str], scratch: Path, log: Path | None, optimizers: list[str]) -> None:
        self.common, self.scratch, self.log, self.optimizers = common, scratch, log, optimizers
        self.done = [json.loads(line) for line in log.read_text().splitlines()] if log and log.exists() else []

    def __call__(self, optimizer: str, lr: float, seed: int, steps: int) -> dict:
        name = f"{optimizer}-lr{lr:g}-seed{seed}-{steps}steps"
        overrides = overrides_for(optimizer, lr, seed, steps, self.common)
        logged = [r for r in self.done if r["overrides"] == overrides]
        if logged:
            print(f"{name:32s} from {self.log}", flush=True)
            return logged[-1]
        result = {
            "optimizer": optimizer,
            "lr": lr,
            "seed": seed,
            "steps": steps,
            "overrides": overrides,
            # how the run was trained: with the other optimizer's runs in this process, or beside it in another
            "process_optimizers": self.optimizers,
            "cpu_threads": torch.get_num_threads(),
            **train_run("tiny", overrides, self.scratch / name),
        }
        if len(result["losses"]) != steps:  # moe_train stops early, cleanly, on SIGTERM / SIGINT
            raise SystemExit(f"{name}: stopped after {len(result['losses'])} of {steps} steps; not logged")
        print(
            f"{name:32s} final loss {result['final_loss_last_step']:.4f} (mean last 10 "
            f"{result['final_loss_mean_last_10']:.4f}), held-out {result['val_loss']:.4f}, "
            f"{result['wall_time_s']:.1f} s",
            flush=True,
        )
        if self.log is not None:
            with self.log.open("a") as file:
                file.write(json.dumps(result) + "\n")
        return result


def tune(run: Runner, optimizers: list[str], lrs: list[float], seed: int, steps: int) -> tuple[list, dict]:
    """Every (lr, optimizer) for ``steps`` steps, lrs in the outer loop; and each optimizer's best lr by held-out
    loss (whether it lies at an end of the grid, where a wider sweep might find better)."""
    runs = [run(opt, lr, seed, steps) for lr in lrs for opt in optimizers]
    best = {}
    for opt in optimizers:
        mine = [r for r in runs if r["optimizer"] == opt]
        chosen = min(mine, key=lambda r: r["val_loss"])
        best[opt] = {
            "lr": chosen["lr"],
            "val_loss": chosen["val_loss"],
            "at_grid_edge": chosen["lr"] in (min(lrs), max(lrs)),
            "val_loss_by_lr": {f"{r['lr']:g}": r["val_loss"] for r in mine},
            "final_loss_mean_last_10_by_lr": {f"{r['lr']:g}": r["final_loss_mean_last_10"] for r in mine},
        }
    return runs, best


def stats(values: list[float]) -> dict[str, float]:
    """Mean, min, max and (for two or more) the sample standard deviation."""
    return {
        "mean": statistics.fmean(values),
        "min": min(values),
        "max": max(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
    }


def summarize(runs: list[dict], seeds: list[int]) -> dict:
    """Per optimizer, each measure's statistics over seeds; Muon/AdamW paired by seed; the wall-time ratio."""
    by = {(r["optimizer"], r["seed"]): r for r in runs}
    summary: dict = {opt: {m: stats([by[opt, s][m] for s in seeds]) for m in MEASURES} for opt in OPTIMIZERS}
    for opt in OPTIMIZERS:
        summary[opt]["wall_time_s"] = stats([by[opt, s]["wall_time_s"] for s in seeds])
    ratios = {}
    for measure in (*MEASURES, "wall_time_s"):
        per_seed = [by["muon", s][measure] / by[BASELINE, s][measure] for s in seeds]
        ratios[measure] = {
            "per_seed": dict(zip(map(str, seeds), per_seed, strict=True)),
            **stats(per_seed),
            "of_means": summary["muon"][measure]["mean"] / summary[BASELINE][measure]["mean"],
        }
    summary["muon_over_adamw"] = ratios
    # steps-to-loss: where Muon's 10-step trailing mean first reaches the same seed's AdamW final (last-10 mean)
    reach = {}
    for seed in seeds:
        target = by[BASELINE, seed]["final_loss_mean_last_10"]
        smoothed = trailing_mean(by["muon", seed]["losses"], 10)
        reach[str(seed)] = next((step for step, v in enumerate(smoothed, start=1) if v <= target), None)
    reached = [step for step in reach.values() if step is not None]
    summary["muon_steps_to_adamw_final_loss"] = {
        "per_seed": reach,
        **(stats(reached) if reached else {}),
        "adamw_steps": by[BASELINE, seeds[0]]["steps"],
    }
    summary["muon_lower_in_every_seed"] = {
        m: all(by["muon", s][m] < by[BASELINE, s][m] for s in seeds) for m in MEASURES
    }
    return summary


def execution(runs: list[dict]) -> str:
    """How the runs were trained: interleaved in one process, or one process per optimizer side by side."""
    threads = sorted({r["cpu_threads"] for r in runs})
    if all(len(r["process_optimizers"]) == 1 for r in runs):
        how = "one process per optimizer, run at the same time (so load drift hits both alike)"
    else:
        how = "one process, the optimizers' runs interleaved seed by seed"
    return f"{how}; torch threads per process: {', '.join(map(str, threads))}"


def svg(report: dict) -> str:
    inputs = report["inputs"]
    lrs = report["tuned_lr"]
    groups = {
        f"{opt} lr {lrs[opt]:g}": [r["losses"] for r in report["runs"] if r["optimizer"] == opt] for opt in OPTIMIZERS
    }
    labels = {}
    for opt, name in zip(OPTIMIZERS, groups, strict=True):
        val = report["summary"][opt]["val_loss"]
        last = report["summary"][opt]["final_loss_mean_last_10"]
        held_out = f"held-out {val['mean']:.3f} [{val['min']:.3f}, {val['max']:.3f}]"
        labels[name] = f"{name}: last 10 {last['mean']:.3f}, {held_out}"
    title = f"tiny preset, {inputs['steps']} steps, {len(inputs['seeds'])} seeds: AdamW vs Muon (mean, min-max band)"
    first_step = min(30, inputs["steps"])
    return curves_svg(groups, title, first_step=first_step, labels=labels, legend_width=320, colours=COLOURS)


def main() -> None:
    parser = cli("muon_convergence", __doc__, "micro model, a few steps (CI, a few seconds)")
    parser.add_argument("--steps", type=int, default=None, help="steps of the final runs (default 300)")
    parser.add_argument("--tune-steps", type=int, default=None, help="steps of the lr-tuning runs (default 100)")
    parser.add_argument("--lrs", default="1e-3,3e-3,1e-2,3e-2", help="the lr grid, comma-separated")
    parser.add_argument("--seeds", default=None, help="seeds of the final runs, comma-separated (default 1,2,3)")
    parser.add_argument(
        "--tuned-lrs", default="", help="skip the tuning: adamw=LR,muon=LR (e.g. from an earlier run's JSON)"
    )
    parser.add_argument(
        "--optimizers",
        default=",".join(OPTIMIZERS),
        help="train only these (with --run-log: one process per optimizer, a last one with both to summarize)",
    )
    parser.add_argument("--valid-fraction", type=float, default=0.05, help="data.valid_fraction")
    parser.add_argument("--eval-iters", type=int, default=None, help="train.eval_iters (default 8)")
    parser.add_argument("--cache-dir", default="", help="data.cache_dir (default: moe-train's)")
    parser.add_argument(
        "--run-log", type=Path, default=None, help="JSON lines of finished runs: appended to, and reused on a rerun"
    )
    parser.add_argument("--replot", type=Path, default=None, help="only redraw the SVG beside this results JSON")
    args = parse(parser)
    if args.replot is not None:
        args.replot.with_suffix(".svg").write_text(svg(json.loads(args.replot.read_text())))
        return
    steps = args.steps or (6 if args.quick else 300)
    tune_steps = args.tune_steps or (3 if args.quick else 100)
    seeds = [int(s) for s in (args.seeds or ("1,2" if args.quick else "1,2,3")).split(",")]
    lrs = [float(lr) for lr in args.lrs.split(",")]
    optimizers = args.optimizers.split(",")
    if not set(optimizers) <= set(OPTIMIZERS) or (sorted(optimizers) != sorted(OPTIMIZERS) and not args.run_log):
        raise SystemExit(f"--optimizers: of {', '.join(OPTIMIZERS)}; only some of them needs --run-log")
    common = {
        **(MICRO if args.quick else {}),
        "run.save_checkpoint": "false",
        "data.valid_fraction": repr(args.valid_fraction),
        "train.eval_iters": str(args.eval_iters or (1 if args.quick else 8)),
        "data.cache_dir": args.cache_dir,
    }
    with tempfile.TemporaryDirectory() as tmp:
        run = Runner(common, Path(tmp), args.run_log, optimizers)
        if args.tuned_lrs:
            tuning_runs, best = [], {}
            tuned = {opt: float(lr) for opt, lr in (item.split("=") for item in args.tuned_lrs.split(","))}
        else:
            tuning_runs, best = tune(run, optimizers, lrs, seeds[0], tune_steps)
            tuned = {opt: b["lr"] for opt, b in best.items()}
        print(f"tuned lrs: {tuned}", flush=True)
        runs = [run(opt, tuned[opt], seed, steps) for seed in seeds for opt in optimizers]
    if sorted(optimizers) != sorted(OPTIMIZERS):
        print(f"runs in {args.run_log}; rerun with --optimizers {','.join(OPTIMIZERS)} and this log to summarize")
        return
    summary = summarize(runs, seeds)
    report = {
        "what": "loss of the tiny preset trained with Muon (train.optimizer muon) against AdamW, each at the lr of "
        "its grid with the lowest held-out loss in a short tuning run, over several seeds",
        "inputs": {
            "preset": "tiny",
            "overrides": common | {"data.cache_dir": "(default)" if not args.cache_dir else args.cache_dir},
            "steps": steps,
            "seeds": seeds,
            "tuning": {"steps": tune_steps, "seed": seeds[0], "lrs": lrs, "criterion": "lowest val_loss"},
            "schedule": f"warmup {'2' if args.quick else '10'} steps, cosine from train.lr to train.lr x "
            f"{MIN_LR_FRACTION} (train.min_lr)",
            "muon": "moe_train defaults: momentum 0.95, Nesterov, 5 Newton-Schulz steps (fp32 on CPU), "
            "adjust_lr_fn match_rms_adamw; one train.lr for Muon's matrices and AdamW's other parameters",
            "compute": "fp32 on CPU (run.dtype auto)",
            "execution": execution(runs),
        },
        "tuning": {"best": best, "runs": tuning_runs} if tuning_runs else {"given": tuned},
        "tuned_lr": tuned,
        "summary": summary,
        "runs": runs,
        "note": "a seed fixes initial weights and batch order, so the two optimizers of one seed are paired; the "
        "held-out set (the last data.valid_fraction of the documents, train.eval_iters fixed batches) is the same "
        "for every run; wall times on a shared 2-core machine are noisy",
        "device": "cpu",
    }
    report = header(args, **report)
    for opt in OPTIMIZERS:
        s = summary[opt]
        print(
            f"{opt:6s} lr {tuned[opt]:g}: last-10 loss {s['final_loss_mean_last_10']['mean']:.4f} "
            f"[{s['final_loss_mean_last_10']['min']:.4f}, {s['final_loss_mean_last_10']['max']:.4f}], held-out "
            f"{s['val_loss']['mean']:.4f} [{s['val_loss']['min']:.4f}, {s['val_loss']['max']:.4f}]"
        )
    ratio = summary["muon_over_adamw"]
    print(
        f"muon/adamw: held-out {ratio['val_loss']['mean']:.4f} [{ratio['val_loss']['min']:.4f}, "
        f"{ratio['val_loss']['max']:.4f}], last-10 {ratio['final_loss_mean_last_10']['mean']:.4f}, wall time "
        f"{ratio['wall_time_s']['mean']:.2f} (noisy)"
    )
    write(args.out, report, {".svg": svg(report)})


if __name__ == "__main__":
    main()
