"""Kimi Delta Attention's chunked kernel in plain torch, forward and forward + backward: ours against transformers'.

``moe_models.kimi_delta.chunk_kimi_delta_rule`` head to head with ``chunk_kimi_delta_attention``
(transformers.models.kimi_linear.modeling_kimi_linear), the torch path transformers runs when flash-linear-attention
is absent, as on this CPU machine (checked: the call reaches transformers' own torch function). Both are called as
``KimiLinearDeltaAttention.forward`` calls transformers' (q, k, v [B, S, heads, dim], keywords ``g``, ``beta``,
``initial_state=None``, ``output_final_state=False``, ``use_qk_l2norm_in_kernel=True``; chunk 64); ours gets the same
tensors with ``use_qk_l2norm=True``, chunk 64. Default: fp32, B=1, S=2048, 4 heads, K=V=64; q, k, v after the conv's
SiLU; one log decay per key channel as the layer makes them, ``g = -exp(A_log) softplus(a + dt_bias)`` with
``A_log`` per head spread over slow and fast rates and ``a`` per channel, so that some channels carry the state over
chunks and others forget within a few positions; ``beta = sigmoid(b)``. All computed outside the timing.

Two modes, as benchmarks/linear_attention_kernels.py times its kernels (whose helpers this script reuses):
``forward`` (under ``torch.no_grad``) and ``forward_backward`` (every input a leaf requiring grad, ``out.backward``
with a fixed random output gradient, input grads reset to None before each call); each is one head-to-head pair
(``_harness.head_to_head``: interleaved in one process, taking turns at going first, after untimed warm-ups, on one
thread). Reported per mode: median and range of each side's seconds, the ratio transformers / ours of the medians and
the median, range and quartiles of the per-repetition ratios. Before timing, the outputs and input gradients are
compared once (relative difference max|ours - theirs| / max|theirs|, reported; it must stay under 1e-4).

transformers' backward is the slow side (its UT transform is a Python loop over the chunk's rows, each step an
autograd node): the default 7 repetitions keep the whole run under about 3 minutes here.

    uv run python benchmarks/kimi_delta_kernel.py [--quick] [--out ...]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from _harness import cli, header, write  # beside this script
from linear_attention_kernels import (
    CHECK,
    delta_rule_case,
    environment,
    measure,
    parse_kernel_args,
    ratios,
    silu_qkv,
)

from moe_models.kimi_delta import chunk_kimi_delta_rule


def kimi_delta_case(args: argparse.Namespace) -> dict:
    """Inputs (leaves) and the two calls of the KDA rule (transformers' as KimiLinearDeltaAttention.forward):
    name -> callable(inputs) -> output."""
    from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention

    gen = torch.Generator().manual_seed(0)
    batch, seq, heads, dim = args.batch, args.seq, args.heads, args.dim
    qkv = silu_qkv(gen, batch, seq, heads, dim)
    a_log = torch.empty(1, 1, heads, 1).uniform_(1e-2, 1.0, generator=gen).log()  # rates from slow to fast
    dt_bias = torch.ones(heads * dim)
    a = torch.randn(batch, seq, heads * dim, generator=gen)  # one per key channel of each head
    b = torch.randn(batch, seq, heads, generator=gen)
    g = -a_log.exp() * F.softplus(a + dt_bias).unflatten(-1, (heads, dim))
    inputs = {**qkv, "g": g, "beta": b.sigmoid()}
    return delta_rule_case(inputs, chunk_kimi_delta_rule, chunk_kimi_delta_attention, args.chunk)


def main() -> None:
    parser = cli("kimi_delta_kernel", __doc__, "S=256, 3 repetitions (CI, a few seconds)")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64, help="key = value head dim")
    args = parse_kernel_args(parser, reps=7, warmup=1)
    result = measure("kimi_delta", kimi_delta_case(args), args)

    report = {
        "what": "plain-torch Kimi Delta Attention kernel, forward (no_grad) and forward + backward: moe_models' "
        "chunk_kimi_delta_rule vs transformers' chunk_kimi_delta_attention (Kimi Linear), called as its layer calls it",
        "baseline": "transformers' torch fallback (no flash-linear-attention)",
        "ratio": "transformers time / ours time (> 1: ours faster)",
        "inputs": {
            "dtype": "float32",
            "batch": args.batch,
            "seq": args.seq,
            "chunk_size": args.chunk,
            "heads": args.heads,
            "dim_k": args.dim,
            "dim_v": args.dim,
            "qk_l2norm": True,
            "g": "-exp(A_log) * softplus(a + 1) per key channel, A_log = log U(1e-2, 1) per head, a ~ N(0, 1)",
            "beta": "sigmoid(N(0, 1))",
            "qkv": "silu(N(0, 1))",
            "reps": args.reps,
            "warmup": args.warmup,
        },
        "method": "one head-to-head pair per mode: ours and transformers' interleaved in one process, taking turns at "
        "going first (_harness.head_to_head), after untimed warm-ups; forward under no_grad; forward_backward: inputs "
        "are leaves requiring grad, out.backward(fixed random grad), grads reset to None",
        "check": CHECK,
        "kernel": result,
        "ratios": ratios(result),
        **environment(),
    }
    write(args.out, header(args, **report))


if __name__ == "__main__":
    main()
