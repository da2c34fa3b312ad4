"""Router features driven through the trainer: expert bias, recompute, capacity dropping."""

import json
from pathlib import Path

import pytest
import torch

from moe_train.config import load_config
from moe_train.trainer import prepare, train

BIAS = {
    "model.moe_router_score_function": "sigmoid",
    "model.moe_router_enable_expert_bias": "true",
    "model.moe_router_bias_update_rate": "0.01",
    "model.moe_router_load_balancing_type": "none",
    "train.steps": "4",
    "run.save_checkpoint": "false",
}


def _run(overrides: dict[str, str]) -> tuple[torch.nn.Module, list[dict]]:
    setup = prepare(load_config("tiny", overrides), world_size=1)
    train(setup)
    lines = Path(overrides["run.output_dir"], "metrics.jsonl").read_text().splitlines()
    return setup.model, [json.loads(line) for line in lines]


def test_expert_bias_follows_the_returned_counts_and_recompute_does_not_double_count(
    micro_overrides: dict[str, str],
) -> None:
    plain, plain_records = _run({**micro_overrides, **BIAS})
    recompute_dir = micro_overrides["run.output_dir"] + "-recompute"
    recompute = {"run.recompute_modules": "layers.*.mlp", "run.output_dir": recompute_dir}
    recomputed, records = _run({**micro_overrides, **BIAS, **recompute})
    bias_plain = [r.expert_bias for r in plain.routers()]
    bias_recomputed = [r.expert_bias for r in recomputed.routers()]
    for a, b in zip(bias_plain, bias_recomputed, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # four updates of +-rate (or 0) per expert: the bias moved, in steps of the rate
    moved = torch.cat(bias_plain)
    assert moved.abs().max() > 0
    steps = moved / 0.01
    torch.testing.assert_close(steps, steps.round(), rtol=0, atol=1e-4)
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in plain_records], rel=1e-6)


def test_capacity_factor_drops_tokens_and_reports_them(micro_overrides: dict[str, str]) -> None:
    _, records = _run(
        {
            **micro_overrides,
            "model.moe_expert_capacity_factor": "0.5",
            "train.steps": "2",
            "run.save_checkpoint": "false",
        }
    )
    # a capacity of half the balanced share keeps at most half of the (token, expert) pairs
    assert all(r["dropped_fraction"] >= 0.5 - 1e-6 for r in records)
    _, dropless = _run({**micro_overrides, "train.steps": "2", "run.save_checkpoint": "false"})
    assert all(r["dropped_fraction"] == 0 for r in dropless)
