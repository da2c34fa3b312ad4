"""Router features driven through the trainer: expert bias, recompute, capacity dropping."""

import json
from pathlib import Path

import pytest
import torch

from moe_dispatch import TopKRouter
from moe_parallel import StagedModel
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


def _run(overrides: dict[str, str]) -> tuple[StagedModel, list[dict]]:
    setup = prepare(load_config("tiny", overrides), world_size=1)
    train(setup)
    lines = Path(overrides["run.output_dir"], "metrics.jsonl").read_text().splitlines()
    return setup.parallel, [json.loads(line) for line in lines]


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
    _, dropless = _run({**micro_overrides, "train.steps": "2", "run.save_checkpoint": "false", "run.overwrite": "true"})
    assert all(r["dropped_fraction"] == 0 for r in dropless)


def test_expert_bias_counts_every_micro_batch_of_the_step(
    micro_overrides: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Global batch 4 read as 2 micro-batches of 2 updates the expert bias exactly as one micro-batch of 4.

    Without a balancing loss and without a capacity factor a token's routing does not depend on the other tokens
    of its micro-batch, so the counts summed over the step's micro-batches, and so every bias update, are the
    same. Counts taken from the last micro-batch only would see half the tokens."""
    overrides = {**micro_overrides, **BIAS, "model.num_layers": "2", "model.num_moe_experts": "8"}
    updates: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {"2": [], "4": []}
    models, records = {}, {}
    original = TopKRouter.update_expert_bias
    for micro, calls in updates.items():

        def recording(router: TopKRouter, counts_E: torch.Tensor, *args, calls=calls, **kwargs) -> torch.Tensor:
            bias_E = original(router, counts_E, *args, **kwargs)
            calls.append((counts_E.detach().clone(), bias_E.detach().clone()))  # the counts, the bias after
            return bias_E

        monkeypatch.setattr(TopKRouter, "update_expert_bias", recording)
        output_dir = f"{micro_overrides['run.output_dir']}-micro{micro}"
        models[micro], records[micro] = _run(
            {**overrides, "train.micro_batch_size": micro, "run.output_dir": output_dir}
        )

    assert len(updates["2"]) == len(updates["4"]) == 4 * 2  # each step updates each of the 2 routers once
    topk = load_config("tiny", overrides).model.moe_router_topk
    pairs = 4 * int(micro_overrides["data.seq_len"]) * topk  # every (token, expert) pair of the global batch
    for (accum_counts, accum_bias), (counts, bias) in zip(updates["2"], updates["4"], strict=True):
        assert accum_counts.sum().item() == counts.sum().item() == pairs
        torch.testing.assert_close(accum_counts, counts, rtol=0, atol=0)
        torch.testing.assert_close(accum_bias, bias, rtol=0, atol=0)
    final = [r.expert_bias for r in models["4"].routers()]
    for a, b in zip([r.expert_bias for r in models["2"].routers()], final, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert torch.cat(final).abs().max() > 0
    assert len(records["2"]) == len(records["4"]) == 4
    for accum, one in zip(records["2"], records["4"], strict=True):
        assert accum["loss"] == pytest.approx(one["loss"], rel=1e-6)
        assert accum["dropped_fraction"] == one["dropped_fraction"] == 0
        assert accum["expert_load_max_over_mean"] == pytest.approx(one["expert_load_max_over_mean"], rel=1e-6)
