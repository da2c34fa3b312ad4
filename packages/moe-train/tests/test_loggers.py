import math
import sys
import time
import types
from pathlib import Path
from typing import Any

import pytest
from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

from moe_train.loggers import RunLoggers, WandbUnavailableError, check_wandb_available

CONFIG = {"model": {"family": "qwen3_moe"}, "train": {"steps": 8}}


def _scalars(output_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar TensorBoard would show for the run: tag -> [(step, value)], after its purges."""
    events = EventAccumulator(str(output_dir / "tensorboard"), size_guidance={SCALARS: 0})
    events.Reload()
    # a tag whose every event was purged stays listed, with nothing in it
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    return {tag: values for tag, values in scalars.items() if values}


def _next_second() -> None:
    # event file names start with the creation time in whole seconds and TensorBoard reads them in name order;
    # a real restart comes seconds later, two loggers in one test may not
    time.sleep(1.01 - time.time() % 1)


def test_records_become_grouped_scalars_at_their_steps(tmp_path: Path) -> None:
    loggers = RunLoggers(tmp_path, CONFIG)
    for step in (1, 2, 3):
        loggers.log(
            step,
            {"step": step, "loss": 4.0 - step, "grad_norm": 0.5 * step, "tokens_per_s": 1000.0 * step,
             "dropped_fraction": 0.25, "phase": "warmup"},
        )  # fmt: skip
    loggers.log(2, {"val_loss": 3.5})
    loggers.flush()  # readable before close: a live TensorBoard sees the run
    assert _scalars(tmp_path)["eval/val_loss"] == [(2, 3.5)]
    loggers.log(4, {"loss": float("nan"), "grad_norm": float("inf")})  # a diverged step must not crash
    loggers.close()

    scalars = _scalars(tmp_path)
    assert sorted(scalars) == [
        "eval/val_loss", "moe/dropped_fraction", "perf/tokens_per_s", "train/grad_norm", "train/loss",
    ]  # fmt: skip
    assert scalars["train/loss"][:3] == [(1, 3.0), (2, 2.0), (3, 1.0)]
    assert scalars["train/loss"][3][0] == 4 and math.isnan(scalars["train/loss"][3][1])
    assert scalars["train/grad_norm"] == [(1, 0.5), (2, 1.0), (3, 1.5), (4, math.inf)]
    assert scalars["perf/tokens_per_s"] == [(1, 1000.0), (2, 2000.0), (3, 3000.0)]
    assert scalars["moe/dropped_fraction"] == [(1, 0.25), (2, 0.25), (3, 0.25)]
    assert scalars["eval/val_loss"] == [(2, 3.5)]


def test_resumed_run_leaves_each_step_once(tmp_path: Path) -> None:
    # the first session logged steps 1..6 and died; the checkpoint it resumes from is step 3
    with RunLoggers(tmp_path, CONFIG) as first:
        for step in range(1, 7):
            first.log(step, {"loss": float(step)})
            if step % 2 == 0:
                first.log(step, {"val_loss": float(step)})
    _next_second()
    with RunLoggers(tmp_path, CONFIG, resume_step=3) as resumed:
        for step in range(4, 9):
            resumed.log(step, {"loss": 100.0 + step})
            if step % 2 == 0:
                resumed.log(step, {"val_loss": 100.0 + step})
    scalars = _scalars(tmp_path)
    assert scalars["train/loss"] == [(1, 1.0), (2, 2.0), (3, 3.0)] + [(s, 100.0 + s) for s in range(4, 9)]
    assert scalars["eval/val_loss"] == [(2, 2.0), (4, 104.0), (6, 106.0), (8, 108.0)]

    # a fresh run in the same directory (resume_step 0) hides all of it, as metrics.jsonl starts over too
    _next_second()
    with RunLoggers(tmp_path, CONFIG) as fresh:
        fresh.log(1, {"loss": 9.0})
    assert _scalars(tmp_path) == {"train/loss": [(1, 9.0)]}


class _FakeWandb(types.ModuleType):
    """Stands in for the wandb package: records what RunLoggers asks of it."""

    def __init__(self) -> None:
        super().__init__("wandb")
        self.inits: list[dict[str, Any]] = []
        self.logged: list[tuple[dict[str, float], int]] = []
        self.finished = 0

    def init(self, **kwargs: Any) -> Any:
        self.inits.append(kwargs)
        return types.SimpleNamespace(log=lambda data, step: self.logged.append((dict(data), step)), finish=self._finish)

    def _finish(self) -> None:
        self.finished += 1


def test_wandb_run_is_initialised_logged_and_resumed_under_one_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wandb = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    check_wandb_available("moe-runs")
    with RunLoggers(tmp_path, CONFIG, wandb_project="moe-runs", run_name="tiny") as loggers:
        loggers.log(1, {"step": 1, "loss": 2.5, "tokens_per_s": 10.0, "phase": "warmup"})
        loggers.log(2, {"val_loss": float("nan")})
    with RunLoggers(tmp_path, CONFIG, wandb_project="moe-runs", resume_step=1) as loggers:
        loggers.log(2, {"loss": 2.0})
    RunLoggers(tmp_path / "other", CONFIG, wandb_project="moe-runs").close()

    first, resumed, other = wandb.inits
    run_id = (tmp_path / "wandb_id.txt").read_text().strip()
    assert first == {
        "project": "moe-runs", "name": "tiny", "config": CONFIG, "dir": str(tmp_path), "resume": "allow", "id": run_id,
    }  # fmt: skip
    assert resumed["id"] == run_id and resumed["resume"] == "allow" and resumed["name"] is None
    assert other["id"] != run_id
    assert wandb.logged[0] == ({"train/loss": 2.5, "perf/tokens_per_s": 10.0}, 1)
    (val,), step = wandb.logged[1][0].values(), wandb.logged[1][1]
    assert math.isnan(val) and step == 2
    assert wandb.logged[2] == ({"train/loss": 2.0}, 2)
    assert wandb.finished == 3


def test_missing_wandb_is_a_one_line_error_before_anything_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` fail even where it is installed
    check_wandb_available("")  # unset: nothing to check
    message = "run.wandb_project=moe-runs: wandb is not installed; pip install wandb or unset run.wandb_project"
    with pytest.raises(WandbUnavailableError) as err:
        check_wandb_available("moe-runs")
    assert str(err.value) == message and isinstance(err.value, ValueError)
    with pytest.raises(WandbUnavailableError, match="^run.wandb_project=moe-runs: wandb is not installed"):
        RunLoggers(tmp_path, CONFIG, wandb_project="moe-runs")
    assert not (tmp_path / "tensorboard").exists() and not (tmp_path / "wandb_id.txt").exists()
