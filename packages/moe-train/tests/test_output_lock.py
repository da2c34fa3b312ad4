"""One run per output directory at a time: a second run is a one-line error naming the holder's PID, a lock left by
a dead run is taken over, and two runs started together into one directory end with one run's files, whole."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moe_train import cli
from moe_train.config import load_config
from moe_train.config_error import ConfigError
from moe_train.output_lock import LOCK_FILE, OutputDirLock
from moe_train.resume import WRITE_PROBE_PREFIX, check_output_dir

SMALL = ["--model.num_layers", "1", "--data.seq_len", "16", "--train.global_batch_size", "4", "--run.log_interval", "1"]


def _train(out: Path, *extra: str, steps: int = 2) -> int:
    return cli.main(["train", *SMALL, "--train.steps", str(steps), "--run.output_dir", str(out), *extra])


def test_a_directory_another_run_holds_is_refused_naming_its_pid(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    holder = OutputDirLock(str(out)).acquire()  # as a live run holds it (another open file description)
    try:
        for extra in ([], ["--run.resume", "auto"], ["--run.overwrite", "true"]):
            capsys.readouterr()
            assert _train(out, *extra) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and "Traceback" not in err, err
            assert f"is in use by another moe-train run (PID {os.getpid()} on " in err
            assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE]  # nothing written, nothing cleared
    finally:
        holder.release()
    assert _train(out) == 0  # released: the directory is free again
    assert (out / "summary.json").is_file()


def test_a_lock_left_by_a_dead_run_is_taken_over(tmp_path: Path) -> None:
    out = tmp_path / "run"
    dead = subprocess.run(  # a process that took the lock and died: the kernel dropped its lock
        [
            sys.executable,
            "-c",
            f"from moe_train.output_lock import OutputDirLock; OutputDirLock({str(out)!r}).acquire()",
        ],
        check=True,
    )
    assert dead.returncode == 0 and (out / LOCK_FILE).read_text().split()[0].isdigit()
    assert _train(out, "--run.resume", "auto") == 0
    assert (out / LOCK_FILE).read_text().split()[0] == str(os.getpid())


def test_a_run_that_stops_before_writing_leaves_no_directory(tmp_path: Path) -> None:
    """The lock creates the directory; a run that fails before writing anything (here: a checkpoint whose data file
    is gone, found only once it is read, after the lock is taken) removes it again."""
    first = tmp_path / "first"
    assert _train(first) == 0
    broken = tmp_path / "broken"
    shutil.copytree(first / "checkpoints" / "step_2", broken)
    (broken / "__0_0.distcp").unlink()
    out = tmp_path / "resumed"
    assert _train(out, "--run.resume", str(broken), steps=3) == 2
    assert not out.exists()


def test_two_runs_started_together_into_one_directory(tmp_path: Path, data_cache: Path) -> None:
    """The issue's probe: both passed the emptiness check; one died inside ``.step_1.partial``, the other wrote two
    records on one line. Now one trains and the other is refused in one line (in use, or not empty if the first one
    already finished), and every line of metrics.jsonl is one record."""
    out = tmp_path / "run"
    args = [*SMALL, "--train.steps", "30", "--run.output_dir", str(out), "--data.cache_dir", str(data_cache)]
    assert _train(tmp_path / "warm", "--data.cache_dir", str(data_cache)) == 0  # the token cache, built once
    runs = [
        subprocess.Popen(
            [sys.executable, "-m", "moe_train", "train", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = [(run.wait(timeout=300), run.stderr.read()) for run in runs]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 2], results
    (refused,) = [err for code, err in results if code == 2]
    assert refused.count("\n") == 1 and ("is in use by another moe-train run (PID" in refused or "not empty" in refused)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 31))


def test_another_rank_checking_the_directory_is_not_an_earlier_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every rank of a run checks the output directory before the group forms, while the main rank may hold the lock
    (which makes the directory) and probe it for writing: a snapshot of it then is no earlier run's files. (CI once
    saw one rank refuse the directory over another rank's write probe.)"""
    out = tmp_path / "run"
    cfg = load_config("tiny", {"run.output_dir": str(out)})
    monkeypatch.setenv("RANK", "1")  # this process plays a rank other than the lock's holder
    holder = OutputDirLock(str(out)).acquire()
    try:
        (out / f"{WRITE_PROBE_PREFIX}abc123").mkdir()  # another rank's probe, caught before its cleanup
        check_output_dir(cfg)
        (out / "metrics.jsonl").write_text("{}\n")  # an earlier run's file still is
        with pytest.raises(ConfigError, match="is not empty"):
            check_output_dir(cfg)
    finally:
        holder.release()
