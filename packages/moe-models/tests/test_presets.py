"""Presets: published sizes build on meta with the parameter counts their authors published; tiny proxies keep
their family's features and run on CPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_experts import GroupedExperts
from moe_models import build_model, count_parameters
from moe_models.presets import PRESETS, PUBLISHED_PRESETS, TINY_PRESETS, preset
from moe_models.published_sizes import PUBLISHED_SIZES

# count_parameters of each published preset, to the parameter: pins the presets' shapes (the published figures
# below only check them to 2-5 digits)
EXACT_TOTAL_ACTIVE_MTP = {
    "deepseek-v3-671b": (671_026_404_352, 37_552_282_624, 11_610_067_968),
    "kimi-k2": (1_026_408_209_408, 32_861_477_888, 0),
    "qwen3-30b-a3b": (30_532_122_624, 3_353_032_704, 0),
    "qwen3-235b-a22b": (235_093_634_560, 22_190_763_520, 0),
    "gpt-oss-20b": (20_914_757_184, 4_187_440_704, 0),
    "gpt-oss-120b": (116_829_156_672, 5_711_982_912, 0),
    "mixtral-8x7b": (46_702_792_704, 12_879_925_248, 0),
    "glm-4.5-355b-a32b": (352_797_814_784, 33_632_251_904, 3_988_069_632),
    "glm-4.5-air": (106_852_245_504, 13_424_123_904, 2_375_059_456),
    "glm-4.6": (352_797_814_784, 33_632_251_904, 3_988_069_632),
    "glm-4.7": (352_797_814_784, 33_632_251_904, 3_988_069_632),
    "glm-4.7-flash": (29_943_390_976, 3_896_763_136, 643_706_112),
    "dots.llm1": (142_774_373_888, 14_016_581_120, 0),
    "minimax-m2": (228_689_748_992, 11_030_537_216, 0),
    "qwen1.5-moe-a2.7b": (14_315_784_192, 2_689_173_504, 0),
    "qwen2-57b-a14b": (57_408_658_944, 14_249_270_784, 0),
    "olmoe-1b-7b": (6_919_161_856, 1_282_017_280, 0),
    "deepseek-v2": (235_741_434_880, 21_375_800_320, 0),
    "deepseek-v2-lite": (15_706_484_224, 2_661_150_208, 0),
    "ernie-4.5-21b-a3b": (21_825_436_160, 3_352_148_480, 0),
    "ernie-4.5-300b-a47b": (299_484_160_000, 47_926_583_296, 0),
    "hunyuan-a13b": (80_393_183_232, 12_747_448_320, 0),
    "llama-4-scout-17b-16e": (107_769_861_120, 17_172_894_720, 0),
    "llama-4-maverick-17b-128e": (400_711_848_960, 17_184_691_200, 0),
    # as a stored parameter-count test of Qwen3-Coder-Next (the same architecture) has them, by another count
    "qwen3-next-80b-a3b": (79_674_391_296, 3_874_929_408, 0),
    # equal to transformers' Qwen3_5MoeForCausalLM built on meta from the same config.json values
    "qwen3.5-35b-a3b": (34_660_610_688, 3_454_988_928, 0),
    "qwen3.5-122b-a10b": (122_111_526_912, 9_771_288_576, 0),
    "qwen3.5-397b-a17b": (396_346_350_336, 17_349_040_896, 0),
    # equal to transformers' DeepseekV32ForCausalLM of the same config.json (which builds no MTP layer)
    "deepseek-v3.2": (671_877_929_216, 38_403_807_488, 11_624_027_392),
    # equal to transformers' GlmMoeDsaForCausalLM of the same config.json (which builds no MTP layer)
    "glm-5": (743_911_199_232, 41_784_709_632, 9_952_920_320),
    # equal to transformers' NemotronHForCausalLM of the same config.json (dense: all of it active)
    "nemotron-h-8b": (8_100_852_736, 8_100_852_736, 0),
    "nemotron-h-47b": (46_791_554_816, 46_791_554_816, 0),
    "nemotron-h-56b": (56_324_350_464, 56_324_350_464, 0),
    "nemotron-3-nano-30b-a3b": (31_577_937_344, 3_580_073_408, 0),
    "kimi-linear-48b-a3b": (49_122_675_072, 3_484_453_248, 0),
}

# each tiny proxy and the published model whose features it keeps
TINY_OF = {
    "tiny-qwen3-moe": "qwen3-30b-a3b",
    "tiny-deepseek-v3": "deepseek-v3-671b",
    "tiny-kimi-k2": "kimi-k2",
    "tiny-gpt-oss": "gpt-oss-20b",
    "tiny-mixtral": "mixtral-8x7b",
    "tiny-glm4-moe": "glm-4.5-355b-a32b",
    "tiny-glm4-moe-lite": "glm-4.7-flash",
    "tiny-dots1": "dots.llm1",
    "tiny-minimax-m2": "minimax-m2",
    "tiny-qwen2-moe": "qwen1.5-moe-a2.7b",
    "tiny-olmoe": "olmoe-1b-7b",
    "tiny-deepseek-v2": "deepseek-v2",
    "tiny-ernie4-5-moe": "ernie-4.5-21b-a3b",
    "tiny-hunyuan-v1-moe": "hunyuan-a13b",
    "tiny-llama4": "llama-4-scout-17b-16e",
    "tiny-qwen3-next": "qwen3-next-80b-a3b",
    "tiny-deepseek-v32": "deepseek-v3.2",
    "tiny-glm-moe-dsa": "glm-5",
    "tiny-nemotron-h": "nemotron-3-nano-30b-a3b",
    "tiny-kimi-linear": "kimi-linear-48b-a3b",
}
# tiny proxies of families without a published preset yet
TINY_ALONE: tuple[str, ...] = ()
# fields that choose a feature rather than a size: a proxy must agree with its published model on all of them
FEATURE_FIELDS = (
    "family",
    "qk_layernorm",
    "add_qkv_bias",
    "add_bias_linear",
    "softmax_type",
    "multi_latent_attention",
    "rope_type",
    "rotary_interleaved",
    "rope_yarn_truncate",
    "activation_func",
    "moe_router_score_function",
    "moe_router_pre_softmax",
    "moe_router_load_balancing_type",
    "moe_router_enable_expert_bias",
    "share_embeddings_and_output_weights",
    "qk_layernorm_across_heads",
    "rotary_percent",
    "moe_shared_expert_gate",
    "moe_router_group_score_topk",
    "qk_layernorm_after_rotary",
    "moe_apply_probs_on_input",
    "qk_l2_norm",
    "attn_temperature_tuning",
    "dsa_indexer_rope_interleaved",
)


def _meta_model(name: str):
    with torch.device("meta"):
        return build_model(preset(name))


def test_preset_lists_partition_the_presets():
    assert set(PUBLISHED_PRESETS) | set(TINY_PRESETS) == set(PRESETS)
    assert not set(PUBLISHED_PRESETS) & set(TINY_PRESETS)
    assert set(PUBLISHED_SIZES) == set(PUBLISHED_PRESETS) == set(EXACT_TOTAL_ACTIVE_MTP)
    assert set(TINY_OF) | set(TINY_ALONE) == set(TINY_PRESETS)


@pytest.mark.parametrize("name", PUBLISHED_PRESETS)
def test_published_preset_builds_on_meta_with_the_counted_parameters(name):
    cfg = preset(name)
    model = _meta_model(name)
    named = dict(model.named_parameters())  # a tied weight is listed once
    assert all(p.is_meta for p in named.values())
    counted = count_parameters(cfg)
    assert sum(p.numel() for p in named.values()) == counted.total + counted.mtp
    assert sum(p.numel() for n, p in named.items() if n.startswith("mtp.")) == counted.mtp
    # active, from the built modules: all of the main model but topk / E of each layer's routed experts
    experts = sum(
        p.numel()
        for n, m in model.named_modules()
        if isinstance(m, GroupedExperts) and not n.startswith("mtp.")
        for p in m.parameters()
    )
    assert experts % cfg.num_moe_experts == 0
    assert counted.active == counted.total - experts + experts // cfg.num_moe_experts * cfg.moe_router_topk
    assert (counted.total, counted.active, counted.mtp) == EXACT_TOTAL_ACTIVE_MTP[name]


@pytest.mark.parametrize("name", PUBLISHED_PRESETS)
def test_counts_agree_with_the_published_figures(name):
    """Within one unit of the last published digit (so rounded and truncated figures both pass): DeepSeek-V3
    671B / 37B, Kimi-K2 1T (held to 5%) / 32B, Qwen3 30.5B / 3.3B and 235B / 22B, GPT-OSS 20.91B / 3.61B and
    116.83B / 5.13B, Mixtral 46.7B / 12.9B. Active counts leave the input embedding out where the authors did
    (:class:`~moe_models.presets.PublishedSize`)."""
    cfg, published = preset(name), PUBLISHED_SIZES[name]
    counted = count_parameters(cfg)
    active = counted.active
    if not published.active_includes_input_embedding:
        active -= cfg.vocab_size * cfg.hidden_size
    assert abs(counted.total - published.total) <= published.total_unit
    assert abs(active - published.active) <= published.active_unit


def test_deepseek_v3_mtp_module_is_the_published_remainder():
    # the HF checkpoint holds 685B: 671B + 14B of MTP module, of which 2 x 0.93B are its own copies of the
    # embedding and head (shared with the main model here)
    cfg = preset("deepseek-v3-671b")
    own_embedding_and_head = 2 * cfg.vocab_size * cfg.hidden_size
    assert (count_parameters(cfg).mtp + own_embedding_and_head) / 1e9 == pytest.approx(13.5, abs=0.05)


@pytest.mark.parametrize("name", list(TINY_OF))
def test_tiny_preset_keeps_its_family_features(name):
    tiny, big = preset(name), preset(TINY_OF[name])
    for field in FEATURE_FIELDS:
        assert getattr(tiny, field) == getattr(big, field), field
    assert (tiny.q_lora_rank is None) == (big.q_lora_rank is None)
    assert (tiny.window_size is None) == (big.window_size is None)
    assert (tiny.moe_shared_expert_intermediate_size is None) == (big.moe_shared_expert_intermediate_size is None)
    assert (tiny.mtp_num_layers is None) == (big.mtp_num_layers is None)
    assert (tiny.dsa_indexer_topk is None) == (big.dsa_indexer_topk is None)
    assert (tiny.moe_router_num_groups is None) == (big.moe_router_num_groups is None)
    assert (0 in tiny.moe_layer_pattern()) == (0 in big.moe_layer_pattern())
    assert tiny.full_attention_pattern()[:2] == big.full_attention_pattern()[:2]
    # a Nemotron-H layer is one block (a mixer or an MLP): two of them make one transformer layer
    transformer_layers = tiny.num_layers / 2 if tiny.hybrid_override_pattern is not None else tiny.num_layers
    assert tiny.vocab_size == 256 and 64 <= tiny.hidden_size <= 128 and 2 <= transformer_layers <= 4
    counted = count_parameters(tiny)
    assert 0.4e6 <= counted.total + counted.mtp <= 3e6


def test_tiny_proxies_exercise_their_features_on_128_tokens():
    ds = preset("tiny-deepseek-v3")
    assert ds.moe_router_topk // ds.moe_router_group_topk == 2 and ds.moe_router_num_groups > 1
    assert ds.moe_layer_pattern()[0] == 0 and ds.mtp_num_layers == 1 and ds.q_lora_rank is not None
    for name in ("tiny-deepseek-v3", "tiny-kimi-k2", "tiny-gpt-oss"):
        cfg = preset(name)
        assert cfg.original_max_position_embeddings < 128 <= cfg.max_position_embeddings, name
    assert preset("tiny-deepseek-v32").dsa_indexer_topk < 128  # the indexer's selection is sparse there
    oss = preset("tiny-gpt-oss")
    assert oss.window_size < 128 and oss.full_attention_pattern() == [0, 1]


@pytest.mark.parametrize("name", TINY_PRESETS)
def test_tiny_preset_forward_is_finite_on_cpu(name):
    cfg = preset(name)
    torch.manual_seed(0)
    model = build_model(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 128), generator=torch.Generator().manual_seed(0))
    out = model(ids)
    assert out.logits.shape == (2, 128, cfg.vocab_size)
    assert torch.isfinite(out.logits).all()
    assert len(out.mtp_logits) == (cfg.mtp_num_layers or 0)
    assert all(torch.isfinite(logits).all() for logits in out.mtp_logits)
    assert torch.isfinite(out.aux_loss)


def test_preset_returns_a_fresh_validated_config():
    a, b = preset("tiny-qwen3-moe"), preset("tiny-qwen3-moe")
    assert a == b and a is not b
    a.moe_router_load_balancing_type.append("z")  # mutable list fields must not be shared between calls
    assert preset("tiny-qwen3-moe").moe_router_load_balancing_type == ["aux_loss"]
    assert preset("tiny-qwen3-moe", num_layers=3).num_layers == 3
    with pytest.raises(ValueError, match="num_layers"):
        preset("tiny-qwen3-moe", num_layers=0)
    with pytest.raises(ValueError, match="'gpt-5'.*tiny-mixtral"):
        preset("gpt-5")
    assert dataclasses.replace(preset("kimi-k2")).num_moe_experts == 384


def test_tiny_qwen3_next_is_a_small_hybrid():
    """Three Gated DeltaNet layers then one full attention layer (Qwen3-Next's full_attention_interval 4), all MoE,
    with Qwen3-Next's gate, norms and quarter rotary; at the tiny proxies' sizes."""
    cfg = preset("tiny-qwen3-next")
    assert cfg.family == "qwen3_next" and cfg.attention_kinds() == ["linear_attention"] * 3 + ["attention"]
    assert all(cfg.moe_layer_pattern()) and cfg.moe_shared_expert_gate and cfg.rotary_percent == 0.25
    assert cfg.attention_output_gate and cfg.layernorm_zero_centered_gamma and cfg.qk_layernorm
    assert cfg.vocab_size == 256 and 64 <= cfg.hidden_size <= 128
    counted = count_parameters(cfg)
    assert 0.4e6 <= counted.total <= 3e6
    with torch.device("meta"):
        model = build_model(cfg)
    assert counted.total == sum(p.numel() for p in model.parameters())


def test_tiny_qwen3_next_trains():
    """A few AdamW steps on one batch of 64-token rows bring the loss well down (the Gated DeltaNet, the gated
    attention and the zero-centred norms all learn)."""
    from moe_models import causal_lm_loss

    cfg = preset("tiny-qwen3-next")
    model = build_model(cfg, seed=0)
    ids = torch.randint(0, cfg.vocab_size, (4, 64), generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(12):
        loss = causal_lm_loss(model(ids), ids.roll(-1, dims=1), cfg.mtp_loss_scaling_factor).total
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0, losses
    deltanet = model.layers[0].attention
    for name in ("in_proj.weight", "conv1d.weight", "A_log", "dt_bias", "norm.weight", "out_proj.weight"):
        assert deltanet.get_parameter(name).grad is not None, name
