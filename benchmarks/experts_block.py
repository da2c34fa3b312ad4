"""MoE expert block, forward + backward: ours against HuggingFace's Qwen3-MoE block and a dense GEMM chain.

Setting (default): 2048 tokens, hidden 512, 32 experts, top-4, expert FFN 192, fp32 on CPU, the router's own
(learned, random-init) routing. Three blocks, all with the same shapes:

- ``ours``: moe_models' ``MoEBlock`` (router -> LocalDispatcher -> GroupedExperts -> combine),
  ``RouterConfig(num_experts, topk, load_balancing_type="none")`` (HF's block computes no aux loss either): the
  router probabilities applied inside the experts' activation, the first projection gathering its own rows (it saves
  the block's input, not the ``topk`` times larger permuted rows).
- ``hf``: transformers' ``Qwen3MoeSparseMoeBlock`` with ``experts_implementation="grouped_mm"`` (checked: the
  ``grouped_mm`` experts forward and ``aten::_grouped_mm`` run, the fallback op does not), ``norm_topk_prob=True``,
  and the SAME weights (copied into ours; the outputs are compared before timing).
- ``dense``: the expert GEMMs as if every row went to one expert: ``[T*K, H] @ [H, 2F]`` -> SwiGLU ->
  ``@ [F, H]`` (same GEMM FLOPs as the experts, no routing, no permutation).

Times: two head-to-head pairs (``benchmarks/_harness.py``), ours against HF and ours against dense, each interleaved
in one process and taking turns at going first; the ratio of the medians and the spread of the per-repetition
ratios. Each repetition runs forward + backward (``out.backward(grad)``, input requires grad, parameter grads reset to
None). Peak memory: each block runs in a fresh process
(with --quick: in the timing process, after the timing) with glibc's mmap threshold fixed at 64 KiB
(``MALLOC_MMAP_THRESHOLD_=65536``, ``mallopt`` with --quick): large buffers go to mmap and return to the OS when
freed, so RSS follows what is allocated. After one warm-up forward + backward the peak-RSS counter is reset
(``/proc/self/clear_refs`` = 5) and the figure is ``VmHWM - VmRSS`` across one forward + backward: the additional
resident memory at the peak (saved activations, temporaries, input and parameter gradients). Two figures:
parameter grads set to None before the pass (allocated in it; the headline ratio), and grads already allocated
(accumulated into, as with persistent grad buffers). Where the reset is refused the warm-up is skipped and
``ru_maxrss`` minus the RSS before the first pass is reported. Also reported: the bytes autograd saves for backward
per block (what accumulates over the layers of a model).

With CUDA present it also measures (bf16) the achieved TFLOPS of the grouped expert GEMMs (GroupedExperts
forward + backward) for the Qwen3-30B-A3B layer shape (hidden 2048, 128 experts, top-8, FFN 768, 32k tokens,
balanced routing) against a dense matmul of the same shape measured in the same run.

    uv run python benchmarks/experts_block.py [--quick] [--out benchmarks/results/experts_block.json] [--profile]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from _harness import cli, device_sync, head_to_head, header, parse, ratio_spread, spread, write
from _rss import reset_peak, set_mmap_threshold, status_kib  # benchmarks/_rss.py, beside this script

TARGETS = {"ours_over_hf_time": 0.77, "ours_over_dense_time": 1.2, "ours_over_hf_peak_memory": 0.7}


# ----------------------------------------------------------------------------------------------- blocks


def ours_block(block, x_TH: torch.Tensor) -> torch.Tensor:
    """Router -> dispatch -> grouped experts -> combine (probs applied in the combine), as MoEBlock.forward."""
    out, _ = block(x_TH.unsqueeze(0))
    return out.squeeze(0)


def build_hf(args: argparse.Namespace, seed: int = 0):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(
        hidden_size=args.hidden,
        moe_intermediate_size=args.ffn,
        num_experts=args.experts,
        num_experts_per_tok=args.topk,
        norm_topk_prob=True,
        hidden_act="silu",
        experts_implementation="grouped_mm",
    )
    assert config._experts_implementation == "grouped_mm"
    torch.manual_seed(seed)
    block = Qwen3MoeSparseMoeBlock(config)
    with torch.no_grad():  # HF leaves init to PreTrainedModel._init_weights: initializer_range 0.02 normals
        for p in block.parameters():
            p.normal_(std=0.02)
    return block


def build_ours(args: argparse.Namespace, hf_block=None, seed: int = 0):
    from moe_dispatch import RouterConfig
    from moe_models.layers import MoEBlock

    router = RouterConfig(num_experts=args.experts, topk=args.topk, load_balancing_type="none")
    torch.manual_seed(seed)
    block = MoEBlock(args.hidden, args.ffn, router, expert_backend="auto")
    if hf_block is not None:
        copy_hf_weights(hf_block, block)
    return block


def copy_hf_weights(hf_block, ours) -> None:
    """HF router ``gate.weight`` [E, H] = ours ``router.weight``; HF ``gate_up_proj`` [E, 2F, H] (gate rows first,
    applied as x @ W.T) = ours ``w_gate_up_EH2F`` [E, H, 2F] transposed; HF ``down_proj`` [E, H, F] = ours
    ``w_down_EFH`` [E, F, H] transposed."""
    with torch.no_grad():
        ours.router.weight.copy_(hf_block.gate.weight)
        ours.experts.w_gate_up_EH2F.copy_(hf_block.experts.gate_up_proj.transpose(1, 2))
        ours.experts.w_down_EFH.copy_(hf_block.experts.down_proj.transpose(1, 2))


class Dense(torch.nn.Module):
    """The expert GEMM chain on all T*K rows at once: one expert holding every row."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.w_gate_up = torch.nn.Parameter(torch.randn(hidden, 2 * ffn) * 0.02)
        self.w_down = torch.nn.Parameter(torch.randn(ffn, hidden) * 0.02)

    def forward(self, x_NH: torch.Tensor) -> torch.Tensor:
        gate, up = (x_NH @ self.w_gate_up).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ self.w_down


def make_variant(name: str, args: argparse.Namespace, hf_block=None):
    """(module, forward(x) -> out, input x) for one variant; ``hf_block`` supplies the shared weights."""
    gen = torch.Generator().manual_seed(1)
    if name == "dense":
        module = Dense(args.hidden, args.ffn)
        x = torch.randn(args.tokens * args.topk, args.hidden, generator=gen)
        return module, module, x
    x = torch.randn(args.tokens, args.hidden, generator=gen)
    hf_block = build_hf(args) if hf_block is None else hf_block
    if name == "hf":
        return hf_block, lambda x_TH: hf_block(x_TH.unsqueeze(0)).squeeze(0), x
    ours = build_ours(args, hf_block)
    if name == "ours":
        return ours, lambda x_TH: ours_block(ours, x_TH), x
    raise ValueError(name)


def fwd_bwd(module: torch.nn.Module, fn: Callable, x: torch.Tensor, grad: torch.Tensor) -> None:
    for p in module.parameters():
        p.grad = None
    x.grad = None
    fn(x).backward(grad)


# ----------------------------------------------------------------------------------------------- checks


def check_hf_runs_grouped_mm(hf_block, x: torch.Tensor) -> dict:
    """The HF block dispatches to transformers' grouped_mm experts forward, which calls aten::_grouped_mm (not
    transformers' fallback op): checked by counting the interface calls and by the profiler's op names."""
    from transformers.integrations import moe

    calls = {"grouped_mm_experts_forward": 0}
    original = moe.ALL_EXPERTS_FUNCTIONS["grouped_mm"]
    assert original is moe.grouped_mm_experts_forward

    def counting(*a, **k):
        calls["grouped_mm_experts_forward"] += 1
        return original(*a, **k)

    moe.ALL_EXPERTS_FUNCTIONS["grouped_mm"] = counting  # local mapping of this interface instance
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            hf_block(x.unsqueeze(0)).sum().backward()
    finally:
        del moe.ALL_EXPERTS_FUNCTIONS["grouped_mm"]
    assert moe.ALL_EXPERTS_FUNCTIONS["grouped_mm"] is original
    names = {e.key for e in prof.key_averages()}
    grouped = sorted(n for n in names if "grouped_mm" in n)
    assert calls["grouped_mm_experts_forward"] == 1, calls
    assert "aten::_grouped_mm" in names, grouped
    assert not any("fallback" in n for n in grouped), grouped
    for p in hf_block.parameters():
        p.grad = None
    return {"experts_forward_calls": calls["grouped_mm_experts_forward"], "grouped_mm_ops_seen": grouped}


def check_same_outputs(args: argparse.Namespace, hf_block, variants: dict) -> dict:
    """Forward outputs and input gradients of every MoE variant equal HF's (fp32, rtol 1e-4)."""
    x = variants["hf"][2].clone().requires_grad_()
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))
    ref = variants["hf"][1](x)
    ref.backward(grad)
    ref_grad = x.grad.clone()
    max_err = {}
    for name, (_, fn, _) in variants.items():
        if name in ("hf", "dense"):
            continue
        x.grad = None
        out = fn(x)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-6)
        out.backward(grad)
        torch.testing.assert_close(x.grad, ref_grad, rtol=1e-4, atol=1e-6)
        max_err[name] = {"out": (out - ref).abs().max().item(), "grad_x": (x.grad - ref_grad).abs().max().item()}
    for module, _, _ in variants.values():
        for p in module.parameters():
            p.grad = None
    return max_err


# ----------------------------------------------------------------------------------------------- memory


def _one_pass_peak_kib(module, fn, x, grad, keep_grads: bool) -> tuple[int, int]:
    if not keep_grads:
        for p in module.parameters():
            p.grad = None
    x.grad = None
    gc.collect()
    reset_peak()
    before = status_kib("VmRSS")
    if keep_grads:  # gradients accumulate into buffers that already exist, as with persistent grad buffers
        fn(x).backward(grad)
    else:
        fwd_bwd(module, fn, x, grad)
    return status_kib("VmHWM") - before, before


def measure_memory_child(names: list[str], args: argparse.Namespace) -> dict:
    """Runs in a fresh process: the additional resident memory at the peak of one forward + backward of each
    variant in ``names`` (one per process except in --quick)."""
    torch.set_num_threads(args.threads)
    results = {}
    for name in names:
        module, fn, x = make_variant(name, args)
        x.requires_grad_()
        grad = torch.randn(fn(x).shape)
        if not reset_peak():  # no VmHWM reset here: first pass, no warm-up, ru_maxrss
            for p in module.parameters():
                p.grad = None
            before = status_kib("VmRSS")
            fwd_bwd(module, fn, x, grad)
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            results[name] = {
                "peak_increase_MiB": (peak - before) / 1024,
                "method": "ru_maxrss - VmRSS over the first fwd+bwd (no warm-up), MALLOC_MMAP_THRESHOLD_=65536",
            }
            continue
        fwd_bwd(module, fn, x, grad)  # warm-up: lazy initialisations, libraries, thread pools
        fresh, before = _one_pass_peak_kib(module, fn, x, grad, keep_grads=False)
        fwd_bwd(module, fn, x, grad)  # parameter gradients now exist
        kept, _ = _one_pass_peak_kib(module, fn, x, grad, keep_grads=True)
        results[name] = {
            "peak_increase_MiB": fresh / 1024,
            "peak_increase_grads_preallocated_MiB": kept / 1024,
            "rss_before_MiB": before / 1024,
            "method": "VmHWM - VmRSS over one fwd+bwd after a warm-up (VmHWM reset by clear_refs=5), "
            "MALLOC_MMAP_THRESHOLD_=65536; peak_increase_MiB: parameter grads set to None before the pass "
            "(allocated inside it); peak_increase_grads_preallocated_MiB: grads already allocated, accumulated into",
        }
        del module, fn, x, grad
        gc.collect()
    return results


def measure_memory(names: list[str], args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--memory-child", ",".join(names), "--threads", str(args.threads)]
    for key in ("tokens", "hidden", "experts", "topk", "ffn"):
        cmd += [f"--{key}", str(getattr(args, key))]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def saved_activation_bytes(module: torch.nn.Module, fn: Callable, x: torch.Tensor) -> dict:
    """Bytes autograd keeps from this block's forward for its backward (distinct storages, parameters and the
    input left out): what accumulates over the layers of a full model before the backward starts."""
    skip = {p.untyped_storage().data_ptr() for p in module.parameters()} | {x.untyped_storage().data_ptr()}
    saved: dict[int, tuple[int, list[int]]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip and storage.nbytes():
            saved[storage.data_ptr()] = (storage.nbytes(), list(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(x)
    del out
    big = sorted(saved.values(), key=lambda v: -v[0])
    return {"MiB": sum(v[0] for v in big) / 2**20, "largest": [{"MiB": b / 2**20, "shape": s} for b, s in big[:8]]}


# ----------------------------------------------------------------------------------------------- profile


def profile(variants: dict, names: list[str], rows: int = 18) -> dict:
    """torch.profiler (CPU, memory) tables of one forward + backward per variant."""
    tables = {}
    for name in names:
        module, fn, x = variants[name]
        x = x.clone().requires_grad_()
        grad = torch.randn(fn(x).shape)
        fwd_bwd(module, fn, x, grad)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            fwd_bwd(module, fn, x, grad)
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)
        print(f"--- {name}\n{table}")
        tables[name] = table
    return tables


# ----------------------------------------------------------------------------------------------- CUDA TFLOPS


QWEN3_30B_A3B_LAYER = {"hidden": 2048, "experts": 128, "topk": 8, "ffn": 768, "tokens": 32768}


def grouped_gemm_tflops(
    shape: dict | None = None, device: str = "cuda", dtype: torch.dtype = torch.bfloat16, reps: int = 10
) -> dict:
    """Achieved TFLOPS of our grouped expert GEMMs against dense matmuls of the same shapes, in one run.

    Balanced routing (every expert gets N / E rows, N = tokens x top-k). Measured: (1) the up-projection GEMM
    alone, forward: our back end's grouped GEMM ``[N, H] x [E, H, 2F]`` vs one ``[N, H] @ [H, 2F]``; (2) the
    whole GroupedExperts forward + backward (two grouped GEMMs, SwiGLU) vs the same dense chain. FLOPs:
    ``2 N H 2F`` for (1); ``3 x (2 N H 2F + 2 N F H)`` for (2) (forward + the two backward GEMMs of each).
    Defaults: the Qwen3-30B-A3B layer in bf16 on CUDA (called by main only when CUDA is present); any
    device/dtype/shape works (a tiny fp32 CPU shape serves as a smoke test).
    """
    from moe_experts import GroupedExperts

    shape = QWEN3_30B_A3B_LAYER if shape is None else shape
    hidden, experts, topk, ffn, tokens = (shape[k] for k in ("hidden", "experts", "topk", "ffn", "tokens"))
    rows = tokens * topk
    dev = torch.device(device)
    module = GroupedExperts(experts, hidden, ffn, backend="auto").to(dev, dtype)
    counts = torch.full((experts,), rows // experts, dtype=torch.int64, device=dev)
    rows = int(counts.sum())
    x = torch.randn(rows, hidden, device=dev, dtype=dtype, requires_grad=True)
    grad = torch.randn(rows, hidden, device=dev, dtype=dtype)
    w1 = (torch.randn(hidden, 2 * ffn, device=dev, dtype=dtype) * 0.02).requires_grad_()
    w2 = (torch.randn(ffn, hidden, device=dev, dtype=dtype) * 0.02).requires_grad_()
    gmm = module._backend(x.dtype).gmm
    w_gate_up = module.w_gate_up_EH2F.detach()

    def grouped_gemm():
        with torch.no_grad():
            gmm(x, w_gate_up, counts)

    def dense_gemm():
        with torch.no_grad():
            x @ w1

    def grouped_experts():
        x.grad = None
        module(x, counts).backward(grad)

    def dense_chain():
        x.grad = None
        gate, up = (x @ w1).chunk(2, dim=-1)
        ((F.silu(gate) * up) @ w2).backward(grad)

    flops_up = 2 * rows * hidden * 2 * ffn
    flops_fwd_bwd = 3 * (flops_up + 2 * rows * ffn * hidden)
    fns = {
        "grouped_gemm_up_fwd": (grouped_gemm, flops_up),
        "dense_gemm_up_fwd": (dense_gemm, flops_up),
        "grouped_experts_fwd_bwd": (grouped_experts, flops_fwd_bwd),
        "dense_chain_fwd_bwd": (dense_chain, flops_fwd_bwd),
    }
    times = {}
    for a, b in (("grouped_gemm_up_fwd", "dense_gemm_up_fwd"), ("grouped_experts_fwd_bwd", "dense_chain_fwd_bwd")):
        times[a], times[b] = head_to_head(fns[a][0], fns[b][0], reps, 3, device_sync(dev))  # grouped vs dense
    results: dict = {"shape": dict(shape), "dtype": str(dtype).removeprefix("torch."), "backend": module.backend.name}
    results["device"] = torch.cuda.get_device_name(dev) if dev.type == "cuda" else device
    for name, (_, flops) in fns.items():
        med = statistics.median(times[name])
        results[name] = {"median_s": med, "all_s": times[name], "TFLOPS": flops / med / 1e12}
    results["grouped_over_dense_gemm_TFLOPS"] = (
        results["grouped_gemm_up_fwd"]["TFLOPS"] / results["dense_gemm_up_fwd"]["TFLOPS"]
    )
    results["grouped_over_dense_fwd_bwd_TFLOPS"] = (
        results["grouped_experts_fwd_bwd"]["TFLOPS"] / results["dense_chain_fwd_bwd"]["TFLOPS"]
    )
    return results


# ----------------------------------------------------------------------------------------------- main


def main() -> None:
    parser = cli("experts_block", __doc__, "small shapes, few repetitions (CI, under ~20 s)")
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--experts", type=int, default=None)
    parser.add_argument("--topk", type=int, default=None)
    parser.add_argument("--ffn", type=int, default=None)
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    parser.add_argument("--profile", action="store_true", help="print torch.profiler tables of ours and HF")
    parser.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    args = parse(parser)
    args.tokens = args.tokens or (256 if args.quick else 2048)
    args.hidden = args.hidden or (128 if args.quick else 512)
    args.experts = args.experts or (8 if args.quick else 32)
    args.topk = args.topk or (2 if args.quick else 4)
    args.ffn = args.ffn or (64 if args.quick else 192)
    args.reps = args.reps or (5 if args.quick else 15)

    if args.memory_child:
        print(json.dumps(measure_memory_child(args.memory_child.split(","), args)))
        return
    torch.set_num_threads(args.threads)
    if args.quick and not args.no_memory:
        set_mmap_threshold()

    names = ["ours", "hf", "dense"]
    hf_block = build_hf(args)
    variants = {name: make_variant(name, args, hf_block) for name in names}
    grouped_mm_check = check_hf_runs_grouped_mm(hf_block, variants["hf"][2])
    max_err = check_same_outputs(args, hf_block, variants)

    saved = {name: saved_activation_bytes(m, fn, x.clone().requires_grad_()) for name, (m, fn, x) in variants.items()}

    inputs, grads = {}, {}
    for name, (_, _, x) in variants.items():
        inputs[name] = x.clone().requires_grad_()
        grads[name] = torch.randn(x.shape, generator=torch.Generator().manual_seed(3))
    runs = {name: (lambda n=name: fwd_bwd(variants[n][0], variants[n][1], inputs[n], grads[n])) for name in names}
    pairs = {}  # (ours, baseline) head to head, two at a time
    for baseline in ("hf", "dense"):
        ours_s, base_s = head_to_head(runs["ours"], runs[baseline], args.reps, args.warmup)
        pairs[baseline] = {
            "ours": spread(ours_s),
            baseline: spread(base_s),
            "ours_over_baseline": statistics.median(ours_s) / statistics.median(base_s),
            "per_repetition_ratio": ratio_spread(ours_s, base_s),
        }
    ratios = {
        "ours_over_hf_time": pairs["hf"]["ours_over_baseline"],
        "ours_over_hf_time_spread": pairs["hf"]["per_repetition_ratio"],
        "hf_over_ours_time": 1 / pairs["hf"]["ours_over_baseline"],
        "ours_over_dense_time": pairs["dense"]["ours_over_baseline"],
        "ours_over_dense_time_spread": pairs["dense"]["per_repetition_ratio"],
    }

    memory = {}
    if not args.no_memory:
        if args.quick:  # in this process: a child would re-import torch and transformers (~7 s); CI smoke only
            memory = measure_memory_child(names, args)
        else:
            for name in names:
                memory.update(measure_memory([name], args))
        ratios["ours_over_hf_peak_memory"] = memory["ours"]["peak_increase_MiB"] / memory["hf"]["peak_increase_MiB"]
        if "peak_increase_grads_preallocated_MiB" in memory["ours"]:
            ratios["ours_over_hf_peak_memory_grads_preallocated"] = (
                memory["ours"]["peak_increase_grads_preallocated_MiB"]
                / memory["hf"]["peak_increase_grads_preallocated_MiB"]
            )
    ratios["ours_over_hf_saved_activations"] = saved["ours"]["MiB"] / saved["hf"]["MiB"]
    met = {key: ratios[key] <= target for key, target in TARGETS.items() if key in ratios}

    import transformers

    report = {
        "what": "MoE expert block forward + backward: ours (router -> dispatch -> grouped experts -> combine) vs "
        "HuggingFace Qwen3MoeSparseMoeBlock (experts_implementation=grouped_mm, same weights) vs a dense GEMM chain "
        "with the same expert FLOPs",
        "inputs": {
            "tokens": args.tokens,
            "hidden": args.hidden,
            "num_experts": args.experts,
            "topk": args.topk,
            "ffn": args.ffn,
            "dtype": "float32",
            "routing": "each block's router (same random-init weights), softmax top-k renormalised",
            "reps": args.reps,
            "warmup": args.warmup,
        },
        "expert_backend_ours": variants["ours"][0].experts.backend.name,
        "hf_grouped_mm_check": grouped_mm_check,
        "max_abs_err_vs_hf": max_err,
        "times_s_head_to_head": pairs,
        "ratios": ratios,
        "memory": memory,
        "saved_activations": saved,
        "saved_activations_method": "distinct storages autograd saves in one forward (saved_tensors_hooks), "
        "parameters and the block input excluded",
        "memory_method": next(iter(memory.values()))["method"] if memory else None,
        "memory_processes": "one fresh process per variant"
        if not args.quick
        else "one fresh process, variants in turn",
        "targets": TARGETS,
        "targets_met": met,
        "device": "cpu",
        "cpu_threads": args.threads,
        "transformers": transformers.__version__,
    }
    report = header(args, **report)
    if args.profile:
        report["profile"] = profile(variants, [n for n in names if n != "dense"])
    if torch.cuda.is_available():
        # --quick (CI): the same layer with 4096 tokens
        shape = dict(QWEN3_30B_A3B_LAYER, tokens=4096) if args.quick else None
        report["cuda_qwen3_30b_a3b_grouped_gemm"] = grouped_gemm_tflops(shape)
    for baseline, pair in pairs.items():
        print(f"ours {pair['ours']['median'] * 1e3:8.2f} ms vs {baseline} {pair[baseline]['median'] * 1e3:8.2f} ms")
    for name, mem in memory.items():
        print(f"{name:8s} peak +{mem['peak_increase_MiB']:.1f} MiB")
    for key, value in ratios.items():
        print(f"{key:40s} {value}")
    print(f"targets met: {met}")
    write(args.out, report)


if __name__ == "__main__":
    main()
