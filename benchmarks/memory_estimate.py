"""The per-rank memory estimate (``moe_memory.estimate``) against what a training step really holds.

For every family's tiny model (fp32, CPU) and variations of micro-batch, sequence length and capacity factor, in one
process, and for expert- and tensor-parallel layouts over 2 gloo ranks (built as ``moe-train train`` builds them):

- activations: the bytes the estimate says are saved for backward against those
  :class:`moe_memory.measure.SavedTensorBytes` counts during a real forward + loss (then the backward runs), in total
  and by module; the relative error, and the worst over all configurations;
- parameters, gradients, optimizer states: the estimate against the storages the step allocated (local parameter
  and ``.grad`` shards; AdamW's states after one step: torch's in one process, moe-train's over the layouts).

    uv run python benchmarks/memory_estimate.py [--quick] [--out benchmarks/results/memory_estimate.json]

``--quick`` (the nox benchmarks session) runs the five tiny presets in one process only, and writes a file only
where ``--out`` says (never the committed full results).
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch
from _estimate import compare, measured_step, training_step  # benchmarks/_estimate.py, beside this script
from _harness import cli, header, launch_ranks, parse, write

from moe_memory import apply_memory_policy
from moe_memory.estimate import estimate_memory
from moe_models import build_model
from moe_models.memory import local_parameters, model_shape, run_shape
from moe_models.presets import preset

WORLD = 2
# name -> (preset, micro-batch, sequence length, ModelConfig overrides)
SINGLE = {
    "tiny-qwen3-moe": ("tiny-qwen3-moe", 2, 64, {}),
    "tiny-deepseek-v3": ("tiny-deepseek-v3", 2, 64, {}),
    "tiny-kimi-k2": ("tiny-kimi-k2", 2, 64, {}),
    "tiny-gpt-oss": ("tiny-gpt-oss", 2, 64, {}),
    "tiny-mixtral": ("tiny-mixtral", 2, 64, {}),
    "tiny-qwen3-moe B=8 S=128": ("tiny-qwen3-moe", 8, 128, {}),
    "tiny-deepseek-v3 B=1 S=256": ("tiny-deepseek-v3", 1, 256, {}),
    "tiny-gpt-oss B=4 S=128": ("tiny-gpt-oss", 4, 128, {}),
    "tiny-qwen3-moe capacity 1.0 padded": (
        "tiny-qwen3-moe",
        4,
        64,
        {"moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True},
    ),
    "tiny-mixtral capacity 1.25 dropping": ("tiny-mixtral", 4, 64, {"moe_expert_capacity_factor": 1.25}),
    "tiny-kimi-k2 capacity 0.5 dropping": ("tiny-kimi-k2", 2, 64, {"moe_expert_capacity_factor": 0.5}),
}
# recompute / offload by module kind (moe_memory.apply_memory_policy, offload_min_tensor_bytes 0):
# name -> (a SINGLE case, recompute kinds, offload kinds)
MEGATRON_SET = (("layernorm", "moe_act"), ("core_attn", "attn_proj", "expert_fc1"))
MEMORY = {
    "tiny-qwen3-moe recompute moe": ("tiny-qwen3-moe", ("moe",), ()),
    "tiny-deepseek-v3 recompute moe_act,layernorm": ("tiny-deepseek-v3", ("moe_act", "layernorm"), ()),
    "tiny-kimi-k2 recompute core_attn,mla_up_proj,shared_experts": (
        "tiny-kimi-k2",
        ("core_attn", "mla_up_proj", "shared_experts"),
        (),
    ),
    "tiny-gpt-oss recompute layernorm,moe_act offload core_attn,attn_proj,expert_fc1": ("tiny-gpt-oss", *MEGATRON_SET),
    "tiny-mixtral offload every kind": (
        "tiny-mixtral",
        (),
        ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act"),
    ),
}
QUICK = ("tiny-qwen3-moe", "tiny-deepseek-v3", "tiny-kimi-k2", "tiny-gpt-oss", "tiny-mixtral")
COMMON = {"train.global_batch_size": "4", "train.micro_batch_size": "2", "data.seq_len": "64"}
LAYOUTS = {
    "tiny-qwen3-moe ep=2 alltoall": ("tiny-qwen3-moe", {"parallel.ep": "2"}),
    "tiny-qwen3-moe ep=2 allgather": (
        "tiny-qwen3-moe",
        {"parallel.ep": "2", "parallel.moe_token_dispatcher_type": "allgather"},
    ),
    "tiny-qwen3-moe tp=2 (etp=2)": ("tiny-qwen3-moe", {"parallel.tp": "2"}),
    "tiny-deepseek-v3 tp=2 x ep=2 (etp=1)": (
        "tiny-deepseek-v3",
        {"parallel.tp": "2", "parallel.ep": "2", "parallel.etp": "1"},
    ),
    "tiny-qwen3-moe ep=2 recompute layernorm,moe_act offload core_attn,attn_proj,expert_fc1": (
        "tiny-qwen3-moe",
        {
            "parallel.ep": "2",
            "run.recompute_modules": ",".join(MEGATRON_SET[0]),
            "run.offload_modules": ",".join(MEGATRON_SET[1]),
            "run.offload_min_tensor_bytes": "0",
        },
    ),
    "tiny-deepseek-v3 tp=2 recompute moe": ("tiny-deepseek-v3", {"parallel.tp": "2", "run.recompute_modules": "moe"}),
    # context parallelism: half the positions of every sequence a rank, attention over the keys of all of them
    "tiny-qwen3-moe cp=2": ("tiny-qwen3-moe", {"parallel.cp": "2"}),
    "tiny-gpt-oss cp=2 (sinks, windows)": ("tiny-gpt-oss", {"parallel.cp": "2"}),
    "tiny-deepseek-v3 cp=2 (MLA, MTP)": ("tiny-deepseek-v3", {"parallel.cp": "2"}),
    "tiny-mixtral ep=2 capacity 1.0 padded": (
        "tiny-mixtral",
        {
            "parallel.ep": "2",
            "model.moe_expert_capacity_factor": "1.0",
            "model.moe_pad_expert_input_to_capacity": "true",
        },
    ),
}


def _single(name: str, recompute: tuple[str, ...] = (), offload: tuple[str, ...] = ()) -> dict:
    """One of SINGLE in this process, torch's AdamW, with the recompute and offload kinds."""
    preset_name, batch, seq_len, overrides = SINGLE[name]
    config = preset(preset_name, **overrides)
    model = build_model(config, seed=0)
    policy = apply_memory_policy(model, model.module_kinds(), recompute, offload, offload_min_tensor_bytes=0)
    ids = torch.randint(0, config.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(0))
    saved = measured_step(model, ids, config.mtp_loss_scaling_factor)
    optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
    optimizer.step()
    run = run_shape(
        config, local_parameters(model), micro_batch=batch, seq_len=seq_len, activation_bytes=4, device="cpu"
    )
    estimate = estimate_memory(
        model_shape(config), run, recompute=frozenset(recompute), offload=frozenset(offload), offload_min_tensor_bytes=0
    )
    memory = {"recompute": list(recompute), "offload": list(offload)} if recompute or offload else {}
    if offload:
        memory["offloaded_bytes"] = {"estimated": estimate.offloaded_bytes, "measured": policy.stats.offloaded_bytes}
    record = compare(estimate, saved, model, list(model.parameters()), optimizer)
    return {"micro_batch": batch, "seq_len": seq_len, **memory, **record}


def _rank(out: Path) -> None:
    """One rank: every layout of LAYOUTS in this process group."""
    import torch.distributed as dist

    results = {name: training_step(p, {**COMMON, **overrides}, WORLD) for name, (p, overrides) in LAYOUTS.items()}
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    args = parse(cli("memory_estimate", __doc__, "the five presets in one process (nox benchmarks)", ranks=True))
    if args.rank_dir is not None:
        _rank(args.rank_dir)
        return
    torch.set_num_threads(1)
    started = time.perf_counter()
    configurations = {}
    for name in QUICK if args.quick else SINGLE:
        configurations[name] = {"ranks": 1, **_single(name)}
    for name, (case, recompute, offload) in {} if args.quick else MEMORY.items():
        configurations[name] = {"ranks": 1, **_single(case, recompute, offload)}
    if not args.quick:
        with tempfile.TemporaryDirectory() as tmp:
            ranks = launch_ranks(__file__, WORLD, Path(tmp))
        for name in LAYOUTS:
            per_rank = [r[name] for r in ranks]
            measured = sum(r["measured_activation_bytes"] for r in per_rank) / WORLD
            estimated = per_rank[0]["estimated_activation_bytes"]
            configurations[name] = {
                "ranks": WORLD,
                "layout": per_rank[0]["layout"],
                "estimated_activation_bytes": estimated,
                "measured_activation_bytes_mean": measured,
                "activation_rel_error": (estimated - measured) / measured,
                "activation_rel_error_worst_rank": max((r["activation_rel_error"] for r in per_rank), key=abs),
                "params_grads_optimizer_exact_on_every_rank": all(
                    r[k]["estimated"] == r[k]["allocated"] for r in per_rank for k in ("params", "grads", "optimizer")
                ),
                "per_rank": per_rank,
            }
    # the worst over configurations, each at its worst rank (the estimate is per rank)
    errors = {
        name: c.get("activation_rel_error_worst_rank", c["activation_rel_error"]) for name, c in configurations.items()
    }
    worst = max(errors, key=lambda n: abs(errors[n]))
    exact = {name: _exact(c) for name, c in configurations.items()}
    result = {
        **header(args, device="cpu", dtype="float32"),
        "seconds": round(time.perf_counter() - started, 1),
        "worst_activation_rel_error": {"configuration": worst, "rel_error_on_any_rank": errors[worst]},
        "params_grads_optimizer_exact": all(exact.values()),
        "configurations": configurations,
    }
    md = _markdown(configurations, errors, exact)
    write(args.out, result, {".md": md})
    print(md, end="")
    print(f"worst activation error (any rank): {errors[worst]:+.2%} ({worst}); {result['seconds']} s")


def _exact(c: dict) -> bool:
    """Whether the estimate's parameter, gradient and optimizer bytes equal what every rank allocated."""
    if c["ranks"] > 1:
        return c["params_grads_optimizer_exact_on_every_rank"]
    return all(c[k]["estimated"] == c[k]["allocated"] for k in ("params", "grads", "optimizer"))


def _markdown(configurations: dict, errors: dict, exact: dict) -> str:
    rows = [
        "| configuration | ranks | estimated KiB | measured KiB (rank mean) | error | worst rank "
        "| params, grads, optimizer |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for name, c in configurations.items():
        measured = c.get("measured_activation_bytes_mean", c.get("measured_activation_bytes"))
        rows.append(
            f"| {name} | {c['ranks']} | {c['estimated_activation_bytes'] / 1024:,.1f} | {measured / 1024:,.1f} | "
            f"{c['activation_rel_error']:+.2%} | {errors[name]:+.2%} | {'exact' if exact[name] else 'DIFFERENT'} |"
        )
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    main()
