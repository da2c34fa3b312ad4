"""Writes that fail: a full disk (a real one: a small tmpfs in a mount namespace of its own), a file-size limit the
kernel enforces, a metrics file on /dev/full, and a second Ctrl-C during a save. Each is one line with exit code 2
(130 for the interrupt) naming the file and why; partial files are removed and the last complete checkpoint stays
intact and resumable."""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed.checkpoint.filesystem as dcp_filesystem

from moe_train import cli
from moe_train.checkpoint import list_checkpoints, load_checkpoint
from moe_train.export import load_trained_model

SMALL = ["--model.num_layers", "1", "--data.seq_len", "16", "--train.global_batch_size", "4", "--run.log_interval", "1"]


def _args(out: Path, data_cache: Path, *extra: str, steps: int = 6) -> list[str]:
    run = ["--train.steps", str(steps), "--run.output_dir", str(out), "--data.cache_dir", str(data_cache)]
    return ["train", *SMALL, *run, *extra]


def _one_line(err: str) -> str:
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.fixture(scope="module")
def warm_cache(tmp_path_factory: pytest.TempPathFactory, data_cache: Path) -> Path:
    """The token cache built once, so that the runs under a file-size limit or on a small disk only write the run."""
    assert cli.main(_args(tmp_path_factory.mktemp("warm") / "run", data_cache, steps=1)) == 0
    return data_cache


def _limit_file_size(limit: int):
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def test_a_checkpoint_that_cannot_be_written_is_one_line_and_the_last_one_stays(
    tmp_path: Path, warm_cache: Path
) -> None:
    """The kernel refuses the checkpoint's data file past 1 MiB (it is about 11 MiB); the metrics are smaller. The
    old code: a raw CheckpointException traceback, exit 1, a ``.step_3.partial`` holding the space, no summary."""
    out = tmp_path / "run"
    assert cli.main(_args(out, warm_cache, "--run.checkpoint_interval", "2", "--run.exit_interval", "2")) == 0
    resumed = subprocess.run(
        [sys.executable, "-m", "moe_train", *_args(out, warm_cache, "--run.resume", "auto")],
        preexec_fn=_limit_file_size(1 << 20),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 2, resumed.stderr[-3000:]
    line = _one_line(resumed.stderr)
    assert "checkpoint of step 6 not saved: cannot write" in line and "File too large" in line
    assert f"the last complete checkpoint is {out / 'checkpoints' / 'step_2'}" in line
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_2"]  # no partial left
    _, model = load_trained_model(out)  # intact
    assert cli.main(_args(out, warm_cache, "--run.resume", "auto")) == 0  # and resumable once there is room
    assert [c.step for c in list_checkpoints(out / "checkpoints")] == [2, 6]
    del model


def test_metrics_on_a_full_device_stop_the_run_in_one_line(
    tmp_path: Path, warm_cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").symlink_to("/dev/full")  # every write: ENOSPC, from the kernel
    assert cli.main(_args(out, warm_cache, "--run.resume", "auto")) == 2
    line = _one_line(capsys.readouterr().err)
    assert f"cannot write {out / 'metrics.jsonl'}: No space left on device; the run stopped at step 1" in line


def test_a_second_ctrl_c_during_a_save_removes_it_and_exits_130(
    tmp_path: Path, warm_cache: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C twice while the checkpoint's tensors are written (real SIGINTs, from inside DCP's write): the old code
    printed a KeyboardInterrupt traceback and left the ``.step_N.partial`` that nothing ever removed."""
    out = tmp_path / "run"
    assert cli.main(_args(out, warm_cache, "--run.exit_interval", "2")) == 0
    write_item = dcp_filesystem._write_item

    def interrupted_twice(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # the first asks to stop after the step (the save goes on)
        os.kill(os.getpid(), signal.SIGINT)  # the second interrupts at once
        return write_item(*args, **kwargs)

    monkeypatch.setattr(dcp_filesystem, "_write_item", interrupted_twice)
    capsys.readouterr()
    assert cli.main(_args(out, warm_cache, "--run.resume", "auto", "--run.exit_interval", "4")) == 130
    line = _one_line(capsys.readouterr().err)
    assert "interrupted during the checkpoint save of step 4 (removed)" in line
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_2"]
    monkeypatch.undo()
    model = load_trained_model(out)[1]
    assert load_checkpoint(out / "checkpoints" / "step_2", model) == 2


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-Urm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"], capture_output=True, timeout=30
    )
    return probe.returncode == 0


FULL_DISK = """
set -u
mount -t tmpfs -o size=15m tmpfs "$DISK"
"$PY" -m moe_train {args} --run.checkpoint_interval 1 > /dev/null 2> "$LOGS/first.err"; echo $? > "$LOGS/first.rc"
ls -a "$DISK/run/checkpoints" > "$LOGS/first.ls"
"$PY" -c "from moe_train.export import load_trained_model; load_trained_model('$DISK/run')" && touch "$LOGS/loads"
dd if=/dev/zero of="$DISK/filler" bs=64k 2> /dev/null
"$PY" -m moe_train {args} --run.resume auto > /dev/null 2> "$LOGS/second.err"; echo $? > "$LOGS/second.rc"
ls -a "$DISK/run" > "$LOGS/second.ls"
"""


@pytest.mark.skipif(not _unshare_works(), reason="needs unshare -Urm (user and mount namespaces) to mount a tmpfs")
def test_a_full_disk(tmp_path: Path, warm_cache: Path) -> None:
    """A 15 MiB tmpfs holds the first checkpoint (about 11 MiB), not the second: one line saying the disk is full,
    the partial removed, the first checkpoint loadable; then, with the disk filled up, a resume is one line too and
    leaves no ``metrics.jsonl.tmp`` (the old code: a traceback and a 0-byte one)."""
    disk, logs = tmp_path / "disk", tmp_path / "logs"
    disk.mkdir()
    logs.mkdir()
    args = " ".join(_args(disk / "run", warm_cache))
    env = {**os.environ, "DISK": str(disk), "LOGS": str(logs), "PY": sys.executable}
    subprocess.run(["unshare", "-Urm", "sh", "-c", FULL_DISK.format(args=args)], env=env, check=True, timeout=600)
    first = (logs / "first.err").read_text()
    assert (logs / "first.rc").read_text().strip() == "2", first
    line = _one_line(first)
    assert "checkpoint of step 2 not saved: cannot write" in line and "No space left on device" in line
    assert "the last complete checkpoint is" in line and line.rstrip().endswith("--run.resume auto")
    assert (logs / "first.ls").read_text().split() == [".", "..", "step_1"]
    assert (logs / "loads").exists()
    second = (logs / "second.err").read_text()
    assert (logs / "second.rc").read_text().strip() == "2", second
    assert "No space left on device; the run did not start" in _one_line(second)
    assert "metrics.jsonl.tmp" not in (logs / "second.ls").read_text()


@pytest.mark.dist
def test_a_checkpoint_the_main_rank_cannot_publish_stops_every_rank(launch_gloo_workers, tmp_path: Path) -> None:
    """Two gloo ranks save; the main rank's meta.json write fails (ENOSPC). The main rank reports the write, the other
    stops quietly: neither waits in a barrier for the other (the old code left rank 1 in the barrier for good)."""
    results = launch_gloo_workers(Path(__file__), 2, tmp_path, timeout=120)
    assert results[0]["error"] == "CheckpointWriteError" and "No space left on device" in results[0]["message"]
    assert results[1]["error"] == "OtherRankFailed"
    assert not list((tmp_path / "checkpoints").iterdir())  # the partial save is gone


def _worker(out: Path) -> None:
    import errno

    import torch
    import torch.distributed as dist
    from torch import nn

    import moe_train.checkpoint as checkpoint

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 0:

        def full_disk(path: Path, value: dict) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

        checkpoint._write_json = full_disk
    model = nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    try:
        checkpoint.CheckpointWriter(out / "checkpoints").save(1, model, optimizer, {})
        result = {"error": None, "message": ""}
    except Exception as err:
        result = {"error": type(err).__name__, "message": str(err)}
    torch.save(result, out / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
