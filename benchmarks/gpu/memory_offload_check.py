"""GPU check of recompute and offload by module kind (prepared for a task that is lent a GPU; not yet run).

On CUDA the offload path uses pinned host buffers, copies on a side stream and prefetches the previous layer in the
backward, none of which CPU tests reach. This script checks, on one device, for a Qwen3-MoE-shaped model in bf16
autocast: gradients equal the plain run's bit for bit (the copies are exact, recompute runs the same kernels), the
peak allocated memory of a forward + backward drops, and the step time each variant costs (interleaved with the
plain run, median of 7). Run from the repository root with the packages on PYTHONPATH::

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python benchmarks/gpu/memory_offload_check.py --out $OUT
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import statistics
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


def step(model: torch.nn.Module, ids: torch.Tensor) -> tuple[float, int, float]:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = model(ids[:, :-1])
    loss = causal_lm_loss(out, ids[:, 1:], 0.0).total
    loss.backward()
    end.record()
    torch.cuda.synchronize()
    return loss.item(), torch.cuda.max_memory_allocated() - base, start.elapsed_time(end)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("benchmarks/gpu"))
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    config = preset(
        "tiny-qwen3-moe",
        hidden_size=2048,
        num_layers=4,
        num_attention_heads=16,
        num_query_groups=4,
        kv_channels=128,
        num_moe_experts=16,
        moe_ffn_hidden_size=768,
        moe_router_topk=4,
        vocab_size=32000,
    )
    with torch.device("cuda"):
        plain = build_model(config, seed=1)
    ids = torch.randint(0, config.vocab_size, (4, 4097), device="cuda")
    results = {"date": datetime.date.today().isoformat(), "card": torch.cuda.get_device_name(), "variants": {}}
    for name, (recompute, offload) in VARIANTS.items():
        ours = copy.deepcopy(plain)
        policy = apply_memory_policy(ours, ours.module_kinds(), recompute, offload, offload_min_tensor_bytes=1 << 20)
        ratios, peaks = [], []
        for rep in range(args.reps + 1):
            for m in (plain, ours):
                m.zero_grad(set_to_none=True)
            loss_p, peak_p, ms_p = step(plain, ids)
            loss_o, peak_o, ms_o = step(ours, ids)
            if rep == 0:  # warm-up; and the gradients of one step, compared
                grads_p = dict(plain.named_parameters())
                diff = max(
                    ((p.grad - grads_p[n].grad).abs().max() / grads_p[n].grad.abs().max().clamp_min(1e-30)).item()
                    for n, p in ours.named_parameters()
                    if p.grad is not None
                )
                continue
            ratios.append(ms_o / ms_p)
            peaks.append((peak_p, peak_o))
        results["variants"][name] = {
            "loss_equal": loss_p == loss_o,
            "max_grad_rel_diff": diff,
            "peak_bytes_plain": peaks[-1][0],
            "peak_bytes": peaks[-1][1],
            "step_time_ratio_median": statistics.median(ratios),
            "step_time_ratio_spread": [min(ratios), max(ratios)],
            "offloaded_bytes_per_step": policy.stats.offloaded_bytes // (args.reps + 1),
        }
        print(name, json.dumps(results["variants"][name]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"memory_offload_{results['date']}_{results['card'].replace(' ', '_')}.json"
    path.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
