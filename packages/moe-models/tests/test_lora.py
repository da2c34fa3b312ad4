"""LoRA on whole models: an adapted projection against ``W x + b + (alpha / r) B A x`` by hand; a fresh adapter
changes no logit; a model with trained adapters against the same model without adapters holding the merged weights;
a frozen base gets no gradient and no optimizer state."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moe_models import build_model, causal_lm_loss
from moe_models.lora import DEFAULT_TARGETS, LoRALinear, add_lora_, freeze_base_, merged_state_dict
from moe_models.presets import preset

FAMILIES = ["tiny-qwen3-moe", "tiny-deepseek-v3", "tiny-gpt-oss", "tiny-mixtral"]


def _randomise_adapters(model: nn.Module, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:  # B starts at zero, which would hide the B path
                param.copy_(torch.randn(param.shape, generator=gen, dtype=param.dtype) * 0.1)


def test_an_adapted_linear_is_the_lora_formula():
    linear = nn.Linear(12, 6).double()
    base = nn.Linear(12, 6).double()
    base.load_state_dict(linear.state_dict())
    model = nn.Sequential(linear)
    add_lora_(model, rank=4, alpha=8.0, targets=("0",))
    assert isinstance(model[0], LoRALinear)
    model.double()
    _randomise_adapters(model)
    x = torch.randn(5, 12, dtype=torch.float64, requires_grad=True)
    out = model(x)
    a, b = linear.lora_A.detach().clone().requires_grad_(), linear.lora_B.detach().clone().requires_grad_()
    xr = x.detach().clone().requires_grad_()
    want = base(xr) + (8.0 / 4) * (xr @ a.t()) @ b.t()
    torch.testing.assert_close(out, want, rtol=1e-6, atol=0)
    grad = torch.randn_like(out)
    got_grads = torch.autograd.grad(out, (x, linear.lora_A, linear.lora_B), grad)
    want_grads = torch.autograd.grad(want, (xr, a, b), grad)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("family", FAMILIES)
def test_adapted_model_equals_the_merged_model_and_trains_only_adapters(family):
    cfg = preset(family, moe_expert_backend="torch")
    torch.manual_seed(0)
    model = build_model(cfg, seed=0)
    ids = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    base_logits = model(ids[:, :-1]).logits.detach()
    names = add_lora_(model, rank=8, alpha=16.0)
    assert any(name.endswith("mlp.experts") for name in names) and any("attention" in name for name in names)
    shared = [name for name, _ in model.named_modules() if name.endswith("mlp.shared_experts")]
    assert all(name in names for name in shared)  # shared experts (DeepSeek-V3's) are adapted too
    torch.testing.assert_close(model(ids[:, :-1]).logits, base_logits, rtol=0, atol=0)  # B = 0: no change yet

    _randomise_adapters(model)
    merged = build_model(cfg, seed=1)  # other initial values: everything comes from the merged state dict
    merged.load_state_dict(merged_state_dict(model))
    adapted_logits = model(ids[:, :-1]).logits
    assert not torch.allclose(adapted_logits, base_logits, atol=1e-3)  # the adapters do something
    torch.testing.assert_close(adapted_logits, merged(ids[:, :-1]).logits, rtol=1e-4, atol=1e-5)

    trainable = freeze_base_(model)
    assert trainable == sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    causal_lm_loss(model(ids[:, :-1]), ids[:, 1:], cfg.mtp_loss_scaling_factor).total.backward()
    optimizer.step()
    assert all(p.grad is None for n, p in model.named_parameters() if "lora_" not in n)
    assert all(p.grad is not None for n, p in model.named_parameters() if "lora_" in n)
    assert len(optimizer.state) == sum(1 for n, _ in model.named_parameters() if "lora_" in n)


def test_targets_and_settings_that_cannot_be_adapted_name_the_field():
    model = build_model(preset("tiny-qwen3-moe"), seed=0)
    with pytest.raises(ValueError, match="targets: 'nothing.here' matches no module"):
        add_lora_(model, rank=8, alpha=1.0, targets=("nothing.here",))
    with pytest.raises(ValueError, match="targets: layers.0.input_norm is a RMSNorm"):
        add_lora_(model, rank=8, alpha=1.0, targets=("layers.0.input_norm",))
    with pytest.raises(ValueError, match="rank=0"):
        add_lora_(model, rank=0, alpha=1.0)
    with pytest.raises(ValueError, match="dropout=1.0"):
        add_lora_(model, rank=8, alpha=1.0, dropout=1.0)
    assert DEFAULT_TARGETS  # the default reaches attention, dense MLPs, shared and routed experts (checked above)


def test_a_shared_expert_adapter_is_one_update_per_huggingface_projection():
    from moe_experts import SharedExperts
    from moe_models.lora import LoRASharedExperts

    torch.manual_seed(0)
    holder = nn.Module()
    holder.shared_experts = SharedExperts(16, 24, gate=True)
    add_lora_(holder, rank=4, alpha=8.0, targets=("shared_experts",))
    module = holder.shared_experts
    assert isinstance(module, LoRASharedExperts)
    _randomise_adapters(holder)
    x = torch.randn(5, 16)
    w_gate, w_up = module.w_gate_up_H2F.detach().chunk(2, dim=1)  # [H, F] each

    def update(adapter, inp):  # (alpha / r) B A x, by hand
        return inp @ adapter.lora_A.detach().T @ adapter.lora_B.detach().T * 2.0

    gate = x @ w_gate + update(module.lora_gate_proj, x)
    up = x @ w_up + update(module.lora_up_proj, x)
    h = torch.nn.functional.silu(gate) * up
    down = h @ module.w_down_FH.detach() + update(module.lora_down_proj, h)
    want = torch.sigmoid(x @ module.w_gate_H1.detach()) * down
    torch.testing.assert_close(module(x), want, rtol=1e-5, atol=1e-6)
    merged = SharedExperts(16, 24, gate=True)
    merged.load_state_dict({k.removeprefix("shared_experts."): v for k, v in merged_state_dict(holder).items()})
    torch.testing.assert_close(merged(x), want, rtol=1e-5, atol=1e-6)
