"""GPU check of recompute and offload by module kind (the ``offload`` section of ``benchmarks/gpu/suite.py``).

On CUDA the offload path uses pinned host buffers, copies on a side stream and prefetches the previous layer in the
backward, none of which CPU tests reach. This checks, on one device, for a Qwen3-MoE-shaped model in bf16 autocast:
gradients equal the plain run's bit for bit (the copies are exact, recompute runs the same kernels), the peak
allocated memory of a forward + backward drops, and the step time each variant costs (interleaved with the plain
run, median of 7). On the CPU (``--smoke``, the suite's smoke run) the same code runs a tiny model in fp32: the
gradients are still compared, peak memory is not measured (None) and the times mean nothing.

    benchmarks/gpu/run.sh --section offload --out $OUT/offload.json     # within the suite
    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python benchmarks/gpu/memory_offload_check.py --out $OUT
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import statistics
import time
from pathlib import Path

import torch

from moe_memory import apply_memory_policy
from moe_models import build_model, causal_lm_loss
from moe_models.presets import preset

VARIANTS = {
    "recompute moe_act,layernorm": (["moe_act", "layernorm"], []),
    "Megatron's offload set": (["layernorm", "moe_act"], ["core_attn", "attn_proj", "expert_fc1"]),
    "offload every kind": ([], ["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1"]),
}
# a Qwen3-MoE-shaped model: full hidden width, fewer experts (the point is the activations, not the expert GEMMs)
FULL = {
    "config": {
        "hidden_size": 2048,
        "num_layers": 4,
        "num_attention_heads": 16,
        "num_query_groups": 4,
        "kv_channels": 128,
        "num_moe_experts": 16,
        "moe_ffn_hidden_size": 768,
        "moe_router_topk": 4,
        "vocab_size": 32000,
    },
    "batch": 4,
    "seq": 4096,
    "min_bytes": 1 << 20,
}
SMOKE = {"config": {"num_layers": 2}, "batch": 2, "seq": 32, "min_bytes": 0}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step(model: torch.nn.Module, ids: torch.Tensor, dtype: torch.dtype) -> tuple[float, int | None, float]:
    """One forward + backward: the loss, the peak allocated bytes above what was allocated before (None off CUDA)
    and the seconds."""
    device = ids.device
    cuda = device.type == "cuda"
    _sync(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if cuda else 0
    autocast = torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()
    start = time.perf_counter()
    with autocast:
        out = model(ids[:, :-1])
    loss = causal_lm_loss(out, ids[:, 1:], 0.0).total
    loss.backward()
    _sync(device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) - base if cuda else None
    return loss.item(), peak, seconds


def offload_check(device: torch.device, dtype: torch.dtype, reps: int, smoke: bool) -> dict:
    """Each variant of :data:`VARIANTS` against the plain model: gradient difference, peak memory, time ratio."""
    sizes = SMOKE if smoke else FULL
    config = preset("tiny-qwen3-moe", **sizes["config"])
    with torch.device(device):
        plain = build_model(config, seed=1)
    ids = torch.randint(0, config.vocab_size, (sizes["batch"], sizes["seq"] + 1), device=device)
    results: dict = {"batch": sizes["batch"], "seq": sizes["seq"], "reps": reps, "variants": {}}
    for name, (recompute, offload) in VARIANTS.items():
        ours = copy.deepcopy(plain)
        policy = apply_memory_policy(
            ours, ours.module_kinds(), recompute, offload, offload_min_tensor_bytes=sizes["min_bytes"]
        )
        ratios, peaks, diff, equal = [], [], float("nan"), False
        for rep in range(reps + 1):
            for m in (plain, ours):
                m.zero_grad(set_to_none=True)
            first = rep % 2 == 0  # taking turns at going first
            (loss_p, peak_p, s_p), (loss_o, peak_o, s_o) = (
                (step(plain, ids, dtype), step(ours, ids, dtype))
                if first
                else reversed((step(ours, ids, dtype), step(plain, ids, dtype)))
            )
            if rep == 0:  # warm-up; and the gradients of one step, compared
                grads_p = dict(plain.named_parameters())
                diff = max(
                    ((p.grad - grads_p[n].grad).abs().max() / grads_p[n].grad.abs().max().clamp_min(1e-30)).item()
                    for n, p in ours.named_parameters()
                    if p.grad is not None
                )
                equal = loss_p == loss_o
                continue
            ratios.append(s_o / s_p)
            peaks.append((peak_p, peak_o))
        results["variants"][name] = {
            "loss_equal": equal,
            "max_grad_rel_diff": diff,
            "peak_bytes_plain": peaks[-1][0],
            "peak_bytes": peaks[-1][1],
            "step_time_ratio_median": statistics.median(ratios),
            "step_time_ratio_spread": [min(ratios), max(ratios)],
            "offloaded_bytes_per_step": policy.stats.offloaded_bytes // (reps + 1),
        }
        print(name, json.dumps(results["variants"][name]), flush=True)
        del ours, policy
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("benchmarks/gpu"))
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    results = {
        "date": datetime.date.today().isoformat(),
        "card": torch.cuda.get_device_name(),
        **offload_check(torch.device("cuda"), torch.bfloat16, args.reps, smoke=False),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"memory_offload_{results['date']}_{results['card'].replace(' ', '_')}.json"
    path.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
