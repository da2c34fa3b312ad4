"""The layout planner's check against published runs (benchmarks/plan_search.py)."""

from __future__ import annotations

from table_format import captioned, figure, load, num, ratio, source, table


@table("plan_search")
def _plan_search() -> str:
    data = load("plan_search")
    body = []
    for row in data["rows"]:
        body.append(
            [
                row["row"],
                f"`{row['published_layout']}`",
                f"{row['planner_micro_batch']}, {row['planner_saving']}",
                num(row["memory_gib"]),
                num(row["published_tokens_per_second_per_gpu"], 0),
                num(row["estimated_tokens_per_second_per_gpu"], 0),
                ratio(row["estimated_over_published"], 2),
                f"{row['rank']} of {row['layouts_fitting']}",
                f"{row['rank_at_tp1_cp1']} of {row['layouts_fitting_at_tp1_cp1']}",
                row["why_first_at_tp1_cp1_beats_published"],
            ]
        )
    caption = (
        f"NeMo AutoModel's H100 BF16 runs ({data['baseline']}) under `moe-train plan --search` on the "
        f"`{data['hardware']}` profile, with bf16 FSDP gathers, fp32 reductions and the `flex` (DeepEP) dispatcher, "
        f"compute at the one fitted efficiency {data['fitted_efficiency']:.3f} of peak. Micro-batch and saving: "
        "the planner's fastest choice that fits for the published layout; GiB: that choice's memory per rank (the "
        "largest rank); rank: among every layout that fits, and among those with tp = cp = 1 (AutoModel's own "
        "dimensions); the last column says where the first of those beats the published layout. "
        + source("plan_search")
        + "."
    )
    header = [
        "run",
        "published layout",
        "micro-batch, saving",
        "GiB",
        "published tok/s/GPU",
        "estimated",
        "ratio",
        "rank",
        "rank at tp = cp = 1",
        "first at tp = cp = 1 beats it by",
    ]
    return captioned(caption, header, body, ["---", "---", "---", "--:", "--:", "--:", "--:", "--:", "--:", "---"])


figure("plan_search.efficiency", lambda: f"{load('plan_search')['fitted_efficiency']:.3f}")
figure("plan_search.deepseek_v3_1024_s", lambda: f"{load('plan_search')['deepseek_v3_1024_command_s']['median']:.1f}")
