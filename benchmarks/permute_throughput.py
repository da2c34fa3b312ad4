"""Throughput of permute + unpermute (forward) against a plain memory copy of the same number of bytes.

Setting (default): 4096 tokens, hidden 1024, 32 experts, top-k 4, uniform random routing (distinct experts per
token), no dropping or padding, fp32 on CPU (the plain-torch path). With CUDA present the triton path (and the
torch path) are also timed on the GPU, in bf16. The permutation map is built once, outside the timing.

Bytes counted for one permute + unpermute, with N = T * K rows of H elements:
permute reads N rows and writes N rows, unpermute reads N rows and writes T rows: (3 N + T) H elements. The
baseline is ``dst.copy_(src)`` of a tensor of (3 N + T) H / 2 elements (the same bytes read + written). The pair runs
head to head in one process, interleaved (and again against an allocating ``clone``); the ratio is
(permute+unpermute bytes/s) / (copy bytes/s) = median copy time / median permute+unpermute time (1.0: as fast as a
copy of the same bytes).

    uv run python benchmarks/permute_throughput.py [--quick] [--out benchmarks/results/permute_throughput.json]
"""

from __future__ import annotations

import argparse
import statistics

import torch
from _harness import cli, device_sync, head_to_head, header, parse, write  # benchmarks/_harness.py, beside this script

from moe_dispatch.permutation import make_permutation_map, permute, triton_available, unpermute


def measure(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, backend: str) -> dict:
    gen = torch.Generator().manual_seed(0)
    tokens, hidden, experts, topk = args.tokens, args.hidden, args.experts, args.topk
    idx = torch.rand(tokens, experts, generator=gen).topk(topk, dim=-1).indices.to(device)
    pmap = make_permutation_map(idx, experts)
    x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
    probs = torch.rand(tokens, topk, generator=gen).to(device, dtype)
    rows = pmap.num_rows
    elements = (3 * rows + tokens) * hidden
    src = torch.randn(elements // 2, generator=gen).to(device, dtype)
    dst = torch.empty_like(src)
    moved_bytes = elements * x.element_size()

    def permute_unpermute():
        with torch.no_grad():
            return unpermute(permute(x, pmap, backend=backend), pmap, probs, backend=backend)

    def copy():
        dst.copy_(src)

    def clone():  # a copy that, like permute and unpermute, allocates its output
        return src.clone()

    # the work is what it claims to be: unpermute(permute(x)) = sum_k probs * x
    expected = probs.float().sum(1, keepdim=True) * x.float()
    torch.testing.assert_close(permute_unpermute().float(), expected, rtol=2e-2, atol=2e-2)
    # each baseline head to head with permute + unpermute (a rotation through all three would change what each costs)
    sync = device_sync(device)
    perm_times, copy_times = head_to_head(permute_unpermute, copy, args.reps, args.warmup, sync)
    perm_vs_clone_times, clone_times = head_to_head(permute_unpermute, clone, args.reps, args.warmup, sync)
    ratios = [c / p for c, p in zip(copy_times, perm_times, strict=True)]
    perm_s, copy_s = statistics.median(perm_times), statistics.median(copy_times)
    clone_s = statistics.median(clone_times)
    return {
        "backend": backend,
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        "dtype": str(dtype).removeprefix("torch."),
        "rows": rows,
        "bytes_moved": moved_bytes,
        "permute_unpermute_s": {"median": perm_s, "all": perm_times},
        "copy_s": {"median": copy_s, "all": copy_times},
        "permute_unpermute_GBps": moved_bytes / perm_s / 1e9,
        "copy_GBps": moved_bytes / copy_s / 1e9,
        "ratio": copy_s / perm_s,
        "ratio_spread": [min(ratios), max(ratios)],
        # fresh CPU allocations are paid in page faults, which the in-place copy never sees
        "allocating_copy_s": {"median": clone_s, "all": clone_times},
        "ratio_vs_allocating_copy": clone_s / statistics.median(perm_vs_clone_times),
    }


def main() -> None:
    parser = cli("permute_throughput", __doc__, "small shapes, few repetitions (CI)")
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--experts", type=int, default=None)
    parser.add_argument("--topk", type=int, default=None)
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=2)
    args = parse(parser)
    args.tokens = args.tokens or (512 if args.quick else 4096)
    args.hidden = args.hidden or (256 if args.quick else 1024)
    args.experts = args.experts or (8 if args.quick else 32)
    args.topk = args.topk or (2 if args.quick else 4)
    args.reps = args.reps or 9

    results = [measure(args, torch.device("cpu"), torch.float32, "torch")]
    if torch.cuda.is_available():
        cuda = torch.device("cuda")
        results.append(measure(args, cuda, torch.bfloat16, "torch"))
        if triton_available():
            results.append(measure(args, cuda, torch.bfloat16, "triton"))

    report = {
        "what": "permute + unpermute forward (map built once) vs dst.copy_(src) of the same bytes read + written, "
        "and vs src.clone() (a copy that allocates its output, as permute and unpermute do)",
        "baseline": "memory copy",
        "bytes_model": "(3 * rows + tokens) * hidden elements: permute reads+writes rows, unpermute reads rows "
        "and writes tokens (probs and index reads left out)",
        "inputs": {
            "tokens": args.tokens,
            "hidden": args.hidden,
            "num_experts": args.experts,
            "topk": args.topk,
            "routing": "uniform random top-k (distinct experts), no dropping, no padding",
            "reps": args.reps,
            "warmup": args.warmup,
        },
        "results": results,
        "cpu_threads": torch.get_num_threads(),
    }
    for row in results:
        print(
            f"{row['backend']:6s} {row['device']:24s} {row['dtype']:8s} permute+unpermute "
            f"{row['permute_unpermute_GBps']:7.2f} GB/s  copy {row['copy_GBps']:7.2f} GB/s  "
            f"ratio {row['ratio']:.3f} [{row['ratio_spread'][0]:.3f}, {row['ratio_spread'][1]:.3f}]; "
            f"vs an allocating copy (clone) {row['ratio_vs_allocating_copy']:.3f}"
        )
    write(args.out, header(args, **report))


if __name__ == "__main__":
    main()
