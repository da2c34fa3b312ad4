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
5. ``offload``: recompute and activation offload by module kind against the plain model
   (``memory_offload_check.py``): gradients equal, peak memory, step-time ratio;
6. ``sync``: host synchronisations of a training step (forward + loss + backward + gradient clipping + AdamW) of a
   full-width proxy (2 layers, sequence 2,048), per step and per phase, with the source lines: on CUDA the warnings
   of ``torch.cuda.set_sync_debug_mode("warn")``; on every device the ops that read a device value back, counted at
   the dispatcher (``aten._local_scalar_dense`` - ``.item()`` -, ``nonzero``, ``masked_select``, ``unique``,
   ``repeat_interleave`` without ``output_size``, copies from the device to the host). On the CPU (smoke) only the
   dispatcher count applies; ``cuda_sync_warnings`` is "not applicable".
7. ``graphs``: ``run.cuda_graphs layer`` (``moe_train.cuda_graphs``): the capture-safety check of every scope on a
   full-width 2-layer proxy configured as a GPU runs it, then a training step (forward + loss + backward, bf16
   autocast without its weight cache) with every decoder layer replayed from CUDA graphs against the eager step,
   head to head at 1,024 tokens (where launches weigh), with the largest logit difference. On the CPU (smoke) only
   the check runs.

Each section is guarded: one that raises records ``{"error", "traceback"}`` in the JSON and the next still runs (the
exit status is then 1). ``--section NAME`` (repeatable) runs some; ``benchmarks/gpu/gpu_check.sh`` runs each in a
process of its own under a time limit.

Every ratio is of two things timed head to head (interleaved in one process, taking turns at going first:
``benchmarks/_harness.py``), median of >= 7 repetitions after warm-up, with the range. ``--smoke`` runs the same
code paths on the CPU at tiny sizes in fp32 (CI: ``benchmarks`` nox session); its figures mean nothing.

    benchmarks/gpu/run.sh --out results.json            # on the GPU machine
    python benchmarks/gpu/suite.py --smoke --out x.json   # anywhere
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import dataclasses
import datetime
import gc
import json
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/_harness.py
sys.path.insert(0, str(Path(__file__).resolve().parent))  # memory_offload_check.py
from _harness import head_to_head, spread
from memory_offload_check import offload_check

from moe_dispatch.permutation import make_permutation_map, permute, unpermute
from moe_experts import GroupedExperts
from moe_models import ModelConfig, build_model, causal_lm_loss
from moe_models.flops import training_flops_per_token
from moe_models.presets import preset
from moe_precision import Recipe
from moe_precision.gemm import native_recipes, quantized_matmul
from moe_train.capture_check import CUDA_GRAPH_SCOPES, capture_problems
from moe_train.compile import compile_decoder_layers
from moe_train.config import TrainConfig
from moe_train.cuda_graphs import apply_cuda_graphs
from moe_train.optim import build_optimizer

ROOT = Path(__file__).resolve().parents[2]

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
SYNC_LAYERS, SYNC_SEQ, SYNC_STEPS = 2, 2048, 3  # the sync section's proxy (full width) and its steps


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


def build_on(config: ModelConfig, device: torch.device, seed: int = 0) -> torch.nn.Module:
    """``build_model(config, seed)`` on ``device``, its initial values drawn once: built on the meta device (nothing
    drawn), allocated on ``device``, then filled from ``seed`` (``moe_models.init``: the same values). Built under
    ``torch.device(device)`` instead, every routed expert is drawn twice on the CPU (``GroupedExperts`` initialises
    itself from a seed of its own before the model overwrites it): ~5.5e9 normal draws for the step section's
    full-width 4-layer proxy, tens of seconds of one CPU core per model."""
    with torch.device("meta"):
        model = build_model(config)
    model.to_empty(device=device)
    model.tie_weights()  # to_empty replaces a shared parameter by two
    model.reset_parameters(seed)
    return model


def train_step(
    model: torch.nn.Module, ids: torch.Tensor, config: ModelConfig, autocast: contextlib.AbstractContextManager
) -> None:
    """Forward (under ``autocast``) + LM loss + backward on ``ids`` ``[B, S + 1]``; gradients dropped after."""
    with autocast:
        loss = causal_lm_loss(model(ids[:, :-1]), ids[:, 1:], config.mtp_loss_scaling_factor).total
    loss.backward()
    model.zero_grad(set_to_none=True)


def step(sizes: Sizes, device: torch.device, dtype: torch.dtype, reps: int, warmup: int) -> dict:
    config = dataclasses.replace(preset("qwen3-30b-a3b"), num_layers=sizes.layers, moe_layer_freq=1)
    if sizes is SMOKE:
        config = dataclasses.replace(preset("tiny-qwen3-moe"), num_layers=sizes.layers)
    eager = build_on(config, device)
    compiled = copy.deepcopy(eager)  # the same weights, copied on the device rather than drawn again
    # the smoke run traces the same regions (dynamo, AOT autograd) without inductor's C++ code generation, a minute
    # of the CPU's time; the compile tests (packages/moe-train/tests/test_compile.py) cover inductor on the CPU
    compile_decoder_layers(compiled, **({"backend": "aot_eager"} if sizes is SMOKE else {}))
    ids = torch.randint(0, config.vocab_size, (1, sizes.seq + 1), device=device)
    autocast = torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()

    eager_t, compiled_t = timed_pair(
        lambda: train_step(eager, ids, config, autocast),
        lambda: train_step(compiled, ids, config, autocast),
        device,
        reps,
        warmup,
    )
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


# ops that read a device value back to the host (a synchronisation on CUDA), by overload packet name
SYNC_OPS = frozenset(
    {"_local_scalar_dense", "nonzero", "masked_select", "unique_consecutive", "_unique", "_unique2", "unique_dim"}
)


def _our_frame() -> str:
    """``path:line`` of the innermost frame in this repository's code outside this file (else the innermost frame
    outside torch)."""
    stack = traceback.extract_stack()[:-2]
    ours = [f for f in stack if "/moe_" in f.filename or "/packages/" in f.filename]
    frame = (ours or [f for f in stack if "/torch/" not in f.filename and f.filename != __file__] or stack)[-1]
    path = Path(frame.filename)
    with contextlib.suppress(ValueError):
        path = path.resolve().relative_to(ROOT)
    return f"{path}:{frame.lineno}"


class SyncOpCounter(TorchDispatchMode):
    """Counts the ops that read a value of a ``device_type`` tensor back to the host (:data:`SYNC_OPS`,
    ``repeat_interleave`` without ``output_size``; a copy from a non-CPU device to the CPU), with the source line
    that ran each. On CUDA each is a synchronisation; on the CPU (smoke) they are the reads that would be, together
    with those of values the code keeps on the host (the source lines tell them apart)."""

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self.device_type = device_type
        self.sources: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        syncs = first is not None and first.device.type == self.device_type
        syncs = syncs and (name in SYNC_OPS or (name == "repeat_interleave" and kwargs.get("output_size") is None))
        if name in ("_to_copy", "copy_") and first is not None:
            src = args[1] if name == "copy_" else first
            dst = first.device if name == "copy_" else kwargs.get("device") or src.device
            to_host = torch.device(dst).type == "cpu"
            syncs = isinstance(src, torch.Tensor) and src.device.type != "cpu" and to_host
        if syncs:
            self.sources[f"{name} @ {_our_frame()}"] += 1
        return func(*args, **kwargs)


def sync_count(sizes: Sizes, device: torch.device, dtype: torch.dtype, reps: int, warmup: int) -> dict:
    """Host synchronisations of :data:`SYNC_STEPS` training steps (forward + loss, backward, clip + AdamW) of a
    full-width proxy: ``torch.cuda.set_sync_debug_mode("warn")`` warnings on CUDA, dispatcher-level device-value
    reads everywhere; per step, per phase and by source line."""
    smoke = sizes is SMOKE
    config = dataclasses.replace(preset("qwen3-30b-a3b"), num_layers=SYNC_LAYERS, moe_layer_freq=1)
    seq = SYNC_SEQ
    if smoke:
        config, seq = dataclasses.replace(preset("tiny-qwen3-moe"), num_layers=sizes.layers), sizes.seq
    model = build_on(config, device)
    optimizer = build_optimizer(model, TrainConfig())
    ids = torch.randint(0, config.vocab_size, (1, seq + 1), device=device)
    autocast = torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()
    cuda = device.type == "cuda"

    def phases() -> Iterator[str]:
        with autocast:
            loss = causal_lm_loss(model(ids[:, :-1]), ids[:, 1:], config.mtp_loss_scaling_factor).total
        yield "forward"
        loss.backward()
        yield "backward"
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        yield "optimizer"

    steps = []
    for index in range(SYNC_STEPS):
        record: dict = {"step": index + 1, "warm_up": index == 0, "phases": {}}
        warning_sources: collections.Counter[str] = collections.Counter()
        dispatch_sources: collections.Counter[str] = collections.Counter()
        sync(device)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                run = phases()
                while True:
                    counter = SyncOpCounter(device.type)
                    before = len(caught)
                    with counter:
                        phase = next(run, None)
                    if phase is None:
                        break
                    ours = [w for w in caught[before:] if "synchroniz" in str(w.message).lower()]
                    for w in ours:
                        path = Path(w.filename)
                        with contextlib.suppress(ValueError):
                            path = path.resolve().relative_to(ROOT)
                        warning_sources[f"{path}:{w.lineno}"] += 1
                    dispatch_sources.update(counter.sources)
                    record["phases"][phase] = {
                        "cuda_sync_warnings": len(ours) if cuda else "not applicable",
                        "dispatch_device_reads": sum(counter.sources.values()),
                    }
            finally:
                if cuda:
                    torch.cuda.set_sync_debug_mode("default")
        sync(device)
        record["cuda_sync_warnings"] = sum(warning_sources.values()) if cuda else "not applicable"
        record["cuda_sync_warning_sources"] = dict(warning_sources.most_common()) if cuda else "not applicable"
        record["dispatch_device_reads"] = sum(dispatch_sources.values())
        record["dispatch_device_read_sources"] = dict(dispatch_sources.most_common())
        steps.append(record)
    return {
        "layers": config.num_layers,
        "seq": seq,
        "method": (
            "torch.cuda.set_sync_debug_mode('warn') warnings (CUDA only) and a TorchDispatchMode counting ops that "
            "read a value of a tensor on the device back (aten._local_scalar_dense, nonzero, masked_select, unique, "
            "repeat_interleave without output_size; device-to-host copies); on the CPU (smoke) the latter also "
            "counts values the code keeps on the host, which are no synchronisation on CUDA; step 1 is the warm-up"
        ),
        "steps": steps,
        "per_step_after_warm_up": {
            "cuda_sync_warnings": steps[-1]["cuda_sync_warnings"],
            "dispatch_device_reads": steps[-1]["dispatch_device_reads"],
        },
    }


def offload(sizes: Sizes, device: torch.device, dtype: torch.dtype, reps: int, warmup: int) -> dict:
    return offload_check(device, dtype, reps, smoke=sizes is SMOKE)


def graphs(sizes: Sizes, device: torch.device, dtype: torch.dtype, reps: int, warmup: int) -> dict:
    gpu_run = {"moe_expert_backend": "torch", "moe_permute_backend": "triton"}
    config = dataclasses.replace(preset("qwen3-30b-a3b"), num_layers=2, moe_layer_freq=1, **gpu_run)
    if sizes is SMOKE:
        config = dataclasses.replace(preset("tiny-qwen3-moe"), num_layers=sizes.layers, **gpu_run)
    eager = build_on(config, device)
    graphed = copy.deepcopy(eager)
    seq = max(sizes.seq // 4, 16)
    ids = torch.randint(0, config.vocab_size, (1, seq + 1), device=device)
    # a graph replays the casts it captured: autocast's cache of cast weights must not outlive a call
    autocast: contextlib.AbstractContextManager = contextlib.nullcontext()
    if dtype != torch.float32:
        autocast = torch.autocast(device.type, dtype=dtype, cache_enabled=False)

    def forward(model: torch.nn.Module) -> torch.Tensor:
        with autocast:
            return model(ids[:, :-1]).logits

    out: dict = {"seq": seq, "capture_problems": capture_problems(graphed, CUDA_GRAPH_SCOPES, lambda: forward(graphed))}
    if device.type != "cuda":
        out["graphed"] = "not applicable (CUDA graphs need a CUDA device)"
        return out
    out["regions"] = apply_cuda_graphs(graphed, ("layer",), lambda: forward(graphed))

    eager_t, graphed_t = timed_pair(
        lambda: train_step(eager, ids, config, autocast),
        lambda: train_step(graphed, ids, config, autocast),
        device,
        reps,
        warmup,
    )
    with torch.no_grad():
        out["max_abs_logit_diff"] = float((forward(eager) - forward(graphed)).abs().max())
    out.update(eager=eager_t, graphed=graphed_t, graphed_speedup=eager_t["median_s"] / graphed_t["median_s"])
    return out


SECTIONS: dict[str, Callable[[Sizes, torch.device, torch.dtype, int, int], dict]] = {
    "step": step,
    "experts": experts,
    "permutation": permutation,
    "fp8": fp8,
    "offload": offload,
    "sync": sync_count,
    "graphs": graphs,
}


def run_section(name: str, sizes: Sizes, device: torch.device, dtype: torch.dtype, reps: int, warmup: int) -> dict:
    """``name``'s result, or ``{"error", "traceback"}`` if it raised; its seconds either way."""
    start = time.perf_counter()
    try:
        result = SECTIONS[name](sizes, device, dtype, reps, warmup)
    except Exception as err:  # guarded: the next section still runs
        traceback.print_exc()
        result = {"error": f"{type(err).__name__}: {err}"[:2000], "traceback": traceback.format_exc()[-4000:]}
    result["seconds"] = time.perf_counter() - start
    gc.collect()
    if device.type == "cuda":
        with contextlib.suppress(Exception):  # a failed section may have left the context unusable
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU in fp32, the same code paths")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument(
        "--section",
        "--only",
        dest="sections",
        action="extend",
        nargs="+",
        choices=list(SECTIONS),
        help="the sections to run, in this order (repeatable; default: all)",
    )
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
    failed = []
    for name in args.sections or list(SECTIONS):
        print(f"{name}: start", flush=True)
        report[name] = run_section(name, sizes, device, dtype, reps, warmup)
        if "error" in report[name]:
            failed.append(name)
        print(f"{name}: {'FAILED' if name in failed else 'done'} in {report[name]['seconds']:.1f}s", flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")  # what finished survives a later crash
    print(f"wrote {args.out}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
