"""Validation loss during training: at train.eval_interval and the last step, in metrics.jsonl, the progress line,
the loss picture and TensorBoard, equal to the loss recomputed by hand from the checkpoint."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from moe_models import build_model, causal_lm_loss
from moe_models.config import ModelConfig
from moe_train import cli
from moe_train.checkpoint import load_checkpoint, read_meta
from moe_train.config import load_config
from moe_train.data import prepare_data


def _corpus(path: Path) -> Path:
    lines = [
        json.dumps({"text": f"document {i}: " + "the quick brown fox jumps over the lazy dog " * (i % 5 + 1)})
        for i in range(120)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def evaluated_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[Path, list[str], str]:
    overrides = [
        "--data.source", str(_corpus(tmp_path / "docs.jsonl")),
        "--data.valid_fraction", "0.25",
        "--data.cache_dir", str(tmp_path / "cache"),
        "--data.seq_len", "32",
        "--model.num_layers", "1",
        "--train.global_batch_size", "4",
        "--train.steps", "6",
        "--train.eval_interval", "4",
        "--train.eval_iters", "2",
        "--run.log_interval", "100",
    ]  # fmt: skip
    out = tmp_path / "run"
    assert cli.main(["train", *overrides, "--run.output_dir", str(out)]) == 0
    return out, overrides, capsys.readouterr().out


def test_validation_loss_is_logged_at_the_interval_and_the_end(evaluated_run) -> None:
    out, _, stdout = evaluated_run
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "val_loss" in r] == [4, 6]
    assert sum(" val " in line for line in stdout.splitlines()) == 2  # the progress line shows each evaluation
    svg = ET.fromstring((out / "loss.svg").read_text())
    assert len(svg.findall(".//{http://www.w3.org/2000/svg}polyline")) == 2 and "validation" in ET.tostring(
        svg, "unicode"
    )
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    logged = {e.step: e.value for e in events.Scalars("eval/val_loss")}
    assert logged == pytest.approx({r["step"]: r["val_loss"] for r in records if "val_loss" in r}, rel=1e-6)
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 7))


def test_validation_loss_equals_a_hand_computation_from_the_checkpoint(evaluated_run) -> None:
    out, overrides, _ = evaluated_run
    cfg = load_config("tiny", dict(zip([k.removeprefix("--") for k in overrides[::2]], overrides[1::2], strict=True)))
    data = prepare_data(cfg.data, seed=cfg.train.seed, model_vocab_size=cfg.model.vocab_size)
    checkpoint = out / "checkpoints" / "step_6"
    model = build_model(ModelConfig(**read_meta(checkpoint)["config"]["model"]))
    assert load_checkpoint(checkpoint, model) == 6
    model.eval()
    losses = []
    with torch.no_grad():
        for batch in data.valid.eval_batches(2, 4):
            losses.append(causal_lm_loss(model(batch.input_ids_BS), batch.labels_BS, 0.0).lm)
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["val_loss"] == pytest.approx(torch.stack(losses).mean().item(), rel=1e-5)
    # validation documents are not trained on: their loss differs from the training loss of the same step
    assert last["val_loss"] != pytest.approx(last["loss"], rel=1e-3)
