"""``moe-train plan --search`` against published runs: NeMo AutoModel's six H100 BF16 pre-training rows
(``moe_train.published_runs``), and the time it takes for DeepSeek-V3 on 1,024 GPUs.

For each row, on the ``h100-80gb`` profile with the run's settings (bf16 FSDP gathers and fp32 reductions, DeepEP's
``flex`` dispatcher, the row's global batch, sequence 4,096):

- the published layout (tp, pp, cp, ep, vpp, fsdp) as the planner would run it (its fastest micro-batch size and
  memory saving that fit): its memory per rank, its estimated tokens/s/GPU against the published figure, its rank
  among all layouts that fit, and among those of AutoModel's own dimensions (tp = cp = 1);
- the planner's first layout, and where the published one loses to it (the parts of the step that differ most);
- whether the row's own micro-batch size and recompute fit under the estimate.

The compute efficiency is one number for all rows, fitted here: the one minimising the squared log ratio of estimated
to published tokens/s over the six rows (a grid of 0.005 from 0.2 to 0.8). ``moe_train.layout_search.
DEFAULT_EFFICIENCY`` is set to it by hand, and the docs table comes from this JSON.

The timing is of the whole command (``moe-train plan --search --gpus 1024`` for DeepSeek-V3, a fresh process:
imports, the model on the meta device, the search and its printout), median of 3 with their spread: an absolute time
held against the issue's 60 s on these machines, not a comparison between two things (each run takes about 20 s).

    uv run python benchmarks/plan_search.py [--quick] [--out benchmarks/results/plan_search.json]

``--quick`` (the nox benchmarks session): the two 8-GPU rows at the default efficiency, no fit and no timing.
"""

from __future__ import annotations

import math
import statistics
import subprocess
import sys
import time

from _harness import cli, header, parse, write  # benchmarks/_harness.py, beside this script

from moe_models.presets import preset
from moe_train.hardware import load_hardware
from moe_train.layout_search import DEFAULT_EFFICIENCY, GIB, LayoutSearch, SearchSettings
from moe_train.plan_search import describe, why
from moe_train.published_runs import PUBLISHED_RUNS, SEQ_LEN, SOURCE
from moe_train.step_time import LayoutSizes

HARDWARE = "h100-80gb"
GRID = [round(0.2 + 0.005 * i, 3) for i in range(121)]
ANCHOR_DIMS = {"tp": 1, "cp": 1}


def _searches() -> dict:
    hw = load_hardware(HARDWARE)
    out = {}
    for name, run in PUBLISHED_RUNS.items():
        settings = SearchSettings(run.global_batch, SEQ_LEN, gather_bytes=2, reduce_bytes=4, dispatcher="flex")
        out[name] = (run, settings, LayoutSearch(preset(run.preset), settings, hw))
    return out


def _published(run, search: LayoutSearch, efficiency: float):
    sizes = LayoutSizes(run.gpus, run.tp, run.cp, run.pp, run.vpp, run.ep, 1)
    return sizes, search.best_for(sizes, efficiency)


def _fit(searches: dict) -> tuple[float, list[float]]:
    """The efficiency minimising the squared log ratio of estimated to published tokens/s, and the loss at each."""
    losses = []
    for efficiency in GRID:
        loss = 0.0
        for run, settings, search in searches.values():
            _, candidate = _published(run, search, efficiency)
            loss += math.log(candidate.tokens_per_second_per_gpu(settings) / run.tokens_per_second) ** 2
        losses.append(loss)
    return GRID[losses.index(min(losses))], losses


def _row(name: str, run, settings: SearchSettings, search: LayoutSearch, efficiency: float) -> dict:
    sizes, published = _published(run, search, efficiency)
    microbatches = run.global_batch // sizes.dp // run.micro_batch
    own_memory, _, _ = search.memory(sizes, run.micro_batch, microbatches, run.recompute)
    result = search.search(run.gpus, efficiency)
    anchored = search.search(run.gpus, efficiency, fixed=ANCHOR_DIMS)

    def rank(ranked) -> int | None:
        found = [i for i, c in enumerate(ranked, 1) if c.sizes == sizes]
        return found[0] if found else None

    estimated = published.tokens_per_second_per_gpu(settings)
    first = result.top[0]
    return {
        "row": name,
        "model": run.preset,
        "gpus": run.gpus,
        "global_batch": run.global_batch,
        "published_layout": describe(published),
        "published_tokens_per_second_per_gpu": run.tokens_per_second,
        "published_tflops_per_gpu": run.tflops,
        "estimated_tokens_per_second_per_gpu": round(estimated, 1),
        "estimated_over_published": round(estimated / run.tokens_per_second, 3),
        "planner_micro_batch": published.micro_batch,
        "planner_saving": published.saving,
        "memory_gib": round(published.memory / GIB, 2),
        "usable_gib": round(search.hw.usable_bytes / GIB, 2),
        "own_settings": f"micro-batch {run.micro_batch}, recompute {run.recompute}",
        "own_settings_memory_gib": round(own_memory / GIB, 2),
        "own_settings_fit": own_memory <= search.hw.usable_bytes,
        "time_split_s": {k: round(v, 3) for k, v in published.time.parts.items()},
        "step_s": round(published.time.total, 3),
        "rank": rank(result.ranked),
        "layouts_fitting": result.fitting,
        "rank_at_tp1_cp1": rank(anchored.ranked),
        "layouts_fitting_at_tp1_cp1": anchored.fitting,
        "first": describe(first),
        "first_tokens_per_second_per_gpu": round(first.tokens_per_second_per_gpu(settings), 1),
        "first_micro_batch_saving": f"{first.micro_batch}, {first.saving}",
        "why_first_beats_published": why(first, published, 1) if first.sizes != sizes else "it is the first",
        "first_at_tp1_cp1": describe(anchored.top[0]),
        "why_first_at_tp1_cp1_beats_published": why(anchored.top[0], published, 1)
        if anchored.top[0].sizes != sizes
        else "it is the first",
        "search_s": round(result.seconds, 2),
    }


def _command_seconds(repeats: int) -> list[float]:
    command = [
        sys.executable, "-m", "moe_train", "plan", "--search", "--gpus", "1024", "--hardware", HARDWARE,
        "--model.preset", "deepseek-v3-671b", "--train.global_batch_size", "8192", "--data.seq_len", str(SEQ_LEN),
    ]  # fmt: skip
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(command, check=True, capture_output=True)
        seconds.append(time.perf_counter() - start)
    return seconds


def main() -> None:
    args = parse(cli("plan_search", __doc__, "the two 8-GPU rows at the default efficiency; no fit, no timing"))
    searches = _searches()
    if args.quick:
        searches = {k: v for k, v in searches.items() if v[0].gpus == 8}
        efficiency, losses = DEFAULT_EFFICIENCY, []
    else:
        efficiency, losses = _fit(searches)
    rows = [_row(name, *entry, efficiency) for name, entry in searches.items()]
    for row in rows:
        print(
            f"{row['row']}: estimated {row['estimated_tokens_per_second_per_gpu']:,.0f} tokens/s/GPU, published "
            f"{row['published_tokens_per_second_per_gpu']:,} ({row['estimated_over_published']}); "
            f"rank {row['rank']} of {row['layouts_fitting']}, "
            f"{row['rank_at_tp1_cp1']} of {row['layouts_fitting_at_tp1_cp1']} at tp=cp=1"
        )
    report = header(
        args,
        what="moe-train plan --search: published layouts' estimated throughput and rank; the fitted efficiency",
        baseline=SOURCE,
        hardware=HARDWARE,
        fitted_efficiency=efficiency,
        fit_loss=dict(zip(GRID, [round(x, 4) for x in losses], strict=True)) if losses else {},
        rows=rows,
    )
    if not args.quick:
        seconds = _command_seconds(3)
        report["deepseek_v3_1024_command_s"] = {
            "median": round(statistics.median(seconds), 2),
            "min": round(min(seconds), 2),
            "max": round(max(seconds), 2),
            "runs": len(seconds),
        }
        print(f"moe-train plan --search, DeepSeek-V3 on 1,024 GPUs: {statistics.median(seconds):.1f} s (median of 3)")
    write(args.out, report)


if __name__ == "__main__":
    main()
