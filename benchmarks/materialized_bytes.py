"""Bytes each rank allocates to build its share of a model: built on meta then materialised, against building
the whole model first (what every rank did before; the baseline).

Setting (default): a Qwen3-MoE-shaped model with 64 experts per layer (4 layers, hidden 256, expert FFN 256,
vocab 4096), fp32, 4 gloo ranks on CPU, layouts ep=4 (dp_shard=4, edp=1) and tp=2 x ep=2 (dp_shard=2, edp=2, so
FSDP also shards the experts). Each rank counts, with :class:`moe_memory.LiveTensorBytes`, the peak of tensor bytes
alive at once while it builds, parallelises and fills its model (transient copies included), for both ways, and
compares it with what it finally holds:

- ``shard``: this rank's parameters and buffers after parallelisation (experts and non-experts as sharded);
- ``bound``: this rank's routed-expert shard plus the model's whole non-expert parameters (issue 11's yardstick:
  a rank may hold one whole non-expert tensor while filling it, never the other ranks' experts).

    uv run python benchmarks/materialized_bytes.py [--quick] [--out benchmarks/results/materialized_bytes.json]
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path

import torch
from _harness import cli, header, launch_ranks, parse, write  # benchmarks/_harness.py, beside this script

WORLD = 4
LAYOUTS = {"ep=4": {"ep": 4}, "tp=2 x ep=2": {"tp": 2, "ep": 2, "etp": 1}}


def _model_config(quick: bool):
    from moe_models.presets import preset

    sizes = dict(num_moe_experts=64, num_layers=4, hidden_size=256, moe_ffn_hidden_size=256, vocab_size=4096)
    if quick:
        sizes.update(num_layers=2, hidden_size=128, moe_ffn_hidden_size=128, vocab_size=1024)
    return dataclasses.replace(preset("tiny-qwen3-moe"), **sizes)


def _bytes(tensors) -> int:
    from moe_parallel import local_box

    return sum(local_box(t)[0].untyped_storage().nbytes() for t in tensors)


def _rank(quick: bool, out: Path) -> None:
    """One rank: both ways of building, every layout."""
    from moe_memory import LiveTensorBytes
    from moe_models import build_model
    from moe_parallel import ParallelConfig, build_meshes, init_distributed, materialize, parallelize

    ctx = init_distributed("gloo", "cpu")
    config = _model_config(quick)
    results = {}
    for name, sizes in LAYOUTS.items():
        parallel = ParallelConfig(**sizes)
        meshes = build_meshes(parallel.layout(WORLD), "cpu")
        with LiveTensorBytes() as meta_way:
            with torch.device("meta"):
                model = build_model(config)
            plan = model.parallel_plan()
            parallelize(model, meshes, parallel, plan)
            materialize(model, plan, model.initial_weights(0), "cpu")
        expert_names = tuple(f"{p}." for p in plan.experts_paths())
        named = [*model.named_parameters(), *model.named_buffers()]
        experts = _bytes(t for n, t in named if n.startswith(expert_names))
        shard = _bytes(t for _, t in named)
        del model
        with torch.device("meta"):
            whole_non_expert = sum(
                t.numel() * t.element_size()
                for n, t in [*build_model(config).named_parameters(), *build_model(config).named_buffers()]
                if not n.startswith(expert_names)
            )
        with LiveTensorBytes() as eager_way:
            model = build_model(config, seed=0)
            parallelize(model, meshes, parallel, plan)
        del model
        bound = experts + whole_non_expert
        results[name] = {
            "peak_meta_bytes": meta_way.peak,
            "peak_whole_model_first_bytes": eager_way.peak,
            "shard_bytes": shard,
            "expert_shard_bytes": experts,
            "whole_non_expert_bytes": whole_non_expert,
            "bound_bytes": bound,
            "peak_meta_over_bound": meta_way.peak / bound,
            "peak_meta_over_shard": meta_way.peak / shard,
            "peak_whole_model_first_over_bound": eager_way.peak / bound,
        }
    (out / f"rank{ctx.rank}.json").write_text(json.dumps(results))
    torch.distributed.destroy_process_group()


def main() -> None:
    args = parse(cli("materialized_bytes", __doc__, "a smaller model (the nox benchmarks session)", ranks=True))
    if args.rank_dir is not None:
        _rank(args.quick, args.rank_dir)
        return
    with tempfile.TemporaryDirectory() as tmp:
        ranks = launch_ranks(__file__, WORLD, Path(tmp), *(["--quick"] if args.quick else []))
    config = _model_config(args.quick)
    summary = {
        name: {
            "max_peak_meta_over_bound": max(r[name]["peak_meta_over_bound"] for r in ranks),
            "max_peak_meta_over_shard": max(r[name]["peak_meta_over_shard"] for r in ranks),
            "max_peak_whole_model_first_over_bound": max(r[name]["peak_whole_model_first_over_bound"] for r in ranks),
        }
        for name in LAYOUTS
    }
    model = {k: getattr(config, k) for k in ("num_moe_experts", "num_layers", "hidden_size", "vocab_size")}
    result = header(args, device="cpu", world_size=WORLD, model=model) | {"summary": summary, "ranks": ranks}
    for name, row in summary.items():
        print(
            f"{name}: peak/bound {row['max_peak_meta_over_bound']:.3f} (whole model first: "
            f"{row['max_peak_whole_model_first_over_bound']:.2f}), peak/shard {row['max_peak_meta_over_shard']:.3f}"
        )
    write(args.out, result)


if __name__ == "__main__":
    main()
