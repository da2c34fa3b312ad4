"""Recompute and offload by Megatron module kind on the real model families: every choice leaves the loss and every
gradient as the plain run has them (fp32, rel < 1e-6), and keeps fewer bytes saved for backward on the device."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks

from moe_memory import OFFLOAD_KINDS, RECOMPUTE_KINDS, apply_memory_policy
from moe_models import build_model, causal_lm_loss
from moe_models.presets import preset

PRESETS = ("tiny-qwen3-moe", "tiny-deepseek-v3", "tiny-gpt-oss")
BATCH, SEQ = 2, 64  # long enough that the attention probabilities outweigh q, k and v
# Megatron-Core's suggested combination: cheap recompute of norms and activations, offload of the big saves
RECOMMENDED = (["layernorm", "moe_act"], ["core_attn", "attn_proj", "expert_fc1"])


class DeviceSavedBytes:
    """Distinct storages saved for backward that stay on the device (outside the policy's hooks: what it keeps)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.storages: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in self.params:
            self.storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def _step(model: torch.nn.Module, ids: torch.Tensor) -> tuple[float, dict[str, torch.Tensor], torch.Tensor, int]:
    meter = DeviceSavedBytes(model)
    with saved_tensors_hooks(meter.pack, lambda t: t):
        out = model(ids[:, :-1])
    loss = causal_lm_loss(out, ids[:, 1:], model.config.mtp_loss_scaling_factor).total
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.item(), grads, out.tokens_per_expert_LE, meter.total


@pytest.fixture(scope="module", params=PRESETS)
def reference(request):
    torch.manual_seed(0)
    model = build_model(preset(request.param), seed=3)
    ids = torch.randint(0, model.config.vocab_size, (BATCH, SEQ + 1))
    return request.param, model, ids, _step(copy.deepcopy(model), ids)


def _choices(model) -> list[tuple[list[str], list[str]]]:
    kinds = model.module_kinds()
    recompute = [([kind], []) for kind in RECOMPUTE_KINDS if kind in kinds]
    offload = [([], [kind]) for kind in OFFLOAD_KINDS if kind in kinds]
    both = [(["core_attn", "mla_up_proj"], [])] if "mla_up_proj" in kinds else []
    return [*recompute, (["moe_act", "layernorm"], []), *both, *offload, RECOMMENDED]


def test_every_choice_keeps_loss_and_gradients(reference) -> None:
    name, model, ids, (loss_ref, grads_ref, load_ref, saved_ref) = reference
    kinds = model.module_kinds()
    assert set(RECOMPUTE_KINDS) - set(kinds) == ({"mlp", "shared_experts", "mla_up_proj"} - _kinds_of(name))
    kept: dict[str, int] = {}
    for recompute, offload in _choices(model):
        wrapped = copy.deepcopy(model)
        policy = apply_memory_policy(wrapped, kinds, recompute, offload, offload_min_tensor_bytes=0)
        loss, grads, load, saved = _step(wrapped, ids)
        what = f"{name} recompute={recompute} offload={offload}"
        assert loss == pytest.approx(loss_ref, rel=1e-6), what
        assert grads.keys() == grads_ref.keys(), what
        for key, grad in grads.items():
            torch.testing.assert_close(grad, grads_ref[key], rtol=1e-6, atol=1e-9, msg=f"{what}: {key}")
        # routers that ran again in the backward did not count their tokens twice
        assert torch.equal(load, load_ref), what
        kept[what] = saved
        if recompute != ["mla_up_proj"]:
            assert saved < saved_ref, f"{what}: {saved} bytes kept, {saved_ref} without"
        if offload and not recompute:  # what left is at least what the device no longer keeps
            assert policy.stats.offloaded_bytes >= saved_ref - saved > 0, what
    if "mla_up_proj" in kinds:
        # CPU attention with q/k and v head dims apart takes SDPA's math path, which at these sizes saves its own
        # copies of q, k and v rather than the up projection's outputs (at DeepSeek-V3's width it keeps v as a view of
        # the kv up projection, which is then freed: benchmarks/memory_savings.py): discarding them pays wherever
        # attention saves its inputs, as it does when core_attn is recomputed
        assert kept[f"{name} recompute=['mla_up_proj'] offload=[]"] <= saved_ref
        both, core = (kept[f"{name} recompute={r} offload=[]"] for r in (["core_attn", "mla_up_proj"], ["core_attn"]))
        assert both < core


def _kinds_of(name: str) -> set[str]:
    return {"mlp", "shared_experts", "mla_up_proj"} if name == "tiny-deepseek-v3" else set()
