"""The tables of layouts and precision: materialisation, the pipeline's bubbles, long context, logits per rank,
FP8 dispatch and the precision recipes' loss parity (docs/gen_tables.py writes them into the pages)."""

from __future__ import annotations

import math

from table_format import MiB, captioned, figure, load, num, pct, source, span, table


@table("materialized_bytes")
def _materialized_bytes() -> str:
    data = load("materialized_bytes")
    body = []
    for layout in data["summary"]:
        # the rank with the highest peak of each layout
        r = max((rank[layout] for rank in data["ranks"]), key=lambda r: r["peak_meta_bytes"])
        body.append(
            [
                layout,
                num(r["peak_meta_bytes"] / 1e6),
                num(r["shard_bytes"] / 1e6),
                num(r["bound_bytes"] / 1e6),
                f"{r['peak_meta_over_bound']:.2f}x",
                f"{r['peak_meta_over_shard']:.2f}x",
                f"{num(r['peak_whole_model_first_bytes'] / 1e6)} ({r['peak_whole_model_first_over_bound']:.1f}x)",
            ]
        )
    m = data["model"]
    caption = (
        f"Peak tensor bytes a rank allocates while building its share: {m['num_moe_experts']} experts, "
        f"{m['num_layers']} layers, hidden {m['hidden_size']}, {data['world_size']} gloo ranks, fp32 "
        f"({source('materialized_bytes')}). The bound is the rank's expert shard plus the whole non-expert "
        f"parameters."
    )
    header = [
        "layout (its rank with the highest peak)",
        "peak, MB",
        "shard held, MB",
        "bound, MB",
        "peak / bound",
        "peak / shard",
        "whole model built first: peak, MB (/ bound)",
    ]
    return captioned(caption, header, body, ["---", "---:", "---:", "---:", "---:", "---:", "---:"])


# --- parallelism and long context --------------------------------------------------------------------------------


@table("pipeline_bubble")
def _pipeline_bubble() -> str:
    data = load("pipeline_bubble")
    configs = data["configurations"]
    schedules: list[str] = []
    for cfg in configs.values():
        schedules += [s for s in cfg["schedules"] if s not in schedules]
    body = []
    for name in schedules:
        cells = [name]
        for cfg in configs.values():
            s = cfg["schedules"].get(name, {})
            if "bubble" not in s:
                cells.append("refused")
            else:
                cells.append(f"{s['bubble']:.3f} ({s['textbook_bubble']:.3f})")
        body.append(cells)
    cost = data["cost_model"]
    caption = (
        f"Idle fraction of a step, simulated from each schedule's own action list, and in brackets the textbook "
        f"formula's; costs F={cost['F']:g}, B={cost['B']:g}, I={cost['I']:g}, W={cost['W']:g}, communication free "
        f"({source('pipeline_bubble')})."
    )
    header = ["schedule", *(f"pp={c['pp']}, m={c['microbatches']}" for c in configs.values())]
    return captioned(caption, header, body, ["---", *["---:"] * len(configs)])


@table("long_context_attention")
def _long_context_attention() -> str:
    data = load("long_context")
    body = []
    for run in data["attention_memory"].values():
        before, after = run["previous"], run["blockwise"]
        low, high = run["speedup_range"]
        body.append(
            [
                f"`{run['preset']}`, {run['seq_len']:,}",
                f"{num(before['saved_bytes'] / MiB)} -> {num(after['saved_bytes'] / MiB)} MiB",
                f"{num(before['peak_live_bytes'] / MiB)} -> {num(after['peak_live_bytes'] / MiB)} MiB",
                f"{run['speedup_median']:.2f} ({low:.2f}-{high:.2f})",
            ]
        )
    caption = (
        f"One training step of one sequence, {data['dtype']} on {data['device']}, before (the attention blockwise "
        f"attention replaced) and after ({source('long_context')})."
    )
    header = ["model, sequence", "saved for backward", "peak live tensors", "step time, before / after: median (range)"]
    return captioned(caption, header, body, ["---", "---:", "---:", "---:"])


def _losses(losses: list[float]) -> str:
    return " -> ".join(f"{loss:.4f}" for loss in losses)


@table("long_context_runs")
def _long_context_runs() -> str:
    data = load("long_context")
    gpt = data["gpt_oss_training"]
    cp = data["long_context"]
    body = [
        [
            f"`tiny-gpt-oss`, {gpt['seq_len']:,} tokens, one process",
            num(gpt["tokens_per_s_median"], 0),
            _losses(gpt["losses"]),
            "",
        ]
    ]
    activation = cp["activation_bytes"]
    for name in ("cp=1", f"cp={cp['cp']}"):
        run = cp["training"][name]
        per_rank = activation[name] if isinstance(activation[name], list) else [activation[name]]
        saved = max(r["saved_bytes"] for r in per_rank)
        exact = all(r["saved_bytes"] == r["estimated_bytes"] for r in per_rank)
        body.append(
            [
                f"`tiny`, one {cp['seq_len']:,}-token sequence, {name}",
                num(run["tokens_per_s_median"], 0),
                _losses(run["losses"]),
                f"{num(saved / MiB)} MiB (estimate {'equal' if exact else 'differs'})",
            ]
        )
    caption = (
        f"Training under `moe-train` on this 2-core machine; the cp={cp['cp']} rank saves "
        f"{cp['activation_ratio_worst_rank']:.3f}x what one process saves ({source('long_context')})."
    )
    header = ["run", "tokens/s (median)", "loss per step", "saved for backward, worst rank"]
    return captioned(caption, header, body, ["---", "---:", "---", "---:"])


@table("logits_per_rank")
def _logits_per_rank() -> str:
    data = load("long_context")["logits_per_rank"]
    body = []
    for layout in data["per_rank"][0]:
        # the largest over the ranks (they hold equal shares)
        r = max((rank[layout] for rank in data["per_rank"]), key=lambda r: r["logits_bytes_per_rank"])
        body.append([layout, num(r["logits_bytes_per_rank"] / MiB), num(r["loss_saved_bytes"] / MiB)])
    caption = f"{data['seq_len']:,} tokens, a {data['vocab_size']:,}-token vocabulary, fp32 ({source('long_context')})."
    header = ["layout", "logits per rank, MiB", "loss's saved log-probabilities per rank, MiB"]
    return captioned(caption, header, body, ["---", "---:", "---:"])


# --- precision ---------------------------------------------------------------------------------------------------


@table("fp8_dispatch")
def _fp8_dispatch() -> str:
    data = load("dispatch_bytes")
    fp8 = data["fp8_dispatch"]
    body = [
        [f"bytes against bf16, hidden {hidden}", f"{value:.4f}x", f"<= {fp8['target_ratio']}x"]
        for hidden, value in fp8["bytes_ratio_to_bf16"].items()
    ]
    body.append(["relative error of the tokens (median over seeds)", f"{fp8['token_rel_error']['median']:.4f}", ""])
    body.append(
        ["relative error of a SwiGLU expert's output (median)", f"{fp8['expert_output_rel_error']['median']:.4f}", ""]
    )
    caption = f"{fp8['format']}; tokens with outlier channels ({source('dispatch_bytes')})."
    return captioned(caption, ["", "measured", "target"], body, ["---", "---:", "---:"])


RECIPES = ["none", "fp8_tensorwise", "fp8_delayed", "fp8_blockwise", "mxfp8", "nvfp4"]


def _target(result: dict) -> str:
    return f"{result['target'] * 100:.0f}%" if "target" in result else "-"


@table("precision_parity")
def _precision_parity() -> str:
    data = load("precision_parity")
    one, tp = data["sets"]["one_process"], data["sets"]["tp2_ep2"]
    body = []
    for recipe in RECIPES:
        a, b = one["results"][recipe], tp["results"][recipe]
        finite = "yes" if b["all_finite"] else "no"
        if recipe == "none":
            body.append([f"`{recipe}`", "-", f"{a['final_loss']:.4f}", "-", "-", f"- ({b['final_loss']:.4f})"])
        else:
            body.append(
                [
                    f"`{recipe}`",
                    _target(a),
                    f"{a['final_loss']:.4f}",
                    pct(a["rel_diff_final"]),
                    pct(a["rel_diff_mean_last_20"]),
                    f"{pct(b['rel_diff_final'])} ({b['final_loss']:.4f})",
                ]
            )
        body[-1].append(f"{finite}, {b['max_grad_norm']:.2f}")
    for label, r in data["sets"]["noise_floor"]["results"].items():
        body.append(
            [
                f"`none`, {label} (noise floor)",
                "-",
                f"{r['final_loss']:.4f}",
                pct(r["rel_diff_final"]),
                pct(r["rel_diff_mean_last_20"]),
                "",
                "",
            ]
        )
    caption = (
        f"The `tiny` preset, {one['steps']} steps in one process and {tp['steps']} steps at tp=2 x ep=2 on "
        f"{tp['ranks']} gloo ranks (its own learning-rate schedule, against its own fp32 run), every recipe "
        f"emulated on CPU, against the fp32 run of the same weights and batches ({source('precision_parity')})."
    )
    header = [
        "recipe",
        "target",
        f"final loss, {one['steps']} steps",
        "vs fp32 (final step)",
        "vs fp32 (mean of the last 20)",
        f"tp=2 x ep=2, {tp['steps']} steps: vs fp32 (final)",
        "tp=2 x ep=2: finite, max grad norm",
    ]
    return captioned(caption, header, body)


@table("precision_seeds")
def _precision_seeds() -> str:
    data = load("precision_parity")
    seeds = data["sets"]["seeds"]
    pooled = data["sets"]["all_seeds"]["recipes"]
    summary = seeds["summary"]
    base = summary["none"]
    body = [
        [
            "`none`",
            "-",
            f"{base['mean_final_loss']:.4f} (seed spread {base['rel_spread_final_loss'] * 100:.1f}%)",
            f"{base['mean_val_loss']:.4f} (seed spread {base['rel_spread_val_loss'] * 100:.1f}%)",
            "-",
        ]
    ]
    for recipe in RECIPES[1:]:
        s = summary[recipe]
        final, held = pct(s["rel_diff_final_loss"]), pct(s["rel_diff_val_loss"])
        more = pooled.get(recipe, {})
        if more.get("n", 0) > len(seeds["seeds"]):
            final += f" ({more['n']} seeds: {pct(more['final_loss']['rel_diff_of_means'])})"
            held += f" ({more['n']} seeds: {pct(more['val_loss']['rel_diff_of_means'])})"
        per_seed = ", ".join(pct(s["per_seed_rel_diff_final"][str(seed)]) for seed in seeds["seeds"])
        body.append([f"`{recipe}`", _target(s), final, held, per_seed])
    names = ", ".join(str(seed) for seed in seeds["seeds"])
    caption = (
        f"Every recipe at `train.seed` {names}, {seeds['steps']} steps, `train.eval_iters` {seeds['eval_iters']} "
        f"held-out batches; means over the seeds against fp32's ({source('precision_parity')})."
    )
    header = [
        "recipe",
        "target",
        "final loss: mean vs fp32's",
        "held-out loss: mean vs fp32's",
        f"final loss per seed ({names}) vs fp32",
    ]
    return captioned(caption, header, body)


def _blockwise() -> dict:
    return load("precision_parity")["sets"]["all_seeds"]["recipes"]["fp8_blockwise"]


@table("precision_blockwise_seeds")
def _precision_blockwise_seeds() -> str:
    pooled = _blockwise()
    n = pooled["n"]
    body = []
    for label, key in (("final loss", "final_loss"), ("held-out loss", "val_loss")):
        r = pooled[key]
        per_seed = list(r["per_seed"].values())
        body.append(
            [
                label,
                pct(r["mean_paired_rel_diff"]),
                f"{r['standard_error'] * 100:.2f}%",
                f"{r['standard_error'] * math.sqrt(n) * 100:.1f}%",
                span(per_seed, lambda x: pct(x, 1)),
                f"{r['seeds_worse']} of {n}",
                pct(r["rel_diff_of_means"]),
            ]
        )
    caption = (
        f"`fp8_blockwise` against fp32 at the same seed, pooled over {n} seeds "
        f"({', '.join(map(str, sorted(pooled['seeds'])))}; {source('precision_parity')})."
    )
    header = [
        f"`fp8_blockwise`, {n} seeds",
        "mean of the per-seed differences",
        "standard error",
        "one seed's standard deviation",
        "per-seed range",
        "seeds worse than fp32",
        "difference of the means",
    ]
    return captioned(caption, header, body)


def _three_seed_error() -> str:
    pooled = _blockwise()
    return f"{pooled['final_loss']['standard_error'] * math.sqrt(pooled['n'] / 3) * 100:.1f}%"


figure("precision.three_seed_standard_error", _three_seed_error)


@table("precision_gradient_error")
def _precision_gradient_error() -> str:
    data = load("precision_parity")["sets"]["gradient_error"]
    steps = list(data["rows"])
    body = []
    for recipe in RECIPES[1:]:
        errors = [data["rows"][s][recipe]["rel_error"] for s in steps]
        norms = [data["rows"][s][recipe]["norm_ratio"] for s in steps]
        worst = [data["rows"][s][recipe]["worst_parameter"] for s in steps]
        routers = sum("router" in w for w in worst)
        body.append(
            [
                f"`{recipe}`",
                span(errors, lambda x: f"{x * 100:.1f}%"),
                span(norms, lambda x: f"{x:.3f}"),
                f"{routers} of {len(steps)}",
            ]
        )
    caption = (
        f"One held-out batch's whole gradient under each recipe against fp32's, at fp32-trained weights after "
        f"{', '.join(steps)} steps ({source('precision_parity')})."
    )
    header = ["recipe", "relative error", "norm ratio", "steps where a router is the worst parameter"]
    return captioned(caption, header, body)
