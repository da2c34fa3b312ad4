"""Convergence with bf16 AdamW moments (and bf16 parameters with fp32 master weights) against fp32 moments.

Setting (default): the ``tiny`` preset (4 layers, 8 experts, byte-level Python source) trained for 300 steps by
moe_train itself (``load_config('tiny', overrides)`` -> ``prepare`` -> ``train``), one process, fp32 compute on
CPU, the same seed (same initial weights and batches) in every run:

- ``fp32``: ``train.optimizer_states_dtype=fp32`` (the baseline; torch.optim.AdamW's numbers);
- ``fp32_control``: the same with ``train.adam_eps`` 1.01e-8 instead of 1e-8: a rounding-sized perturbation of each
  update, whose difference to ``fp32`` is the noise floor any change of rounding meets (trajectories diverge);
- ``bf16_states``: ``train.optimizer_states_dtype=bf16``, fp32 parameters;
- ``bf16_params_master``: ``train.params_dtype=bf16`` with ``train.master_weights_dtype=fp32`` and bf16 states
  (the forward and backward then run on bf16 weights and activations).

Recorded per run: the loss of every step, the final loss (last step, and mean of the last 10 steps), the optimizer's
state bytes (``moe_train.adamw.optimizer_state_bytes``) and the wall time; and each run's relative difference to the
fp32 run. Target: bf16 moments end within 1% of the fp32 run's loss (mean of the last 10 steps); the bf16-parameter
run is reported without a target. The loss curves go to an SVG beside the JSON.

    uv run python benchmarks/optimizer_states.py [--quick] [--out benchmarks/results/optimizer_states.json]

``--quick`` (CI, a few seconds): a micro model for 10 steps; it writes only where ``--out`` says (nothing by
default), never over the committed full-run results.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
from _curves import MICRO, curves_svg, train_run  # benchmarks/_curves.py, beside this script
from _harness import cli, header, parse, write  # benchmarks/_harness.py, beside this script

from moe_train.adamw import optimizer_state_bytes
from moe_train.optim import build_optimizer
from moe_train.setup import Setup

TARGET_REL_DIFF = 0.01
TARGETED = ("bf16_states",)  # the target is on bf16 moments; the bf16-parameter run is reported alongside
VARIANTS = {
    "fp32": {"train.optimizer_states_dtype": "fp32"},
    # the noise floor: fp32 again with adam_eps 1% larger, a relative change of about 1e-7 in each update (eps is
    # small beside sqrt(exp_avg_sq)), i.e. rounding-sized; the trajectory still goes its own way
    "fp32_control": {"train.optimizer_states_dtype": "fp32", "train.adam_eps": "1.01e-8"},
    "bf16_states": {"train.optimizer_states_dtype": "bf16"},
    "bf16_params_master": {
        "train.optimizer_states_dtype": "bf16",
        "train.params_dtype": "bf16",
        "train.master_weights_dtype": "fp32",
    },
}


def state_bytes(setup: Setup) -> dict:
    """The state bytes the run's optimizer will hold, and its parameters' dtypes."""
    probe = build_optimizer(setup.model, setup.cfg.train)
    probe.init_state()
    return {
        "optimizer_state_bytes": optimizer_state_bytes(probe),
        "parameter_dtypes": sorted({str(p.dtype).removeprefix("torch.") for p in setup.model.parameters()}),
    }


def run(name: str, overrides: dict[str, str], out_dir: Path) -> dict:
    result = train_run("tiny", {**overrides, **VARIANTS[name]}, out_dir / name, state_bytes)
    return {"settings": VARIANTS[name], **result}


def svg(report: dict) -> str:
    title = f"tiny preset, {report['inputs']['steps']} steps: AdamW state dtypes"
    return curves_svg({n: [r["losses"]] for n, r in report["runs"].items()}, title)


def main() -> None:
    parser = cli("optimizer_states", __doc__, "micro model, 10 steps (CI, a few seconds)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--cache-dir", default="", help="data.cache_dir (default: moe-train's)")
    parser.add_argument("--replot", type=Path, default=None, help="only redraw the SVG beside this results JSON")
    args = parse(parser)
    if args.replot is not None:
        args.replot.with_suffix(".svg").write_text(svg(json.loads(args.replot.read_text())))
        return
    steps = args.steps or (10 if args.quick else 300)
    names = args.variants.split(",")
    if names[0] != "fp32":
        raise SystemExit("--variants must start with fp32 (the baseline)")
    overrides = {
        **(MICRO if args.quick else {}),
        "train.steps": str(steps),
        "run.save_checkpoint": "false",
        "run.log_interval": str(max(steps // 10, 1)),
        "data.cache_dir": args.cache_dir,
    }
    with tempfile.TemporaryDirectory() as tmp:
        runs = {name: run(name, overrides, Path(tmp)) for name in names}
    base = runs["fp32"]
    for result in runs.values():
        result["rel_diff_vs_fp32_mean_last_10"] = (
            result["final_loss_mean_last_10"] / base["final_loss_mean_last_10"] - 1
        )
        result["rel_diff_vs_fp32_last_step"] = result["final_loss_last_step"] / base["final_loss_last_step"] - 1
        result["rel_diff_vs_fp32_mean_last_50"] = (
            result["final_loss_mean_last_50"] / base["final_loss_mean_last_50"] - 1
        )
        total = sum(result["optimizer_state_bytes"].values())
        result["optimizer_state_bytes_vs_fp32"] = total / sum(base["optimizer_state_bytes"].values())
    met = {
        name: abs(r["rel_diff_vs_fp32_mean_last_10"]) <= TARGET_REL_DIFF for name, r in runs.items() if name in TARGETED
    }
    report = {
        "what": "loss of the tiny preset trained with bf16 AdamW moments (and bf16 params + fp32 master weights) "
        "against fp32 moments, same seed",
        "inputs": {
            "preset": "tiny",
            "overrides": overrides | {"data.cache_dir": "(default)" if not args.cache_dir else args.cache_dir},
            "steps": steps,
            "compute": "fp32 on CPU (run.dtype auto); bf16_params_master runs its forward/backward on bf16 weights",
        },
        "runs": runs,
        "target": f"bf16_states: |final loss (mean of last 10 steps) / fp32's - 1| <= {TARGET_REL_DIFF}",
        "note": "the runs see the same batches, so per-step losses compare; any change of rounding sends a run "
        "along its own trajectory: fp32_control (a rounding-sized perturbation of fp32) shows how far that alone "
        "moves the final loss",
        "targets_met": met,
        "device": "cpu",
        "cpu_threads": torch.get_num_threads(),
    }
    report = header(args, **report)
    for name, r in runs.items():
        print(
            f"{name:20s} final loss {r['final_loss_last_step']:.4f} (mean last 10 {r['final_loss_mean_last_10']:.4f}, "
            f"{100 * r['rel_diff_vs_fp32_mean_last_10']:+.2f}% vs fp32; last 50 "
            f"{100 * r['rel_diff_vs_fp32_mean_last_50']:+.2f}%), optimizer state "
            f"{sum(r['optimizer_state_bytes'].values()) / 2**20:.2f} MiB, {r['wall_time_s']:.1f} s"
        )
    print(f"targets met: {met}")
    write(args.out, report, {".svg": svg(report)})


if __name__ == "__main__":
    main()
