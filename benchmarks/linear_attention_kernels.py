"""Linear-attention kernels in plain torch, forward and forward + backward: ours against transformers' torch fallbacks.

Two kernels, each head to head with the torch path transformers runs when the fused package (flash-linear-attention,
mamba-ssm) is absent, as on this CPU machine (checked: the call reaches transformers' own torch function):

- ``gated_delta``: ``moe_models.gated_delta.chunk_gated_delta_rule`` against ``torch_chunk_gated_delta_rule``
  (transformers.models.qwen3_next.modeling_qwen3_next), called as ``Qwen3NextGatedDeltaNet.forward`` calls it
  (q, k, v [B, S, heads, dim], keywords ``g``, ``beta``, ``initial_state=None``, ``output_final_state=False``,
  ``use_qk_l2norm_in_kernel=True``, ``cu_seqlens=None``; chunk 64). Ours gets the same tensors with
  ``use_qk_l2norm=True``, chunk 64. Default: fp32, B=1, S=2048, 4 heads, K=V=64; g and beta as the layer makes them
  (``g = -exp(A_log) softplus(a + dt_bias)``, ``beta = sigmoid(b)``; A_log small, so the state carries over chunks
  and the check covers the chunk-to-chunk path), computed outside the timing.
- ``ssd``: ``moe_models.ssd.chunk_ssd_scan`` against ``mamba2_chunk_scan``
  (transformers.models.nemotron_h.modeling_nemotron_h), called as ``NemotronHMamba2Mixer.forward`` calls it (raw
  dt with ``dt_bias``, ``dt_softplus=True``, ``dt_limit=(0, inf)``, ``D``, chunk 64, no initial or final state).
  Ours takes dt already softplus'd and clamped, as our mixer computes it: ``clamp(softplus(dt + dt_bias))`` is done
  inside ours' timed call, so both do the same work. Default: fp32, B=1, S=2048, 8 heads of P=64, state D=64, G=1.

Each kernel is timed in two modes: ``forward`` (under ``torch.no_grad``) and ``forward_backward`` (every input a
leaf requiring grad, ``out.backward(grad)`` with a fixed random output gradient, input grads reset to None before
each call). Each (kernel, mode) case is one head-to-head pair (``_harness.head_to_head``): ours and transformers'
interleaved in one process, taking turns at going first, after untimed warm-ups, on one thread
(``torch.set_num_threads(1)``). Reported per case: the ratio transformers / ours of the median times, and the median,
range and quartiles of the per-repetition ratios. Before timing, each kernel's outputs and input gradients are
compared once (relative difference max|ours - theirs| / max|theirs|, reported; it must stay under 1e-4).

    uv run python benchmarks/linear_attention_kernels.py [--quick] [--out ...]
"""

from __future__ import annotations

import argparse
import inspect
import math
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F
from _harness import cli, head_to_head, header, parse, quartiles, ratio_spread, spread, write  # beside this script

from moe_models.gated_delta import chunk_gated_delta_rule
from moe_models.ssd import chunk_ssd_scan

MAX_RELATIVE_DIFFERENCE = 1e-4  # fp32; the tests hold both kernels to 1e-5 on small shapes
MODES = ("forward", "forward_backward")
CHECK = (
    "relative difference max|ours - transformers| / max|transformers| of the output and of each input gradient, once "
    f"before timing (fp32, must be < {MAX_RELATIVE_DIFFERENCE})"
)


def relative_difference(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


# ----------------------------------------------------------------------------------------------- kernels


def silu_qkv(gen: torch.Generator, batch: int, seq: int, heads: int, dim: int) -> dict:
    """q, k, v [B, S, heads, dim] as the conv's SiLU leaves them."""
    return {name: F.silu(torch.randn(batch, seq, heads, dim, generator=gen)) for name in ("q", "k", "v")}


def delta_rule_case(inputs: dict, ours_fn: Callable, theirs_fn: Callable, chunk: int, **theirs_options) -> dict:
    """The case of a chunked delta rule on ``inputs`` (q, k, v, g, beta): ours with the q/k L2 norm, transformers'
    as its layer calls it (no cache: no state in or out; ``theirs_options`` besides)."""

    def ours(x: dict) -> torch.Tensor:
        out, _ = ours_fn(x["q"], x["k"], x["v"], x["g"], x["beta"], chunk_size=chunk, use_qk_l2norm=True)
        return out

    def theirs(x: dict) -> torch.Tensor:
        out, _ = theirs_fn(
            x["q"],
            x["k"],
            x["v"],
            g=x["g"],
            beta=x["beta"],
            chunk_size=chunk,
            initial_state=None,
            output_final_state=False,
            use_qk_l2norm_in_kernel=True,
            **theirs_options,
        )
        return out

    return {"inputs": inputs, "ours": ours, "transformers": theirs, "transformers_fn": theirs_fn}


def gated_delta_case(args: argparse.Namespace) -> dict:
    """Inputs (leaves) and the two calls of the gated delta rule (transformers' as Qwen3NextGatedDeltaNet.forward):
    name -> callable(inputs) -> output."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    gen = torch.Generator().manual_seed(0)
    batch, seq, heads, dim = args.batch, args.seq, args.gd_heads, args.gd_dim
    qkv = silu_qkv(gen, batch, seq, heads, dim)
    a_log = torch.empty(heads).uniform_(1e-3, 1e-1, generator=gen).log()  # slow decays: the state carries over
    dt_bias = torch.ones(heads)
    a, b = torch.randn(batch, seq, heads, generator=gen), torch.randn(batch, seq, heads, generator=gen)
    inputs = {**qkv, "g": -a_log.exp() * F.softplus(a + dt_bias), "beta": b.sigmoid()}
    return delta_rule_case(inputs, chunk_gated_delta_rule, torch_chunk_gated_delta_rule, args.chunk, cu_seqlens=None)


def ssd_case(args: argparse.Namespace) -> dict:
    """Inputs (leaves) and the two calls of the SSD scan."""
    from transformers.models.nemotron_h.modeling_nemotron_h import mamba2_chunk_scan

    gen = torch.Generator().manual_seed(1)
    batch, seq, heads, dim_p, groups, dim_d = args.batch, args.seq, args.ssd_heads, args.ssd_p, args.groups, args.ssd_d
    dt_init = torch.empty(heads).uniform_(math.log(1e-3), math.log(1e-1), generator=gen).exp()  # Mamba-2's dt init
    inputs = {
        "x": F.silu(torch.randn(batch, seq, heads, dim_p, generator=gen)),
        "dt": torch.randn(batch, seq, heads, generator=gen),  # before dt_bias and softplus, as in_proj gives it
        "A": -torch.arange(1, heads + 1, dtype=torch.float32),  # -exp(A_log), A_log = log(1..N)
        "B": F.silu(torch.randn(batch, seq, groups, dim_d, generator=gen)),
        "C": F.silu(torch.randn(batch, seq, groups, dim_d, generator=gen)),
        "D": torch.ones(heads),
        "dt_bias": dt_init + torch.log(-torch.expm1(-dt_init)),  # inverse softplus
    }
    dt_limit = (0.0, float("inf"))  # Nemotron-H's default time_step_limit

    def ours(x: dict) -> torch.Tensor:  # as our mixer: dt softplus'd and clamped, then the scan
        dt = F.softplus(x["dt"] + x["dt_bias"]).clamp(*dt_limit)
        out, _ = chunk_ssd_scan(x["x"], dt, x["A"], x["B"], x["C"], chunk_size=args.chunk, D_N=x["D"])
        return out

    def theirs(x: dict) -> torch.Tensor:  # as NemotronHMamba2Mixer.forward (no cache: no state in or out)
        return mamba2_chunk_scan(
            x["x"],
            x["dt"],
            x["A"],
            x["B"],
            x["C"],
            chunk_size=args.chunk,
            D=x["D"],
            z=None,
            return_final_states=False,
            dt_bias=x["dt_bias"],
            dt_softplus=True,
            initial_states=None,
            dt_limit=dt_limit,
        )

    return {"inputs": inputs, "ours": ours, "transformers": theirs, "transformers_fn": mamba2_chunk_scan}


def fallback_check(fn: Callable) -> dict:
    """transformers' hub-kernel wrapper calls the original package (flash-linear-attention, mamba-ssm) when it is
    installed; here it must call the torch function it wraps: read from the wrapper's closure."""
    nonlocals = inspect.getclosurevars(fn).nonlocals
    implementation = nonlocals.get("implementation")
    torch_path = implementation is not None and implementation is getattr(fn, "__wrapped__", None)
    torch_path = torch_path and nonlocals.get("is_new_implementation") is False
    assert torch_path, f"{fn.__name__}: transformers would call {implementation}, not its torch path"
    return {
        "function": f"{implementation.__module__}.{implementation.__qualname__}",
        "torch_path": torch_path,
        "fused_package_not_installed": nonlocals.get("package"),
    }


# ----------------------------------------------------------------------------------------------- checks and timing


def leaves(inputs: dict, grad: bool) -> dict:
    return {n: t.detach().clone().requires_grad_(grad) for n, t in inputs.items()}


def check_same(case: dict) -> dict:
    """Forward outputs and input gradients (one fixed output gradient) of ours and transformers'."""
    results = {}
    for name in ("ours", "transformers"):
        x = leaves(case["inputs"], True)
        out = case[name](x)
        out.backward(case["grad"])
        results[name] = (out.detach(), {n: t.grad for n, t in x.items()})
    (out, grads), (ref, ref_grads) = results["ours"], results["transformers"]
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, ref.shape, out.dtype, ref.dtype)
    diffs = {"output": relative_difference(out, ref)}
    diffs.update({f"grad_{n}": relative_difference(grads[n], ref_grads[n]) for n in grads})
    worst = max(diffs.values())
    assert worst < MAX_RELATIVE_DIFFERENCE, diffs
    return {"relative_difference": diffs, "max_relative_difference": worst}


def runs(case: dict, mode: str) -> tuple[Callable[[], object], Callable[[], object]]:
    if mode == "forward":
        x = leaves(case["inputs"], False)

        def forward(fn: Callable) -> Callable[[], object]:
            def run() -> object:
                with torch.no_grad():
                    return fn(x)

            return run

        return forward(case["ours"]), forward(case["transformers"])

    xs = {name: leaves(case["inputs"], True) for name in ("ours", "transformers")}

    def forward_backward(name: str) -> Callable[[], None]:
        def run() -> None:
            for t in xs[name].values():
                t.grad = None
            case[name](xs[name]).backward(case["grad"])

        return run

    return forward_backward("ours"), forward_backward("transformers")


def time_case(case: dict, mode: str, args: argparse.Namespace) -> dict:
    ours, theirs = runs(case, mode)
    ours_s, theirs_s = head_to_head(ours, theirs, args.reps, args.warmup)
    ratios = [t / o for t, o in zip(theirs_s, ours_s, strict=True)]
    return {
        "ours_s": {**spread(ours_s), "all": ours_s},
        "transformers_s": {**spread(theirs_s), "all": theirs_s},
        "transformers_over_ours": statistics.median(theirs_s) / statistics.median(ours_s),
        "per_repetition_ratio": ratio_spread(theirs_s, ours_s),
        "per_repetition_ratio_quartiles": quartiles(ratios),
    }


def measure(kernel: str, case: dict, args: argparse.Namespace) -> dict:
    """The transformers path and the check of ``case`` (under a fixed random output gradient), then its time in each
    mode, a line printed per mode."""
    out = case["ours"](case["inputs"])
    case["grad"] = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    result = {"transformers_path": fallback_check(case["transformers_fn"]), "check": check_same(case)}
    for mode in MODES:
        result[mode] = row = time_case(case, mode, args)
        spread_ = row["per_repetition_ratio"]
        print(
            f"{kernel:12s} {mode:17s} ours {row['ours_s']['median'] * 1e3:8.2f} ms  transformers "
            f"{row['transformers_s']['median'] * 1e3:8.2f} ms  transformers/ours "
            f"{row['transformers_over_ours']:.3f} [{spread_['min']:.3f}, {spread_['max']:.3f}]"
        )
    print(f"{kernel:12s} max relative difference {result['check']['max_relative_difference']:.2e}")
    return result


def ratios(result: dict) -> dict:
    """Each mode's ratio transformers / ours and the spread of the per-repetition ratios."""
    return {
        mode: {
            "transformers_over_ours": result[mode]["transformers_over_ours"],
            "spread": result[mode]["per_repetition_ratio"],
        }
        for mode in MODES
    }


def environment() -> dict:
    """Where the times were taken: the device, torch's thread count and transformers' version."""
    import transformers

    return {"device": "cpu", "cpu_threads": torch.get_num_threads(), "transformers": transformers.__version__}


def parse_kernel_args(parser: argparse.ArgumentParser, reps: int, warmup: int) -> argparse.Namespace:
    """The options every kernel benchmark has (sequence, batch, chunk, repetitions, warm-ups, threads) added to
    ``parser``, the arguments parsed, defaults resolved (``--quick``: S=256, 3 repetitions, 1 warm-up; else S=2048,
    ``reps`` and ``warmup``) and the thread count set."""
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1)
    args = parse(parser)
    args.seq = args.seq or (256 if args.quick else 2048)
    args.reps = args.reps or (3 if args.quick else reps)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else warmup)
    torch.set_num_threads(args.threads)
    return args


# ----------------------------------------------------------------------------------------------- main


def main() -> None:
    parser = cli("linear_attention_kernels", __doc__, "S=256, 3 repetitions (CI, a few seconds)")
    parser.add_argument("--gd-heads", type=int, default=4)
    parser.add_argument("--gd-dim", type=int, default=64, help="gated delta key = value head dim")
    parser.add_argument("--ssd-heads", type=int, default=8)
    parser.add_argument("--ssd-p", type=int, default=64, help="SSD head dim P")
    parser.add_argument("--ssd-d", type=int, default=64, help="SSD state size D")
    parser.add_argument("--groups", type=int, default=1, help="SSD groups of B/C")
    args = parse_kernel_args(parser, reps=21, warmup=2)
    kernels = {
        kernel: measure(kernel, build(args), args)
        for kernel, build in [("gated_delta", gated_delta_case), ("ssd", ssd_case)]
    }

    report = {
        "what": "plain-torch linear-attention kernels, forward (no_grad) and forward + backward: moe_models' "
        "chunk_gated_delta_rule vs transformers' torch_chunk_gated_delta_rule (Qwen3-Next), moe_models' "
        "chunk_ssd_scan vs transformers' mamba2_chunk_scan (Nemotron-H), each called as its model's layer calls it",
        "baseline": "transformers' torch fallbacks (no flash-linear-attention, no mamba-ssm)",
        "ratio": "transformers time / ours time (> 1: ours faster)",
        "inputs": {
            "dtype": "float32",
            "batch": args.batch,
            "seq": args.seq,
            "chunk_size": args.chunk,
            "gated_delta": {
                "heads": args.gd_heads,
                "qk_heads": args.gd_heads,
                "dim_k": args.gd_dim,
                "dim_v": args.gd_dim,
                "qk_l2norm": True,
                "g": "-exp(A_log) * softplus(a + 1), A_log = log U(1e-3, 1e-1), a ~ N(0, 1)",
                "beta": "sigmoid(N(0, 1))",
                "qkv": "silu(N(0, 1))",
            },
            "ssd": {
                "heads": args.ssd_heads,
                "dim_p": args.ssd_p,
                "dim_d": args.ssd_d,
                "groups": args.groups,
                "dt": "N(0, 1) + dt_bias, softplus, clamp(0, inf); dt_bias = softplus^-1(logU(1e-3, 1e-1))",
                "A": "-(1..N)",
                "D": "ones",
                "x_B_C": "silu(N(0, 1))",
            },
            "reps": args.reps,
            "warmup": args.warmup,
        },
        "method": "one head-to-head pair per (kernel, mode): ours and transformers' interleaved in one process, "
        "taking turns at going first (_harness.head_to_head), after untimed warm-ups; forward under no_grad; "
        "forward_backward: inputs are leaves requiring grad, out.backward(fixed random grad), grads reset to None",
        "check": CHECK,
        "kernels": kernels,
        "ratios": {
            f"{kernel}_{mode}": row for kernel, result in kernels.items() for mode, row in ratios(result).items()
        },
        **environment(),
    }
    write(args.out, header(args, **report))


if __name__ == "__main__":
    main()
