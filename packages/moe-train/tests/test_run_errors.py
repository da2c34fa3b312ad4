"""Mistakes around a run (output directory, resume, optimizer settings, non-finite values, damaged checkpoints) are
one line with exit code 2, found before the model is built; a diverging run stops with a message naming the step."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from moe_models import build_model
from moe_models.presets import preset
from moe_train import cli, loop
from moe_train.checkpoint import CheckpointError, latest_checkpoint, list_checkpoints, load_checkpoint

SMALL = ["--model.num_layers", "1", "--data.seq_len", "16", "--train.global_batch_size", "2", "--run.log_interval", "1"]


def _train(out: Path, *extra: str, steps: int = 2) -> int:
    return cli.main(["train", *SMALL, "--train.steps", str(steps), "--run.output_dir", str(out), *extra])


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def _strict_json(text: str):
    def refuse(constant: str):
        raise AssertionError(f"invalid JSON constant {constant}")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--train.adam_beta1", "7"], "train.adam_beta1=7.0: must be in [0, 1)"),
        (["--train.adam_beta2", "-0.1"], "train.adam_beta2=-0.1: must be in [0, 1)"),
        (["--train.adam_eps", "0"], "train.adam_eps=0.0: must be positive"),
        (["--train.weight_decay", "-1"], "train.weight_decay=-1.0: must be >= 0"),
        (["--train.clip_grad", "-1"], "train.clip_grad=-1.0: must be >= 0"),
        (["--train.lr", "nan"], "config key 'train.lr' must be a finite number, got 'nan'"),
        (["--model.init_method_std", "inf"], "config key 'model.init_method_std' must be a finite number"),
        (["--train.min_lr", ".nan"], "config key 'train.min_lr' must be a finite number"),
        (["--data.seq_len", "8192"], "data.seq_len=8192: longer than model.max_position_embeddings=4096"),
        (["--run.keep_last", "-1"], "run.keep_last=-1: must be >= 0"),
        (["--train.eval_iters", "0"], "train.eval_iters=0: must be >= 1"),
        (["--run.resume", "auto", "--run.overwrite", "true"], "run.overwrite=true with run.resume='auto'"),
        (["--run.wandb_project", "p"], "wandb is not installed"),
    ],
)
def test_bad_settings_are_one_line_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], expected: str
) -> None:
    assert _train(tmp_path / "out", *extra) == 2
    assert expected in _one_line(capsys)
    assert not (tmp_path / "out").exists()


def test_output_directory_is_refused_unless_resumed_or_overwritten(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert _train(out) == 0
    first = (out / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert _train(out) == 2
    assert "run.output_dir=" in _one_line(capsys) and (out / "metrics.jsonl").read_text() == first
    (out / "stale.txt").write_text("from an earlier run")
    assert _train(out, "--run.overwrite", "true", "--train.seed", "5") == 0
    assert not (out / "stale.txt").exists() and (out / "metrics.jsonl").read_text() != first
    assert [c.step for c in list_checkpoints(out / "checkpoints")] == [2]

    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    capsys.readouterr()
    assert _train(blocker / "out") == 2
    assert f"run.output_dir='{blocker / 'out'}' cannot be written" in _one_line(capsys)


def test_resume_mistakes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert _train(out, steps=2) == 0
    capsys.readouterr()
    # another model: the differing fields are named
    assert _train(out, "--run.resume", "auto", "--model.hidden_size", "64", steps=4) == 2
    line = _one_line(capsys)
    assert "model.hidden_size (128 in the checkpoint, 64 here)" in line and "holds another model" in line
    assert _train(out, "--run.resume", "auto", steps=2) == 2
    assert "is at step 2 and train.steps=2: nothing left to train" in _one_line(capsys)
    assert _train(tmp_path / "new", "--run.resume", str(tmp_path / "nowhere"), steps=4) == 2
    assert "no such checkpoint directory" in _one_line(capsys)
    assert _train(tmp_path / "new", "--run.resume", str(tmp_path), steps=4) == 2
    assert "not a complete moe-train checkpoint" in _one_line(capsys)
    # a run's output directory resumes from its latest checkpoint, into another output directory
    assert _train(tmp_path / "continued", "--run.resume", str(out), steps=3) == 0
    records = [_strict_json(line) for line in (tmp_path / "continued" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [3]


def test_checkpoint_into_another_model_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert _train(out, "--model.num_layers", "2") == 0
    checkpoint = latest_checkpoint(out / "checkpoints")
    config = preset("tiny-qwen3-moe")
    fewer = build_model(type(config)(**{**config.__dict__, "num_layers": 1, "hidden_size": 128}))
    with pytest.raises(CheckpointError, match="it holds that the model lacks"):
        load_checkpoint(checkpoint.path, fewer)


def test_incomplete_checkpoints_are_not_resumed(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert _train(out, "--run.checkpoint_interval", "1", steps=3) == 0
    checkpoints = out / "checkpoints"
    (checkpoints / ".step_9.partial").mkdir()  # a save killed half-way
    (checkpoints / "step_8").mkdir()  # no meta.json: not complete
    assert latest_checkpoint(checkpoints).step == 3


def test_non_finite_loss_stops_the_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    # an absurd learning rate makes step 2's loss non-finite; the checkpoint of step 1 stays the last one
    diverging = ["--train.lr", "1e30", "--train.warmup_steps", "0", "--train.clip_grad", "0"]
    assert _train(out, *diverging, "--run.checkpoint_interval", "1", steps=6) == 3
    err = capsys.readouterr().err
    assert "is not finite" in err and "train.skip_nonfinite_steps=0" in err and "Traceback" not in err
    step = int(err.split("step ")[1].split(":")[0])
    records = [_strict_json(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == step and None in (records[-1]["loss"], records[-1]["grad_norm"])
    assert max(c.step for c in list_checkpoints(out / "checkpoints")) < step
    summary = _strict_json((out / "summary.json").read_text())
    assert summary["status"] == "diverged"

    skipping = tmp_path / "skipping"
    assert _train(skipping, *diverging, "--train.skip_nonfinite_steps", "2", steps=8) == 3
    records = [_strict_json(line) for line in (skipping / "metrics.jsonl").read_text().splitlines()]
    # two non-finite steps skipped (no update), the third stops the run; the last record is that third step
    non_finite = [r["step"] for r in records if r.get("skipped")]
    assert len(non_finite) == 3 and records[-1]["step"] == non_finite[-1]


class _InfiniteGradient(torch.autograd.Function):
    """The identity forward; its backward makes every gradient infinite: a finite loss with non-finite gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad * math.inf


@pytest.mark.parametrize("bad", ["loss", "gradients"])
def test_the_non_finite_step_itself_is_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bad: str) -> None:
    """Step 2 alone has a non-finite loss with finite gradients (or the reverse), one skip allowed: step 2 makes no
    update and is recorded as skipped, steps 1, 3 and 4 update. A guard reading another step's values skips the
    wrong step."""
    bad_step, state, moved = 2, {"step": 0}, {}
    real_loss, real_step = loop.next_token_loss, loop.TrainLoop.step

    def loss_of_step(*args, **kwargs):
        loss = real_loss(*args, **kwargs)
        if state["step"] != bad_step:
            return loss
        if bad == "loss":  # what is logged and checked, not what is backwarded
            return dataclasses.replace(loss, lm=torch.full_like(loss.lm, math.nan))
        return dataclasses.replace(loss, total=_InfiniteGradient.apply(loss.total))

    def step(self, index: int, *args, **kwargs):
        state["step"] = index + 1
        before = [p.detach().clone() for p in self.params]
        result = real_step(self, index, *args, **kwargs)
        moved[index + 1] = any(not torch.equal(a, p) for a, p in zip(before, self.params, strict=True))
        return result

    monkeypatch.setattr(loop, "next_token_loss", loss_of_step)
    monkeypatch.setattr(loop.TrainLoop, "step", step)
    out = tmp_path / "out"
    assert _train(out, "--train.skip_nonfinite_steps", "1", steps=4) == 0
    assert moved == {1: True, 2: False, 3: True, 4: True}
    records = [_strict_json(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r.get("skipped")] == [bad_step]
    at_bad = records[bad_step - 1]
    assert (at_bad["loss"] is None) == (bad == "loss") and (at_bad["grad_norm"] is None) == (bad == "gradients")
    assert all(r["loss"] is not None and r["grad_norm"] is not None for r in records if r["step"] != bad_step)
