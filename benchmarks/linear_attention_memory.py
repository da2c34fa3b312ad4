"""Saved-activation bytes of one Gated DeltaNet layer (Qwen3-Next's linear attention), one Mamba-2 mixer
(Nemotron-H's) and one KDA layer (Kimi Linear's) against the sequence length: measured, estimated, and bytes per token.

One ``moe_models.linear_attention.GatedDeltaNet`` (hidden 256, 2 query/key heads each serving 2 of 4 value heads,
head dims 64, a 4-tap convolution, chunks of 64 positions) and one ``moe_models.mamba.Mamba2Mixer`` (hidden 256, 8
heads of 64 channels sharing 2 groups of B and C, state 64, a 4-tap convolution, chunks of 64 positions), fp32 on the
CPU, and one ``moe_models.kimi_delta.KimiDeltaMixer`` (hidden 256, 4 heads of 64, a 4-tap convolution, chunks of 64
positions in sub-chunks of 8), one sequence of 2048, 4096 and 8192 random hidden states. Measured: what the forward
saves for the backward, by :class:`moe_memory.measure.SavedTensorBytes` on the module (its input, saved by
``in_proj``, included); for the Mamba-2 mixer and the KDA layer only what is still saved when the backward starts
(their scans' last state update feeds nothing, and the state only it keeps is freed before then), with the Mamba-2
mixer's gated norm, a function, attributed to the ``norm`` module that holds its weight. Estimated:
``moe_models.saved_bytes``' declaration of the same layer
(:func:`~moe_models.saved_bytes.gated_delta_net_saved_bytes`, :func:`~moe_models.saved_bytes.mamba2_saved_bytes`),
per estimate module. The chunked scans save per position, per chunk of 64 positions (their [C, C] matrices) and per
chunk again in their loops (one state per chunk, kept by autograd in the Python loop): for whole chunks every term is
the sequence times a constant, so the bytes per token stay the same as the sequence grows; a quadratic term would
double them with each doubling. Each row: measured and estimated bytes, their ratio, both per token, and both by
module; the Gated DeltaNet's rows under ``rows``, the Mamba-2 mixer's under ``mamba2``, the KDA layer's
(:func:`~moe_models.recurrent_saved_bytes.kimi_delta_saved_bytes`) under ``kda``; with them the measured bytes each
token added from one length to the next costs (the same at every step: linear).

    uv run python benchmarks/linear_attention_memory.py [--quick] [--out ...]
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable
from unittest import mock

import torch
from _harness import cli, header, parse, write  # beside this script
from torch import nn

from moe_memory.estimate import LocalParameters, Mamba2Shape, RankSizes, RunShape
from moe_memory.measure import SavedAtBackwardBytes, SavedTensorBytes
from moe_models import mamba as mamba_module
from moe_models import ssd
from moe_models.config import ModelConfig
from moe_models.kimi_delta import KimiDeltaMixer
from moe_models.linear_attention import GatedDeltaNet
from moe_models.memory import estimate_module, model_shape
from moe_models.presets import preset
from moe_models.recurrent_saved_bytes import gated_delta_net_saved_bytes, kimi_delta_saved_bytes, mamba2_saved_bytes

LAYER = {
    "hidden_size": 256,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4,
    "linear_attention_chunk_size": 64,
}
MAMBA_LAYER = {
    "hidden_size": 256,
    "mamba_num_heads": 8,
    "mamba_head_dim": 64,
    "mamba_num_groups": 2,
    "mamba_state_dim": 64,
    "mamba_conv_kernel_dim": 4,
    "mamba_chunk_size": 64,
}
KDA_LAYER = {
    "hidden_size": 256,
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4,
    "linear_attention_chunk_size": 64,
}
# the Mamba-2 mixer's modules as the estimate names them ("" is the mixer itself)
MAMBA_MODULES = {"": "mamba_mixer", "in_proj": "qkv_linear", "norm": "mamba_norm", "out_proj": "attn_proj"}
SEQUENCES = (2048, 4096, 8192)
QUICK_SEQUENCES = (256, 512, 1024)


@contextlib.contextmanager
def gated_norm_as_module(mixer: mamba_module.Mamba2Mixer):
    """Runs the mixer's gated norm (the function ``ssd.gated_rms_norm``) as a call of ``mixer.norm``, the module
    holding its weight, so that the measurement attributes what it saves to ``norm``."""
    mixer.norm.forward = ssd.gated_rms_norm  # this instance only
    try:
        with mock.patch.object(mamba_module, "gated_rms_norm", lambda *args, **kwargs: mixer.norm(*args, **kwargs)):
            yield
    finally:
        del mixer.norm.forward


def measure_gated_delta_net(layer: nn.Module, x_BSH: torch.Tensor) -> dict[str, int]:
    """Bytes the Gated DeltaNet's forward saves for backward, by estimate module."""
    with SavedTensorBytes(model=layer) as saved:
        out_BSH = layer(x_BSH)
    by_module: dict[str, int] = {}
    for storage in saved.storages:
        module = estimate_module(f"attention.{storage.module}".rstrip("."), linear_attention=True)
        by_module[module] = by_module.get(module, 0) + storage.nbytes
    del out_BSH
    return by_module


def measure_mamba2(layer: mamba_module.Mamba2Mixer, x_BSH: torch.Tensor) -> dict[str, int]:
    """Bytes the Mamba-2 mixer's forward leaves saved for the backward, by estimate module."""
    with gated_norm_as_module(layer), SavedAtBackwardBytes(model=layer) as saved:
        out_BSH = layer(x_BSH)
    by_module: dict[str, int] = {}
    for storage in saved.alive():
        module = MAMBA_MODULES[storage.module]
        by_module[module] = by_module.get(module, 0) + storage.nbytes
    del out_BSH
    return by_module


def measure_kimi_delta(layer: KimiDeltaMixer, x_BSH: torch.Tensor) -> dict[str, int]:
    """Bytes the KDA layer's forward leaves saved for the backward, by estimate module."""
    with SavedAtBackwardBytes(model=layer) as saved:
        out_BSH = layer(x_BSH)
    by_module: dict[str, int] = {}
    for storage in saved.alive():
        module = estimate_module(f"attention.{storage.module}".rstrip("."), linear_attention=True)
        by_module[module] = by_module.get(module, 0) + storage.nbytes
    del out_BSH
    return by_module


def sweep(
    name: str,
    sequences: tuple[int, ...],
    hidden: int,
    measure: Callable[[torch.Tensor], dict[str, int]],
    estimate: Callable[[RankSizes, RunShape], dict[str, int]],
) -> dict:
    """Measured against estimated bytes at each sequence length, and how far the bytes per token spread."""
    rows = []
    for seq in sequences:
        start = time.perf_counter()
        x_BSH = torch.randn(1, seq, hidden, generator=torch.Generator().manual_seed(seq), requires_grad=True)
        measured = measure(x_BSH)
        run = RunShape(micro_batch=1, seq_len=seq, params=LocalParameters(1, 1), activation_bytes=4)
        estimated = estimate(RankSizes(1, seq, seq, seq, 4), run)
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
        print(
            f"{name} seq {seq:5d}: measured {m:,} B, estimated {e:,} B, ratio {e / m:.6f}, {m / seq:,.1f} B per token"
        )
    per_token = [row["measured_bytes_per_token"] for row in rows]
    spread = max(per_token) / min(per_token) - 1
    # constant bytes (masks, per-head parameters in fp32) and one state fewer than chunks bend the bytes per token a
    # little at short sequences; what each added token costs is exactly constant when the bytes are linear
    added = [
        (row["measured_bytes"] - before["measured_bytes"]) / (row["seq"] - before["seq"])
        for before, row in itertools.pairwise(rows)
    ]
    exact = all(row["measured_by_module"] == row["estimated_by_module"] for row in rows)
    print(f"{name}: bytes per token within {spread:.2%}; per added token {added}; exact: {exact}")
    return {
        "rows": rows,
        "bytes_per_token_spread": spread,
        "measured_bytes_per_added_token": added,
        "estimate_exact": exact,
    }


def main() -> None:
    args = parse(cli("linear_attention_memory", __doc__, f"sequences {QUICK_SEQUENCES} (nox benchmarks)"))
    sequences = QUICK_SEQUENCES if args.quick else SEQUENCES
    config = preset("tiny-qwen3-next", **LAYER)
    layer = GatedDeltaNet(config)
    shape = model_shape(config).layers[0].attention
    gated_delta = sweep(
        "Gated DeltaNet",
        sequences,
        config.hidden_size,
        lambda x_BSH: measure_gated_delta_net(layer, x_BSH),
        lambda sizes, run: gated_delta_net_saved_bytes(shape, config.hidden_size, sizes, run),
    )
    mamba_config = ModelConfig(**MAMBA_LAYER)
    mixer = mamba_module.Mamba2Mixer(mamba_config)
    mamba_shape = Mamba2Shape(
        heads=mamba_config.mamba_num_heads,
        head_dim=mamba_config.mamba_head_dim,
        groups=mamba_config.mamba_num_groups,
        state_dim=mamba_config.mamba_state_dim,
        conv_kernel=mamba_config.mamba_conv_kernel_dim,
        chunk=mamba_config.mamba_chunk_size,
    )
    mamba2 = sweep(
        "Mamba-2",
        sequences,
        mamba_config.hidden_size,
        lambda x_BSH: measure_mamba2(mixer, x_BSH),
        lambda sizes, run: mamba2_saved_bytes(mamba_shape, mamba_config.hidden_size, sizes, run),
    )
    kda_config = preset("tiny-kimi-linear", **KDA_LAYER)
    kda_layer = KimiDeltaMixer(kda_config)
    kda_shape = model_shape(kda_config).layers[0].attention
    kda = sweep(
        "KDA",
        sequences,
        kda_config.hidden_size,
        lambda x_BSH: measure_kimi_delta(kda_layer, x_BSH),
        lambda sizes, run: kimi_delta_saved_bytes(kda_shape, kda_config.hidden_size, sizes, run),
    )
    report = {
        **header(args, device="cpu", dtype="float32"),
        "what": "saved-activation bytes of one Gated DeltaNet layer (rows), one Mamba-2 mixer (mamba2) and one KDA "
        "layer (kda) against the sequence: SavedTensorBytes on the module vs moe_models.saved_bytes' declaration, "
        "and bytes per token (constant: linear in the sequence)",
        "inputs": {"batch": 1, **LAYER},
        **gated_delta,
        "mamba2": {"inputs": {"batch": 1, **MAMBA_LAYER}, **mamba2},
        "kda": {"inputs": {"batch": 1, **KDA_LAYER}, **kda},
    }
    write(args.out, report)


if __name__ == "__main__":
    main()
