"""The expert-parallel overlap tables of docs/parallelism.md (benchmarks/ep_overlap.py, ep_overlap_microbatch.py,
ep_overlap_delayed_wgrad.py)."""

from __future__ import annotations

from table_format import captioned, load, source, table


def _range(stats: dict, scale: float = 1.0) -> str:
    return f"{stats['median'] / scale:.3f} ({stats['min'] / scale:.3f} to {stats['max'] / scale:.3f})"


@table("ep_overlap")
def _ep_overlap() -> str:
    return _overlap_table("ep_overlap", "chunked")


@table("ep_overlap_microbatch")
def _ep_overlap_microbatch() -> str:
    return _overlap_table("ep_overlap_microbatch", "microbatch")


@table("ep_overlap_delayed_wgrad")
def _ep_overlap_delayed_wgrad() -> str:
    return _overlap_table("ep_overlap_delayed_wgrad", "microbatch_delayed")


def _overlap_table(name: str, mode: str) -> str:
    data = load(name)
    body = []
    for run in data["runs"].values():
        summary = run["summary"]
        compute = summary["t_compute_s"]
        real = summary[f"real_gloo_{mode}_over_none"]
        row_name = [str(run["ep"]), str(run["tokens_per_rank"])]
        body.append([*row_name, "real gloo, no link", "", "", "1.000", _range(real)])
        for ratio, row in summary["ratios"].items():
            body.append(
                [
                    *row_name,
                    ratio,
                    _range(row["hidden_fraction"]),
                    _range(row["hidden_of_own_compute"]),
                    _range(row["none_s"], compute),
                    _range(row[f"{mode}_s"], compute),
                ]
            )
    model = data["model"]
    how = (
        f"`parallel.ep_overlap chunked` ({data['chunks']} chunks)"
        if mode == "chunked"
        else f"`parallel.ep_overlap microbatch` (steps of {data['micro_batches']} micro-batches, "
        f"{data['chunks']} chunks)"
    )
    if mode == "microbatch_delayed":
        how += " and `parallel.delay_wgrad_compute true`"
    caption = (
        f"A training step (forward and backward, no optimizer) of {model['num_layers']} MoE layers of "
        f"{model['num_moe_experts']} experts (top-2, expert FFN {model['moe_ffn_hidden_size']}, hidden "
        f"{model['hidden_size']}), sequences of {data['seq_len']} tokens, on ep gloo ranks of one thread each (ep=4: "
        f"4 ranks on 2 cores), without overlap and with {how}, {data['reps']} interleaved pairs. Every collective "
        f"of the MoE layers waits for a modelled link of {data['latency_s'] * 1e6:.0f} us a collective and a bandwidth "
        "set so that the step without overlap communicates `comm / compute` times its computation `T_compute` (the "
        f"step on the real gloo, measured first). Hidden fraction: `(T_none - T_{mode}) / T_comm` of each pair; of its "
        f"own compute: `1 - (T_{mode} - T_{mode},real) / T_comm`, which leaves out what the overlapped step computes "
        "faster (the real gloo row), from each rank's medians; steps in units of `T_compute`; the median over the "
        "ranks of each rank's median, with the lowest and highest repetition of any rank (of its own compute: the "
        f"lowest and highest rank) ({source(name)})."
    )
    header = [
        "ep",
        "tokens a rank",
        "comm / compute",
        "hidden fraction",
        "of its own compute",
        "step, no overlap",
        f"step, {mode.replace('_', ' ')} overlap",
    ]
    return captioned(caption, header, body, ["---:", "---:", "---", "---:", "---:", "---:", "---:"])
