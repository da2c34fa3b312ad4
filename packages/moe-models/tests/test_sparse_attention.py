"""DeepSeek Sparse Attention: the lightning indexer against transformers' DeepseekV32Indexer / GlmMoeDsaIndexer on the
same weights (the same top-k keys, in the same order) and its scores against a per-head sum written here; the sparse
core against a dense masked softmax (fp64, outputs and gradients); MLA's projections with the indexer and the sparse
core against DeepseekV32Attention / GlmMoeDsaAttention (output and gradients); both indexer losses against a
per-query hand computation; memory linear in the sequence; sequence lengths on both sides of top-k throughout."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
from _dsa_cases import random_selection, small_indexer, small_inputs
from _hf_reference import rel_err
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from transformers import DeepseekV32Config, GlmMoeDsaConfig
from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Attention, DeepseekV32RotaryEmbedding
from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaAttention

from moe_models.config import ModelConfig
from moe_models.mla import MultiLatentAttention
from moe_models.sparse_attention import (
    LightningIndexer,
    SparseCoreAttention,
    sparse_attention,
)

F64 = torch.float64
HIDDEN, HEADS, Q_LORA, KV_LORA, NOPE, ROPE, V_DIM, INDEX_HEADS, INDEX_DIM = 32, 4, 16, 12, 8, 8, 8, 8, 16
FAMILIES = {
    "deepseek_v32": (DeepseekV32Config, DeepseekV32Attention),
    "glm_moe_dsa": (GlmMoeDsaConfig, GlmMoeDsaAttention),
}
# MLA's checkpoint names that differ from ours; the indexer's are the same
MLA_RENAMES = {"q_a_layernorm": "q_a_norm", "kv_a_proj_with_mqa": "kv_a_proj", "kv_a_layernorm": "kv_a_norm"}


def _hf_attention(family: str, topk: int, seed: int) -> torch.nn.Module:
    config_cls, attention_cls = FAMILIES[family]
    config = config_cls(
        vocab_size=64,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        q_lora_rank=Q_LORA,
        kv_lora_rank=KV_LORA,
        qk_nope_head_dim=NOPE,
        qk_rope_head_dim=ROPE,
        v_head_dim=V_DIM,
        index_topk=topk,
        index_head_dim=INDEX_DIM,
        index_n_heads=INDEX_HEADS,
        num_hidden_layers=1,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    config._attn_implementation = "eager"
    attention = attention_cls(config, 0).to(F64)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # every weight random, norms away from one and the indexer's LayerNorm bias non-zero
        for name, p in attention.named_parameters():
            if "norm" in name:
                p.copy_((0.0 if name.endswith("bias") else 1.0) + 0.3 * torch.randn(p.shape, generator=g, dtype=F64))
            else:
                p.copy_(torch.randn(p.shape, generator=g, dtype=F64) / p.shape[-1] ** 0.5)
    return attention


def _ours(family: str, hf: torch.nn.Module, topk: int) -> tuple[MultiLatentAttention, LightningIndexer]:
    mla = MultiLatentAttention(
        ModelConfig(
            multi_latent_attention=True,
            hidden_size=HIDDEN,
            num_attention_heads=HEADS,
            q_lora_rank=Q_LORA,
            kv_lora_rank=KV_LORA,
            qk_head_dim=NOPE,
            qk_pos_emb_head_dim=ROPE,
            v_head_dim=V_DIM,
            rotary_interleaved=True,
        )
    ).to(F64)
    indexer = LightningIndexer(
        hidden_size=HIDDEN,
        q_lora_rank=Q_LORA,
        num_heads=INDEX_HEADS,
        head_dim=INDEX_DIM,
        rope_dim=ROPE,
        topk=topk,
        rope_interleaved=family == "glm_moe_dsa",
    ).to(F64)
    state = hf.state_dict()
    indexer.load_state_dict({n.removeprefix("indexer."): t for n, t in state.items() if n.startswith("indexer.")})
    mla_state = {n: t for n, t in state.items() if not n.startswith("indexer.")}
    for theirs, mine in MLA_RENAMES.items():
        mla_state = {n.replace(theirs, mine): t for n, t in mla_state.items()}
    mla.load_state_dict(mla_state)
    return mla, indexer


def _rotary(
    hf: torch.nn.Module, x: torch.Tensor
) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor, torch.Tensor]:
    """transformers' (cos, sin) ``[1, S, R]`` and ours ``[S, R/2]`` (its first half: one column per frequency)."""
    cos, sin = DeepseekV32RotaryEmbedding(hf.config)(x, torch.arange(x.shape[1]).unsqueeze(0))
    return (cos, sin), cos[0, :, : ROPE // 2], sin[0, :, : ROPE // 2]


def _causal_mask(b: int, s: int) -> torch.Tensor:
    """transformers' additive causal mask ``[B, 1, S, S]`` (the eager path adds it to the logits)."""
    allowed = torch.ones(s, s, dtype=torch.bool).tril()
    return torch.zeros(b, 1, s, s, dtype=F64).masked_fill(~allowed, torch.finfo(F64).min)


def _clear_top_k(scores_BSK: torch.Tensor, topk: int) -> bool:
    """No query's k-th and (k+1)-th best earlier keys are within fp32 rounding of each other (transformers ranks in
    fp32, we in fp64), so the selection is unambiguous."""
    ranked = scores_BSK.sort(dim=-1, descending=True).values
    if ranked.shape[-1] <= topk:
        return True
    gap = ranked[..., topk - 1] - ranked[..., topk]
    scale = ranked[..., :1].abs().clamp_min(1.0).squeeze(-1)
    return bool(((gap > 1e-4 * scale) | torch.isinf(gap)).all())


def _assert_same_selection(ours_BST: torch.Tensor, theirs_BST: torch.Tensor) -> None:
    """The same keys in the same order for each query's earlier keys; ours marks the rest -1 (transformers fills
    them with later keys that its causal mask then hides)."""
    assert ours_BST.shape == theirs_BST.shape
    for s in range(ours_BST.shape[1]):
        n_valid = min(s + 1, ours_BST.shape[2])
        assert torch.equal(ours_BST[:, s, :n_valid], theirs_BST[:, s, :n_valid].long()), s
        assert (ours_BST[:, s, n_valid:] == -1).all(), s


# the draws of the comparisons with transformers: sequence lengths max(1, topk + extra), both sides of top-k
FAMILY_CASES = {
    "family": st.sampled_from(sorted(FAMILIES)),
    "topk": st.integers(1, 6),
    "extra": st.integers(-5, 8),
    "seed": st.integers(0, 2**16),
}


class _Pair(NamedTuple):
    """transformers' attention and ours on the same weights, an input ``[2, S, hidden]`` and the rotary tables."""

    hf: torch.nn.Module
    mla: MultiLatentAttention
    indexer: LightningIndexer
    x: torch.Tensor
    hf_rotary: tuple[torch.Tensor, torch.Tensor]
    cos: torch.Tensor
    sin: torch.Tensor
    generator: torch.Generator


def _pair(family: str, topk: int, s: int, seed: int, requires_grad: bool = False) -> _Pair:
    hf = _hf_attention(family, topk, seed)
    mla, indexer = _ours(family, hf, topk)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(2, s, HIDDEN, generator=g, dtype=F64, requires_grad=requires_grad)
    return _Pair(hf, mla, indexer, x, *_rotary(hf, x), g)


# ----------------------------------------------------------------------------- the indexer


@settings(max_examples=20, deadline=None)
@given(**FAMILY_CASES)
def test_indexer_matches_transformers(family, topk, extra, seed) -> None:
    s = max(1, topk + extra)
    hf, _, indexer, x, hf_rotary, cos, sin, _ = _pair(family, topk, s, seed)
    q_latent = hf.q_a_layernorm(hf.q_a_proj(x))
    scores = indexer.scores(x, q_latent, cos, sin)
    torch.testing.assert_close(scores, _naive_index_scores(indexer, x, q_latent, cos, sin), rtol=1e-9, atol=1e-9)
    assume(_clear_top_k(scores, topk))
    theirs = hf.indexer(x, q_latent, hf_rotary, _causal_mask(2, s)[:, 0], None)
    for block_size in (1, 3, 64):
        indexer.top_k.block_size = block_size
        _assert_same_selection(indexer(x, q_latent, cos, sin), theirs)


def _naive_index_scores(indexer, x, q_latent, cos, sin) -> torch.Tensor:
    """I[b, s, t] = sum_h w_h relu(q_h . k_t / sqrt(d)) / sqrt(H) for t <= s, -inf after; the rotation written out
    per pair of dimensions (interleaved pairs (2j, 2j+1) or split halves (j, j + R/2))."""
    b, s, _ = x.shape
    heads, d = indexer.num_heads, indexer.head_dim
    q = indexer.wq_b(q_latent).view(b, s, heads, d)
    k = indexer.k_norm(indexer.wk(x))
    w = x @ indexer.weights_proj.weight.T

    def rotate(t: torch.Tensor) -> torch.Tensor:  # t [B, S, ..., d]
        out = t.clone()
        for j in range(ROPE // 2):
            a, c = (2 * j, 2 * j + 1) if indexer.rope_interleaved else (j, j + ROPE // 2)
            shape = (1, s) + (1,) * (t.dim() - 3)
            cj, sj = cos[:, j].view(shape), sin[:, j].view(shape)
            out[..., a], out[..., c] = t[..., a] * cj - t[..., c] * sj, t[..., c] * cj + t[..., a] * sj
        return out

    q, k = rotate(q), rotate(k)
    scores = torch.full((b, s, s), float("-inf"), dtype=F64)
    for i in range(s):
        for t in range(i + 1):
            per_head = torch.relu((q[:, i] * k[:, t, None]).sum(-1) / d**0.5)  # [B, H]
            scores[:, i, t] = (w[:, i] * per_head).sum(-1) / heads**0.5
    return scores


@settings(max_examples=10, deadline=None)
@given(topk=st.integers(1, 6), prefix=st.integers(1, 8), new=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_indexer_on_cached_keys_selects_as_on_the_whole_sequence(topk, prefix, new, seed) -> None:
    """Generation: the last ``new`` queries scored against the keys of the whole sequence (a cache's, from
    ``keys``) select what they select in one pass over the whole sequence."""
    indexer = small_indexer(topk, heads=3)
    total = prefix + new
    x, q_latent, cos, sin = small_inputs(torch.Generator().manual_seed(seed), 1, total)
    whole = indexer(x, q_latent, cos, sin)
    cached_keys = indexer.keys(x, cos, sin)
    tail = slice(prefix, total)
    step = indexer(x[:, tail], q_latent[:, tail], cos[tail], sin[tail], k_BKD=cached_keys)
    assert torch.equal(step, whole[:, tail])
    explicit = indexer(x[:, tail], q_latent[:, tail], cos[tail], sin[tail], torch.arange(prefix, total), cached_keys)
    assert torch.equal(explicit, step)


def test_bf16_inputs_compute_in_fp32() -> None:
    """bf16 in, bf16 out, the result that of fp64 on the same (bf16-rounded) values to bf16 precision."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 20, 8, generator=g).bfloat16() for _ in range(3))
    indices = random_selection(g, 1, 20, 20, 5, 0.0)
    out = sparse_attention(q, k, v, indices)
    assert out.dtype == torch.bfloat16
    exact = sparse_attention(q.double(), k.double(), v.double(), indices)
    assert rel_err(out, exact) < 1e-2
    indexer = small_indexer(5, heads=2, dtype=torch.bfloat16)
    x, q_latent, cos, sin = small_inputs(g, 1, 20, torch.float32)
    scores = indexer.scores(x.bfloat16(), q_latent.bfloat16(), cos, sin)
    assert scores.dtype == torch.float32  # the ranking is done in fp32 whatever the model's dtype


def test_indexer_constructor_refuses_bad_fields() -> None:
    base = {"hidden_size": 8, "q_lora_rank": 4, "num_heads": 2, "head_dim": 8, "rope_dim": 4, "topk": 2}
    with pytest.raises(ValueError, match="topk"):
        LightningIndexer(**base | {"topk": 0})
    with pytest.raises(ValueError, match="rope_dim"):
        LightningIndexer(**base | {"rope_dim": 3})
    with pytest.raises(ValueError, match="rope_dim"):
        LightningIndexer(**base | {"rope_dim": 10})


# ----------------------------------------------------------------------------- the sparse core


def _dense_reference(q, k, v, indices, scale, q_pos, k_pos) -> torch.Tensor:
    """softmax(q k^T scale) v under a dense [B, S, K] mask: selected and not later; a row with nothing gets zeros."""
    b, s, _ = indices.shape
    selected = torch.zeros(b, s, k.shape[2] + 1, dtype=torch.bool)
    selected.scatter_(-1, torch.where(indices < 0, k.shape[2], indices), True)
    mask = selected[..., :-1] & (k_pos[None, None, :] <= q_pos[None, :, None])
    any_key = mask.any(-1, keepdim=True)
    logits = (q @ k.transpose(-1, -2)) * scale
    probs = logits.masked_fill(~(mask | ~any_key).unsqueeze(1), float("-inf")).softmax(-1) * any_key.unsqueeze(1)
    return probs @ v


@settings(max_examples=30, deadline=None)
@given(
    topk=st.integers(1, 6),
    extra=st.integers(-5, 8),
    prefix=st.sampled_from([0, 3]),
    block_size=st.sampled_from([1, 2, 5, 64]),
    empty_share=st.sampled_from([0.0, 0.3]),
    seed=st.integers(0, 2**16),
)
def test_sparse_attention_matches_dense_mask(topk, extra, prefix, block_size, empty_share, seed) -> None:
    """``prefix`` keys before the queries (a cache's): the queries are then the last S of the K keys."""
    s = max(1, topk + extra)
    b, n, d, dv, k_len = 2, 3, 6, 5, s + prefix
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, n, s, d, generator=g, dtype=F64, requires_grad=True)
    k = torch.randn(b, n, k_len, d, generator=g, dtype=F64, requires_grad=True)
    v = torch.randn(b, n, k_len, dv, generator=g, dtype=F64, requires_grad=True)
    indices = random_selection(g, b, s, k_len, min(topk, k_len), empty_share)
    q_pos, k_pos = torch.arange(prefix, k_len), torch.arange(k_len)
    out = sparse_attention(q, k, v, indices, 0.7, block_size=block_size)
    ref = _dense_reference(q, k, v, indices, 0.7, q_pos, k_pos)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)
    cotangent = torch.randn(out.shape, generator=g, dtype=F64)
    grads = torch.autograd.grad((out * cotangent).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * cotangent).sum(), (q, k, v))
    for name, grad, ref_grad in zip("qkv", grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-9, msg=lambda m, x=name: f"d{x}: {m}")
    # explicit positions say the same as the default ones
    explicit = sparse_attention(q, k, v, indices.int(), 0.7, q_pos, k_pos, block_size=block_size)
    torch.testing.assert_close(explicit, out, rtol=0, atol=0)


@settings(max_examples=15, deadline=None)
@given(topk=st.integers(1, 6), extra=st.integers(-5, 8), seed=st.integers(0, 2**16))
def test_indexer_with_sparse_core_is_causal_attention_when_topk_covers_the_sequence(topk, extra, seed) -> None:
    """A query with at most top-k earlier keys takes them all: sparse attention is then plain causal attention."""
    s = max(1, topk + extra)
    g = torch.Generator().manual_seed(seed)
    indexer = small_indexer(topk, heads=2)
    indices = indexer(*small_inputs(g, 1, s))
    assert indices.shape == (1, s, min(topk, s))
    assert ((indices >= 0).sum(-1) == torch.arange(s).clamp_max(topk - 1) + 1).all()  # min(topk, s+1) keys each
    q, k, v = (torch.randn(1, 2, s, 5, generator=g, dtype=F64) for _ in range(3))
    out = SparseCoreAttention(None)(q, k, v, indices)
    allowed = torch.ones(s, s, dtype=torch.bool).tril()
    plain = ((q @ k.transpose(-1, -2)) / 5**0.5).masked_fill(~allowed, float("-inf")).softmax(-1) @ v
    if s <= topk:
        torch.testing.assert_close(out, plain, rtol=1e-9, atol=1e-9)
    else:  # the queries past top-k differ, the first top-k ones do not
        torch.testing.assert_close(out[:, :, :topk], plain[:, :, :topk], rtol=1e-9, atol=1e-9)


def test_sparse_attention_refuses_misshapen_indices() -> None:
    q = torch.zeros(1, 2, 4, 3)
    with pytest.raises(ValueError, match="indices_BST"):
        sparse_attention(q, q, q, torch.zeros(1, 3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="block_size"):
        sparse_attention(q, q, q, torch.zeros(1, 4, 2, dtype=torch.long), block_size=0)


# ----------------------------------------------------------------------------- the whole attention against transformers


def _our_attention(mla, indexer, x, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA's projections as :class:`MultiLatentAttention` forms them, the indexer on the normalised q latent, the sparse
    core over the selected keys, the output projection."""
    b, s, _ = x.shape
    q_latent = mla.q_a_norm(mla.q_a_proj(x))
    latent, k_rope = mla.kv_a_proj(x).split([mla.kv_lora_rank, mla.rope_dim], dim=-1)
    q, k, v = mla.up_proj(mla.q_b_proj, mla.kv_b_proj, q_latent, mla.kv_a_norm(latent), k_rope, cos, sin)
    indices = indexer(x, q_latent, cos, sin)
    out = SparseCoreAttention(mla.core_attention.scale, block_size=3)(q, k, v, indices)
    return mla.o_proj(out.transpose(1, 2).reshape(b, s, -1)), indices


@settings(max_examples=16, deadline=None)
@given(**FAMILY_CASES)
def test_attention_matches_transformers(family, topk, extra, seed) -> None:
    s = max(1, topk + extra)
    hf, mla, indexer, x, hf_rotary, cos, sin, g = _pair(family, topk, s, seed, requires_grad=True)
    with torch.no_grad():
        q_latent = mla.q_a_norm(mla.q_a_proj(x))
        assume(_clear_top_k(indexer.scores(x, q_latent, cos, sin), topk))
    captured = {}
    hook = hf.indexer.register_forward_hook(lambda _m, _a, out: captured.setdefault("indices", out))
    theirs = hf(x, hf_rotary, _causal_mask(2, s), position_ids=torch.arange(s)[None])[0]
    hook.remove()
    ours, indices = _our_attention(mla, indexer, x, cos, sin)
    _assert_same_selection(indices, captured["indices"])
    assert _relative(ours, theirs) < 1e-5, _relative(ours, theirs)
    cotangent = torch.randn(ours.shape, generator=g, dtype=F64)
    hf_params = {n: p for n, p in hf.named_parameters() if not n.startswith("indexer.")}
    our_params = dict(mla.named_parameters())
    names = list(hf_params)
    theirs_grads = torch.autograd.grad((theirs * cotangent).sum(), [x, *hf_params.values()])
    mine = [our_params[_renamed(n)] for n in names]
    index_params = list(indexer.parameters())
    our_grads = torch.autograd.grad((ours * cotangent).sum(), [x, *mine, *index_params], allow_unused=True)
    for name, grad, ref in zip(["x", *names], our_grads[: len(mine) + 1], theirs_grads, strict=True):
        assert _relative(grad, ref) < 1e-5, (name, _relative(grad, ref))
    assert all(g is None for g in our_grads[len(mine) + 1 :])  # the selection passes no gradient to the indexer


def _relative(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """rel_err, 0 when both are zero (q gets no gradient when every query sees one key)."""
    return 0.0 if not ref.any() and not ours.any() else rel_err(ours, ref)


def _renamed(hf_name: str) -> str:
    for theirs, mine in MLA_RENAMES.items():
        hf_name = hf_name.replace(theirs, mine)
    return hf_name


# ----------------------------------------------------------------------------- wired into MLA and the model

# the per-expert loop: the grouped GEMM has no fp64
DSA_FIELDS = {"dsa_indexer_topk": 5, "dsa_indexer_n_heads": 8, "dsa_indexer_head_dim": 16, "moe_expert_backend": "loop"}


def _dsa_model(**fields) -> torch.nn.Module:
    """tiny-deepseek-v32 with a top-5 indexer, random weights, fp64."""
    from _hf_reference import randomize_

    from moe_models import build_model
    from moe_models.presets import preset

    torch.manual_seed(0)
    model = build_model(preset("tiny-deepseek-v32", **DSA_FIELDS | fields)).to(F64)
    randomize_(model, seed=1)
    return model.eval()


def test_mla_with_an_indexer_is_our_assembly_of_the_pieces() -> None:
    """MultiLatentAttention with dsa_* fields = the projections, the indexer and the sparse core assembled by hand
    (this file's ``_our_attention``, itself matched against transformers above), and its indexer gets no gradient."""
    mla = _dsa_model().layers[1].attention
    assert isinstance(mla.core_attention, SparseCoreAttention) and isinstance(mla.indexer, LightningIndexer)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 12, mla.o_proj.out_features, generator=g, dtype=F64, requires_grad=True)
    angles = torch.arange(12, dtype=F64)[:, None] * torch.rand(mla.rope_dim // 2, generator=g, dtype=F64)
    cos, sin = angles.cos(), angles.sin()
    out = mla(x, cos, sin)
    torch.testing.assert_close(out, _our_attention(mla, mla.indexer, x, cos, sin)[0], rtol=1e-12, atol=1e-12)
    out.square().sum().backward()
    assert all(p.grad is None for p in mla.indexer.parameters())
    assert all(p.grad is not None for n, p in mla.named_parameters() if not n.startswith("indexer."))


def test_context_parallel_ranks_compute_their_positions_of_the_whole_sequence() -> None:
    """cp=2 in one process: each rank runs the model on its load-balanced positions, its core attentions and
    indexer rankings handed the whole sequence's keys as GatherKeysValues hands them (every rank's, sorted by
    position; the rank's own keys checked to be those at its positions). Its logits are the whole run's there."""
    from moe_parallel import load_balanced_positions

    model = _dsa_model()
    plan = model.parallel_plan()
    assert all(p.endswith((".core_attention", ".indexer.top_k")) for p in plan.context_parallel)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    whole_pos = torch.arange(32)
    keys: dict[str, tuple] = {}

    def record(path):
        def hook(module, args):
            keys[path] = (args[1], args[2], args[5])

        return hook

    handles = [model.get_submodule(p).register_forward_pre_hook(record(p)) for p in plan.context_parallel]
    with torch.no_grad():
        whole = model(ids, positions_S=whole_pos).logits
    for h in handles:
        h.remove()
    assert len(keys) == len(plan.context_parallel) == 2 * (model.config.num_layers + 1)  # with the MTP depth
    for rank in range(2):
        pos = load_balanced_positions(32, 2, rank)

        def gather(path, pos=pos):
            def hook(module, args):
                q, k, _v, fourth, q_pos, k_pos, *rest = args
                k_all, v_all, k_pos_all = keys[path]
                torch.testing.assert_close(k, k_all[:, :, pos], rtol=1e-12, atol=1e-12)
                assert torch.equal(k_pos, pos) and torch.equal(k_pos_all, whole_pos)
                return (q, k_all, v_all, fourth, q_pos, k_pos_all, *rest)

            return hook

        handles = [model.get_submodule(p).register_forward_pre_hook(gather(p)) for p in plan.context_parallel]
        with torch.no_grad():
            local = model(ids, positions_S=pos).logits
        for h in handles:
            h.remove()
        torch.testing.assert_close(local, whole[:, pos], rtol=1e-10, atol=1e-10)


def test_packed_documents_select_within_their_document() -> None:
    """A row packing two documents gives each the logits it has alone (the indexer ranks keys of the query's own
    document only, the rotary positions restart), with a top-k below both documents' lengths."""
    model = _dsa_model(mtp_num_layers=None)
    g = torch.Generator().manual_seed(1)
    a, b = torch.randint(0, 256, (1, 9), generator=g), torch.randint(0, 256, (1, 11), generator=g)
    docs = torch.tensor([[0] * 9 + [1] * 11])
    with torch.no_grad():
        packed = model(torch.cat([a, b], dim=1), document_ids_BS=docs).logits
        alone = torch.cat([model(a).logits, model(b).logits], dim=1)
    # 1e-5, not fp64's 1e-10: the packed rows' per-document rotary tables differ from a lone row's in the 7th digit,
    # dense MLA alike (measured 5.8e-7 there, 9.6e-8 here)
    assert rel_err(packed, alone) < 1e-5, rel_err(packed, alone)
    with torch.no_grad():  # and the other document would change them: the selection does hide it
        unpacked = model(torch.cat([a, b], dim=1)).logits
    assert rel_err(unpacked[:, 9:], alone[:, 9:]) > 1e-3


def test_tensor_parallel_plan_keeps_the_indexer_whole() -> None:
    plan = _dsa_model().parallel_plan()
    assert not [p for p in plan.tensor_parallel if ".indexer" in p]
    assert not [p for p in plan.tp_partial_grads if ".indexer" in p]
    assert "layers.0.attention.indexer.top_k" in plan.context_parallel


def test_config_refuses_incomplete_dsa_fields() -> None:
    from moe_models.config import ModelConfigError
    from moe_models.presets import preset

    with pytest.raises(ModelConfigError, match="dsa_indexer_head_dim"):
        preset("tiny-deepseek-v32", dsa_indexer_head_dim=None)
    with pytest.raises(ModelConfigError, match="dsa_indexer_topk.*q_lora_rank"):
        preset("tiny-deepseek-v32", q_lora_rank=None)
    with pytest.raises(ModelConfigError, match="dsa_indexer_head_dim"):
        preset("tiny-deepseek-v32", dsa_indexer_head_dim=8)  # below the 16 rotating dimensions
    with pytest.raises(ModelConfigError, match="dsa_indexer_topk"):
        preset("tiny-deepseek-v32", dsa_indexer_topk=0)


def test_generation_cache_serves_the_indexer_and_the_sparse_core() -> None:
    """With KVCache, each step's logits are the whole forward's: the index keys and MLA's keys of the tokens before
    are handed to the ranking and the sparse core in the same order (top-5 of up to 20 keys)."""
    from moe_models.generation import KVCache

    model = _dsa_model(mtp_num_layers=None)
    sequence = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        whole = model(sequence).logits
    with torch.no_grad(), KVCache(model) as cache:
        assert sum(".indexer.top_k" in name for name in cache.modules) == model.config.num_layers
        for start, end in ((0, 7), (7, 8), (8, 9), (9, 12), (12, 20)):
            cached = model(sequence[:, :end], torch.arange(start, end)).logits
            # 1e-6 (measured 3e-8): fp32 rotary tables of a prefix differ from the whole's in the last digit, as for
            # every family; another selection would move them by far more
            assert rel_err(cached, whole[:, start:end]) < 1e-6, start
            assert cache.length == end
