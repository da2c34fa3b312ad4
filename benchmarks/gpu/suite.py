"""The GPU benchmark suite, one command writing one JSON (``benchmarks/gpu/run.sh``; prepared for a task that is
lent a GPU, run from source on torch >= 2.11 with PYTHONPATH to each package's src/):

1. ``step``: a bf16 (autocast, fp32 master parameters) training step, forward + LM loss + backward, of a
   Qwen3-30B-A3B-shaped proxy (full width: hidden 2048, 128 experts top-8, expert FFN 768, 32 heads / 4 KV heads; 4
   layers; sequence 4,096, one sequence), eager and with ``run.compile``'s regional compile: TFLOPS (Megatron's FLOP
   convention, ``moe_models.flops``) and MFU against the card's dense bf16 datasheet peak;
2. ``experts``: the experts block (``GroupedExperts``, torch's grouped_mm back end, fused weighted activation)
   against torch's ``grouped_mm`` alone doing the same three grouped GEMMs, forward + backward, TFLOPS of each;
3. ``permutation``: the Triton permute / unpermute kernels' bandwidth (bytes read + written) against a device copy
   of the same bytes;
4. ``fp8``: each recipe with a native GEMM here (per-tensor FP8 through ``torch._scaled_mm``) against the bf16 GEMM
   of the same shape, forward + backward of a linear layer, speed-up.

Every ratio is of two things timed head to head (interleaved in one process, taking turns at going first:
``benchmarks/_harness.py``), median of >= 7 repetitions after warm-up, with the range. ``--smoke`` runs the same
code paths on the CPU at tiny sizes in fp32 (CI: ``benchmarks`` nox session); its figures mean nothing.

    benchmarks/gpu/run.sh --out results.json            # on the GPU machine
    python benchmarks/gpu/suite.py --smoke --out x.json   # anywhere
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/_harness.py
from _harness import head_to_head, spread

from moe_dispatch.permutation import make_permutation_map, permute, unpermute
from moe_experts import GroupedExperts
from moe_models import build_model, causal_lm_loss
from moe_models.flops import training_flops_per_token
from moe_models.presets import preset
from moe_precision import Recipe
from moe_precision.gemm import native_recipes, quantized_matmul
from moe_train.compile import compile_decoder_layers

DATASHEET_BF16_TFLOPS = {"B200": 2250.0, "H200": 989.0, "H100": 989.0, "A100": 312.0}


@dataclasses.dataclass(frozen=True)
class Sizes:
    layers: int
    seq: int
    tokens: int  # experts / permutation rows
    hidden: int
    ffn: int
    experts: int
    topk: int
    gemm: int  # fp8 GEMM edge


FULL = Sizes(layers=4, seq=4096, tokens=16384, hidden=2048, ffn=768, experts=128, topk=8, gemm=8192)
SMOKE = Sizes(layers=2, seq=64, tokens=64, hidden=32, ffn=16, experts=4, topk=2, gemm=64)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_pair(
    a: Callable[[], object], b: Callable[[], object], device: torch.device, reps: int, warmup: int
) -> tuple[dict, dict]:
    """Median and range of ``a`` and ``b``, head to head (``benchmarks/_harness.py``)."""
    times_a, times_b = head_to_head(a, b, reps, warmup, sync=lambda: sync(device))
    return (
        {
            k.replace("median", "median_s").replace("min", "min_s").replace("max", "max_s"): v
            for k, v in spread(t).items()
        }
        for t in (times_a, times_b)
    )


def peak_tflops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in DATASHEET_BF16_TFLOPS.items() if k in name), None)


def step(sizes: Sizes, device: torch.device, dtype: torch.dtype, reps: int, warmup: int) -> dict:
    config = dataclasses.replace(preset("qwen3-30b-a3b"), num_layers=sizes.layers, moe_layer_freq=1)
    if sizes is SMOKE:
        config = dataclasses.replace(preset("tiny-qwen3-moe"), num_layers=sizes.layers)
    with torch.device(device):
        eager = build_model(config, seed=0)
        compiled = build_model(config, seed=0)
    compiled.load_state_dict(eager.state_dict())
    compile_decoder_layers(compiled)
    ids = torch.randint(0, config.vocab_size, (1, sizes.seq + 1), device=device)
    autocast = torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()

    def run(model: torch.nn.Module) -> None:
        with autocast:
            loss = causal_lm_loss(model(ids[:, :-1]), ids[:, 1:], config.mtp_loss_scaling_factor).total
        loss.backward()
        model.zero_grad(set_to_none=True)

    eager_t, compiled_t = timed_pair(lambda: run(eager), lambda: run(compiled), device, reps, warmup)
    times = {"eager": eager_t, "compiled": compiled_t}
    flops = training_flops_per_token(config, sizes.seq) * sizes.seq
    peak = peak_tflops(device)
    out: dict = {"layers": sizes.layers, "seq": sizes.seq, "flops_per_step": flops, "peak_tflops": peak}
    for key, t in times.items():
        tflops = flops / t["median_s"] / 1e12
        out[key] = {**t, "tflops": tflops, "mfu": None if peak is None else tflops / peak}
    out["compiled_speedup"] = times["eager"]["median_s"] / times["compiled"]["median_s"]
    return out


def experts(sizes: Sizes, device: torch.device, dtype: torch.dtype, reps: int, warmup: int) -> dict:
    n = sizes.tokens * sizes.topk
    block = GroupedExperts(sizes.experts, sizes.hidden, sizes.ffn, backend="torch", seed=0).to(device, dtype)
    counts = torch.full((sizes.experts,), n // sizes.experts, device=device)
    counts[0] += n - int(counts.sum())
    x = torch.randn(n, sizes.hidden, device=device, dtype=dtype, requires_grad=True)
    probs = torch.rand(n, device=device, dtype=torch.float32)
    w1 = block.w_gate_up_EH2F.detach().clone().requires_grad_(True)
    w2 = block.w_down_EFH.detach().clone().requires_grad_(True)
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    cot = torch.randn(n, sizes.hidden, device=device, dtype=dtype)  # a dense gradient (sum()'s is stride-0)

    def ours() -> None:
        block(x, counts, probs).backward(cot)

    def grouped_mm_alone() -> None:  # the same three GEMMs (gate and up as one), a plain activation
        h = F.grouped_mm(x, w1, offs=offsets)
        gate, up = h.chunk(2, dim=-1)
        F.grouped_mm((F.silu(gate) * up).contiguous(), w2, offs=offsets).backward(cot)

    block_t, alone_t = timed_pair(ours, grouped_mm_alone, device, reps, warmup)
    times = {"experts_block": block_t, "grouped_mm_alone": alone_t}
    flops = 3 * 2 * n * sizes.hidden * 3 * sizes.ffn  # forward + backward (x3) of the three projections
    return {
        "rows": n,
        **{k: {**t, "tflops": flops / t["median_s"] / 1e12} for k, t in times.items()},
        "block_over_grouped_mm": times["grouped_mm_alone"]["median_s"] / times["experts_block"]["median_s"],
    }


def permutation(sizes: Sizes, device: torch.device, dtype: torch.dtype, reps: int, warmup: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    idx = torch.stack([torch.randperm(sizes.experts, generator=gen)[: sizes.topk] for _ in range(sizes.tokens)])
    pmap = make_permutation_map(idx.to(device), sizes.experts)
    x = torch.randn(sizes.tokens, sizes.hidden, device=device, dtype=dtype)
    y = torch.randn(sizes.tokens * sizes.topk, sizes.hidden, device=device, dtype=dtype)
    probs = torch.rand(sizes.tokens, sizes.topk, device=device)
    backend = "triton" if device.type == "cuda" else "torch"
    copy_src = torch.randn(sizes.tokens * sizes.topk, sizes.hidden, device=device, dtype=dtype)
    kernels = {
        "permute": lambda: permute(x, pmap, backend=backend),
        "unpermute": lambda: unpermute(y, pmap, probs, backend=backend),
    }
    moved = 2 * sizes.tokens * sizes.topk * sizes.hidden * x.element_size()  # read + write of the rows
    out: dict = {"backend": backend, "bytes_moved": moved}
    for key, kernel in kernels.items():  # each head to head with a device copy of the same bytes
        kernel_t, copy_t = timed_pair(kernel, lambda: copy_src.clone(), device, reps, warmup)
        out[key] = {**kernel_t, "gb_per_s": moved / kernel_t["median_s"] / 1e9}
        out[f"{key}_device_copy"] = {**copy_t, "gb_per_s": moved / copy_t["median_s"] / 1e9}
        out[f"{key}_over_copy"] = copy_t["median_s"] / kernel_t["median_s"]
    return out


def fp8(sizes: Sizes, device: torch.device, dtype: torch.dtype, reps: int, warmup: int) -> dict:
    names = native_recipes(device) or (("fp8_tensorwise",) if device.type == "cpu" else ())
    native = bool(native_recipes(device))
    m = k = n = sizes.gemm
    x = torch.randn(m, k, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(n, k, device=device, dtype=dtype, requires_grad=True)
    out: dict = {"shape": [m, k, n], "native": native}

    def high_precision() -> None:
        (x @ w.t()).sum().backward()

    for name in names:  # each recipe head to head with the high-precision GEMM
        recipe = Recipe(name)
        state = recipe.new_state()

        def quantized(r: Recipe = recipe, s: object = state) -> None:
            quantized_matmul(x, w, r, state=s, native=native).sum().backward()

        recipe_t, high_t = timed_pair(quantized, high_precision, device, reps, warmup)
        out[name] = {"recipe": recipe_t, "high_precision": high_t, "speedup": high_t["median_s"] / recipe_t["median_s"]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU in fp32, the same code paths")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--only", nargs="*", default=["step", "experts", "permutation", "fp8"])
    args = parser.parse_args()
    if args.smoke:
        device, dtype, sizes, reps, warmup = torch.device("cpu"), torch.float32, SMOKE, 2, 1
    else:
        if not torch.cuda.is_available():
            raise SystemExit("benchmarks/gpu/suite.py needs a CUDA device (or --smoke)")
        device, dtype, sizes, reps, warmup = torch.device("cuda"), torch.bfloat16, FULL, max(7, args.reps), 2
    report: dict = {
        "benchmark": "gpu_suite",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke)",
        "torch": torch.__version__,
        "smoke": args.smoke,
        "sizes": dataclasses.asdict(sizes),
    }
    sections = {"step": step, "experts": experts, "permutation": permutation, "fp8": fp8}
    for name in args.only:
        start = time.perf_counter()
        report[name] = sections[name](sizes, device, dtype, reps, warmup)
        print(f"{name}: done in {time.perf_counter() - start:.1f}s", flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")  # what finished survives a later failure
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
