"""The GPU check's plumbing on the CPU (the nox ``benchmarks`` session): ``gpu_check.sh --smoke`` runs every step
and writes one JSON with every suite section's result; the test-dependency folder builds from uv.lock under 10 MB;
the merge records a section whose process died."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
import build_test_deps  # noqa: E402
import merge_check  # noqa: E402

SECTION_KEYS = {  # what each section's result must hold (not an error)
    "step": {"eager", "compiled", "compiled_speedup", "flops_per_step"},
    "experts": {"experts_block", "grouped_mm_alone", "block_over_grouped_mm"},
    "permutation": {"permute", "unpermute", "permute_over_copy"},
    "fp8": {"shape", "native"},
    "offload": {"variants"},
    "sync": {"steps", "per_step_after_warm_up"},
    "graphs": {"capture_problems", "graphed"},
}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, dict, float]:
    out = tmp_path_factory.mktemp("gpu_check")
    env = {**os.environ, "PYTHON": sys.executable}
    start = time.perf_counter()
    done = subprocess.run(
        ["bash", str(HERE / "gpu_check.sh"), str(out), "--smoke", "--deps", "none"],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    seconds = time.perf_counter() - start
    print(done.stdout[-6000:], done.stderr[-3000:], f"gpu_check.sh --smoke: {seconds:.0f} s", sep="\n")
    report = json.loads((out / "gpu_check.json").read_text())
    return done, report, seconds


def test_smoke_runs_every_step_and_section(smoke: tuple[subprocess.CompletedProcess, dict, float]) -> None:
    done, report, _ = smoke
    assert done.returncode == 0, done.stdout[-4000:]
    assert report["smoke"] is True
    assert {n: s["status"] for n, s in report["steps"].items()} == {"probe": "ok", "tests": "ok", "suite:suite": "ok"}
    assert set(report["sections"]) == set(SECTION_KEYS)
    for name, keys in SECTION_KEYS.items():
        result = report["sections"][name]
        assert "error" not in result, (name, result.get("error"), result.get("traceback"))
        assert keys <= set(result), (name, sorted(result))
    sync = report["sections"]["sync"]
    assert [s["step"] for s in sync["steps"]] == [1, 2, 3]
    assert sync["steps"][-1]["cuda_sync_warnings"] == "not applicable"  # the CPU: the dispatcher count only
    assert set(sync["steps"][-1]["phases"]) == {"forward", "backward", "optimizer"}
    assert all(v["loss_equal"] for v in report["sections"]["offload"]["variants"].values())


def test_smoke_probe_and_tests_summary(smoke: tuple[subprocess.CompletedProcess, dict, float]) -> None:
    _, report, _ = smoke
    probe = report["probe"]
    assert report["versions"]["torch"] and report["versions"]["python"]
    assert report["card"] == {"cuda_available": False}
    # the scan found the APIs the code uses, resolved each, and every module of ours imports
    for name in ("torch.nn.functional.grouped_mm", "torch.float8_e8m0fnu", "torch.compiler.is_compiling"):
        assert probe["apis"][name]["present"] is True, name
    assert "torch.distributed.tensor._utils._compute_local_shape_and_global_offset" in probe["apis"]
    assert probe["signatures"]["_compute_local_shape_and_global_offset(skip_offset=)"]["ok"] is True
    assert set(probe["our_modules"].values()) == {"ok"}
    assert probe["checks"]["grouped_mm"]["ok"] is True
    assert probe["checks"]["_scaled_mm fp8"]["ok"] is None  # not applicable without CUDA
    # the gpu-marked module collected and skipped cleanly on the CPU
    tests = report["tests"]
    assert tests["tests"] > 0 and tests["skipped"] == tests["tests"] and not tests["problems"]


def test_merge_records_a_section_whose_process_died(tmp_path: Path) -> None:
    (tmp_path / "suite").mkdir()
    (tmp_path / "suite" / "step.json").write_text(json.dumps({"device": "x", "step": {"eager": {}}}))
    log = tmp_path / "fp8.log"
    log.write_text("compiling\nRuntimeError: CUDA error: an illegal memory access was encountered\n")
    rows = ["name\trc\tseconds\tbudget_s\tlog", f"suite:step\t0\t3.0\t150\t{log}", f"suite:fp8\t124\t45.0\t45\t{log}"]
    (tmp_path / "steps.tsv").write_text("\n".join(rows) + "\n")
    sys_argv = sys.argv
    sys.argv = ["merge_check.py", str(tmp_path)]
    try:
        assert merge_check.main() == 1
    finally:
        sys.argv = sys_argv
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["sections"]["step"] == {"eager": {}}
    assert report["sections"]["fp8"]["error"] == "no result: step exited 124 (timed out)"
    assert "illegal memory access" in report["sections"]["fp8"]["log_tail"][-1]
    assert report["sections"]["sync"]["error"] == "no result: its step did not run"
    assert report["steps"]["suite:fp8"]["status"] == "timed out"
    assert "error" in report["probe"] and "error" in report["tests"]


def test_test_deps_build_from_the_lock_under_10_mb(tmp_path: Path) -> None:
    if shutil.which("uv") is None:
        pytest.skip("uv is not on PATH")
    out = tmp_path / "deps"
    try:
        manifest = build_test_deps.build(out)
    except RuntimeError as err:
        if any(w in str(err).lower() for w in ("fetch", "connect", "network", "dns", "offline", "timed out")):
            pytest.skip(f"the registry is not reachable: {str(err)[-300:]}")
        raise
    lock = build_test_deps.lock_packages(REPO / "uv.lock")
    assert {"pytest", "hypothesis", "pluggy", "iniconfig", "packaging", "sortedcontainers"} <= set(manifest["packages"])
    for name, version in manifest["packages"].items():
        assert lock[name]["version"] == version, name
        dist = name.replace("-", "_")
        assert (out / f"{dist}-{version}.dist-info").is_dir(), name
    assert manifest["python"] == "3.12"
    assert build_test_deps.folder_bytes(out) < build_test_deps.LIMIT_BYTES
    python312 = _python("3.12")
    if python312:  # the GPU machine's Python: both import from the folder alone
        code = "import sys; sys.path.insert(0, sys.argv[1]); import pytest, hypothesis; print(pytest.__version__, "
        code += "hypothesis.__version__, pytest.__file__)"
        done = subprocess.run([python312, "-I", "-c", code, str(out)], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        versions = done.stdout.split()
        assert versions[:2] == [manifest["packages"]["pytest"], manifest["packages"]["hypothesis"]]
        assert versions[2].startswith(str(out))


def _python(version: str) -> str | None:
    """A ``python<version>`` on PATH that runs (a pyenv shim of a version not selected does not), else None."""
    found = shutil.which(f"python{version}")
    if found and subprocess.run([found, "-c", "pass"], capture_output=True, timeout=60).returncode == 0:
        return found
    return None
