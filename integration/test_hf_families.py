"""Each model family added in issue 34 trains from a checkpoint that transformers made: ``moe-train train
--model.from_hf DIR`` on the tiny proxy's architecture, built and saved by transformers' own model class, and the
loss falls (``moe-train plan`` of each published size: packages/moe-train/tests/test_plan.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from moe_models.hf import config_to_hf
from moe_models.presets import preset
from moe_train import cli

# family -> its tiny proxy
TINY = {
    "glm4_moe": "tiny-glm4-moe",
    "glm4_moe_lite": "tiny-glm4-moe-lite",
    "dots1": "tiny-dots1",
    "minimax_m2": "tiny-minimax-m2",
    "qwen2_moe": "tiny-qwen2-moe",
    "olmoe": "tiny-olmoe",
    "deepseek_v2": "tiny-deepseek-v2",
    "ernie4_5_moe": "tiny-ernie4-5-moe",
    "hunyuan_v1_moe": "tiny-hunyuan-v1-moe",
    "llama4": "tiny-llama4",
}
STEPS = 16
RUN = {
    "train.steps": str(STEPS),
    "train.global_batch_size": "4",
    "train.warmup_steps": "2",
    "train.lr": "3e-3",
    "data.seq_len": "64",
    "run.save_checkpoint": "false",
}


def _transformers_checkpoint(name: str, path: Path) -> Path:
    """transformers' own model of the proxy's architecture, initialised and saved by transformers."""
    hf = config_to_hf(preset(name))
    config = transformers.AutoConfig.for_model(**hf)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("family", list(TINY))
def test_family_trains_from_a_transformers_checkpoint(family: str, data_cache: Path, tmp_path: Path) -> None:
    checkpoint = _transformers_checkpoint(TINY[family], tmp_path / "hf")
    run = {**RUN, "data.cache_dir": str(data_cache), "run.output_dir": str(tmp_path / "run")}
    args = ["train", "--model.from_hf", str(checkpoint), *(t for k, v in run.items() for t in (f"--{k}", v))]
    assert cli.main(args) == 0
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == STEPS
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    print(f"\n{family} from a transformers checkpoint: loss {first:.3f} -> {last:.3f}")
    assert last < 0.9 * first, losses
