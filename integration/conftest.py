import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest


def _run(args: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run a console script of this environment (moe-train, torchrun) and capture its output."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    executable = str(Path(sys.executable).parent / args[0])
    return subprocess.run([executable, *args[1:]], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def run() -> Callable[..., subprocess.CompletedProcess[str]]:
    return _run


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("data-cache")
