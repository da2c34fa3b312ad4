"""The fine-tuning recipes fit the GPUs they are written for (80 GB each), as ``moe-train plan --memory``
estimates them, and their LoRA would not fit as full fine-tuning on the same GPUs (what the adapters save)."""

from __future__ import annotations

import pytest

from moe_train import cli
from moe_train.config import load_config, preset_names
from moe_train.recipes import RECIPES, GiB, recipe_memory

DEVICE_GIB = 80


def test_every_finetune_preset_is_a_recipe() -> None:
    assert {name for name in preset_names() if name.startswith("finetune-")} == set(RECIPES)


@pytest.mark.parametrize("name", list(RECIPES))
def test_recipe_fits_80_gb_gpus(name: str) -> None:
    cfg = load_config(name)
    assert cfg.data.format == "chat" and cfg.data.seq_len == 4096
    memory = recipe_memory(name)
    print(f"{name} on {RECIPES[name]} GPUs: {memory.total / GiB:.2f} GiB")
    assert memory.total < DEVICE_GIB * GiB
    if cfg.peft.method == "lora":
        full = recipe_memory(name, full=True)
        # adapters: gradients and AdamW states for a few percent of the parameters; the frozen base the same
        assert full.total > DEVICE_GIB * GiB and full.parameters == pytest.approx(memory.parameters, rel=0.05)
        assert memory.gradients + memory.optimizer_states < 0.1 * (full.gradients + full.optimizer_states)


def test_plan_command_says_the_recipe_fits(capsys: pytest.CaptureFixture[str]) -> None:
    name = "finetune-gpt-oss-20b-lora"
    assert cli.main(["plan", "--config", name, "--world-size", str(RECIPES[name]), "--device-memory", "80"]) == 0
    out = capsys.readouterr().out
    assert "every rank fits in --device-memory 80 GiB" in out
    assert "LoRA, gradients and AdamW states for" in out
