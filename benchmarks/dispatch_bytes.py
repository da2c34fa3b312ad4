"""Bytes each expert-parallel dispatcher sends per token, against the minimum (once per distinct remote rank).

Setting (default): ep=4, 64 experts (16 a rank), top-k=8, hidden 1024, bf16 (2 bytes), uniform random
routing (each token K distinct experts), 4096 tokens on each of the 4 ranks, several seeds. Bytes are a
function of the routing, computed with the accounting functions the dispatchers use
(:mod:`moe_dispatch.accounting`); the all-to-all figure is also read off the layout the
:class:`~moe_dispatch.alltoall.AllToAllDispatcher` actually builds (its send map) and checked equal, and
the mean is checked against the closed form for uniform routing. Dispatch payload only: combine sends
the same rows back (of the expert output width), and routing metadata is left out.

FP8 dispatch (``precision.dispatch_fp8``): the same rows in moe-precision's blockwise FP8 wire format (E4M3, one fp32
scale per 1x128 block) against bf16, for this hidden size and DeepSeek-V3's 7168, and the error that costs: the
dispatched tokens and a SwiGLU expert's output on them, against the bf16 tokens (hidden-state-like tokens: normal
values with a few outlier channels), over several seeds.

    uv run python benchmarks/dispatch_bytes.py [--quick] [--out benchmarks/results/dispatch_bytes.json]
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch
from _harness import cli, header, parse, write  # benchmarks/_harness.py, beside this script

from moe_dispatch.accounting import SCHEMES, bytes_sent
from moe_dispatch.alltoall import send_map
from moe_precision import BlockwiseFP8Wire


def uniform_routing(num_tokens: int, num_experts: int, topk: int, gen: torch.Generator) -> torch.Tensor:
    return torch.rand(num_tokens, num_experts, generator=gen).topk(topk, dim=-1).indices


def expected_remote_ranks(num_experts: int, topk: int, ep: int) -> float:
    """Mean distinct remote ranks a token reaches under uniform top-k routing: (ep-1) * P(rank hit)."""
    per_rank = num_experts // ep
    miss = math.comb(num_experts - per_rank, topk) / math.comb(num_experts, topk)
    return (ep - 1) * (1 - miss)


def measure(args: argparse.Namespace, seed: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(seed)
    totals = dict.fromkeys(SCHEMES, 0)
    layout_rows = 0
    for rank in range(args.ep):
        idx = uniform_routing(args.tokens, args.experts, args.topk, gen)
        for scheme in SCHEMES:
            totals[scheme] += bytes_sent(scheme, idx, None, args.experts, args.ep, rank, args.hidden, args.element_size)
        smap, _, _ = send_map(idx, None, args.experts, args.ep)  # what AllToAllDispatcher sends
        layout_rows += int(smap.tokens_per_expert_E.sum() - smap.tokens_per_expert_E[rank])
    layout_bytes = layout_rows * args.hidden * args.element_size
    assert layout_bytes == totals["alltoall_dedup"], (layout_bytes, totals["alltoall_dedup"])
    num_tokens = args.tokens * args.ep
    return {scheme: total / num_tokens for scheme, total in totals.items()}


def fp8_wire(args: argparse.Namespace, summary: dict) -> dict:
    """Bytes of the FP8 wire against bf16, and the error of the tokens and of an expert's output it causes."""
    wire = BlockwiseFP8Wire()
    ratios = {str(h): wire.row_bytes(h) / (2 * h) for h in (args.hidden, 7168)}
    token_err, expert_err = [], []
    for seed in range(args.seeds):
        gen = torch.Generator().manual_seed(100 + seed)
        x = torch.randn(args.tokens, args.hidden, generator=gen)
        x[:, torch.randint(0, args.hidden, (8,), generator=gen)] *= 20.0  # outlier channels, as hidden states have
        x_bf16 = x.to(torch.bfloat16)
        sent = wire.decode(wire.encode(x_bf16), torch.bfloat16).float()
        ffn = 2 * args.hidden
        w_gate, w_up = (torch.randn(args.hidden, ffn, generator=gen) / args.hidden**0.5 for _ in range(2))
        w_down = torch.randn(ffn, args.hidden, generator=gen) / ffn**0.5

        def expert(t: torch.Tensor, w_gate=w_gate, w_up=w_up, w_down=w_down) -> torch.Tensor:
            return (torch.nn.functional.silu(t @ w_gate) * (t @ w_up)) @ w_down

        ref = x_bf16.float()
        token_err.append(((sent - ref).norm() / ref.norm()).item())
        expert_err.append(((expert(sent) - expert(ref)).norm() / expert(ref).norm()).item())
    dedup = summary["alltoall_dedup"]["bytes_per_token"]
    return {
        "format": "E4M3 tokens, one fp32 scale per 1x128 block (moe_precision.BlockwiseFP8Wire)",
        "bytes_ratio_to_bf16": ratios,
        "alltoall_dedup_bytes_per_token": {"bf16": dedup, "fp8": dedup * ratios[str(args.hidden)]},
        "target_ratio": 0.53,
        "token_rel_error": {"median": statistics.median(token_err), "spread": [min(token_err), max(token_err)]},
        "expert_output_rel_error": {
            "median": statistics.median(expert_err),
            "spread": [min(expert_err), max(expert_err)],
        },
    }


def main() -> None:
    parser = cli("dispatch_bytes", __doc__, "fewer tokens and seeds (CI)")
    parser.add_argument("--ep", type=int, default=4)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--element-size", type=int, default=2, help="bytes per element (bf16: 2)")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per rank")
    parser.add_argument("--seeds", type=int, default=None)
    args = parse(parser)
    args.tokens = args.tokens or (512 if args.quick else 4096)
    args.seeds = args.seeds or (2 if args.quick else 5)

    runs = [measure(args, seed) for seed in range(args.seeds)]
    minimum = "alltoall_dedup"  # one row per distinct remote rank: the least any dispatcher can send
    row_bytes = args.hidden * args.element_size
    expected_min = expected_remote_ranks(args.experts, args.topk, args.ep) * row_bytes
    mean_min = statistics.fmean(run[minimum] for run in runs)
    assert abs(mean_min - expected_min) / expected_min < 0.02, (mean_min, expected_min)

    summary = {}
    for scheme in SCHEMES:
        ratios = [run[scheme] / run[minimum] for run in runs]
        summary[scheme] = {
            "bytes_per_token": statistics.fmean(run[scheme] for run in runs),
            "rows_per_token": statistics.fmean(run[scheme] for run in runs) / row_bytes,
            "ratio_to_minimum": statistics.fmean(ratios),
            "ratio_spread": [min(ratios), max(ratios)],
        }
    report = header(
        args,
        what="dispatch payload bytes sent to other ep ranks per token; minimum = once per distinct remote rank",
        baseline=minimum,
    )
    report |= {
        "inputs": {
            "ep": args.ep,
            "num_experts": args.experts,
            "topk": args.topk,
            "hidden": args.hidden,
            "element_size": args.element_size,
            "dtype": "bf16" if args.element_size == 2 else f"{args.element_size}-byte",
            "tokens_per_rank": args.tokens,
            "seeds": args.seeds,
            "routing": "uniform random top-k (distinct experts)",
        },
        "expected_minimum_bytes_per_token": expected_min,
        "results": summary,
        "fp8_dispatch": fp8_wire(args, summary),
        "device": "cpu (bytes are computed from the routing, not timed)",
    }
    for scheme, row in summary.items():
        print(
            f"{scheme:15s} {row['bytes_per_token']:10.1f} B/token  {row['rows_per_token']:5.3f} rows/token  "
            f"x{row['ratio_to_minimum']:.3f} of minimum"
        )
    fp8 = report["fp8_dispatch"]
    print(
        f"fp8 dispatch: x{fp8['bytes_ratio_to_bf16'][str(args.hidden)]:.4f} of bf16 bytes (hidden {args.hidden}), "
        f"x{fp8['bytes_ratio_to_bf16']['7168']:.4f} (7168); token error {fp8['token_rel_error']['median']:.4f}, "
        f"expert output error {fp8['expert_output_rel_error']['median']:.4f}"
    )
    write(args.out, report)


if __name__ == "__main__":
    main()
