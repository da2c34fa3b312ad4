import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

# the workers beside this file (_*.py) import as top-level modules under importlib import mode
sys.path.insert(0, str(Path(__file__).parent))


def _run(args: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run a console script of this environment (moe-train, torchrun) and capture its output."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    executable = str(Path(sys.executable).parent / args[0])
    # a session of its own, so a hung torchrun is killed together with its worker processes
    with subprocess.Popen(
        [executable, *args[1:]],
        cwd=cwd,
        env=env,
        text=True,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    ) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


@pytest.fixture(scope="session")
def run() -> Callable[..., subprocess.CompletedProcess[str]]:
    return _run


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("data-cache")
