"""Each published preset of the families added in issue 34 has exactly the parameters of transformers' own model built
(on the meta device) from the published config.json the preset is read from."""

from __future__ import annotations

import pytest
import torch
import transformers

from moe_models import build_model, count_parameters
from moe_models.presets import PUBLISHED_PRESETS, preset
from moe_models.published_configs import PUBLISHED_HF_CONFIGS

FROM_CONFIG_JSON = [name for name in PUBLISHED_PRESETS if name in PUBLISHED_HF_CONFIGS]


def test_every_published_config_of_a_mapped_family_is_a_preset():
    from moe_models.hf.config_map import MODEL_TYPES

    mapped = {name for name, values in PUBLISHED_HF_CONFIGS.items() if values["model_type"] in MODEL_TYPES}
    assert mapped == set(FROM_CONFIG_JSON)
    assert len(FROM_CONFIG_JSON) >= 12


@pytest.mark.parametrize("name", FROM_CONFIG_JSON)
def test_preset_has_transformers_parameter_count(name: str) -> None:
    values = dict(PUBLISHED_HF_CONFIGS[name])
    config = transformers.AutoConfig.for_model(values.pop("model_type"), **values)
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(config)
        ours = build_model(preset(name))
    # ERNIE 4.5 holds its expert bias as a frozen parameter; it is a buffer here, as in transformers' other families
    their_count = sum(p.numel() for n, p in theirs.named_parameters() if "e_score_correction_bias" not in n)
    counted = count_parameters(preset(name))
    # transformers builds no multi-token-prediction layers
    our_count = sum(p.numel() for n, p in ours.named_parameters() if not n.startswith("mtp."))
    print(f"\n{name}: transformers {their_count:,}, ours {our_count:,}")
    assert our_count == their_count == counted.total


@pytest.mark.parametrize(
    "name", [name for name in FROM_CONFIG_JSON if PUBLISHED_HF_CONFIGS[name]["model_type"] == "nemotron_h"]
)
def test_nemotron_h_preset_has_transformers_layer_order(name: str) -> None:
    """The published Nemotron-H files give the legacy hybrid_override_pattern string, which transformers turns into
    its layers_block_type list: the preset's layers are transformers' NemotronHForCausalLM's, one for one."""
    values = dict(PUBLISHED_HF_CONFIGS[name])
    config = transformers.AutoConfig.for_model(values.pop("model_type"), **values)
    symbol = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}
    theirs = "".join(symbol[kind] for kind in config.layers_block_type)
    assert theirs == values["hybrid_override_pattern"] == preset(name).hybrid_override_pattern
    assert len(theirs) == values["num_hidden_layers"] == preset(name).num_layers
    assert transformers.AutoModelForCausalLM._model_mapping[type(config)].__name__ == "NemotronHForCausalLM"


@pytest.mark.parametrize(
    "name", [name for name in FROM_CONFIG_JSON if PUBLISHED_HF_CONFIGS[name]["model_type"] == "kimi_linear"]
)
def test_kimi_linear_preset_has_transformers_layer_order(name: str) -> None:
    """The published Kimi Linear file gives its layer kinds as 1-based kda_layers / full_attn_layers lists, which
    transformers turns into its layer_types (and first_k_dense_replace into mlp_layer_types): the preset's layers are
    transformers' KimiLinearForCausalLM's, one for one."""
    values = dict(PUBLISHED_HF_CONFIGS[name])
    config = transformers.AutoConfig.for_model(values.pop("model_type"), **values)
    ours = preset(name)
    assert ours.attention_kinds() == ["attention" if t == "full_attention" else t for t in config.layer_types]
    assert ours.moe_layer_pattern() == [int(t == "sparse") for t in config.mlp_layer_types]
    assert ours.attention_kinds().count("linear_attention") == len(values["linear_attn_config"]["kda_layers"]) == 20
    assert transformers.AutoModelForCausalLM._model_mapping[type(config)].__name__ == "KimiLinearForCausalLM"
