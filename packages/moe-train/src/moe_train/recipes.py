"""The fine-tuning recipes (``moe-train --config finetune-*``, in moe_train/presets) and their memory per GPU, as
``moe-train plan --memory`` estimates it: what a test checks against 80 GB GPUs and what benchmarks/recipe_memory.py
records, for LoRA against full fine-tuning on the same GPUs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from moe_train.config import ExperimentConfig, load_config
from moe_train.plan_report import (
    memory_estimates,
    plan_memory_options,
    plan_micro_batching,
    plan_report,
    with_microbatches,
)

# recipe -> the GPUs it is written for (its comment says how to launch it)
RECIPES = {
    "finetune-qwen3-30b-a3b-sft": 8,
    "finetune-qwen3-30b-a3b-lora": 2,
    "finetune-gpt-oss-20b-lora": 1,
    "finetune-deepseek-v3-lora": 32,
}
GiB = 1 << 30


@dataclass(frozen=True)
class RecipeMemory:
    """The largest rank's estimate, in bytes."""

    total: int
    parameters: int
    gradients: int
    optimizer_states: int
    master_weights: int
    activations: int


def rank_memory(cfg: ExperimentConfig, world_size: int) -> RecipeMemory:
    """The estimate of the rank that needs the most, for ``cfg`` over ``world_size`` ranks."""
    dtype = torch.bfloat16 if cfg.train.params_dtype == "bf16" else torch.float32
    report = plan_report(cfg.model, cfg.parallel, world_size, dtype, cfg.run, cfg.data.seq_len, cfg.peft)
    report = with_microbatches(report, cfg.parallel.pp_schedule, plan_micro_batching(cfg, report.layout)[1])
    options = plan_memory_options(cfg, report.layout)
    largest = max((estimate for _, estimate in memory_estimates(report, cfg.model, options)), key=lambda e: e.total)
    return RecipeMemory(
        largest.total,
        largest.parameters,
        largest.gradients,
        largest.optimizer_states,
        largest.master_weights,
        largest.activation_bytes,
    )


def recipe_memory(name: str, full: bool = False) -> RecipeMemory:
    """Recipe ``name``'s estimate on its GPUs; ``full``: with every parameter trained instead of its adapters."""
    cfg = load_config(name)
    if full:
        cfg = dataclasses.replace(cfg, peft=dataclasses.replace(cfg.peft, method="none"))
    return rank_memory(cfg, RECIPES[name])
