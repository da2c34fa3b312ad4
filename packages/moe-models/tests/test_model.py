"""MoETransformer in its Qwen3-MoE configuration: shapes, causality, aux loss, overfitting, meta build, bf16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _published_shapes import QWEN3_30B_A3B

from moe_models import ModelConfig, ModelOutput, MoETransformer, build_model, count_parameters

TINY = {
    "vocab_size": 64,
    "hidden_size": 32,
    "num_layers": 2,
    "num_attention_heads": 4,
    "num_query_groups": 2,
    "kv_channels": 8,
    "num_moe_experts": 4,
    "moe_router_topk": 2,
    "moe_ffn_hidden_size": 16,
}


def _tiny(**overrides) -> tuple[ModelConfig, MoETransformer]:
    cfg = ModelConfig(**{**TINY, **overrides})
    torch.manual_seed(0)
    return cfg, build_model(cfg)


def _ids(cfg: ModelConfig, batch: int = 2, seq: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))


def test_build_model_returns_qwen3_moe_with_configured_sizes():
    _, model = _tiny()
    assert isinstance(model, MoETransformer)
    assert len(model.layers) == 2
    assert model.layers[0].attention.q_proj.weight.shape == (4 * 8, 32)
    assert model.layers[0].attention.k_proj.weight.shape == (2 * 8, 32)
    assert model.layers[0].mlp.experts.w_gate_up_EH2F.shape == (4, 32, 2 * 16)
    assert model.lm_head.weight.shape == (64, 32)


def test_output_shapes_and_expert_loads():
    cfg, model = _tiny()
    out = model(_ids(cfg, batch=3, seq=10))
    assert isinstance(out, ModelOutput)
    assert out.logits.shape == (3, 10, cfg.vocab_size)
    assert out.logits.dtype == torch.float32
    assert out.aux_loss.shape == ()
    assert out.tokens_per_expert_LE.shape == (cfg.num_layers, cfg.num_moe_experts)
    assert out.tokens_per_expert_LE.dtype == torch.int64
    assert out.tokens_per_expert_LE.sum(dim=1).tolist() == [3 * 10 * cfg.moe_router_topk] * cfg.num_layers


@pytest.mark.parametrize("t", [0, 4, 10])
def test_logits_are_causal(t):
    cfg, model = _tiny()
    model.eval()
    ids = _ids(cfg, seq=12)
    changed = ids.clone()
    changed[:, t + 1 :] = (ids[:, t + 1 :] + 1 + torch.arange(12 - t - 1)) % cfg.vocab_size
    with torch.no_grad():
        a, b = model(ids).logits, model(changed).logits
    torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1], rtol=0, atol=1e-6)
    # and the change is visible from the first changed position on
    assert (a[:, t + 1] - b[:, t + 1]).abs().max() > 1e-4


def test_expert_backends_agree():
    cfg, model = _tiny()
    _, loop_model = _tiny(moe_expert_backend="loop")
    loop_model.load_state_dict(model.state_dict())
    ids = _ids(cfg)
    torch.testing.assert_close(loop_model(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-6)


def test_tied_embeddings_share_one_tensor():
    cfg, model = _tiny(share_embeddings_and_output_weights=True)
    assert model.lm_head.weight is model.embed_tokens.weight
    out = model(_ids(cfg))
    out.logits.sum().backward()
    assert model.embed_tokens.weight.grad is not None


def test_aux_loss_is_the_sum_of_layer_switch_losses_in_train_mode():
    cfg, model = _tiny(moe_aux_loss_coeff=0.1)
    router_inputs = []
    for layer in model.layers:
        layer.mlp.router.register_forward_hook(lambda mod, args, out: router_inputs.append((mod, args[0].detach())))
    model.train()
    out = model(_ids(cfg))
    assert out.aux_loss.item() > 0
    expected = 0.0
    for router, x_TH in router_inputs:
        scores = torch.softmax(x_TH.double() @ router.weight.double().T, dim=-1)
        chosen = scores.topk(cfg.moe_router_topk, dim=-1).indices
        fraction = torch.bincount(chosen.flatten(), minlength=cfg.num_moe_experts) / (len(x_TH) * cfg.moe_router_topk)
        expected += 0.1 * cfg.num_moe_experts * (fraction * scores.mean(0)).sum().item()  # Switch: E * sum f_e P_e
    assert len(router_inputs) == cfg.num_layers
    assert out.aux_loss.item() == pytest.approx(expected, rel=1e-5)
    # a near-uniform router at init gives the Switch loss ~1 per layer
    assert out.aux_loss.item() == pytest.approx(0.1 * cfg.num_layers, rel=0.2)


def test_no_aux_loss_in_eval_mode_or_when_disabled():
    cfg, model = _tiny()
    assert model.eval()(_ids(cfg)).aux_loss.item() == 0.0
    cfg, model = _tiny(moe_router_load_balancing_type="none")
    assert model.train()(_ids(cfg)).aux_loss.item() == 0.0


def test_a_few_steps_overfit_a_fixed_batch():
    cfg, model = _tiny()
    model.train()
    ids = _ids(cfg, batch=2, seq=16, seed=2)
    inputs, targets = ids[:, :-1], ids[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    losses, aux = [], []
    for _ in range(25):
        out = model(inputs)
        loss = F.cross_entropy(out.logits.reshape(-1, cfg.vocab_size), targets.reshape(-1))
        opt.zero_grad()
        (loss + out.aux_loss).backward()
        opt.step()
        losses.append(loss.item())
        aux.append(out.aux_loss.item())
    assert losses[0] == pytest.approx(torch.log(torch.tensor(64.0)).item(), abs=0.3)  # near-uniform at init
    assert losses[-1] < 0.5 * losses[0]
    assert all(a > 0 for a in aux)


def test_parameters_are_float32_and_init_std():
    _, model = _tiny(hidden_size=64, vocab_size=512, init_method_std=0.05)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert model.embed_tokens.weight.std().item() == pytest.approx(0.05, rel=0.1)
    assert model.layers[0].input_norm.weight.eq(1).all()


def test_full_size_model_builds_on_meta_without_allocating():
    cfg = ModelConfig(**QWEN3_30B_A3B)
    with torch.device("meta"):
        model = build_model(cfg)
    params = list(model.parameters())
    assert all(p.is_meta for p in params)
    assert all(b.is_meta for b in model.buffers())
    # 30.5B parameters in fp32 would need ~122 GB: only meta tensors can hold them here
    assert sum(p.numel() for p in params) == count_parameters(cfg).total
    assert sum(p.numel() for p in params) > 30e9


def test_meta_model_materializes_like_a_cpu_model():
    """Meta build -> to_empty -> reset_parameters initialises every tensor exactly as on the CPU."""
    cfg = ModelConfig(**TINY)
    with torch.device("meta"):
        meta_built = build_model(cfg)
    meta_built.to_empty(device="cpu")
    torch.manual_seed(5)
    meta_built.reset_parameters()
    _, cpu_built = _tiny()
    torch.manual_seed(5)
    cpu_built.reset_parameters()
    reference = cpu_built.state_dict()
    for name, tensor in meta_built.state_dict().items():
        assert torch.equal(tensor, reference[name]), name
    ids = _ids(cfg)
    torch.testing.assert_close(meta_built(ids).logits, cpu_built(ids).logits, rtol=0, atol=0)


def test_bf16_autocast_forward_is_finite_and_close_to_fp32():
    cfg, model = _tiny()
    model.eval()
    ids = _ids(cfg, batch=1, seq=8)
    with torch.no_grad():
        ref = model(ids).logits
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(ids)
    assert out.logits.dtype == torch.bfloat16
    assert torch.isfinite(out.logits).all()
    err = (out.logits.float() - ref).abs().max().item()
    assert err <= 0.05 * ref.abs().max().item()
