"""moe_models.saved_bytes (with moe_dispatch's and moe_experts' declarations it composes) against what a forward and
loss of every family's tiny model really save for backward (moe_memory.measure.SavedTensorBytes), byte for byte and
module by module: one process, CPU, dropless routing, fp32 and bf16 parameters and activations."""

from __future__ import annotations

import pytest
import torch

from moe_memory.estimate import estimate_memory
from moe_memory.measure import SavedTensorBytes
from moe_models import build_model, causal_lm_loss
from moe_models.memory import estimate_module, local_parameters, model_shape, run_shape
from moe_models.presets import TINY_PRESETS, preset
from moe_models.saved_bytes import MOE_TRANSFORMER_SAVED_BYTES

CASES = [(name, torch.float32) for name in TINY_PRESETS] + [
    ("tiny-qwen3-moe", torch.bfloat16),
    ("tiny-deepseek-v3", torch.bfloat16),
    ("tiny-gpt-oss", torch.bfloat16),
]


@pytest.mark.parametrize(("name", "dtype"), CASES, ids=lambda case: str(case))
def test_declared_saves_are_what_the_model_saves(name: str, dtype: torch.dtype) -> None:
    config = preset(name)
    batch, seq_len = 2, 32
    model = build_model(config, seed=0).to(dtype)
    ids = torch.randint(0, config.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(0))
    with SavedTensorBytes(model=model) as measured:
        causal_lm_loss(model(ids), ids.roll(-1, dims=1), config.mtp_loss_scaling_factor)
    dense = {n for n, m in model.named_modules() if n.endswith("mlp") and not hasattr(m, "router")}
    measured_by_module: dict[str, int] = {}
    for saved in measured.storages:
        module = estimate_module(saved.module, saved.module in dense)
        measured_by_module[module] = measured_by_module.get(module, 0) + saved.nbytes
    size = dtype.itemsize
    params = local_parameters(model)
    run = run_shape(
        config, params, micro_batch=batch, seq_len=seq_len, activation_bytes=size, param_bytes=size, device="cpu"
    )
    shape = model_shape(config)
    assert shape.saved_bytes is MOE_TRANSFORMER_SAVED_BYTES
    declared = estimate_memory(shape, run).activations_by_module()
    declared["dispatch"] = declared.get("dispatch", 0) + declared.pop("combine", 0)  # both run in the block's forward
    assert declared == measured_by_module
