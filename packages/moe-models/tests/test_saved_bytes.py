"""moe_models.saved_bytes (with moe_dispatch's and moe_experts' declarations it composes) against what a forward and
loss of every family's tiny model really save for backward, still saved when the backward starts
(moe_memory.measure.SavedAtBackwardBytes), byte for byte and module by module: one process, CPU, dropless routing,
fp32 and bf16 parameters and activations; hybrid patterns of Mamba-2, attention, dense-MLP and MoE blocks
(Nemotron-H) and DeepSeek Sparse Attention over sequences shorter and longer than its top-k too. A Gated DeltaNet
layer, a KDA layer (Kimi Linear) and a Mamba-2 mixer alone, over their shapes."""

from __future__ import annotations

import contextlib
import dataclasses
from unittest import mock

import pytest
import torch
from _hybrid_configs import HYBRID_BLOCKS
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_memory.estimate import (
    GatedDeltaNetShape,
    KimiDeltaShape,
    LocalParameters,
    Mamba2Shape,
    MemoryEstimate,
    RankSizes,
    RunShape,
    estimate_memory,
)
from moe_memory.measure import SavedAtBackwardBytes
from moe_models import MoETransformer, build_model, causal_lm_loss, ssd
from moe_models import mamba as mamba_module
from moe_models.config import ModelConfig, ModelConfigError
from moe_models.kimi_delta import KimiDeltaMixer
from moe_models.linear_attention import GatedDeltaNet
from moe_models.memory import estimate_module, local_parameters, model_shape, run_shape
from moe_models.presets import TINY_PRESETS, preset
from moe_models.recurrent_saved_bytes import gated_delta_net_saved_bytes, kimi_delta_saved_bytes, mamba2_saved_bytes
from moe_models.saved_bytes import MOE_TRANSFORMER_SAVED_BYTES

# the families' building blocks on a tiny preset: (preset, ModelConfig overrides), each in fp32 and bf16
BLOCKS = [
    ("tiny-qwen3-moe", {"rotary_percent": 0.5}),  # GQA, half of each head rotates: narrower rotary tables
    ("tiny-qwen3-moe", {"qk_layernorm_across_heads": True, "clip_qkv": 8.0}),  # one rsqrt per token; clamp inputs
    ("tiny-qwen3-moe", {"qk_layernorm_after_rotary": True}),  # per-head q/k norms of the rotated q and k (Hunyuan)
    ("tiny-gpt-oss", {"clip_qkv": 4.0, "rotary_percent": 0.25}),  # clamp without q/k norms, blockwise attention
    ("tiny-qwen3-moe", {"moe_shared_expert_intermediate_size": 64, "moe_shared_expert_gate": True}),
    ("tiny-deepseek-v3", {"moe_shared_expert_gate": True, "moe_router_group_score_topk": 1}),  # MLA, MTP
    # Llama 4's attention: a NoPE layer (SDPA on a token-major q: no merged copy) with its fp32 temperature, and a
    # rotating layer in chunks shorter than the sequence (blockwise kernel) with fp32 q/k L2 norms
    (
        "tiny-qwen3-moe",
        {
            "qk_layernorm": False,
            "no_rope_freq": 2,
            "attention_chunk_size": 16,
            "qk_l2_norm": True,
            "attn_temperature_tuning": True,
            "attn_temperature_floor_scale": 16,
        },
    ),
    ("tiny-gpt-oss", {"no_rope_freq": 2, "attn_temperature_tuning": True}),  # NoPE with sinks: blockwise copies
    # Llama 4's router: the block weighs the permuted rows (the product keeps rows and probabilities), the experts'
    # activation takes no probabilities
    (
        "tiny-qwen3-moe",
        {
            "moe_apply_probs_on_input": True,
            "moe_router_topk": 1,
            "moe_router_score_function": "sigmoid",
            "moe_router_sigmoid_norm_topk": False,
        },
    ),
    # top-2 rows weighed before the experts: permuted, not gathered by the experts; MTP (it rotates) after a NoPE
    # last layer, chunks and L2 norms on the rotating ones
    (
        "tiny-glm4-moe",
        {"no_rope_freq": [0, 0, 1], "attention_chunk_size": 16, "qk_l2_norm": True, "moe_apply_probs_on_input": True},
    ),
    # Qwen3-Next's attention blocks on a GQA model with MTP: zero-centred norms (fp32 rows and scale) everywhere, the
    # output gate (its sigmoid and the merged output kept for the product)
    ("tiny-glm4-moe", {"layernorm_zero_centered_gamma": True, "attention_output_gate": True}),
    # Gated DeltaNet layers only, and an MTP depth (full attention) after them
    (
        "tiny-qwen3-next",
        {"linear_attention_freq": [1, 1, 1, 1], "mtp_num_layers": 1, "linear_attention_chunk_size": 24},
    ),
    (  # Llama 3.1 / 4 frequencies: the same tables
        "tiny-qwen3-moe",
        {
            "rope_type": "llama3",
            "rotary_scaling_factor": 8.0,
            "rope_low_freq_factor": 1.0,
            "rope_high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
]
# Gated DeltaNet layers over 32 positions: in two chunks, the last padded (one chunk, or whole chunks of more than one
# row, free some of the scan's saves before the backward: test_gated_delta_net_layer below measures those)
LINEAR_CHUNKS = {
    "tiny-qwen3-next": {"linear_attention_chunk_size": 24},
    "tiny-kimi-linear": {"linear_attention_chunk_size": 24},  # KDA: 3 sub-chunks of 8 positions a chunk
}
CASES = (
    [(name, torch.float32, LINEAR_CHUNKS.get(name, {})) for name in TINY_PRESETS]
    + [(name, torch.bfloat16, {}) for name in ("tiny-qwen3-moe", "tiny-deepseek-v3", "tiny-gpt-oss")]
    + [(name, torch.bfloat16, {}) for name in ("tiny-deepseek-v32", "tiny-glm-moe-dsa")]
    + [("tiny-qwen3-next", torch.bfloat16, LINEAR_CHUNKS["tiny-qwen3-next"]), ("tiny-nemotron-h", torch.bfloat16, {})]
    + [("tiny-kimi-linear", torch.bfloat16, {})]
    + [(name, dtype, overrides) for name, overrides in BLOCKS for dtype in (torch.float32, torch.bfloat16)]
)


def _measured_by_module(model: MoETransformer, config: ModelConfig, batch: int, seq_len: int) -> dict[str, int]:
    """What a forward and loss of ``model`` on ``batch`` random sequences leave saved when the backward starts, by the
    estimate's module (each Mamba-2 mixer's gated norm run as its ``norm`` module)."""
    ids = torch.randint(0, config.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(0))
    mixers = {n: m for n, m in model.named_modules() if isinstance(m, mamba_module.Mamba2Mixer)}
    with _gated_norm_as_module(*mixers.values()), SavedAtBackwardBytes(model=model) as measured:
        loss = causal_lm_loss(model(ids), ids.roll(-1, dims=1), config.mtp_loss_scaling_factor)
    dense = {n for n, m in model.named_modules() if n.endswith("mlp") and not hasattr(m, "router")}
    linear = {n for n, m in model.named_modules() if isinstance(m, GatedDeltaNet | KimiDeltaMixer)}
    by_module: dict[str, int] = {}
    for saved in measured.alive():  # the loss (and its graph) still held
        mamba = saved.module.removesuffix(".norm") in mixers
        module = estimate_module(saved.module, saved.module in dense, saved.module in linear, mamba)
        by_module[module] = by_module.get(module, 0) + saved.nbytes
    del loss
    return by_module


def _declared(model: MoETransformer, config: ModelConfig, batch: int, seq_len: int, dtype) -> MemoryEstimate:
    size = dtype.itemsize
    params = local_parameters(model)
    run = run_shape(
        config, params, micro_batch=batch, seq_len=seq_len, activation_bytes=size, param_bytes=size, device="cpu"
    )
    shape = model_shape(config)
    assert shape.saved_bytes is MOE_TRANSFORMER_SAVED_BYTES
    return estimate_memory(shape, run)


def _declared_by_module(estimate: MemoryEstimate) -> dict[str, int]:
    declared = estimate.activations_by_module()
    if "combine" in declared:  # dispatch and combine run in the MoE block's forward
        declared["dispatch"] = declared.get("dispatch", 0) + declared.pop("combine")
    return declared


@pytest.mark.parametrize(("name", "dtype", "overrides"), CASES, ids=lambda case: str(case))
def test_declared_saves_are_what_the_model_saves(name: str, dtype: torch.dtype, overrides: dict) -> None:
    config = preset(name, **overrides)
    batch, seq_len = 2, 32
    model = build_model(config, seed=0).to(dtype)
    declared = _declared_by_module(_declared(model, config, batch, seq_len, dtype))
    assert declared == _measured_by_module(model, config, batch, seq_len)


@settings(max_examples=40, deadline=None)
@given(
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    batch=st.integers(1, 2),
    seq=st.integers(1, 40),
    chunk=st.sampled_from([4, 8, 16, 64]),
    heads=st.sampled_from([(1, 1), (1, 2), (2, 2), (2, 4)]),
)
def test_gated_delta_net_layer(dtype, batch, seq, chunk, heads) -> None:
    """One Gated DeltaNet layer's declared saves, module by module, are what its forward leaves saved for the
    backward: one chunk or several, padded or whole, one value head per key head or more, one row or two."""
    config = preset(
        "tiny-qwen3-next",
        linear_num_key_heads=heads[0],
        linear_num_value_heads=heads[1],
        linear_attention_chunk_size=chunk,
    )
    torch.manual_seed(0)
    layer = GatedDeltaNet(config).to(dtype)
    x = torch.randn(batch, seq, config.hidden_size, dtype=dtype, requires_grad=True)
    with SavedAtBackwardBytes(model=layer) as measured:
        out = layer(x)
    measured_by_module: dict[str, int] = {}
    for saved in measured.alive():
        module = estimate_module(f"attention.{saved.module}".rstrip("."), linear_attention=True)
        measured_by_module[module] = measured_by_module.get(module, 0) + saved.nbytes
    del out
    shape = model_shape(config).layers[0].attention
    tokens, size = batch * seq, dtype.itemsize
    run = RunShape(micro_batch=batch, seq_len=seq, params=local_parameters(layer), activation_bytes=size)
    sizes = RankSizes(batch, seq, tokens, tokens, size)
    assert gated_delta_net_saved_bytes(shape, config.hidden_size, sizes, run) == measured_by_module


def test_gated_delta_net_bytes_grow_linearly_with_the_sequence() -> None:
    """Per chunk of positions the same bytes more: linear in the sequence (whole chunks of 64 positions, one row)."""
    config = preset("tiny-qwen3-next")
    shape = model_shape(config).layers[0].attention

    def total(seq: int) -> int:
        run = RunShape(micro_batch=1, seq_len=seq, params=LocalParameters(1, 1), activation_bytes=4)
        return sum(gated_delta_net_saved_bytes(shape, config.hidden_size, RankSizes(1, seq, seq, seq, 4), run).values())

    steps = [total(64 * (n + 1)) - total(64 * n) for n in range(2, 6)]
    assert len(set(steps)) == 1 and steps[0] > 0


def test_cp_with_gated_delta_net_layers_is_refused() -> None:
    """Their context-parallel form is not declared: the estimate says so, naming the field, rather than guess."""
    config = preset("tiny-qwen3-next")
    model = build_model(config, seed=0)
    run = run_shape(config, local_parameters(model), micro_batch=1, seq_len=64, activation_bytes=4)
    run = RunShape(**{**run.__dict__, "cp": 2})
    with pytest.raises(ValueError, match="^cp=2: Gated DeltaNet layers under context parallelism are not estimated"):
        estimate_memory(model_shape(config), run)


def _kda_config(heads: int, head_dim: int, chunk: int) -> ModelConfig:
    return preset(
        "tiny-kimi-linear",
        linear_num_key_heads=heads,
        linear_num_value_heads=heads,
        linear_key_head_dim=head_dim,
        linear_value_head_dim=head_dim,
        linear_attention_chunk_size=chunk,
    )


@settings(max_examples=40, deadline=None)
@given(
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    batch=st.integers(1, 2),
    seq=st.integers(1, 40),
    chunk=st.sampled_from([4, 7, 12, 16, 64]),  # sub-chunks: 1 of 4; 1 of 7 (prime); 2 of 6; 2 of 8; 8 of 8
    heads=st.integers(1, 3),
    head_dim=st.sampled_from([2, 4, 8]),
)
def test_kimi_delta_layer(dtype, batch, seq, chunk, heads, head_dim) -> None:
    """One KDA layer's declared saves, module by module, are what its forward leaves saved for the backward: one
    chunk or several, padded or whole, one sub-chunk a chunk or several, one row or two."""
    config = _kda_config(heads, head_dim, chunk)
    torch.manual_seed(0)
    layer = KimiDeltaMixer(config).to(dtype)
    x = torch.randn(batch, seq, config.hidden_size, dtype=dtype, requires_grad=True)
    with SavedAtBackwardBytes(model=layer) as measured:
        out = layer(x)
    measured_by_module: dict[str, int] = {}
    for saved in measured.alive():
        module = estimate_module(f"attention.{saved.module}".rstrip("."), linear_attention=True)
        measured_by_module[module] = measured_by_module.get(module, 0) + saved.nbytes
    del out
    shape = model_shape(config).layers[0].attention
    assert isinstance(shape, KimiDeltaShape)
    tokens, size = batch * seq, dtype.itemsize
    run = RunShape(micro_batch=batch, seq_len=seq, params=local_parameters(layer), activation_bytes=size)
    sizes = RankSizes(batch, seq, tokens, tokens, size)
    assert kimi_delta_saved_bytes(shape, config.hidden_size, sizes, run) == measured_by_module


@pytest.mark.parametrize("chunk", [64, 12])
def test_kimi_delta_bytes_grow_linearly_with_the_sequence(chunk: int) -> None:
    """Per chunk of positions the same bytes more: linear in the sequence (whole chunks, one row)."""
    shape = model_shape(_kda_config(4, 32, chunk)).layers[0].attention

    def total(seq: int) -> int:
        run = RunShape(micro_batch=1, seq_len=seq, params=LocalParameters(1, 1), activation_bytes=4)
        return sum(kimi_delta_saved_bytes(shape, 128, RankSizes(1, seq, seq, seq, 4), run).values())

    steps = [total(chunk * (n + 1)) - total(chunk * n) for n in range(2, 6)]
    assert len(set(steps)) == 1 and steps[0] > 0


def test_kimi_delta_under_cp_is_refused() -> None:
    """Its context-parallel form (the layer's segments) is not declared: one line naming the field."""
    shape = model_shape(_kda_config(2, 4, 8)).layers[0].attention
    run = RunShape(micro_batch=1, seq_len=64, params=LocalParameters(1, 1), activation_bytes=4, cp=2)
    with pytest.raises(ValueError, match="^cp=2: KDA layers under context parallelism are not estimated"):
        kimi_delta_saved_bytes(shape, 128, RankSizes(1, 32, 32, 32, 4, 2), run)


def test_token_mixers_not_estimated_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer kind the declarations do not describe is refused, naming the field, rather than estimated as
    attention (moe-train's ``plan --memory`` shows this one line)."""
    from moe_models.layer_patterns import LayerMixers

    config = preset("tiny-qwen3-next")
    layers = [LayerMixers("kimi_delta", "moe"), LayerMixers("attention", "moe")] * 2
    monkeypatch.setattr(ModelConfig, "layer_mixers", lambda self: layers)
    with pytest.raises(ModelConfigError, match="^experimental_attention_variant=.*not estimated: .* kimi_delta layers"):
        model_shape(config)


# the Mamba-2 mixer's modules as the estimate names them ("" is the mixer itself)
MAMBA_MODULES = {"": "mamba_mixer", "in_proj": "qkv_linear", "norm": "mamba_norm", "out_proj": "attn_proj"}


@contextlib.contextmanager
def _gated_norm_as_module(*mixers: mamba_module.Mamba2Mixer):
    """A mixer's gated norm is a function (ssd.gated_rms_norm) holding its weight in ``mixer.norm``: run it as that
    module's call (the norm of the mixer whose weight it is given), so that a measurement attributes what it saves to
    ``norm``."""
    norm_of_weight = {id(mixer.norm.weight): mixer.norm for mixer in mixers}
    for mixer in mixers:
        mixer.norm.forward = ssd.gated_rms_norm  # these instances only

    def as_module(y, z, weight, **kwargs):
        return norm_of_weight[id(weight)](y, z, weight, **kwargs)

    try:
        with mock.patch.object(mamba_module, "gated_rms_norm", as_module):
            yield
    finally:
        for mixer in mixers:
            del mixer.norm.forward


def _mamba_config(groups: int, per_group: int, head_dim: int, state_dim: int, chunk: int, conv_bias: bool):
    return ModelConfig(
        hidden_size=12,
        mamba_num_groups=groups,
        mamba_num_heads=groups * per_group,
        mamba_head_dim=head_dim,
        mamba_state_dim=state_dim,
        mamba_conv_kernel_dim=4,
        mamba_conv_bias=conv_bias,
        mamba_chunk_size=chunk,
    )


def _mamba_shape(config: ModelConfig) -> Mamba2Shape:
    return Mamba2Shape(
        heads=config.mamba_num_heads,
        head_dim=config.mamba_head_dim,
        groups=config.mamba_num_groups,
        state_dim=config.mamba_state_dim,
        conv_kernel=config.mamba_conv_kernel_dim,
        chunk=config.mamba_chunk_size,
    )


@settings(max_examples=40, deadline=None)
@given(
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    batch=st.integers(1, 2),
    seq=st.integers(1, 40),
    chunk=st.sampled_from([4, 8, 16, 64]),
    heads=st.sampled_from([(1, 1), (1, 2), (2, 1), (2, 2)]),  # (groups, heads per group)
    dims=st.sampled_from([(2, 4), (4, 2), (4, 4)]),  # (head_dim, state_dim)
    conv_bias=st.booleans(),
)
def test_mamba2_layer(dtype, batch, seq, chunk, heads, dims, conv_bias) -> None:
    """One Mamba-2 mixer's declared saves, module by module, are what its forward leaves saved for the backward: one
    chunk or several, padded or whole, one B/C group or two, one head per group or two, one row or two."""
    config = _mamba_config(*heads, *dims, chunk, conv_bias)
    torch.manual_seed(0)
    layer = mamba_module.Mamba2Mixer(config).to(dtype)
    x = torch.randn(batch, seq, config.hidden_size, dtype=dtype, requires_grad=True)
    with _gated_norm_as_module(layer), SavedAtBackwardBytes(model=layer) as measured:
        out = layer(x)
    measured_by_module: dict[str, int] = {}
    for saved in measured.alive():
        module = MAMBA_MODULES[saved.module]
        measured_by_module[module] = measured_by_module.get(module, 0) + saved.nbytes
    del out
    tokens, size = batch * seq, dtype.itemsize
    run = RunShape(micro_batch=batch, seq_len=seq, params=local_parameters(layer), activation_bytes=size)
    sizes = RankSizes(batch, seq, tokens, tokens, size)
    assert mamba2_saved_bytes(_mamba_shape(config), config.hidden_size, sizes, run) == measured_by_module


def test_mamba2_bytes_grow_linearly_with_the_sequence() -> None:
    """Per chunk of positions the same bytes more: linear in the sequence (whole chunks of 64 positions, one row)."""
    shape = Mamba2Shape(heads=8, head_dim=64, groups=2, state_dim=64, conv_kernel=4, chunk=64)

    def total(seq: int) -> int:
        run = RunShape(micro_batch=1, seq_len=seq, params=LocalParameters(1, 1), activation_bytes=4)
        return sum(mamba2_saved_bytes(shape, 256, RankSizes(1, seq, seq, seq, 4), run).values())

    steps = [total(64 * (n + 1)) - total(64 * n) for n in range(2, 6)]
    assert len(set(steps)) == 1 and steps[0] > 0


def test_mamba2_under_cp_is_refused() -> None:
    """Its context-parallel form is not declared (the mixer refuses it too): one line naming the field."""
    shape = Mamba2Shape(heads=4, head_dim=4, groups=2, state_dim=4, conv_kernel=4, chunk=8)
    run = RunShape(micro_batch=1, seq_len=64, params=LocalParameters(1, 1), activation_bytes=4, cp=2)
    with pytest.raises(ValueError, match="^cp=2: Mamba-2 layers under context parallelism are not estimated"):
        mamba2_saved_bytes(shape, 12, RankSizes(1, 32, 32, 32, 4, 2), run)


def test_an_unknown_linear_attention_variant_is_refused_naming_the_field() -> None:
    """A linear-attention variant the declarations do not describe (one the config may accept in future) is refused
    in one line naming the field rather than estimated as a Gated DeltaNet."""
    config = preset("tiny-qwen3-next")
    config.experimental_attention_variant = "future_delta_rule"  # past the config's own check, as a newer one
    with pytest.raises(ModelConfigError, match="^experimental_attention_variant='future_delta_rule': not estimated"):
        model_shape(config)


def test_kimi_delta_attention_layers_are_estimated_as_kda_not_gated_deltanet() -> None:
    """KDA's layers are "linear_attention" layers as Gated DeltaNet's, but save other tensors: the same config
    estimated as either variant gives a KimiDeltaShape or a Gated DeltaNet shape, and different bytes."""
    gdn = preset("tiny-qwen3-next")
    kda = dataclasses.replace(
        gdn,
        experimental_attention_variant="kimi_delta_attention",
        linear_num_value_heads=gdn.linear_num_key_heads,
        linear_value_head_dim=gdn.linear_key_head_dim,
    )
    assert [m.token for m in kda.layer_mixers()] == [m.token for m in gdn.layer_mixers()]  # the same layer kinds
    as_gdn = model_shape(dataclasses.replace(kda, experimental_attention_variant="gated_delta_net"))
    as_kda = model_shape(kda)
    linear = [i for i, m in enumerate(kda.layer_mixers()) if m.token == "linear_attention"]
    assert linear and all(type(as_kda.layers[i].attention) is KimiDeltaShape for i in linear)
    assert all(type(as_gdn.layers[i].attention) is GatedDeltaNetShape for i in linear)
    run = RunShape(micro_batch=1, seq_len=64, params=LocalParameters(1, 1), activation_bytes=4)
    kinds = {t.where for t in estimate_memory(as_kda, run).activations}
    assert any(kind.endswith("(KDA)") for kind in kinds)
    assert estimate_memory(as_kda, run).activation_bytes != estimate_memory(as_gdn, run).activation_bytes


def test_a_training_dsa_indexer_is_refused_naming_the_field() -> None:
    """With its loss on, the indexer re-scores keys with gradient: what that saves is not declared."""
    config = preset("tiny-deepseek-v32", dsa_indexer_loss_coeff=0.01)
    with pytest.raises(ModelConfigError, match="^dsa_indexer_loss_coeff=0.01: not estimated"):
        model_shape(config)
    model_shape(preset("tiny-deepseek-v32", dsa_indexer_loss_coeff=0.0))  # a zero coefficient trains nothing


# (batch, sequence length): fewer positions than the top-k of 16 (every earlier key selected, slots left empty),
# exactly 16, more, and more than one query block of 64 (the last of 1 or 16 queries: a view of q or a copy)
DSA_RUNS = [(2, 8), (1, 16), (2, 40), (2, 65), (1, 80), (2, 129)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("batch", "seq_len"), DSA_RUNS, ids=str)
def test_sparse_attention_layers_declare_what_they_save(dtype: torch.dtype, batch: int, seq_len: int) -> None:
    """DeepSeek Sparse Attention (tiny-deepseek-v32, an MTP depth with its own indexer): what the sparse core keeps
    grows with min(topk, S) per query, and is what the model saves, module by module; the indexer saves nothing."""
    config = preset("tiny-deepseek-v32")
    model = build_model(config, seed=0).to(dtype)
    estimate = _declared(model, config, batch, seq_len, dtype)
    measured = _measured_by_module(model, config, batch, seq_len)
    assert _declared_by_module(estimate) == measured
    assert "indexer" not in measured and measured["core_attn"] > 0
    kinds = {t.where for t in estimate.activations}
    assert {"dense layer x1 (MLA sparse top-16)", "moe layer x2 (MLA sparse top-16)"} <= kinds


# Nemotron-H's building blocks: one block per layer (Mamba-2, NoPE attention, squared-ReLU dense MLP and MoE with a
# non-gated shared expert)
HYBRID = HYBRID_BLOCKS
# (pattern, sequence length, the layer kinds the estimate names): whole chunks of 8 positions, the last chunk padded,
# one chunk; a MoE block first, an attention block last
HYBRID_CASES = [
    (
        "M-ME*E",
        32,
        {"mamba-only layer x2 (Mamba-2)", "mlp-only layer x1", "moe-only layer x2", "attention-only layer x1 (GQA)"},
    ),
    (
        "EM*-",
        20,
        {"moe-only layer x1", "mamba-only layer x1 (Mamba-2)", "attention-only layer x1 (GQA)", "mlp-only layer x1"},
    ),
    ("-M*", 8, {"mlp-only layer x1", "mamba-only layer x1 (Mamba-2)", "attention-only layer x1 (GQA)"}),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("pattern", "seq_len", "kinds"), HYBRID_CASES, ids=lambda case: str(case)[:12])
def test_hybrid_declared_saves_are_what_the_model_saves(pattern: str, seq_len: int, kinds: set, dtype) -> None:
    """A hybrid pattern's model (layers of one block each) saves what the estimate declares, module by module and in
    total, measured when the backward starts (the Mamba-2 scan's last state update is freed before it)."""
    config = ModelConfig(hybrid_override_pattern=pattern, num_layers=len(pattern), **HYBRID)
    batch = 2
    model = build_model(config, seed=0).to(dtype)
    estimate = _declared(model, config, batch, seq_len, dtype)
    declared = _declared_by_module(estimate)
    assert declared == _measured_by_module(model, config, batch, seq_len)
    blocks = {"mamba_mixer", "mamba_norm", "dense_mlp", "core_attn"} | ({"shared_experts"} if "E" in pattern else set())
    assert blocks <= set(declared)
    assert {t.where for t in estimate.activations} == kinds | {"model"}


def test_non_gated_mlps_declare_their_activation_by_hand() -> None:
    """The squared-ReLU dense MLP and shared expert, hand counted (fp32, 2 x 4 tokens): the input, relu(h) (kept once
    by relu and by the square) and the activation's output, [tokens, ffn] each; SwiGLU's four [tokens, ffn] tensors
    where the activation is gated."""
    tokens, hidden, ffn, shared = 8, 128, 512, 64
    config = ModelConfig(hybrid_override_pattern="-E", num_layers=2, **HYBRID)
    run = RunShape(micro_batch=2, seq_len=4, params=LocalParameters(1, 1), activation_bytes=4, device="cpu")
    by_module = estimate_memory(model_shape(config), run).activations_by_module()
    assert by_module["dense_mlp"] == tokens * hidden * 4 + 2 * tokens * ffn * 4
    # its input is counted with the router's, which saves the same fp32 tensor first (the shared expert runs while
    # the tokens travel, after the router)
    assert by_module["shared_experts"] == 2 * tokens * shared * 4
    gated = estimate_memory(model_shape(dataclasses.replace(config, activation_func="swiglu")), run)
    assert gated.activations_by_module()["dense_mlp"] == tokens * hidden * 4 + 4 * tokens * ffn * 4
