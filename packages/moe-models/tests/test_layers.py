"""RMSNorm, rotary embeddings, Attention, MoEBlock and the whole decoder against naive fp64 references."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from moe_dispatch import RouterConfig
from moe_models import (
    Attention,
    ModelConfig,
    MoEBlock,
    RMSNorm,
    apply_rotary,
    build_model,
    rotary_cos_sin,
)

BASE = 10_000.0


def _tables(seq: int, dim: int, base: float = BASE) -> tuple[torch.Tensor, torch.Tensor]:
    return rotary_cos_sin(ModelConfig(kv_channels=dim, rotary_base=base), seq, torch.device("cpu"))


def _randomize(module: nn.Module, seed: int, std: float = 0.4) -> None:
    """Weights far from their init (norm weights away from 1) so every term matters."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight") or name.endswith("_norm.weight"):
                p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(std * torch.randn(p.shape, generator=gen))


# ----------------------------------------------------------------------------- naive references (fp64)


def naive_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight


def naive_rotate(x_SD: torch.Tensor, base: float) -> torch.Tensor:
    """Rotate-half rotary: pairs (i, i + D/2) turned by position * base^(-2i/D)."""
    seq, dim = x_SD.shape
    half = dim // 2
    out = torch.empty_like(x_SD)
    for pos in range(seq):
        for i in range(half):
            angle = pos * base ** (-2.0 * i / dim)
            c, s = math.cos(angle), math.sin(angle)
            a, b = x_SD[pos, i], x_SD[pos, i + half]
            out[pos, i] = a * c - b * s
            out[pos, i + half] = b * c + a * s
    return out


def naive_attention(attn: Attention, x_BSH: torch.Tensor, base: float, eps: float) -> torch.Tensor:
    nh, nkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    wq, wk, wv, wo = (m.weight.double() for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj))
    qk_norm = isinstance(attn.q_norm, RMSNorm)
    batch, seq, _ = x_BSH.shape
    out = torch.zeros(batch, seq, wo.shape[0], dtype=torch.float64)
    for b in range(batch):
        x = x_BSH[b].double()
        q, k, v = (x @ wq.T).view(seq, nh, d), (x @ wk.T).view(seq, nkv, d), (x @ wv.T).view(seq, nkv, d)
        if qk_norm:
            q = naive_rms_norm(q, attn.q_norm.weight.double(), eps)
            k = naive_rms_norm(k, attn.k_norm.weight.double(), eps)
        heads = []
        for h in range(nh):
            g = h // (nh // nkv)  # query head h reads kv head g
            qh, kh = naive_rotate(q[:, h], base), naive_rotate(k[:, g], base)
            scores = qh @ kh.T / math.sqrt(d)
            for i in range(seq):
                for j in range(i + 1, seq):
                    scores[i, j] = -math.inf
            heads.append(torch.softmax(scores, dim=-1) @ v[:, g])
        out[b] = torch.cat(heads, dim=-1) @ wo.T
    return out


def naive_expert(block: MoEBlock, e: int, x_H: torch.Tensor) -> torch.Tensor:
    w_gate_up, w_down = block.experts.w_gate_up_EH2F[e].double(), block.experts.w_down_EFH[e].double()
    ffn = w_down.shape[0]
    gate, up = x_H @ w_gate_up[:, :ffn], x_H @ w_gate_up[:, ffn:]
    return (gate * torch.sigmoid(gate) * up) @ w_down


def naive_moe(block: MoEBlock, x_BSH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token loop: softmax over all experts, top-k, renormalise, weighted sum of SwiGLU experts.

    Returns the output, the (token, expert) counts per expert and the unscaled Switch aux loss.
    """
    topk = block.router.config.topk
    w_router = block.router.weight.double()
    x_TH = x_BSH.reshape(-1, x_BSH.shape[-1]).double()
    out = torch.zeros_like(x_TH)
    counts = torch.zeros(w_router.shape[0], dtype=torch.int64)
    probs_all = []
    for t, x in enumerate(x_TH):
        probs = torch.softmax(x @ w_router.T, dim=-1)
        probs_all.append(probs)
        chosen = sorted(range(len(probs)), key=lambda e: -probs[e].item())[:topk]
        norm = sum(probs[e] for e in chosen)
        for e in chosen:
            out[t] += probs[e] / norm * naive_expert(block, e, x)
            counts[e] += 1
    num_experts, num_tokens = len(counts), len(x_TH)
    mean_prob = torch.stack(probs_all).mean(0)
    aux = num_experts * sum(counts[e] / (num_tokens * topk) * mean_prob[e] for e in range(num_experts))
    return out.view(x_BSH.shape), counts, aux


# ----------------------------------------------------------------------------- RMSNorm and rotary


def test_rms_norm_matches_formula():
    norm = RMSNorm(10, eps=1e-5)
    _randomize(norm, 0)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, 10))
    x = torch.randn(3, 4, 10, generator=torch.Generator().manual_seed(1)) * 3
    expected = naive_rms_norm(x.double(), norm.weight.double(), 1e-5)
    torch.testing.assert_close(norm(x).double(), expected, rtol=1e-5, atol=1e-6)


def test_rms_norm_keeps_low_precision_input_dtype():
    norm = RMSNorm(8, eps=1e-6)
    x = torch.randn(4, 8).to(torch.bfloat16)
    y = norm.to(torch.bfloat16)(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), naive_rms_norm(x.double(), 1.0, 1e-6), rtol=2e-2, atol=2e-2)


def test_rotary_tables_by_hand():
    cos, sin = _tables(3, 4, base=100.0)
    # frequencies 100^(-0/4) = 1 and 100^(-2/4) = 0.1: one column each
    angles = torch.tensor([[0.0, 0.0], [1.0, 0.1], [2.0, 0.2]])
    torch.testing.assert_close(cos, angles.cos())
    torch.testing.assert_close(sin, angles.sin())


def test_apply_rotary_turns_the_first_pair_by_position():
    cos, sin = _tables(4, 2)
    x = torch.tensor([1.0, 0.0]).expand(1, 1, 4, 2)
    expected = torch.tensor([[math.cos(p), math.sin(p)] for p in range(4)])
    torch.testing.assert_close(apply_rotary(x, cos, sin)[0, 0], expected)


def test_apply_rotary_matches_rotate_half_reference():
    x = torch.randn(2, 3, 9, 8, generator=torch.Generator().manual_seed(2))
    cos, sin = _tables(9, 8)
    got = apply_rotary(x, cos, sin)
    for b in range(2):
        for n in range(3):
            torch.testing.assert_close(got[b, n].double(), naive_rotate(x[b, n].double(), BASE), rtol=1e-5, atol=1e-6)


def test_rotary_scores_depend_only_on_relative_position():
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(16, generator=gen), torch.randn(16, generator=gen)
    cos, sin = _tables(20, 16)
    x = torch.stack([q, k]).expand(20, 2, 16).permute(1, 0, 2)[None]  # [1, 2, S, D]: q and k at every position
    rq, rk = apply_rotary(x, cos, sin)[0]
    assert torch.dot(rq[5], rk[2]).item() == pytest.approx(torch.dot(rq[15], rk[12]).item(), abs=1e-4)
    assert torch.dot(rq[5], rk[2]).item() != pytest.approx(torch.dot(rq[5], rk[3]).item(), abs=1e-3)
    torch.testing.assert_close(rq.norm(dim=-1), q.norm().expand(20))


# ----------------------------------------------------------------------------- attention


@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
def test_attention_matches_naive_reference(num_kv_heads, qk_norm):
    hidden, heads, head_dim, seq, eps = 24, 4, 8, 7, 1e-6  # heads * head_dim != hidden on purpose
    cfg = ModelConfig(
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=num_kv_heads,
        kv_channels=head_dim,
        qk_layernorm=qk_norm,
        norm_epsilon=eps,
        rotary_base=BASE,
    )
    attn = Attention(cfg)
    _randomize(attn, seed=num_kv_heads)
    x = torch.randn(2, seq, hidden, generator=torch.Generator().manual_seed(10))
    cos, sin = _tables(seq, head_dim)
    got = attn(x, cos, sin)
    assert got.shape == (2, seq, hidden)
    torch.testing.assert_close(got.double(), naive_attention(attn, x, BASE, eps), rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- MoE block


@pytest.mark.parametrize("backend", ["torch", "loop"])
@pytest.mark.parametrize(("num_experts", "topk"), [(8, 2), (4, 1), (6, 6)])
def test_moe_block_matches_per_token_loop(backend, num_experts, topk):
    hidden, ffn = 16, 12
    coeff = 0.01
    block = MoEBlock(hidden, ffn, RouterConfig(num_experts=num_experts, topk=topk, aux_loss_coeff=coeff), backend)
    _randomize(block, seed=num_experts + topk)
    x = torch.randn(3, 5, hidden, generator=torch.Generator().manual_seed(11))
    out, routing = block(x)
    expected, counts, aux = naive_moe(block, x)
    assert out.shape == x.shape
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-5)
    assert torch.equal(routing.tokens_per_expert_E, counts)
    assert int(counts.sum()) == 15 * topk
    assert routing.aux_loss.item() == pytest.approx(coeff * aux.item(), rel=1e-5)


def test_moe_block_gradients_flow_to_router_and_experts():
    block = MoEBlock(8, 8, RouterConfig(num_experts=4, topk=2), "torch")
    _randomize(block, 0)
    out, routing = block(torch.randn(2, 3, 8))
    (out.square().sum() + routing.aux_loss).backward()
    for name, p in block.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


# ----------------------------------------------------------------------------- the whole decoder


def naive_model_logits(model: nn.Module, ids_BS: torch.Tensor) -> torch.Tensor:
    c = model.config
    h = model.embed_tokens.weight.double()[ids_BS]
    for layer in model.layers:
        normed = naive_rms_norm(h, layer.input_norm.weight.double(), c.norm_epsilon)
        h = h + naive_attention(layer.attention, normed, c.rotary_base, c.norm_epsilon)
        normed = naive_rms_norm(h, layer.post_attention_norm.weight.double(), c.norm_epsilon)
        h = h + naive_moe(layer.mlp, normed)[0]
    return naive_rms_norm(h, model.norm.weight.double(), c.norm_epsilon) @ model.lm_head.weight.double().T


@pytest.mark.parametrize("tied", [False, True])
def test_decoder_matches_naive_composition(tied):
    cfg = ModelConfig(
        vocab_size=50,
        hidden_size=24,
        num_layers=2,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=8,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=16,
        rotary_base=BASE,
        share_embeddings_and_output_weights=tied,
    )
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    _randomize(model, seed=5, std=0.3)
    ids = torch.randint(0, cfg.vocab_size, (2, 6), generator=torch.Generator().manual_seed(4))
    logits = model(ids).logits
    torch.testing.assert_close(logits.double(), naive_model_logits(model, ids), rtol=1e-4, atol=1e-4)
