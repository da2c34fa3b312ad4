import json
import math
from pathlib import Path

from moe_train.metrics import MetricsLog


def _lines(path: Path) -> list[dict]:
    # parse_constant rejects the bare NaN / Infinity that Python's json accepts but JSON does not
    def reject(token: str) -> None:
        raise ValueError(f"not JSON: {token}")

    return [json.loads(line, parse_constant=reject) for line in path.read_text().splitlines()]


def _run(path: Path, steps: range, resume_step: int = 0, loss=lambda s: 10.0 / s) -> MetricsLog:
    log = MetricsLog(path, resume_step=resume_step)
    for step in steps:
        log.write({"step": step, "loss": loss(step)})
        if step % 2 == 0:
            log.write({"step": step, "val_loss": loss(step) + 1})
    log.close()
    return log


def test_non_finite_values_are_written_as_null(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path)
    log.write({"step": 1, "loss": float("nan"), "grad_norm": float("inf"), "lr": 1e-3, "per_layer": [1.0, -math.inf]})
    log.close()
    assert _lines(path) == [{"step": 1, "loss": None, "grad_norm": None, "lr": 1e-3, "per_layer": [1.0, None]}]
    assert math.isnan(log.records[0]["loss"])  # in memory the value stays as written


def test_fresh_log_replaces_an_earlier_file(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    _run(path, range(1, 6))
    log = _run(path, range(1, 3))
    assert [r["step"] for r in _lines(path)] == [1, 2, 2]
    assert len(log.records) == 3


def test_resume_drops_steps_after_the_checkpoint_and_keeps_the_rest(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    # killed after step 7 (its last line cut mid-write), resumed from the checkpoint of step 4
    _run(path, range(1, 8))
    path.write_text(path.read_text() + '{"step": 8, "lo')
    log = _run(path, range(5, 10), resume_step=4, loss=lambda s: 1.0 / s)
    expected = []
    for step in range(1, 10):
        loss = 10.0 / step if step <= 4 else 1.0 / step
        expected.append({"step": step, "loss": loss})
        if step % 2 == 0:
            expected.append({"step": step, "val_loss": loss + 1})
    assert _lines(path) == expected
    assert log.records == expected  # the summary and pictures see the whole run, in order
    assert log.series("val_loss") == ([2, 4, 6, 8], [6.0, 3.5, 1 / 6 + 1, 1 / 8 + 1])
    assert not (tmp_path / "metrics.jsonl.tmp").exists()


def test_resume_reads_nulls_back_as_nan_and_rewrites_legacy_bare_nan(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    lines = ['{"step": 1, "loss": NaN}', '{"step": 2, "loss": null}', '{"note": "no step"}', '{"step": 3, "loss": 1}']
    path.write_text("".join(line + "\n" for line in lines))
    log = MetricsLog(path, resume_step=2)
    log.close()
    assert math.isnan(log.records[0]["loss"]) and math.isnan(log.records[1]["loss"])
    assert log.records[2] == {"note": "no step"}
    assert _lines(path) == [{"step": 1, "loss": None}, {"step": 2, "loss": None}, {"note": "no step"}]


def test_resume_without_an_earlier_file_starts_one(tmp_path: Path) -> None:
    log = _run(tmp_path / "metrics.jsonl", range(3, 4), resume_step=2)
    assert log.records == [{"step": 3, "loss": 10.0 / 3}]
