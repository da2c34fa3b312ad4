"""run.recompute_modules / run.offload_modules through the trainer: the run trains exactly as without them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe_train.config import load_config
from moe_train.trainer import prepare, train


def _losses(overrides: dict[str, str]) -> list[float]:
    summary = train(prepare(load_config("tiny", overrides), 1))
    records = [json.loads(line) for line in (Path(summary.output_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in records for key in ("loss", "grad_norm")]


def test_recompute_and_offload_train_as_the_plain_run(
    micro_overrides: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = {**micro_overrides, "train.steps": "3", "run.save_checkpoint": "false", "run.dtype": "fp32"}
    plain = _losses({**base, "run.output_dir": str(tmp_path / "plain")})
    memory = {
        "run.recompute_modules": "layernorm,moe_act",
        "run.offload_modules": "core_attn,attn_proj,expert_fc1",
        "run.offload_min_tensor_bytes": "0",
    }
    capsys.readouterr()
    ours = _losses({**base, **memory, "run.output_dir": str(tmp_path / "ours")})
    assert "recomputing layernorm (2 modules), moe_act (1 modules), offloading core_attn (1 modules)" in (
        capsys.readouterr().out
    )
    assert ours == pytest.approx(plain, rel=1e-6)
    assert plain[-2] < plain[0]  # it trained
