"""The expert-parallel overlap table of docs/parallelism.md (benchmarks/ep_overlap.py)."""

from __future__ import annotations

from table_format import captioned, load, source, table


def _range(stats: dict, scale: float = 1.0) -> str:
    return f"{stats['median'] / scale:.3f} ({stats['min'] / scale:.3f} to {stats['max'] / scale:.3f})"


@table("ep_overlap")
def _ep_overlap() -> str:
    data = load("ep_overlap")
    body = []
    for run in data["runs"].values():
        summary = run["summary"]
        compute = summary["t_compute_s"]
        real = summary["real_gloo_chunked_over_none"]
        name = [str(run["ep"]), str(run["tokens_per_rank"])]
        body.append([*name, "real gloo, no link", "", "", "1.000", _range(real)])
        for ratio, row in summary["ratios"].items():
            body.append(
                [
                    *name,
                    ratio,
                    _range(row["hidden_fraction"]),
                    _range(row["hidden_of_own_compute"]),
                    _range(row["none_s"], compute),
                    _range(row["chunked_s"], compute),
                ]
            )
    model = data["model"]
    caption = (
        f"A training step (forward and backward, no optimizer) of {model['num_layers']} MoE layers of "
        f"{model['num_moe_experts']} experts (top-2, expert FFN {model['moe_ffn_hidden_size']}, hidden "
        f"{model['hidden_size']}), sequences of {data['seq_len']} tokens, on ep gloo ranks of one thread each (ep=4: "
        "4 ranks on 2 cores), without overlap and with "
        f"`parallel.ep_overlap chunked` ({data['chunks']} chunks), {data['reps']} interleaved pairs. Every collective "
        f"of the MoE layers waits for a modelled link of {data['latency_s'] * 1e6:.0f} us a collective and a bandwidth "
        "set so that the step without overlap communicates `comm / compute` times its computation `T_compute` (the "
        "step on the real gloo, measured first). Hidden fraction: `(T_none - T_chunked) / T_comm` of each pair; of its "
        "own compute: `1 - (T_chunked - T_chunked,real) / T_comm`, which leaves out what the chunked step computes "
        "faster (the real gloo row), from each rank's medians; steps in units of `T_compute`; the median over the "
        "ranks of each rank's median, with the lowest and highest repetition of any rank (of its own compute: the "
        f"lowest and highest rank) ({source('ep_overlap')})."
    )
    header = [
        "ep",
        "tokens a rank",
        "comm / compute",
        "hidden fraction",
        "of its own compute",
        "step, no overlap",
        "step, chunked overlap",
    ]
    return captioned(caption, header, body, ["---:", "---:", "---", "---:", "---:", "---:", "---:"])
