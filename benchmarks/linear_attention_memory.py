"""Saved-activation bytes of one Gated DeltaNet layer (Qwen3-Next's linear attention) against the sequence length:
measured, estimated, and bytes per token.

One ``moe_models.linear_attention.GatedDeltaNet`` (hidden 256, 2 query/key heads each serving 2 of 4 value heads,
head dims 64, a 4-tap convolution, chunks of 64 positions), fp32 on the CPU, one sequence of 2048, 4096 and 8192
random hidden states. Measured: what its forward saves for the backward, by :class:`moe_memory.measure.SavedTensorBytes`
on the module (its input, saved by ``in_proj``, included); estimated: ``moe_models.saved_bytes``'s declaration of
the same layer (:func:`~moe_models.saved_bytes.gated_delta_net_saved_bytes`), per estimate module. The chunked delta
rule saves per position, per chunk of 64 positions (its [C, C] matrices) and per chunk again in its scan (one state
and one correction per chunk, kept by autograd in the Python loop): for whole chunks every term is the sequence times
a constant, so the bytes per token stay the same as the sequence grows; a quadratic term would double them with each
doubling. Each row: measured and estimated bytes, their ratio, both per token, and the measurement by module.

    uv run python benchmarks/linear_attention_memory.py [--quick] [--out ...]
"""

from __future__ import annotations

import time

import torch
from _harness import cli, header, parse, write  # beside this script

from moe_memory.estimate import LocalParameters, RankSizes, RunShape
from moe_memory.measure import SavedTensorBytes
from moe_models.linear_attention import GatedDeltaNet
from moe_models.memory import estimate_module, model_shape
from moe_models.presets import preset
from moe_models.saved_bytes import gated_delta_net_saved_bytes

LAYER = {
    "hidden_size": 256,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4,
    "linear_attention_chunk_size": 64,
}
SEQUENCES = (2048, 4096, 8192)
QUICK_SEQUENCES = (256, 512, 1024)


def measure(layer: GatedDeltaNet, seq: int, hidden: int) -> dict[str, int]:
    """Bytes the layer's forward on one sequence of ``seq`` positions saves for backward, by estimate module."""
    x_BSH = torch.randn(1, seq, hidden, generator=torch.Generator().manual_seed(seq), requires_grad=True)
    with SavedTensorBytes(model=layer) as saved:
        out_BSH = layer(x_BSH)
    by_module: dict[str, int] = {}
    for storage in saved.storages:
        module = estimate_module(f"attention.{storage.module}".rstrip("."), linear_attention=True)
        by_module[module] = by_module.get(module, 0) + storage.nbytes
    del out_BSH
    return by_module


def main() -> None:
    args = parse(cli("linear_attention_memory", __doc__, f"sequences {QUICK_SEQUENCES} (nox benchmarks)"))
    config = preset("tiny-qwen3-next", **LAYER)
    layer = GatedDeltaNet(config)
    shape = model_shape(config).layers[0].attention
    rows = []
    for seq in QUICK_SEQUENCES if args.quick else SEQUENCES:
        start = time.perf_counter()
        measured = measure(layer, seq, config.hidden_size)
        run = RunShape(micro_batch=1, seq_len=seq, params=LocalParameters(1, 1), activation_bytes=4)
        estimated = gated_delta_net_saved_bytes(shape, config.hidden_size, RankSizes(1, seq, seq, seq, 4), run)
        m, e = sum(measured.values()), sum(estimated.values())
        rows.append(
            {
                "seq": seq,
                "measured_bytes": m,
                "estimated_bytes": e,
                "ratio": e / m,
                "measured_bytes_per_token": m / seq,
                "estimated_bytes_per_token": e / seq,
                "measured_by_module": measured,
                "estimated_by_module": estimated,
                "seconds": round(time.perf_counter() - start, 2),
            }
        )
        print(f"seq {seq:5d}: measured {m:,} B, estimated {e:,} B, ratio {e / m:.6f}, {m / seq:,.1f} B per token")
    per_token = [row["measured_bytes_per_token"] for row in rows]
    report = {
        **header(args, device="cpu", dtype="float32"),
        "what": "saved-activation bytes of one Gated DeltaNet layer against the sequence: SavedTensorBytes on the "
        "module vs moe_models.saved_bytes' declaration, and bytes per token (constant: linear in the sequence)",
        "inputs": {"batch": 1, **LAYER},
        "rows": rows,
        "bytes_per_token_spread": max(per_token) / min(per_token) - 1,
        "estimate_exact": all(row["measured_by_module"] == row["estimated_by_module"] for row in rows),
    }
    print(f"bytes per token within {report['bytes_per_token_spread']:.2%}; exact: {report['estimate_exact']}")
    write(args.out, report)


if __name__ == "__main__":
    main()
