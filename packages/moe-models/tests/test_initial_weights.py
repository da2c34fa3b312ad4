"""Initial weights that depend on (seed, tensor name) alone: any slice of a tensor is that slice of the whole, the
eager build fills exactly those values, and a HuggingFace checkpoint served slice by slice agrees with reading it
whole."""

from __future__ import annotations

import pytest
import torch
from _hf_reference import tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_models import build_model
from moe_models.hf import CheckpointSource, read_state_dict, save_pretrained
from moe_models.init import ROWS_PER_DRAW, InitialWeights
from moe_models.presets import preset


@pytest.fixture(scope="module")
def weights() -> InitialWeights:
    with torch.device("meta"):
        model = build_model(preset("tiny-deepseek-v3"))
    return model.initial_weights(11)


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 3 * ROWS_PER_DRAW), data=st.data())
def test_a_box_is_that_slice_of_the_whole_tensor(weights: InitialWeights, rows: int, data) -> None:
    shape = (rows, 24)
    start = data.draw(st.integers(0, rows - 1))
    stop = data.draw(st.integers(start + 1, rows))
    col = data.draw(st.integers(0, 23))
    whole = weights.tensor("embed_tokens.weight", shape)
    box = (slice(start, stop), slice(col, 24))
    assert torch.equal(weights.tensor("embed_tokens.weight", shape, box), whole[box])


def test_values_follow_the_rules_and_differ_by_name_and_seed(weights: InitialWeights) -> None:
    config = preset("tiny-deepseek-v3")
    q = weights.tensor("layers.0.attention.q_b_proj.weight", (64, 16))
    o = weights.tensor("layers.0.attention.o_proj.weight", (512, 64))
    assert q.std().item() == pytest.approx(config.init_method_std, rel=0.1)
    # the residual-output projections start smaller, as Megatron's scaled init
    assert o.std().item() == pytest.approx(config.init_method_std / (2 * config.num_layers) ** 0.5, rel=0.1)
    assert torch.equal(weights.tensor("norm.weight", (8,)), torch.ones(8))
    assert not torch.equal(q, weights.tensor("layers.1.attention.q_b_proj.weight", (64, 16)))
    with torch.device("meta"):
        other = build_model(config).initial_weights(12)
    assert not torch.equal(q, other.tensor("layers.0.attention.q_b_proj.weight", (64, 16)))


def test_the_eager_build_holds_the_served_values() -> None:
    config = preset("tiny-gpt-oss")  # expert biases, sinks, attention biases
    model = build_model(config, seed=3)
    again = build_model(config, seed=3)
    served = model.initial_weights(3)
    for name, tensor in model.named_parameters():
        assert torch.equal(tensor, dict(again.named_parameters())[name]), name
        if ".experts." not in name:
            assert torch.equal(tensor, served.tensor(name, tuple(tensor.shape))), name
    experts = model.layers[0].mlp.experts
    for e in (0, experts.num_experts - 1):
        for name, value in served.expert("layers.0.mlp.experts", e).items():
            assert torch.equal(getattr(experts, name)[e], value), (name, e)
    assert not torch.equal(build_model(config, seed=4).embed_tokens.weight, model.embed_tokens.weight)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_a_checkpoint_served_slice_by_slice_equals_reading_it_whole(family: str, tmp_path) -> None:
    model = tiny_model(family)
    save_pretrained(model, tmp_path / "hf")
    whole = read_state_dict(tmp_path / "hf", model.config)
    with CheckpointSource(tmp_path / "hf", model.config) as source:
        for name, value in whole.items():
            if ".experts." in name:
                continue
            box = tuple(slice(n // 3, n) for n in value.shape)
            assert torch.equal(source.tensor(name, tuple(value.shape), box), value[box]), name
            assert torch.equal(source.tensor(name, tuple(value.shape)), value), name
        layer = next(i for i, layer in enumerate(model.layers) if layer.is_moe)
        path = f"layers.{layer}.mlp.experts"
        for e in (0, model.config.num_moe_experts - 1):
            for name, value in source.expert(path, e).items():
                assert torch.equal(value, whole[f"{path}.{name}"][e]), (name, e)
