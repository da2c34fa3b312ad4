"""GroupedExperts(activation="swiglu_oai", bias=True) with router probabilities against transformers'
GptOssExperts holding the same weights (same [E, H, 2F] interleaved layout), forward and backward."""

from __future__ import annotations

import pytest
import torch

from moe_experts.backends import backend_availability
from moe_experts.grouped import GroupedExperts

modeling = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
configuration = pytest.importorskip("transformers.models.gpt_oss.configuration_gpt_oss")

E, H, F, T, K = 4, 8, 12, 10, 2
AVAILABLE = sorted(name for name, reason in backend_availability().items() if reason is None and name != "te")


def _hf_experts():
    config = configuration.GptOssConfig(
        hidden_size=H, intermediate_size=F, num_local_experts=E, num_experts_per_tok=K, num_hidden_layers=1
    )
    if hasattr(config, "_experts_implementation"):
        config._experts_implementation = "eager"
    return modeling.GptOssExperts(config)


@pytest.mark.parametrize("backend", AVAILABLE)
def test_matches_transformers_gpt_oss_experts(backend):
    ours = GroupedExperts(E, H, F, activation="swiglu_oai", backend=backend, bias=True, seed=0)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        ours.w_gate_up_EH2F.mul_(100)  # reach the +-7 clamps
        ours.b_gate_up_E2F.copy_(torch.randn(E, 2 * F, generator=gen))
        ours.b_down_EH.copy_(torch.randn(E, H, generator=gen))
    hf = _hf_experts()
    with torch.no_grad():
        hf.gate_up_proj.copy_(ours.w_gate_up_EH2F)
        hf.gate_up_proj_bias.copy_(ours.b_gate_up_E2F)
        hf.down_proj.copy_(ours.w_down_EFH)
        hf.down_proj_bias.copy_(ours.b_down_EH)

    x0 = torch.randn(T, H, generator=gen)
    logits = torch.randn(T, E, generator=gen)
    logits[:, 2] = -1e9  # expert 2 gets no tokens
    top, idx_TK = logits.topk(K, dim=-1)
    weights_TK = top.softmax(-1)
    cot = torch.randn(T, H, generator=gen)

    x_hf = x0.clone().requires_grad_(True)
    out_hf = hf(x_hf, router_indices=idx_TK, routing_weights=weights_TK)
    (out_hf * cot).sum().backward()

    # dispatch by hand: (token, slot) pairs sorted by expert, probabilities applied inside the experts
    x = x0.clone().requires_grad_(True)
    order = torch.argsort(idx_TK.flatten(), stable=True)
    token_N = torch.arange(T).repeat_interleave(K)[order]
    counts = torch.bincount(idx_TK.flatten(), minlength=E)
    assert counts[2] == 0
    y_NH = ours(x[token_N], counts, weights_TK.flatten()[order])
    out = torch.zeros(T, H).index_add(0, token_N, y_NH)  # combine without weights
    (out * cot).sum().backward()

    torch.testing.assert_close(out, out_hf, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, x_hf.grad, rtol=1e-5, atol=1e-5)
    for ours_name, hf_name in [
        ("w_gate_up_EH2F", "gate_up_proj"),
        ("b_gate_up_E2F", "gate_up_proj_bias"),
        ("w_down_EFH", "down_proj"),
        ("b_down_EH", "down_proj_bias"),
    ]:
        hf_grad = getattr(hf, hf_name).grad
        hf_grad = torch.zeros_like(getattr(hf, hf_name)) if hf_grad is None else hf_grad
        torch.testing.assert_close(getattr(ours, ours_name).grad, hf_grad, rtol=1e-5, atol=1e-5, msg=ours_name)
    # the clamps were reached (else the GPT-OSS specifics went untested)
    h = x0 @ ours.w_gate_up_EH2F.detach()[0] + ours.b_gate_up_E2F.detach()[0]
    assert (h[:, 0::2] > 7).any() and (h[:, 1::2].abs() > 7).any()
