"""What the GPU machine has, before anything runs on it: versions, the card, and every torch / Triton API our code
relies on, present or missing. Never fails on what it finds (the exit status is 0 unless the probe itself breaks);
``benchmarks/gpu/gpu_check.sh`` runs it first. Writes one JSON and prints a summary::

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python benchmarks/gpu/probe.py --out probe.json

The API list is collected, not kept by hand: every ``import torch...`` / ``from torch... import name`` and every
attribute chain rooted at such a name (``torch.float8_e8m0fnu``, ``F.grouped_mm``, ``dist.all_to_all_single``,
``tl.program_id``...) in ``packages/*/src``, each resolved here (imported, then ``getattr`` along the chain), with
the first places that use it. :data:`EXTRA` adds what the code reaches by a string or through a signature
(``getattr(torch._C._autograd, ...)``, ``skip_offset=``, the pipelining schedules by class name). ``checks``: small
calls that must work, not only exist (a grouped GEMM; on CUDA ``_scaled_mm`` in FP8, the Triton permutation, an
inductor compile, the sync-debug warning the suite's ``sync`` section counts), each guarded.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import datetime
import importlib
import importlib.metadata
import inspect
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROOTS = ("torch", "triton")  # the APIs listed: these packages'
# reached by a string, a keyword or a class name rather than an attribute chain the scan sees, or named in issue 32
EXTRA = (
    "torch._C._autograd._top_saved_tensors_default_hooks",
    "torch.nn.functional.grouped_mm",
    "torch._scaled_mm",
    "torch._scaled_grouped_mm",
    "torch.float8_e4m3fn",
    "torch.float8_e5m2",
    "torch.float8_e8m0fnu",
    "torch.float4_e2m1fn_x2",
    "torch.library.custom_op",
    "torch.library.register_fake",
    "torch.library.register_autograd",
    "torch.library.triton_op",
    "torch.compiler.is_compiling",
    "torch.cuda.set_sync_debug_mode",
    "torch.distributed.fsdp.fully_shard",
    "torch.distributed.tensor._utils._compute_local_shape_and_global_offset",
    "torch.distributed.pipelining.schedules._ComputationType",
    "torch.utils.checkpoint.checkpoint",
    "torch.autograd.graph.saved_tensors_hooks",
)
PACKAGES = ("moe_dispatch", "moe_experts", "moe_precision", "moe_parallel", "moe_memory", "moe_models", "moe_train")
DISTRIBUTIONS = (
    "torch",
    "triton",
    "transformers",
    "numpy",
    "safetensors",
    "tokenizers",
    "pyyaml",
    "datasets",
    "pyarrow",
    "tensorboard",
    "nvidia-modelopt",
    "transformer_engine",
    "pytest",
    "hypothesis",
)


# ----------------------------------------------------------------------------------------------- the API list


def _src_files() -> list[Path]:
    return sorted(p for src in sorted(ROOT.glob("packages/*/src")) for p in src.rglob("*.py"))


def collect_apis(files: list[Path]) -> dict[str, list[str]]:
    """Dotted torch / Triton names the files use -> the first three ``path:line`` that use each."""
    uses: dict[str, list[str]] = {}

    def add(name: str, file: Path, line: int) -> None:
        where = uses.setdefault(name, [])
        if len(where) < 3:
            where.append(f"{file.relative_to(ROOT)}:{line}")

    for file in files:
        tree = ast.parse(file.read_text(), str(file))
        aliases: dict[str, str] = {}  # a local name -> the dotted torch / Triton object it stands for
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] in ROOTS:
                        local = alias.asname or alias.name.split(".")[0]
                        aliases[local] = alias.name if alias.asname else local
                        add(alias.name, file, node.lineno)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] in ROOTS:
                for alias in node.names:
                    aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                    add(f"{node.module}.{alias.name}", file, node.lineno)
        inner = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or id(node) in inner:
                continue  # only whole chains: torch.cuda.Event, not torch.cuda as well
            chain, base = [], node
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in aliases:
                add(".".join([aliases[base.id], *reversed(chain)]), file, node.lineno)
    return dict(sorted(uses.items()))


def lookup(dotted: str) -> object:
    """The object ``dotted`` names: the longest importable module prefix, then attributes; raises if missing."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for index, attr in enumerate(parts[cut:], cut):
            try:
                obj = getattr(obj, attr)
            except AttributeError:
                raise LookupError(f"no {attr!r} in {'.'.join(parts[:index])}") from None
        return obj
    raise LookupError(f"cannot import {parts[0]}")


def resolve(dotted: str) -> tuple[bool, str]:
    """Whether ``dotted`` exists here; what it is, or why not (a module that imports but breaks says how)."""
    try:
        return True, type(lookup(dotted)).__name__
    except Exception as err:
        return False, (str(err) if isinstance(err, LookupError) else f"{type(err).__name__}: {err}")[:300]


def _signature_has(dotted: str, *names: str) -> dict:
    try:
        obj = lookup(dotted)
    except Exception as err:
        return {"ok": False, "detail": f"{type(err).__name__}: {err}"[:300]}
    try:
        params = list(inspect.signature(obj).parameters)
    except (TypeError, ValueError) as err:  # a builtin without a signature: its docstring's first lines instead
        doc = (getattr(obj, "__doc__", None) or "").strip().splitlines()[:3]
        present = [n for n in names if any(n in line for line in doc)]
        return {"ok": len(present) == len(names), "detail": f"no signature ({err}); doc: {doc[:1]}"}
    missing = [n for n in names if n not in params]
    return {"ok": not missing, "parameters": params, **({"missing": missing} if missing else {})}


def signature_checks() -> dict[str, dict]:
    """Keywords our calls pass, present in the signatures here."""
    checks = {
        "_compute_local_shape_and_global_offset(skip_offset=)": (
            "torch.distributed.tensor._utils._compute_local_shape_and_global_offset",
            "skip_offset",
        ),
        "grouped_mm(offs=)": ("torch.nn.functional.grouped_mm", "offs"),
        "checkpoint(use_reentrant=)": ("torch.utils.checkpoint.checkpoint", "use_reentrant"),
        "DTensor.from_local(run_check=, shape=, stride=)": (
            "torch.distributed.tensor.DTensor.from_local",
            "run_check",
            "shape",
            "stride",
        ),
        "fully_shard(mp_policy=, reshard_after_forward=)": (
            "torch.distributed.fsdp.fully_shard",
            "mp_policy",
            "reshard_after_forward",
        ),
        "clip_grad_norm_(foreach=)": ("torch.nn.utils.clip_grad_norm_", "foreach"),
    }
    out = {}
    for label, (dotted, *names) in checks.items():
        try:
            out[label] = _signature_has(dotted, *names)
        except Exception as err:
            out[label] = {"ok": False, "detail": f"{type(err).__name__}: {err}"[:300]}
    try:  # the pipelining schedules moe_parallel names by class
        from moe_parallel.schedules import SCHEDULES

        names = [s.torch_class for s in SCHEDULES.values()]
    except Exception:
        names = ["Schedule1F1B", "ScheduleGPipe", "ScheduleInterleaved1F1B", "ScheduleZBVZeroBubble"]
        names.append("ScheduleDualPipeV")
    for name in names:
        ok, what = resolve(f"torch.distributed.pipelining.schedules.{name}")
        out[f"pipelining schedule {name}"] = {"ok": ok, "detail": what}
    return out


# ----------------------------------------------------------------------------------------------- calls that must work


def _grouped_mm(device: str) -> str:
    import torch
    import torch.nn.functional as F

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    x = torch.randn(64, 32, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(4, 32, 48, device=device, dtype=dtype, requires_grad=True)
    offs = torch.tensor([16, 32, 48, 64], device=device, dtype=torch.int32)
    y = F.grouped_mm(x, w, offs=offs)
    y.backward(torch.randn_like(y))  # a dense gradient: sum()'s is stride-0
    ref = torch.cat([x[i * 16 : (i + 1) * 16] @ w[i] for i in range(4)])
    err = (y - ref).abs().max().item()
    return f"{dtype}, forward + backward, max |diff| vs a loop {err:.3g}"


def _scaled_mm() -> str:
    import torch

    a = torch.randn(64, 64, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(64, 64, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    out = torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    return f"fp8 e4m3 per-tensor -> {out.dtype} {tuple(out.shape)}"


def _triton_permutation() -> str:
    import torch

    from moe_dispatch.permutation import make_permutation_map, permute

    idx = torch.stack([torch.randperm(8)[:2] for _ in range(32)]).cuda()
    pmap = make_permutation_map(idx, 8)
    x = torch.randn(32, 64, device="cuda")
    same = torch.equal(permute(x, pmap, backend="triton"), permute(x, pmap, backend="torch"))
    return f"triton permute == torch permute: {same}"


def _inductor() -> str:
    import torch

    f = torch.compile(lambda x: torch.nn.functional.silu(x) * 2 + 1)
    x = torch.randn(1024, device="cuda")
    return f"inductor on CUDA, max |diff| {(f(x) - (torch.nn.functional.silu(x) * 2 + 1)).abs().max().item():.3g}"


def _sync_debug_warns() -> str:
    import torch

    x = torch.ones(4, device="cuda")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            x.sum().item()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    n = sum("synchroniz" in str(w.message).lower() for w in caught)
    if not n:
        raise AssertionError(f".item() under set_sync_debug_mode('warn') gave no warning ({len(caught)} others)")
    return f".item() gave {n} sync warning(s)"


def _pinned_copy() -> str:
    import torch

    host = torch.empty(1 << 20, pin_memory=True)
    dev = torch.randn(1 << 20, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())  # dev is written on the current stream: copy after it
    with torch.cuda.stream(stream):
        host.copy_(dev, non_blocking=True)
    stream.synchronize()
    return f"pinned {host.is_pinned()}, equal {torch.equal(host, dev.cpu())}"


def run_checks(cuda: bool) -> dict[str, dict]:
    checks: dict[str, Callable[[], str]] = {"grouped_mm": lambda: _grouped_mm("cuda" if cuda else "cpu")}
    gpu_checks = {
        "_scaled_mm fp8": _scaled_mm,
        "triton permutation": _triton_permutation,
        "pinned side-stream copy": _pinned_copy,
        "sync debug warning": _sync_debug_warns,
        "inductor compile": _inductor,
    }
    out = {}
    for name, check in {**checks, **gpu_checks}.items():
        if name in gpu_checks and not cuda:
            out[name] = {"ok": None, "detail": "not applicable: no CUDA device"}
            continue
        start = time.perf_counter()
        try:
            out[name] = {"ok": True, "detail": check()}
        except Exception as err:
            out[name] = {"ok": False, "detail": f"{type(err).__name__}: {err}"[:500]}
            out[name]["traceback"] = traceback.format_exc()[-1500:]
        out[name]["seconds"] = round(time.perf_counter() - start, 2)
    return out


# ----------------------------------------------------------------------------------------------- versions


def versions() -> dict:
    out: dict = {"python": sys.version.split()[0], "platform": platform.platform(), "executable": sys.executable}
    for dist in DISTRIBUTIONS:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    for module in ("pytest", "hypothesis"):  # from the deps folder or the machine's own
        spec = importlib.util.find_spec(module)
        out[f"{module}_from"] = str(Path(spec.origin).parent.parent) if spec and spec.origin else None
    try:
        import torch

        out["torch"] = torch.__version__
        out["torch_cuda"] = torch.version.cuda
        out["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
    except Exception as err:
        out["torch_error"] = f"{type(err).__name__}: {err}"
    with contextlib.suppress(Exception):
        import triton

        out["triton"] = triton.__version__
    # Triton builds its CUDA launcher with a C compiler ($CC, else cc / gcc / clang): without one, every Triton
    # kernel (the permutation, inductor's) fails at its first launch
    out["c_compiler"] = os.environ.get("CC") or next(
        (found for name in ("cc", "gcc", "clang") if (found := shutil.which(name))), None
    )
    return out


def card() -> dict:
    try:
        import torch

        if not torch.cuda.is_available():
            return {"cuda_available": False}
        props = torch.cuda.get_device_properties(0)
        out = {
            "cuda_available": True,
            "count": torch.cuda.device_count(),
            "name": props.name,
            "capability": list(torch.cuda.get_device_capability(0)),
            "memory_gib": round(props.total_memory / 2**30, 1),
            "multiprocessors": props.multi_processor_count,
        }
    except Exception as err:
        return {"error": f"{type(err).__name__}: {err}"}
    with contextlib.suppress(Exception):
        query = "--query-gpu=driver_version,power.limit,clocks.max.sm,mig.mode.current"
        smi = subprocess.run(["nvidia-smi", query, "--format=csv,noheader"], capture_output=True, text=True, timeout=15)
        out["nvidia_smi"] = smi.stdout.strip()
    return out


def import_ours() -> dict[str, str]:
    """Every module of our packages imported: ``ok`` or the error (a top-level import of what the machine lacks)."""
    out = {}
    for file in _src_files():
        src = next(p for p in file.parents if p.name == "src")
        parts = file.relative_to(src).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if parts[-1] == "__main__":
            continue
        try:
            importlib.import_module(name)
            out[name] = "ok"
        except BaseException as err:  # SystemExit included: a module must not exit on import
            out[name] = f"{type(err).__name__}: {err}"[:300]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    start = time.perf_counter()
    report: dict = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "versions": versions(),
        "card": card(),
        "env": {k: os.environ.get(k) for k in ("PYTHONPATH", "CUDA_VISIBLE_DEVICES", "TRITON_INTERPRET")},
    }
    timings = {}
    mark = time.perf_counter()
    apis = collect_apis(_src_files())
    listed = {name: {"used_at": where} for name, where in apis.items()}
    for name in EXTRA:
        listed.setdefault(name, {"used_at": ["(EXTRA)"]})
    missing = []
    for name, entry in sorted(listed.items()):
        entry["present"], entry["detail"] = resolve(name)
        if not entry["present"]:
            missing.append(name)
    report["apis"] = dict(sorted(listed.items()))
    report["apis_missing"] = missing
    report["signatures"] = signature_checks()
    timings["apis"], mark = time.perf_counter() - mark, time.perf_counter()
    report["our_modules"] = import_ours()
    timings["our_modules"], mark = time.perf_counter() - mark, time.perf_counter()
    report["checks"] = run_checks(bool(report["card"].get("cuda_available")))
    timings["checks"] = time.perf_counter() - mark
    report["part_seconds"] = {k: round(v, 1) for k, v in timings.items()}
    report["seconds"] = round(time.perf_counter() - start, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=str) + "\n")

    v, c = report["versions"], report["card"]
    print(f"python {v['python']}  torch {v.get('torch')} (CUDA {v.get('torch_cuda')})  triton {v.get('triton')}")
    print(
        f"transformers {v.get('transformers')}  pytest {v.get('pytest')}  hypothesis {v.get('hypothesis')}  "
        f"C compiler {v.get('c_compiler')}"
    )
    print(f"card: {c.get('name', 'none')} {c.get('capability', '')} {c.get('memory_gib', '')} GiB x{c.get('count', 0)}")
    print(f"APIs: {len(listed)} listed, {len(missing)} missing" + (f": {', '.join(missing)}" if missing else ""))
    for label, result in {**report["signatures"], **report["checks"]}.items():
        if result.get("ok") is False:
            print(f"  NOT OK {label}: {result.get('detail') or result.get('missing')}")
    bad = {k: e for k, e in report["our_modules"].items() if e != "ok"}
    print(f"our modules: {len(report['our_modules']) - len(bad)} import, {len(bad)} do not")
    for name, err in bad.items():
        print(f"  {name}: {err}")
    print(f"wrote {args.out} ({report['seconds']} s)")


if __name__ == "__main__":
    main()
