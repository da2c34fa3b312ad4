"""Write the measured figures of benchmarks/results/*.json into the docs.

    uv run python docs/gen_tables.py

A table sits in a page between ``<!-- table:NAME -->`` and ``<!-- /table:NAME -->``; a figure inside a sentence
between ``<!-- fig:NAME -->`` and ``<!-- /fig -->``. This script rewrites what is between the markers from the JSON
the benchmarks wrote (it never runs a benchmark), so no measured number is typed by hand.
integration/test_docs.py fails when a page differs from what this script writes.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MiB = 1 << 20
KiB = 1 << 10

TABLES: dict[str, Callable[[], str]] = {}
FIGURES: dict[str, Callable[[], str]] = {}

TABLE = re.compile(r"(<!-- table:([\w-]+) -->\n)(.*?)(<!-- /table:\2 -->)", re.S)
FIGURE = re.compile(r"(<!-- fig:([\w.-]+) -->)(.*?)(<!-- /fig -->)")


def pages() -> list[Path]:
    """Every page the markers may sit in: the README and docs/*.md."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def table(name: str) -> Callable[[Callable[[], str]], Callable[[], str]]:
    def register(fn: Callable[[], str]) -> Callable[[], str]:
        TABLES[name] = fn
        return fn

    return register


def figure(name: str, fn: Callable[[], str]) -> None:
    FIGURES[name] = fn


def load(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


def source(name: str) -> str:
    """The caption's last words: which file, when, on what."""
    data = load(name)
    date = str(data.get("date", ""))[:10]
    torch = data.get("torch", "")
    return f"`benchmarks/results/{name}.json`, {date}, torch {torch}"


def rows(header: list[str], body: list[list[str]], align: list[str] | None = None) -> str:
    align = align or ["---"] * len(header)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(cells) + " |" for cells in body]
    return "\n".join(lines)


def captioned(caption: str, header: list[str], body: list[list[str]], align: list[str] | None = None) -> str:
    """A table under the sentence that says what was measured, on what, and where the figures come from."""
    return caption + "\n\n" + rows(header, body, align)


def num(x: float, digits: int = 1) -> str:
    return f"{x:,.{digits}f}"


def pct(x: float, digits: int = 2) -> str:
    return f"{x * 100:+.{digits}f}%"


def ratio(x: float, digits: int = 3) -> str:
    return f"{x:.{digits}f}"


def span(values: list[float], fmt: Callable[[float], str]) -> str:
    return f"{fmt(min(values))} to {fmt(max(values))}"


# --- speed -------------------------------------------------------------------------------------------------------

FAMILY_NAMES = {"qwen3_moe": "Qwen3-MoE", "deepseek_v3": "DeepSeek-V3", "gpt_oss": "GPT-OSS", "mixtral": "Mixtral"}


@table("step_vs_transformers")
def _step_vs_transformers() -> str:
    data = load("step_vs_transformers")
    body = []
    for key, fam in data["families"].items():
        eager, compiled = fam["speedup_eager"], fam["speedup_compiled"]
        reps = len(fam["seconds"]["eager_pair"]["ours"])
        losses = fam["first_losses"]
        same = "yes" if len({round(v, 5) for v in losses.values()}) == 1 else "no"
        body.append(
            [
                f"{FAMILY_NAMES.get(key, key)} (`{fam['preset']}`; transformers' "
                f"{fam['transformers_attention']} attention)",
                f"{eager['median']:.2f}x ({eager['min']:.2f}-{eager['max']:.2f})",
                f"{compiled['median']:.2f}x ({compiled['min']:.2f}-{compiled['max']:.2f})",
                f"{fam['gemm_fraction_eager'] * 100:.1f}% / {fam['gemm_fraction_compiled'] * 100:.1f}%",
                f"{fam['gemm_rate_flops'] / 1e9:.0f}",
                same,
            ]
        )
    batch = next(iter(data["families"].values()))["batch"]
    targets = data["targets"]
    caption = (
        f"One training step (forward, LM loss, backward), batch {batch[0]} x {batch[1]} tokens, fp32, "
        f"{data['threads']} CPU threads, {reps} repetitions per pair; targets: eager >= {targets['eager']}x, "
        f"compiled >= {targets['compiled']}x, >= {targets['gemm_fraction'] * 100:.0f}% of the GEMM rate "
        f"({source('step_vs_transformers')})."
    )
    header = [
        "family",
        "transformers' time / ours, eager: median (range)",
        "compiled: median (range)",
        "our FLOP rate / fp32 GEMM rate, eager / compiled",
        "fp32 GEMM rate, GFLOP/s",
        "first-step losses equal",
    ]
    return captioned(caption, header, body)


@table("experts_block")
def _experts_block() -> str:
    data = load("experts_block")
    inp, r, mem = data["inputs"], data["ratios"], data["memory"]
    target, met = data["targets"], data["targets_met"]

    def goal(key: str) -> str:
        return f"<= {target[key]} ({'met' if met[key] else 'missed'})"

    def spread(s: dict) -> str:
        return f"{s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f})"

    saved = data["saved_activations"]
    body = [
        [
            "time against transformers",
            f"{ratio(r['ours_over_hf_time'])} ({r['hf_over_ours_time']:.2f}x faster)",
            spread(r["ours_over_hf_time_spread"]),
            goal("ours_over_hf_time"),
        ],
        [
            "time against the dense chain",
            ratio(r["ours_over_dense_time"]),
            spread(r["ours_over_dense_time_spread"]),
            goal("ours_over_dense_time"),
        ],
        [
            "peak memory against transformers (a fresh process each, forward + backward)",
            f"{ratio(r['ours_over_hf_peak_memory'])} ({mem['ours']['peak_increase_MiB']:.1f} against "
            f"{mem['hf']['peak_increase_MiB']:.1f} MiB)",
            "",
            goal("ours_over_hf_peak_memory"),
        ],
        [
            "bytes saved for backward against transformers",
            f"{ratio(r['ours_over_hf_saved_activations'])} ({saved['ours']['MiB']:.1f} against "
            f"{saved['hf']['MiB']:.1f} MiB)",
            "",
            "",
        ],
    ]
    errors = data["max_abs_err_vs_hf"]["ours"]
    caption = (
        f"One MoE block, forward + backward: {inp['tokens']:,} tokens, hidden {inp['hidden']}, "
        f"{inp['num_experts']} experts, top-{inp['topk']}, FFN {inp['ffn']}, {inp['dtype']}, {data['cpu_threads']} "
        f"threads, {inp['reps']} repetitions per pair; outputs equal to transformers' within "
        f"{max(errors.values()):.0e} ({source('experts_block')})."
    )
    header = ["", "ours / baseline, ratio of medians", "per-repetition ratios, median (range)", "target"]
    return captioned(caption, header, body)


@table("permute_throughput")
def _permute_throughput() -> str:
    data = load("permute_throughput")
    inp = data["inputs"]
    body = [
        [
            res["backend"],
            res["device"],
            f"{res['permute_unpermute_GBps']:.2f}",
            f"{res['copy_GBps']:.2f}",
            ratio(res["ratio"]),
        ]
        for res in data["results"]
    ]
    caption = (
        f"Permute + unpermute forward (map built once) against a copy of the same bytes: {inp['tokens']:,} tokens, "
        f"hidden {inp['hidden']}, {inp['num_experts']} experts, top-{inp['topk']}, {inp['reps']} repetitions, "
        f"{data['cpu_threads']} threads ({source('permute_throughput')})."
    )
    header = ["back end", "device", "permute + unpermute, GB/s", "copy, GB/s", "ratio"]
    return captioned(caption, header, body, ["---", "---", "---:", "---:", "---:"])


@table("dispatch_bytes")
def _dispatch_bytes() -> str:
    data = load("dispatch_bytes")
    inp = data["inputs"]
    body = [
        [
            f"`{name}`",
            num(res["bytes_per_token"], 0),
            f"{res['rows_per_token']:.2f}",
            f"{res['ratio_to_minimum']:.3f}",
        ]
        for name, res in data["results"].items()
    ]
    caption = (
        f"Payload bytes a rank sends to other ep ranks per token: ep={inp['ep']}, {inp['num_experts']} experts, "
        f"top-{inp['topk']}, hidden {inp['hidden']}, {inp['dtype']}, {inp['tokens_per_rank']:,} tokens a rank, "
        f"{inp['seeds']} seeds; the minimum sends each token once per distinct remote rank "
        f"({source('dispatch_bytes')})."
    )
    header = ["dispatch", "bytes per token", "rows per token", "over the minimum"]
    return captioned(caption, header, body, ["---", "---:", "---:", "---:"])


# --- memory ------------------------------------------------------------------------------------------------------


@table("memory_estimate")
def _memory_estimate() -> str:
    data = load("memory_estimate")
    body = []
    for name, cfg in data["configurations"].items():
        if cfg["ranks"] == 1:
            measured = cfg["measured_activation_bytes"]
            worst = cfg["activation_rel_error"]
            exact = all(cfg[k]["estimated"] == cfg[k]["allocated"] for k in ("params", "grads", "optimizer"))
        else:
            measured = cfg["measured_activation_bytes_mean"]
            worst = cfg["activation_rel_error_worst_rank"]
            exact = cfg["params_grads_optimizer_exact_on_every_rank"]
        body.append(
            [
                name,
                str(cfg["ranks"]),
                num(cfg["estimated_activation_bytes"] / KiB),
                num(measured / KiB),
                pct(cfg["activation_rel_error"]),
                pct(worst),
                "exact" if exact else "differ",
            ]
        )
    caption = (
        f"Activations saved for backward in one training step, estimated against measured "
        f"({data['dtype']} on {data['device']}; {source('memory_estimate')})."
    )
    header = [
        "configuration",
        "ranks",
        "estimated KiB",
        "measured KiB (rank mean)",
        "error",
        "worst rank",
        "params, grads, optimizer",
    ]
    return captioned(caption, header, body, ["---", "---:", "---:", "---:", "---:", "---:", "---"])


def _worst_estimate() -> str:
    worst = load("memory_estimate")["worst_activation_rel_error"]
    return f"{abs(worst['rel_error_on_any_rank']) * 100:.2f}%"


def _worst_estimate_configuration() -> str:
    return load("memory_estimate")["worst_activation_rel_error"]["configuration"]


figure("memory_estimate.worst", _worst_estimate)
figure("memory_estimate.worst_configuration", _worst_estimate_configuration)


def _variant_name(variant: dict, name: str) -> str:
    parts = []
    if variant["recompute"]:
        parts.append("recompute " + ", ".join(f"`{k}`" for k in variant["recompute"]))
    if variant["offload"]:
        limit = variant["offload_min_tensor_bytes"]
        at_least = f" (tensors >= {limit // MiB} MiB)" if limit else " (every tensor)"
        parts.append("offload " + ", ".join(f"`{k}`" for k in variant["offload"]) + at_least)
    return "; ".join(parts) or name


@table("memory_savings_layers")
def _memory_savings_layers() -> str:
    data = load("memory_savings")
    layers = data["layers"]
    names: list[str] = []
    for layer in layers.values():
        names += [n for n in layer["variants"] if n not in names]
    body = []
    for name in names:
        described = next(layer["variants"][name] for layer in layers.values() if name in layer["variants"])
        cells = [_variant_name(described, name)]
        for layer in layers.values():
            variant = layer["variants"].get(name)
            if variant is None:
                cells.append("-")
                continue
            cell = num(variant["kept_bytes_per_token"] / KiB)
            if variant["offloaded_bytes_per_token"]:
                cell += f" (+{num(variant['offloaded_bytes_per_token'] / KiB)} on host)"
            cells.append(cell)
        body.append(cells)
    described = []
    for preset, layer in layers.items():
        shape = layer["layer"]
        described.append(
            f"{preset}: hidden {shape['hidden_size']}, {shape['attention']}, {shape['num_moe_experts_used']} of "
            f"{shape['num_moe_experts_real']} experts, top-{shape['moe_router_topk']}"
        )
    tokens = next(iter(layers.values()))["tokens"]
    identical = all(v["grad_max_rel_diff"] == 0 for layer in layers.values() for v in layer["variants"].values())
    caption = (
        f"KiB per token kept on the device for backward by one MoE layer ({'; '.join(described)}), "
        f"{tokens['batch'] * tokens['seq_len']} tokens, {data['dtype']} on {data['device']}; gradients "
        f"{'identical to the plain run in every variant' if identical else 'differ from the plain run'} "
        f"({source('memory_savings')})."
    )
    header = ["variant", *(f"{preset} layer, KiB/token" for preset in layers)]
    return captioned(caption, header, body, ["---", *["---:"] * len(layers)])


@table("memory_savings_step_time")
def _memory_savings_step_time() -> str:
    data = load("memory_savings")["step_time"]
    body = []
    for name, v in data["variants"].items():
        low, high = v["time_ratio_iqr"]
        body.append(
            [
                _variant_name(v, name),
                ratio(v["time_ratio_median"]),
                f"{low:.3f}-{high:.3f}",
                ratio(v["kept_bytes_model_over_none"]),
            ]
        )
    mb = data["micro_batch"]
    caption = (
        f"Step time of the `{data['preset']}` preset ({mb['sequences']} x {mb['seq_len']} tokens), each variant "
        f"against none, {data['reps']} interleaved pairs on a shared machine, so the ranges are wide "
        f"({source('memory_savings')})."
    )
    header = ["variant", "time / none, median", "interquartile range", "bytes kept / none (whole model)"]
    return captioned(caption, header, body, ["---", "---:", "---:", "---:"])


@table("optimizer_states")
def _optimizer_states() -> str:
    data = load("optimizer_states")
    body = []
    for name, run in data["runs"].items():
        settings = ", ".join(f"`{k} {v}`" for k, v in run["settings"].items())
        states = run["optimizer_state_bytes"]
        state_bytes = states["exp_avg"] + states["exp_avg_sq"] + states["master"]
        body.append(
            [
                name,
                settings,
                f"{run['final_loss_mean_last_10']:.4f}",
                pct(run["rel_diff_vs_fp32_mean_last_10"]),
                num(state_bytes / MiB),
            ]
        )
    caption = (
        f"The `{data['inputs']['preset']}` preset for {data['inputs']['steps']} steps, the same seed and batches "
        f"({source('optimizer_states')})."
    )
    header = ["run", "settings", "final loss (mean of the last 10 steps)", "vs fp32", "optimizer state, MiB"]
    return captioned(caption, header, body, ["---", "---", "---:", "---:", "---:"])


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


# --- rendering ---------------------------------------------------------------------------------------------------


def render(text: str) -> str:
    """``text`` with every marked table and figure written from the JSON; an unknown name is an error."""

    def fill_table(m: re.Match) -> str:
        name = m.group(2)
        if name not in TABLES:
            raise KeyError(f"no table {name!r} in docs/gen_tables.py (known: {', '.join(TABLES)})")
        return f"{m.group(1)}{TABLES[name]()}\n{m.group(4)}"

    def fill_figure(m: re.Match) -> str:
        name = m.group(2)
        if name not in FIGURES:
            raise KeyError(f"no figure {name!r} in docs/gen_tables.py (known: {', '.join(FIGURES)})")
        return f"{m.group(1)}{FIGURES[name]()}{m.group(4)}"

    return FIGURE.sub(fill_figure, TABLE.sub(fill_table, text))


def used(text: str) -> set[str]:
    return {m.group(2) for m in TABLE.finditer(text)} | {m.group(2) for m in FIGURE.finditer(text)}


def main() -> int:
    changed = []
    for page in pages():
        text = page.read_text()
        new = render(text)
        if new != text:
            page.write_text(new)
            changed.append(page.relative_to(ROOT))
    print("rewrote " + ", ".join(map(str, changed)) if changed else "every table is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
