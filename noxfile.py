"""Test sessions. ``uv run nox`` runs them all; ``uv run nox -s moe-dispatch`` runs one.

Each package session syncs only that package, its declared dependencies and its dev group from
uv.lock into a fresh environment, so a test that needs an undeclared package fails there: this is
what proves every package installs and imports alone.

``floors`` (not in the default run: CI's 25-minute budget) runs the library packages' suites on the oldest torch
they declare (2.11, what the first GPU machine runs) and on 2.13, each with the oldest Triton (3.6), from source:
``uv run nox -s floors`` runs both, ``uv run nox -s "floors(torch='2.11.0')"`` one.
"""

from __future__ import annotations

import os
from pathlib import Path

import nox

nox.options.default_venv_backend = "uv"
nox.options.reuse_venv = "yes"
nox.options.error_on_missing_interpreters = True

ROOT = Path(__file__).parent
REPORTS = ROOT / ".ci-reports"
PACKAGES = [
    "moe-dispatch",
    "moe-experts",
    "moe-precision",
    "moe-parallel",
    "moe-memory",
    "moe-models",
    "moe-train",
]


def sync(session: nox.Session, *args: str) -> None:
    """Install from uv.lock into this session's environment (exactly: nothing else stays)."""
    env = {"UV_PROJECT_ENVIRONMENT": session.virtualenv.location}
    session.run_install("uv", "sync", "--frozen", "--no-progress", *args, env=env, external=True)


def pytest(session: nox.Session, *paths: str, report: str = "") -> None:
    REPORTS.mkdir(exist_ok=True)
    session.run(
        "pytest",
        *paths,
        "-q",
        f"--junitxml={REPORTS / (report or session.name)}.xml",
        *session.posargs,
        env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(os.cpu_count() or 1))},
        success_codes=[0, 5],  # 5: no tests collected
    )


def _package_session(dist: str) -> None:
    @nox.session(name=dist)
    def run(session: nox.Session) -> None:
        sync(session, "--package", dist)
        pytest(session, f"packages/{dist}/tests")


for _dist in PACKAGES:
    _package_session(_dist)

nox.options.sessions = [*PACKAGES, "integration", "lint", "benchmarks"]

# the oldest torch and Triton the packages declare (pyproject.toml; the first GPU machine runs torch 2.11.0+cu130 and
# Triton 3.6), tested by the floors session, and the later torch releases it tests too, each with that Triton
FLOOR_TORCH, FLOOR_TRITON = "2.11.0", "3.6.0"
FLOOR_TORCHES = (FLOOR_TORCH, "2.13.0")
LIBRARY_PACKAGES = [d for d in PACKAGES if d != "moe-train"]  # moe-train's data stack is tested on the lock only


def _torch_requirement(version: str) -> str:
    """A CPU build on disk where these machines hold one (/opt/wheels: 2.13's), else the registry's build: PyPI's
    Linux wheels are CUDA builds (2.11.0: CUDA 13.0, with its nvidia-* libraries, 4.7 GB installed; run on the CPU).
    PyTorch's own CPU index is out of reach of these machines."""
    wheel = next(Path("/opt/wheels").glob(f"torch-{version}+cpu-*.whl"), None)
    return str(wheel) if wheel is not None else f"torch=={version}"


@nox.session
@nox.parametrize("torch", FLOOR_TORCHES)
def floors(session: nox.Session, torch: str) -> None:
    """The library packages' suites on one torch release and Triton 3.6, from source (PYTHONPATH to each package's
    src/), as the GPU machine runs them."""
    deps = ["pytest>=8", "hypothesis>=6", "numpy>=1.26", "safetensors>=0.4", "pyyaml>=6", "transformers>=5"]
    session.install(_torch_requirement(torch), f"triton=={FLOOR_TRITON}", *deps)
    session.run(
        "python",
        "-c",
        f"import torch, triton; assert torch.__version__.split('+')[0] == '{torch}', torch.__version__; "
        f"assert triton.__version__ == '{FLOOR_TRITON}', triton.__version__",
    )
    src = os.pathsep.join(str(ROOT / "packages" / dist / "src") for dist in PACKAGES)
    for dist in LIBRARY_PACKAGES:
        session.run(
            "pytest",
            f"packages/{dist}/tests",
            "-q",
            "-k",
            "not test_version",  # the installed distribution's version: nothing is installed here
            *session.posargs,
            env={"PYTHONPATH": src, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(os.cpu_count() or 1))},
        )


@nox.session
def integration(session: nox.Session) -> None:
    """All packages together: the CLI end to end, torchrun data parallel, docs in step with the code."""
    sync(session)
    # the device harness registers a torch backend for the rest of its process (one per process, never undone): it
    # gets a process of its own, so that no other test meets that backend (transformers' loading, DCP's writer do)
    pytest(session, "integration", "--ignore", "integration/test_device_correct.py")
    pytest(session, "integration/test_device_correct.py", report="integration-device")


@nox.session
def lint(session: nox.Session) -> None:
    """ruff, and the allowed imports between packages (import-linter contracts in pyproject.toml)."""
    sync(session)
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("lint-imports")


@nox.session
def benchmarks(session: nox.Session) -> None:
    """Every benchmarks/*.py script in its quick mode, all in one process (imports paid once:
    benchmarks/_quick_all.py); full runs write benchmarks/results/*.json."""
    sync(session)
    REPORTS.mkdir(exist_ok=True)
    session.run("python", str(ROOT / "benchmarks" / "_quick_all.py"), str(REPORTS))
    # the GPU check (benchmarks/gpu/gpu_check.sh: probe, gpu tests, every suite section, one JSON) at tiny sizes on
    # the CPU, from source as the GPU machine runs it; and the test-dependency folder it carries, built from uv.lock
    pytest(session, "benchmarks/gpu/test_gpu_check.py")
