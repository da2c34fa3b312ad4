"""Test sessions. ``uv run nox`` runs them all; ``uv run nox -s moe-dispatch`` runs one.

Each package session syncs only that package, its declared dependencies and its dev group from
uv.lock into a fresh environment, so a test that needs an undeclared package fails there: this is
what proves every package installs and imports alone.
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


def pytest(session: nox.Session, *paths: str) -> None:
    REPORTS.mkdir(exist_ok=True)
    session.run(
        "pytest",
        *paths,
        "-q",
        f"--junitxml={REPORTS / session.name}.xml",
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


@nox.session
def integration(session: nox.Session) -> None:
    """All packages together: the CLI end to end, torchrun data parallel, docs in step with the code."""
    sync(session)
    pytest(session, "integration")


@nox.session
def lint(session: nox.Session) -> None:
    """ruff, and the allowed imports between packages (import-linter contracts in pyproject.toml)."""
    sync(session)
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("lint-imports")


@nox.session
def benchmarks(session: nox.Session) -> None:
    """Every benchmarks/*.py script in its quick mode; full runs write benchmarks/results/*.json."""
    sync(session)
    REPORTS.mkdir(exist_ok=True)
    for script in sorted((ROOT / "benchmarks").glob("[!_]*.py")):  # _*.py: helpers the scripts import
        session.run("python", str(script), "--quick", "--out", str(REPORTS / f"bench-{script.stem}.json"))
