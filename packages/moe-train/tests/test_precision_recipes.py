"""The ``precision`` section in moe-train: which modules take the recipe, the device check (exit 2 before anything is
written), and short emulated runs of every recipe against the unquantised run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from moe_experts import ExpertLinear
from moe_models import build_model
from moe_models.presets import preset
from moe_precision import RECIPES, PrecisionConfig, QuantizedLinear
from moe_precision.layers import QuantizedGroupedLinear
from moe_train import cli
from moe_train.precision import apply_run_precision, precision_targets

SMALL = ["--data.seq_len", "32", "--train.global_batch_size", "4", "--run.log_interval", "1"]


def _model(name: str = "tiny-deepseek-v3") -> nn.Module:
    with torch.device("meta"):
        return build_model(preset(name))


def test_targets_are_the_layers_linears_and_expert_projections():
    model = _model()
    linear, grouped = precision_targets(model, model.config.num_layers, first_last_high=False)
    kinds = {name.split(".")[-1] for name in linear}
    assert {"o_proj", "kv_a_proj", "kv_b_proj"} <= kinds  # MLA's projections, and dense MLPs where there are any
    assert all(isinstance(model.get_submodule(n), ExpertLinear) for n in grouped)
    assert {n.split(".")[-1] for n in grouped} == {"fc1", "fc2"}
    everything = set(linear) | set(grouped)
    # router, embeddings, norms, output layer and MTP projection stay out
    assert not any(k in n for n in everything for k in ("router", "embed", "norm", "lm_head", "eh_proj"))
    assert any(n.startswith("mtp.") for n in everything)
    linear_h, grouped_h = precision_targets(model, model.config.num_layers, first_last_high=True)
    last = f"layers.{model.config.num_layers - 1}."
    kept = set(linear_h) | set(grouped_h)
    assert not any(n.startswith(("layers.0.", last, "mtp.")) for n in kept)
    assert kept == {n for n in everything if not n.startswith(("layers.0.", last, "mtp."))}


def test_apply_swaps_in_place_and_keeps_parameter_names():
    model = _model("tiny-qwen3-moe")
    names = [n for n, _ in model.named_parameters()]
    linear, grouped = precision_targets(model, model.config.num_layers, False)
    changed = apply_run_precision(model, PrecisionConfig(recipe="mxfp8", emulate=True), model.config.num_layers, False)
    assert changed == len(linear) + len(grouped) > 0
    assert all(isinstance(model.get_submodule(n), QuantizedLinear) for n in linear)
    assert all(isinstance(model.get_submodule(n), QuantizedGroupedLinear | ExpertLinear) for n in grouped)
    assert [n for n, _ in model.named_parameters()] == names
    assert apply_run_precision(_model(), PrecisionConfig(), 2, False) == 0


def test_a_recipe_the_cpu_cannot_run_natively_is_refused_before_anything_is_written(tmp_path: Path, capsys):
    out = tmp_path / "out"
    code = cli.main(
        ["train", *SMALL, "--train.steps", "1", "--run.output_dir", str(out), "--precision.recipe", "nvfp4"]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert "precision.recipe='nvfp4'" in err and "native here: none" in err and "emulate" in err
    assert not out.exists()
    assert cli.main(["train", *SMALL, "--run.output_dir", str(out), "--precision.recipe", "fp7"]) == 2
    assert "precision.recipe='fp7': unknown recipe" in capsys.readouterr().err


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines() if '"step"' in line]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[float]]:
    """Four steps of the tiny default model under each recipe, emulated."""
    losses = {}
    for recipe in RECIPES:
        out = tmp_path_factory.mktemp(recipe) / "out"
        args = ["train", *SMALL, "--model.num_layers", "2", "--train.steps", "4", "--run.output_dir", str(out)]
        assert cli.main([*args, "--precision.recipe", recipe, "--precision.emulate", "true"]) == 0
        losses[recipe] = _losses(out)
    return losses


@pytest.mark.parametrize("recipe", [r for r in RECIPES if r != "none"])
def test_each_recipe_trains_close_to_the_unquantised_run(runs, recipe):
    ref, got = runs["none"], runs[recipe]
    assert len(got) == 4 and all(torch.isfinite(torch.tensor(got)))
    assert got != ref  # the recipe changed the arithmetic
    bound = 0.03 if recipe == "nvfp4" else 0.01
    for a, b in zip(got, ref, strict=True):
        assert abs(a - b) / b < bound, (recipe, got, ref)
    assert got[-1] < got[0]  # and it learns
