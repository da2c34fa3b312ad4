"""QK-clip's model side: the max logit per head against plain torch over the allowed pairs, a planted large logit
rescaled onto the threshold (GQA with biases and the output gate, MLA with and without the q latent), the maxima
through the whole model and a pipeline stage, and what is refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_models import ModelConfig, build_model
from moe_models.attention import Attention
from moe_models.mla import MultiLatentAttention
from moe_models.pipeline import ModelStage
from moe_models.qk_clip import (
    attention_row_scales,
    clip_attention_,
    qk_clip_refusals,
    scale_rows_,
    softmax_attentions,
)
from moe_models.rope import apply_rotary, rotary_cos_sin

GQA = {
    "vocab_size": 40,
    "hidden_size": 32,
    "num_layers": 2,
    "num_attention_heads": 4,
    "num_query_groups": 2,
    "kv_channels": 8,
    "num_moe_experts": 4,
    "moe_router_topk": 2,
    "moe_ffn_hidden_size": 8,
    "qk_layernorm": False,
}
MLA = {
    **GQA,
    "multi_latent_attention": True,
    "kv_lora_rank": 16,
    "qk_head_dim": 8,
    "qk_pos_emb_head_dim": 4,
    "v_head_dim": 6,
}
B, S, PLANTED, FACTOR = 2, 24, 1, 6.0


def _reference_max(q_BNSD, k_BNKD, scale, allowed_BSK) -> torch.Tensor:
    """max over batch and allowed (query, key) pairs of q.k * scale per query head: the whole score matrix at once."""
    n, n_kv = q_BNSD.shape[1], k_BNKD.shape[1]
    k = k_BNKD.repeat_interleave(n // n_kv, dim=1).double()
    logits = (q_BNSD.double() @ k.transpose(-1, -2)) * scale
    logits = logits.masked_fill(~allowed_BSK[:, None], float("-inf"))
    return logits.amax(dim=(0, 2, 3))


def _gqa_qk(attn: Attention, x_BSH, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k of a GQA layer by hand: projections (q rows per head [q, gate] with the gate), rotary embeddings."""
    d = attn.head_dim
    q = x_BSH @ attn.q_proj.weight.T + (attn.q_proj.bias if attn.q_proj.bias is not None else 0)
    if attn.output_gate:
        q = q.view(B, S, -1, 2 * d)[..., :d].reshape(B, S, -1)
    k = x_BSH @ attn.k_proj.weight.T + (attn.k_proj.bias if attn.k_proj.bias is not None else 0)
    q, k = (t.view(B, S, -1, d).transpose(1, 2) for t in (q, k))
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def _mla_qk(attn: MultiLatentAttention, x_BSH, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k of an MLA layer by hand: [no-rope | rotated rope] per head, one rotated key shared by the heads."""
    nope, rope = attn.nope_dim, attn.rope_dim
    q_in = attn.q_a_norm(x_BSH @ attn.q_a_proj.weight.T) if attn.q_latent else x_BSH
    q_up = attn.q_b_proj if attn.q_latent else attn.q_proj
    q = (q_in @ q_up.weight.T).view(B, S, -1, nope + rope).transpose(1, 2)
    latent, k_rope = (x_BSH @ attn.kv_a_proj.weight.T).split([attn.kv_lora_rank, rope], dim=-1)
    k_nope = (attn.kv_a_norm(latent) @ attn.kv_b_proj.weight.T).view(B, S, -1, nope + attn.v_dim)[..., :nope]
    k_nope = k_nope.transpose(1, 2)
    k_rot = apply_rotary(k_rope.unsqueeze(1), cos, sin).expand(-1, k_nope.shape[1], -1, -1)
    q = torch.cat([q[..., :nope], apply_rotary(q[..., nope:], cos, sin)], dim=-1)
    return q, torch.cat([k_nope, k_rot], dim=-1)


def _allowed(window: int | None = None, documents_BS: torch.Tensor | None = None) -> torch.Tensor:
    pos = torch.arange(S)
    delta = pos[:, None] - pos[None, :]
    allowed = (delta >= 0) & (delta < window) if window is not None else delta >= 0
    allowed = allowed.expand(B, S, S)
    if documents_BS is not None:
        allowed = allowed & (documents_BS[:, :, None] == documents_BS[:, None, :])
    return allowed


def _planted(module: torch.nn.Module, rows: slice, *names: str) -> None:
    """Scale rows ``rows`` of the named projections (weight and bias): one head's logits grow FACTOR-fold."""
    with torch.no_grad():
        for name in names:
            proj = module.get_submodule(name)
            proj.weight[rows] *= FACTOR
            if proj.bias is not None:
                proj.bias[rows] *= FACTOR


def _inputs(config: ModelConfig):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(B, S, config.hidden_size, generator=g)
    cos, sin = rotary_cos_sin(config, S)
    return x, cos, sin


def _max_of(attn, x, cos, sin, **kwargs) -> torch.Tensor:
    out, maxima = attn(x, cos, sin, logit_max=True, **kwargs)
    assert torch.equal(out, attn(x, cos, sin, **kwargs))  # asking for the maxima changes nothing else
    return maxima


def _clip_and_check(attn, before_N, gamma_N, heads_moved, x, cos, sin, hand_qk) -> set[str]:
    """Clip by ``gamma_N``; every head's new max is its old one times its factor (the planted head lands on tau),
    by the kernel and by hand; returns the names of the parameters that changed."""
    untouched = {n: p.detach().clone() for n, p in attn.named_parameters()}
    clip_attention_(attn, gamma_N)
    after_N = _max_of(attn, x, cos, sin)
    expected_N = before_N.double() * heads_moved
    torch.testing.assert_close(after_N.double(), expected_N, rtol=1e-5, atol=0)
    q, k = hand_qk(attn, x, cos, sin)
    torch.testing.assert_close(
        _reference_max(q, k, attn.core_attention.scale or q.shape[-1] ** -0.5, _allowed()),
        expected_N,
        rtol=1e-5,
        atol=0,
    )
    changed = {n for n, p in attn.named_parameters() if not torch.equal(p, untouched[n])}
    return changed


@pytest.mark.parametrize(("bias", "gate"), [(False, False), (True, False), (True, True)])
def test_gqa_max_matches_plain_torch_and_the_planted_head_lands_on_tau(bias: bool, gate: bool) -> None:
    config = ModelConfig(**GQA, add_qkv_bias=bias, attention_output_gate=gate)
    torch.manual_seed(0)
    attn = Attention(config)
    d = config.kv_channels
    per_head = 2 * d if gate else d
    _planted(attn, slice(PLANTED * per_head, PLANTED * per_head + d), "q_proj")  # head 1's q rows (not its gate)
    x, cos, sin = _inputs(config)
    before = _max_of(attn, x, cos, sin)
    q, k = _gqa_qk(attn, x, cos, sin)
    torch.testing.assert_close(before.double(), _reference_max(q, k, d**-0.5, _allowed()), rtol=1e-6, atol=0)
    assert before.argmax() == PLANTED
    tau = float(before.sort().values[-2] + before.max()) / 2  # between the planted head and the next largest
    gamma = torch.where(before > tau, tau / before, torch.ones_like(before))
    # heads 0 and 1 share key head 0: the group's factor is head 1's, so both shrink by it; heads 2, 3 stay
    eta = tau / float(before[PLANTED])
    moved = torch.tensor([eta, eta, 1.0, 1.0], dtype=torch.float64)
    changed = _clip_and_check(attn, before, gamma, moved, x, cos, sin, _gqa_qk)
    assert changed == {"q_proj.weight", "k_proj.weight"} | ({"q_proj.bias", "k_proj.bias"} if bias else set())
    after = _max_of(attn, x, cos, sin)
    assert after[PLANTED].item() == pytest.approx(tau, rel=1e-5)


def test_gqa_row_factors_by_hand() -> None:
    """alpha splits a group's factor between its query and key rows; the gate rows stay at 1."""
    config = ModelConfig(**GQA, attention_output_gate=True)
    attn = Attention(config)
    gamma = torch.tensor([1.0, 0.25, 0.5, 1.0])
    rows = attention_row_scales(attn, gamma, alpha=0.5)
    d = config.kv_channels
    q = rows["q_proj.weight"].view(4, 2, d)  # per head [q, gate]
    assert torch.equal(q[:, 0, 0], torch.tensor([0.5, 0.5, 0.5**0.5, 0.5**0.5]))
    assert torch.equal(q[:, 1], torch.ones(4, d))
    assert torch.equal(rows["k_proj.weight"].view(2, d)[:, 0], torch.tensor([0.5, 0.5**0.5]))
    q30 = attention_row_scales(attn, gamma, alpha=0.3)
    torch.testing.assert_close(
        q30["q_proj.weight"].view(4, 2, d)[1, 0, 0] * q30["k_proj.weight"][0], torch.tensor(0.25)
    )


@pytest.mark.parametrize("window", [5, None])
def test_gqa_max_over_windows_and_documents(window: int | None) -> None:
    config = ModelConfig(**GQA, window_size=window)
    torch.manual_seed(1)
    attn = Attention(config, full_attention=window is None)
    x, cos, sin = _inputs(config)
    documents = torch.tensor([[0] * 7 + [1] * 10 + [2] * 7, [0] * 15 + [-1] * 9])
    for docs in (None, documents):
        kwargs = {} if docs is None else {"document_ids_BS": docs}
        rotary = (cos, sin) if docs is None else rotary_cos_sin(config, _doc_positions(docs))
        got = _max_of(attn, x, *rotary, **kwargs)
        q, k = _gqa_qk(attn, x, *rotary)
        want = _reference_max(q, k, config.kv_channels**-0.5, _allowed(window, docs))
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)


def _doc_positions(documents_BS: torch.Tensor) -> torch.Tensor:
    """Each token's position in its document, by hand."""
    out = torch.zeros_like(documents_BS)
    for b in range(documents_BS.shape[0]):
        for i in range(1, documents_BS.shape[1]):
            same = documents_BS[b, i] == documents_BS[b, i - 1]
            out[b, i] = out[b, i - 1] + 1 if same else 0
    return out


@pytest.mark.parametrize("q_lora_rank", [None, 12])
def test_mla_planted_head_lands_on_tau_with_the_shared_rotary_key_untouched(q_lora_rank: int | None) -> None:
    config = ModelConfig(**MLA, q_lora_rank=q_lora_rank)
    torch.manual_seed(2)
    attn = MultiLatentAttention(config)
    qk = config.qk_head_dim + config.qk_pos_emb_head_dim
    _planted(attn, slice(PLANTED * qk, (PLANTED + 1) * qk), "q_b_proj" if q_lora_rank else "q_proj")
    x, cos, sin = _inputs(config)
    before = _max_of(attn, x, cos, sin)
    q, k = _mla_qk(attn, x, cos, sin)
    torch.testing.assert_close(before.double(), _reference_max(q, k, qk**-0.5, _allowed()), rtol=1e-6, atol=0)
    assert before.argmax() == PLANTED
    tau = float(before.sort().values[-2] + before.max()) / 2
    gamma = torch.where(before > tau, tau / before, torch.ones_like(before))
    moved = gamma.double()  # MLA: per head
    changed = _clip_and_check(attn, before, gamma, moved, x, cos, sin, _mla_qk)
    assert changed == {f"{'q_b_proj' if q_lora_rank else 'q_proj'}.weight", "kv_b_proj.weight"}
    assert _max_of(attn, x, cos, sin)[PLANTED].item() == pytest.approx(tau, rel=1e-5)


def test_mla_row_factors_by_hand() -> None:
    """Kimi K2's rule: no-rope q and k rows by sqrt(gamma), rope q rows by gamma, value rows untouched."""
    config = ModelConfig(**MLA)
    attn = MultiLatentAttention(config)
    gamma = torch.tensor([1.0, 0.25, 1.0, 0.64])
    rows = attention_row_scales(attn, gamma)
    nope, rope, v = config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim
    q = rows["q_proj.weight"].view(4, nope + rope)
    kv = rows["kv_b_proj.weight"].view(4, nope + v)
    torch.testing.assert_close(q[:, :nope], gamma.sqrt()[:, None].expand(4, nope))
    torch.testing.assert_close(q[:, nope:], gamma[:, None].expand(4, rope))
    torch.testing.assert_close(kv[:, :nope], gamma.sqrt()[:, None].expand(4, nope))
    assert torch.equal(kv[:, nope:], torch.ones(4, v))
    assert set(rows) == {"q_proj.weight", "kv_b_proj.weight"}


def test_scale_rows_from_an_offset_equals_the_whole_projection_scaled() -> None:
    """A shard of rows (a tp rank's heads, an FSDP shard) scaled from its global offset is that slice of the whole."""
    whole = torch.randn(12, 5)
    factors = torch.linspace(0.1, 1.0, 12)
    expected = whole * factors[:, None]
    for start, stop in ((0, 4), (4, 9), (9, 12)):
        shard = whole[start:stop].clone()
        scale_rows_(shard, factors, start)
        assert torch.equal(shard, expected[start:stop])
    with pytest.raises(ValueError, match="past the projection"):
        scale_rows_(whole[:4].clone(), factors, 10)


@pytest.mark.parametrize("extra", [GQA, {**MLA, "mtp_num_layers": 1}])
def test_model_and_stage_output_the_maxima_each_core_attention_sees(extra: dict) -> None:
    """ModelOutput.attention_logit_max row by row against plain torch over the q and k each core attention was
    given (captured by hooks), MTP depth last; logits unchanged; a one-stage ModelStage puts them last."""
    torch.manual_seed(4)
    model = build_model(ModelConfig(**extra)).eval()
    ids = torch.randint(0, 40, (B, S), generator=torch.Generator().manual_seed(5))
    seen: list[tuple[torch.Tensor, torch.Tensor, float]] = []
    attentions = softmax_attentions(model)
    hooks = [
        a.core_attention.register_forward_pre_hook(lambda m, args: seen.append((args[0], args[1], m.scale)))
        for a in attentions
    ]
    plain = model(ids)
    hooks_out = [(q, k, scale or q.shape[-1] ** -0.5) for q, k, scale in seen]
    for hook in hooks:
        hook.remove()
    out = model(ids, attention_logit_max=True)
    assert torch.equal(out.logits, plain.logits) and plain.attention_logit_max is None
    layers = extra["num_layers"] + extra.get("mtp_num_layers", 0)
    assert out.attention_logit_max.shape == (layers, extra["num_attention_heads"]) == (len(hooks_out), 4)
    for row, (q, k, scale) in enumerate(hooks_out):
        want = _reference_max(q, k, scale, _allowed())
        torch.testing.assert_close(out.attention_logit_max[row].double(), want, rtol=1e-6, atol=0)
    stage = ModelStage(model, 0, tuple(range(extra["num_layers"])), first=True, last=True)
    staged = stage(ids, input_ids_BS=ids, attention_logit_max=True)
    assert torch.equal(staged[-1], out.attention_logit_max)
    assert torch.equal(staged[0], out.logits)
    with pytest.raises(ValueError, match="not carried between pipeline stages"):
        ModelStage(model, 0, (0,), first=True, last=False)(ids, input_ids_BS=ids, attention_logit_max=True)


def test_refusals_name_the_field() -> None:
    base = ModelConfig(**GQA)
    assert qk_clip_refusals(base) == {}
    assert set(qk_clip_refusals(dataclasses.replace(base, qk_layernorm=True))) == {"qk_layernorm"}
    assert set(qk_clip_refusals(dataclasses.replace(base, clip_qkv=8.0))) == {"clip_qkv"}
    assert set(qk_clip_refusals(dataclasses.replace(base, qk_l2_norm=True))) == {"qk_l2_norm"}
    # MLA has no q/k norms after its projections: qk_layernorm does not reach it
    assert qk_clip_refusals(ModelConfig(**{**MLA, "qk_layernorm": True})) == {}
