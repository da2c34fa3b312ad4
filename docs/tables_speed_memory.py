"""The tables of speed and memory: a step against transformers, the experts block, permutation and dispatch,
the memory estimate and savings, optimizer states (docs/gen_tables.py writes them into the pages)."""

from __future__ import annotations

from table_format import FAMILY_NAMES, KiB, MiB, captioned, figure, load, num, pct, ratio, source, table


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
