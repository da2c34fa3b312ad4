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
import statistics
import tempfile
import time
from html import escape
from pathlib import Path

import torch
from _harness import cli, header, parse, write  # benchmarks/_harness.py, beside this script

from moe_train.adamw import optimizer_state_bytes
from moe_train.config import load_config
from moe_train.optim import build_optimizer
from moe_train.plots import HEIGHT, PAD, WIDTH
from moe_train.trainer import prepare, train

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
# a model small enough for --quick (the test suite's micro model)
MICRO = {
    "model.hidden_size": "32",
    "model.num_layers": "1",
    "model.num_attention_heads": "2",
    "model.num_query_groups": "1",
    "model.kv_channels": "16",
    "model.num_moe_experts": "4",
    "model.moe_ffn_hidden_size": "32",
    "data.seq_len": "32",
    "train.global_batch_size": "4",
    "train.warmup_steps": "2",
}
COLOURS = ("#1f77b4", "#7f7f7f", "#d62728", "#2ca02c")


def run(name: str, overrides: dict[str, str], out_dir: Path) -> dict:
    cfg = load_config("tiny", {**overrides, **VARIANTS[name], "run.output_dir": str(out_dir / name)})
    setup = prepare(cfg, world_size=1)
    probe = build_optimizer(setup.model, cfg.train)  # the state bytes the run's optimizer will hold
    probe.init_state()
    state_bytes = optimizer_state_bytes(probe)
    del probe
    start = time.perf_counter()
    summary = train(setup)
    wall = time.perf_counter() - start
    records = [json.loads(line) for line in (out_dir / name / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records]
    return {
        "settings": VARIANTS[name],
        "losses": losses,
        "final_loss_last_step": losses[-1],
        "final_loss_mean_last_10": statistics.fmean(losses[-10:]),
        "final_loss_mean_last_50": statistics.fmean(losses[-50:]),
        "optimizer_state_bytes": state_bytes,
        "parameter_dtypes": sorted({str(p.dtype).removeprefix("torch.") for p in setup.model.parameters()}),
        "wall_time_s": wall,
        "median_tokens_per_s": summary.median_tokens_per_s,
    }


def trailing_mean(values: list[float], window: int) -> list[float]:
    """Mean of each value and up to ``window - 1`` before it."""
    return [statistics.fmean(values[max(i + 1 - window, 0) : i + 1]) for i in range(len(values))]


def curves_svg(curves: dict[str, list[float]], title: str, window: int = 10, first_step: int = 30) -> str:
    """Loss curves (per-step losses, one per run) on one pair of axes in moe_train.plots' size and style, with a
    legend: each as its ``window``-step trailing mean from step ``first_step`` on, where the runs part (the first
    steps' steep fall would squeeze the rest into a few pixels; the raw losses are in the JSON)."""
    steps = max(len(ys) for ys in curves.values())
    first_step = min(first_step, steps)
    shown = {name: trailing_mean(ys, window)[first_step - 1 :] for name, ys in curves.items()}
    y0 = min(min(ys) for ys in shown.values())
    y1 = max(max(ys) for ys in shown.values())
    y1 = y1 if y1 > y0 else y0 + 1

    def px(x: float) -> float:
        return PAD + (x - first_step) / max(steps - first_step, 1) * (WIDTH - 2 * PAD)

    def py(y: float) -> float:
        return HEIGHT - PAD - (y - y0) / (y1 - y0) * (HEIGHT - 2 * PAD)

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif">',
        '<rect width="100%" height="100%" fill="white"/>',
        f'<text x="{WIDTH / 2}" y="20" text-anchor="middle" font-size="14">{escape(title)}</text>',
        f'<line x1="{PAD}" y1="{HEIGHT - PAD}" x2="{WIDTH - PAD}" y2="{HEIGHT - PAD}" stroke="black"/>',
        f'<line x1="{PAD}" y1="{PAD}" x2="{PAD}" y2="{HEIGHT - PAD}" stroke="black"/>',
    ]
    for v in (y0, (y0 + y1) / 2, y1):
        parts.append(f'<text x="{PAD - 6}" y="{py(v) + 4:.1f}" text-anchor="end" font-size="11">{v:.2f}</text>')
    for v in (first_step, steps):
        parts.append(f'<text x="{px(v):.1f}" y="{HEIGHT - PAD + 16}" text-anchor="middle" font-size="11">{v}</text>')
    parts.append(f'<text x="{WIDTH / 2}" y="{HEIGHT - 10}" text-anchor="middle" font-size="12">step</text>')
    parts.append(
        f'<text x="14" y="{HEIGHT / 2}" text-anchor="middle" font-size="12" transform="rotate(-90 14 {HEIGHT / 2})">'
        f"loss, mean of last {window} steps (nats/byte)</text>"
    )
    for i, (name, ys) in enumerate(shown.items()):
        colour = COLOURS[i % len(COLOURS)]
        points = " ".join(f"{px(s):.1f},{py(y):.1f}" for s, y in enumerate(ys, start=first_step))
        parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{points}"/>')
        y = PAD + 14 * i
        parts.append(f'<line x1="{WIDTH - PAD - 200}" y1="{y}" x2="{WIDTH - PAD - 180}" y2="{y}" stroke="{colour}"/>')
        label = f"{name}: {curves[name][-1]:.4f} at the end ({statistics.fmean(curves[name][-10:]):.4f} last 10)"
        parts.append(f'<text x="{WIDTH - PAD - 175}" y="{y + 4}" font-size="10">{escape(label)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def svg(report: dict) -> str:
    title = f"tiny preset, {report['inputs']['steps']} steps: AdamW state dtypes"
    return curves_svg({n: r["losses"] for n, r in report["runs"].items()}, title)


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
