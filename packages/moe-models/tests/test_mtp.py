"""Multi-token prediction (DeepSeek-V3): the MTP logits against a hand composition, causality, and the loss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moe_models import ModelConfig, build_model, causal_lm_loss, next_token_loss

CFG = {
    "vocab_size": 40,
    "hidden_size": 16,
    "num_layers": 2,
    "num_attention_heads": 2,
    "num_query_groups": 2,
    "kv_channels": 8,
    "num_moe_experts": 4,
    "moe_router_topk": 2,
    "moe_ffn_hidden_size": 8,
    "mtp_num_layers": 2,
}


def _model(**overrides):
    torch.manual_seed(0)
    model = build_model(ModelConfig(**{**CFG, **overrides})).eval()
    with torch.no_grad():  # norms away from 1 so the hand composition below must use each of them
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
    return model


def _hidden_states(model, ids):
    """The main decoder's residual stream after the last layer (before the final norm), by hand."""
    from moe_models.rope import rotary_cos_sin

    cos, sin = rotary_cos_sin(model.config, ids.shape[1], ids.device)
    x = model.embed_tokens(ids)
    for layer in model.layers:
        x, _ = layer(x, cos, sin)
    return x, cos, sin


def test_mtp_logits_match_a_hand_composition():
    model = _model()
    ids = torch.randint(0, 40, (2, 9), generator=torch.Generator().manual_seed(1))
    out = model(ids)
    h, cos, sin = _hidden_states(model, ids)
    torch.testing.assert_close(out.logits, model.lm_head(model.norm(h)))
    assert len(out.mtp_logits) == 2
    for depth, mtp in enumerate(model.mtp, start=1):
        shifted = torch.cat([ids[:, depth:], ids[:, :depth]], dim=1)  # token i + depth at position i
        e = mtp.enorm(model.embed_tokens(shifted))
        x = mtp.eh_proj(torch.cat([e, mtp.hnorm(h)], dim=-1))
        h, _ = mtp.layer(x, cos, sin)
        torch.testing.assert_close(out.mtp_logits[depth - 1], model.lm_head(mtp.final_norm(h)))
    # one load row per routed layer: 2 main + 2 MTP, each T * topk pairs
    assert out.tokens_per_expert_LE.shape == (4, 4)
    assert out.tokens_per_expert_LE.sum(dim=1).tolist() == [2 * 9 * 2] * 4
    assert len(model.routers()) == 4


def test_mtp_position_i_sees_tokens_up_to_i_plus_depth_only():
    model = _model()
    ids = torch.randint(0, 40, (1, 10), generator=torch.Generator().manual_seed(2))
    changed = ids.clone()
    changed[0, 6] = (ids[0, 6] + 1) % 40
    a, b = model(ids), model(changed)
    for depth, (la, lb) in enumerate(zip(a.mtp_logits, b.mtp_logits, strict=True), start=1):
        unaffected = 6 - depth  # positions < 6 - depth read tokens < 6 only
        # (not bit-equal: the changed token regroups the experts' rows, which reorders float sums)
        torch.testing.assert_close(la[:, :unaffected], lb[:, :unaffected], rtol=0, atol=1e-6)
        assert (la[:, unaffected] - lb[:, unaffected]).abs().max() > 1e-3


def test_causal_lm_loss_adds_the_scaled_mean_of_mtp_losses():
    model = _model()
    ids = torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(3))
    labels = torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(4))
    out = model(ids)
    loss = causal_lm_loss(out, labels, mtp_loss_scaling_factor=0.3)
    lm = F.cross_entropy(out.logits.reshape(-1, 40), labels.reshape(-1))
    # depth k at position i predicts labels[i + k]: the last k positions have no target
    mtp1 = F.cross_entropy(out.mtp_logits[0][:, :7].reshape(-1, 40), labels[:, 1:].reshape(-1))
    mtp2 = F.cross_entropy(out.mtp_logits[1][:, :6].reshape(-1, 40), labels[:, 2:].reshape(-1))
    torch.testing.assert_close(loss.lm, lm)
    torch.testing.assert_close(torch.stack(loss.mtp), torch.stack([mtp1, mtp2]))
    torch.testing.assert_close(loss.total, lm + 0.3 * (mtp1 + mtp2) / 2)
    loss.total.backward()
    assert model.mtp[1].eh_proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("tied", [False, True])
def test_without_mtp_the_loss_is_plain_cross_entropy(tied):
    model = _model(mtp_num_layers=None, share_embeddings_and_output_weights=tied)
    ids = torch.randint(0, 40, (2, 5))
    out = model(ids)
    assert out.mtp_logits == () and len(model.mtp) == 0
    loss = causal_lm_loss(out, ids)
    torch.testing.assert_close(loss.total, F.cross_entropy(out.logits.reshape(-1, 40), ids.reshape(-1)))
    assert loss.mtp == ()
    assert (model.lm_head.weight is model.embed_tokens.weight) == tied


def _load_balanced(seq: int, cp: int, rank: int) -> torch.Tensor:
    """Context-parallel rank ``rank``'s positions as load balancing cuts (written out here, not moe_parallel's):
    chunks ``rank`` and ``2 cp - 1 - rank`` of ``2 cp``."""
    chunk = seq // (2 * cp)
    return torch.cat(
        [
            torch.arange(rank * chunk, (rank + 1) * chunk),
            torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk),
        ]
    )


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("per_token", [False, True])
def test_context_parallel_shares_of_the_mtp_loss_average_to_the_whole_sequences(cp: int, per_token: bool) -> None:
    """Each cp rank's loss over its positions (the MTP depths' last positions, which have no target, all sit on the
    last rank's chunks): the mean over the ranks is the whole sequences' loss, depth by depth, the mean loss and the
    per-token loss alike."""
    gen = torch.Generator().manual_seed(cp)
    batch, seq, vocab, depths = 2, 16, 11, 2
    logits = torch.randn(batch, seq, vocab, generator=gen)
    mtp = tuple(torch.randn(batch, seq, vocab, generator=gen) for _ in range(depths))
    labels = torch.randint(0, vocab, (batch, seq), generator=gen)
    labelled = float(batch * seq) if per_token else None
    whole = next_token_loss(logits, mtp, labels, 0.3, None, labelled)
    shares = []
    for rank in range(cp):
        pos = _load_balanced(seq, cp, rank)
        share = None if labelled is None else labelled / cp
        shares.append(next_token_loss(logits[:, pos], [m[:, pos] for m in mtp], labels, 0.3, pos, share))
    for depth in range(depths):
        got = torch.stack([s.mtp[depth] for s in shares]).mean()
        torch.testing.assert_close(got, whole.mtp[depth], rtol=1e-6, atol=1e-7, msg=f"MTP depth {depth + 1}")
    torch.testing.assert_close(torch.stack([s.lm for s in shares]).mean(), whole.lm, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(torch.stack([s.total for s in shares]).mean(), whole.total, rtol=1e-6, atol=1e-7)
