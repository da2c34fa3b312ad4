"""Training runs of a moe_train preset in this process and their loss curves as SVG: what the convergence
benchmarks (optimizer_states.py, muon_convergence.py) share.

:func:`train_run` trains through moe_train's own API (``load_config`` -> ``prepare`` -> ``train``) and reads the
per-step losses (and a held-out loss, when the run logged one) back from the run's ``metrics.jsonl``.
:func:`curves_svg` draws named groups of runs on one pair of axes, in moe_train.plots' size and style: each group's
mean over its runs, with the min-max band when there are several. ``MICRO`` is the test suite's micro model, for
the scripts' ``--quick`` modes.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from html import escape
from pathlib import Path

from moe_train.config import load_config
from moe_train.plots import HEIGHT, PAD, WIDTH
from moe_train.setup import Setup
from moe_train.trainer import prepare, train

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


def train_run(
    preset: str, overrides: dict[str, str], output_dir: Path, inspect: Callable[[Setup], dict] | None = None
) -> dict:
    """Train ``preset`` with ``overrides`` into ``output_dir`` and return its losses: every step's, the last step's,
    the means of the last 10 and 50 steps, ``val_loss`` (the last one logged; only when the run evaluated), the
    wall time of ``train`` and its median tokens/s. ``inspect`` sees the prepared run before it trains; what it
    returns joins the result."""
    setup = prepare(load_config(preset, {**overrides, "run.output_dir": str(output_dir)}), world_size=1)
    inspected = inspect(setup) if inspect is not None else {}
    start = time.perf_counter()
    summary = train(setup)
    wall = time.perf_counter() - start
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    held_out = [r["val_loss"] for r in records if r.get("val_loss") is not None]
    return {
        "losses": losses,
        "final_loss_last_step": losses[-1],
        "final_loss_mean_last_10": statistics.fmean(losses[-10:]),
        "final_loss_mean_last_50": statistics.fmean(losses[-50:]),
        **({"val_loss": held_out[-1]} if held_out else {}),
        **inspected,
        "wall_time_s": wall,
        "median_tokens_per_s": summary.median_tokens_per_s,
    }


def trailing_mean(values: list[float], window: int) -> list[float]:
    """Mean of each value and up to ``window - 1`` before it."""
    return [statistics.fmean(values[max(i + 1 - window, 0) : i + 1]) for i in range(len(values))]


def default_label(name: str, runs: list[list[float]]) -> str:
    """The legend's words for a group: its (mean) loss at the last step and over the last 10 steps."""
    last = statistics.fmean(ys[-1] for ys in runs)
    last_10 = statistics.fmean(statistics.fmean(ys[-10:]) for ys in runs)
    mean = "" if len(runs) == 1 else f"mean of {len(runs)}: "
    return f"{name}: {mean}{last:.4f} at the end ({last_10:.4f} last 10)"


def curves_svg(
    groups: dict[str, list[list[float]]],
    title: str,
    window: int = 10,
    first_step: int = 30,
    labels: dict[str, str] | None = None,
    legend_width: int = 200,
    colours: tuple[str, ...] = COLOURS,
) -> str:
    """Loss curves on one pair of axes with a legend: each group (name -> one list of per-step losses per run) as
    the mean over its runs of their ``window``-step trailing means, with a band from the lowest to the highest run
    when it has several; from step ``first_step`` on, where runs part (the first steps' steep fall would squeeze the
    rest into a few pixels; the raw losses are in the JSON). ``labels`` replaces a group's legend text; the legend
    starts ``legend_width`` pixels left of the plot's right edge; the groups take ``colours`` in turn."""
    steps = max(len(ys) for runs in groups.values() for ys in runs)
    first_step = min(first_step, steps)
    smoothed = {name: [trailing_mean(ys, window)[first_step - 1 :] for ys in runs] for name, runs in groups.items()}
    means = {name: [statistics.fmean(col) for col in zip(*runs, strict=True)] for name, runs in smoothed.items()}
    y0 = min(min(ys) for runs in smoothed.values() for ys in runs)
    y1 = max(max(ys) for runs in smoothed.values() for ys in runs)
    y1 = y1 if y1 > y0 else y0 + 1

    def px(x: float) -> float:
        return PAD + (x - first_step) / max(steps - first_step, 1) * (WIDTH - 2 * PAD)

    def py(y: float) -> float:
        return HEIGHT - PAD - (y - y0) / (y1 - y0) * (HEIGHT - 2 * PAD)

    def points(ys: list[float]) -> list[str]:
        return [f"{px(s):.1f},{py(y):.1f}" for s, y in enumerate(ys, start=first_step)]

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
    for i, (name, runs) in enumerate(smoothed.items()):
        colour = colours[i % len(colours)]
        if len(runs) > 1:
            low = [min(col) for col in zip(*runs, strict=True)]
            high = [max(col) for col in zip(*runs, strict=True)]
            outline = " ".join(points(low) + points(high)[::-1])
            parts.append(f'<polygon fill="{colour}" fill-opacity="0.2" stroke="none" points="{outline}"/>')
        line = " ".join(points(means[name]))
        parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{line}"/>')
        y = PAD + 14 * i
        x = WIDTH - PAD - legend_width
        parts.append(f'<line x1="{x}" y1="{y}" x2="{x + 20}" y2="{y}" stroke="{colour}"/>')
        label = (labels or {}).get(name) or default_label(name, groups[name])
        parts.append(f'<text x="{x + 25}" y="{y + 4}" font-size="10">{escape(label)}</text>')
    parts.append("</svg>")
    return "".join(parts)
