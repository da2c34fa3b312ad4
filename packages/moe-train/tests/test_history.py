"""One history per output directory: resuming from an earlier checkpoint sets the later ones aside, cuts the metrics
and TensorBoard events back to it, ``keep_last`` never deletes the newest checkpoint of the history, and
``run.resume auto`` continues the history the last run wrote; saves that never finished are passed over (and said
so) and cleaned up."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from moe_train import cli
from moe_train.checkpoint import list_checkpoints

SMALL = ["--model.num_layers", "1", "--data.seq_len", "16", "--train.global_batch_size", "4", "--run.log_interval", "1"]


def _train(out: Path, *extra: str, steps: int) -> int:
    return cli.main(["train", *SMALL, "--train.steps", str(steps), "--run.output_dir", str(out), *extra])


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _tensorboard_steps(out: Path) -> list[int]:
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    return [event.step for event in events.Scalars("train/loss")]


@pytest.fixture(scope="module")
def original(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of 12 steps stopped at step 8 with a checkpoint every 2 steps (the history the tests below branch
    from; the learning-rate schedule depends on train.steps, so every run here has 12)."""
    out = tmp_path_factory.mktemp("original") / "run"
    assert _train(out, "--run.checkpoint_interval", "2", "--run.exit_interval", "8", steps=12) == 0
    return out


def _copy(original: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(original, out)
    return out


@pytest.mark.parametrize("keep_last", ["1", "0"])
def test_resuming_from_an_earlier_checkpoint_starts_a_new_history(
    original: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], keep_last: str
) -> None:
    """The issue's probe: resume from step_2 of a run that reached step_8, stop at step 3 and follow the advice
    (``--run.resume auto``). The old code resumed the second time from the abandoned step_8 (keep_last 1 had deleted
    the new step_3) or step_4 (keep_last 0), and metrics.jsonl ended [1, 2, 3, 9, 10]."""
    out = _copy(original, tmp_path)
    whole = {r["step"]: r["loss"] for r in _records(out)}
    branch = ["--run.keep_last", keep_last, "--run.exit_interval", "3"]
    capsys.readouterr()
    assert _train(out, "--run.resume", str(out / "checkpoints" / "step_2"), *branch, steps=12) == 0
    err = capsys.readouterr().err
    assert "abandons the history" in err and "step_4, step_6, step_8" in err
    (aside,) = (out / "checkpoints").glob("abandoned-*")
    assert sorted(p.name for p in aside.iterdir() if p.name.startswith("step_")) == ["step_4", "step_6", "step_8"]
    assert [r["step"] for r in _records(aside)] == list(range(1, 9))  # the abandoned history's, whole
    assert json.loads((aside / "summary.json").read_text())["steps"] == 8
    kept = [c.step for c in list_checkpoints(out / "checkpoints")]
    assert kept == ([3] if keep_last == "1" else [2, 3])
    assert [r["step"] for r in _records(out)] == [1, 2, 3]
    # the branch retraces the original history from step 2 on (same weights, data and seed)
    assert _records(out)[2]["loss"] == pytest.approx(whole[3], rel=1e-6)

    # TensorBoard orders event files by name: whole seconds, then host, pid and an in-process counter compared as
    # text ("10" < "9"), so two runs of one process within one second may be read in the wrong order
    time.sleep(1.1)
    assert _train(out, "--run.resume", "auto", *branch, steps=12) == 0
    assert [r["step"] for r in _records(out)] == list(range(1, 7))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from"].endswith("step_3") and summary["steps"] == 6
    assert [c.step for c in list_checkpoints(out / "checkpoints")][-1] == 6
    assert _tensorboard_steps(out) == list(range(1, 7))  # the abandoned steps 4-8 are purged from the events
    assert [r["loss"] for r in _records(out)[3:]] == pytest.approx([whole[s] for s in (4, 5, 6)], rel=1e-6)


def test_resuming_another_runs_checkpoint_sets_this_directorys_history_aside(original: Path, tmp_path: Path) -> None:
    out = tmp_path / "other"
    assert _train(out, "--train.seed", "5", "--run.checkpoint_interval", "1", "--run.exit_interval", "3", steps=12) == 0
    assert (
        _train(out, "--run.resume", str(original / "checkpoints" / "step_6"), "--run.exit_interval", "7", steps=12) == 0
    )
    assert [c.step for c in list_checkpoints(out / "checkpoints")] == [7]
    (aside,) = (out / "checkpoints").glob("abandoned-*")
    assert sorted(p.name for p in aside.iterdir()) == [
        "expert_load.svg",
        "loss.svg",
        "metrics.jsonl",
        "step_1",
        "step_2",
        "step_3",
        "summary.json",
        "tensorboard",
    ]
    assert [r["step"] for r in _records(out)] == [7]
    assert _tensorboard_steps(out) == [7]


def test_keep_last_never_deletes_the_checkpoint_just_written(tmp_path: Path) -> None:
    from moe_train.checkpoint import CheckpointWriter

    out = tmp_path / "checkpoints"
    for step in (4, 9):  # a later step left behind by another history (moved aside by a resume; here by hand)
        (out / f"step_{step}").mkdir(parents=True)
        (out / f"step_{step}" / "meta.json").write_text("{}")
    writer = CheckpointWriter(out, keep_last=1)
    writer._publish(_staged(out, 5), out / "step_5", {"format": 1, "step": 5})
    assert [c.step for c in list_checkpoints(out)] == [5, 9]


def _staged(out: Path, step: int) -> Path:
    staging = out / f".step_{step}.partial"
    staging.mkdir()
    return staging


def test_resume_passes_over_incomplete_saves_says_so_and_cleans_up(
    original: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = _copy(original, tmp_path)
    checkpoints = out / "checkpoints"
    (checkpoints / ".step_10.partial").mkdir()  # a save killed half-way
    (checkpoints / ".step_10.partial" / "__0_0.distcp").write_bytes(b"x" * 1000)
    (checkpoints / "step_9").mkdir()  # complete-looking name, no meta.json
    (out / "metrics.jsonl.tmp").write_text("")  # a rewrite killed on a full disk
    capsys.readouterr()
    assert _train(out, "--run.resume", "auto", "--run.exit_interval", "9", steps=12) == 0
    err = capsys.readouterr().err
    assert "passed over step_9, .step_10.partial (newer than step 8 but incomplete" in err
    assert "removed what interrupted writes left: metrics.jsonl.tmp" in err
    assert not (checkpoints / ".step_10.partial").exists() and not (out / "metrics.jsonl.tmp").exists()
    assert [r["step"] for r in _records(out)] == list(range(1, 10))


def test_a_resumed_run_continues_exactly(original: Path, tmp_path: Path) -> None:
    """Resumed from step 4, steps 5 to 8 repeat the original's losses and gradient norms bit for bit (one process, the
    same data order and random state): the weights, the optimizer's moments and step counts, the learning-rate
    schedule and the random generators all came back. A fresh optimizer state, for one, changes step 6's loss."""
    out = _copy(original, tmp_path)
    assert _train(out, "--run.resume", str(out / "checkpoints" / "step_4"), "--run.exit_interval", "8", steps=12) == 0
    want = {r["step"]: r for r in _records(original)}
    got = {r["step"]: r for r in _records(out)}
    for step in range(5, 9):
        for key in ("loss", "grad_norm", "lr"):
            assert got[step][key] == want[step][key], (step, key)
