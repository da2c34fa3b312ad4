"""RouterConfig validation: every bad field is rejected with a RouterConfigError (a ValueError) that carries it."""

import dataclasses
import pickle
import re

import pytest
import torch

from moe_dispatch import RouterConfig, RouterConfigError


def test_defaults_follow_megatron():
    cfg = RouterConfig(num_experts=8)
    assert (cfg.topk, cfg.score_function, cfg.load_balancing_type) == (2, "softmax", "aux_loss")
    assert cfg.aux_loss_coeff == pytest.approx(1e-2)
    assert cfg.router_dtype == "fp32"
    assert cfg.torch_router_dtype is torch.float32


def test_router_dtype_fp64_maps_to_float64():
    assert RouterConfig(num_experts=4, router_dtype="fp64").torch_router_dtype is torch.float64


@pytest.mark.parametrize(
    ("kwargs", "field", "words"),
    [
        ({"num_experts": 0, "topk": 1}, "num_experts", []),
        ({"num_experts": -3, "topk": 1}, "num_experts", []),
        ({"num_experts": 4, "topk": 5}, "topk", ["number of experts (4)"]),
        ({"num_experts": 4, "topk": 0}, "topk", []),
        ({"num_experts": 4, "topk": -1}, "topk", []),
        ({"num_experts": 4, "score_function": "tanh"}, "score_function", ["sigmoid"]),
        ({"num_experts": 4, "load_balancing_type": "switch"}, "load_balancing_type", ["aux_loss"]),
        ({"num_experts": 4, "aux_loss_coeff": -1e-3}, "aux_loss_coeff", []),
        ({"num_experts": 4, "router_dtype": "bf16"}, "router_dtype", ["fp32"]),
    ],
)
def test_invalid_field_raises_the_typed_error_naming_it(kwargs, field, words):
    with pytest.raises(RouterConfigError) as excinfo:
        RouterConfig(**kwargs)
    err = excinfo.value
    assert isinstance(err, ValueError)  # callers catching ValueError keep working
    assert (err.field, err.value) == (field, kwargs[field])
    assert str(err) == f"{field}={kwargs[field]!r}: {err.reason}"
    for word in words:
        assert word in err.reason, f"{word!r} missing from {err.reason!r}"


@pytest.mark.parametrize(("num_experts", "topk"), [(1, 1), (4, 1), (4, 4), (64, 8)])
def test_valid_edges_accepted(num_experts, topk):
    cfg = RouterConfig(num_experts=num_experts, topk=topk, aux_loss_coeff=0.0, load_balancing_type="none")
    assert (cfg.num_experts, cfg.topk) == (num_experts, topk)


def test_config_is_frozen():
    cfg = RouterConfig(num_experts=4)
    with pytest.raises(AttributeError):
        cfg.topk = 3  # type: ignore[misc]


def test_new_field_defaults_follow_megatron():
    cfg = RouterConfig(num_experts=8)
    assert (cfg.pre_softmax, cfg.num_groups, cfg.group_topk, cfg.topk_scaling_factor) == (False, None, None, None)
    assert (cfg.z_loss_coeff, cfg.enable_expert_bias, cfg.bias_update_rate) == (None, False, 1e-3)
    assert (cfg.capacity_factor, cfg.token_drop_policy, cfg.pad_to_capacity) == (None, "probs", False)
    assert cfg.force_load_balancing is False
    assert cfg.sigmoid_norm_topk is True  # Megatron-Core always renormalises the sigmoid top-k
    assert cfg.load_balancing_types == ("aux_loss",) and cfg.aux_loss_coeffs == {"aux_loss": 1e-2}
    assert RouterConfig(num_experts=8, load_balancing_type="none").load_balancing_types == ()


def test_combined_types_and_per_type_coefficients():
    cfg = RouterConfig(num_experts=4, load_balancing_type=["aux_loss", "global_aux_loss"], aux_loss_coeff=[0.1, 0.2])
    assert cfg.load_balancing_type == ("aux_loss", "global_aux_loss") and cfg.aux_loss_coeff == (0.1, 0.2)
    assert cfg.aux_loss_coeffs == {"aux_loss": 0.1, "global_aux_loss": 0.2}
    assert hash(cfg) == hash(
        RouterConfig(num_experts=4, load_balancing_type=("aux_loss", "global_aux_loss"), aux_loss_coeff=(0.1, 0.2))
    )
    shared = RouterConfig(num_experts=4, load_balancing_type=("aux_loss", "seq_aux_loss"), aux_loss_coeff=0.3)
    assert shared.aux_loss_coeffs == {"aux_loss": 0.3, "seq_aux_loss": 0.3}


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"topk": 2.0}, "topk"),
        ({"topk": True}, "topk"),
        ({"pre_softmax": True, "score_function": "sigmoid"}, "pre_softmax"),
        ({"pre_softmax": 1}, "pre_softmax"),
        ({"sigmoid_norm_topk": False}, "sigmoid_norm_topk"),  # softmax scores: that is pre_softmax
        ({"sigmoid_norm_topk": 0, "score_function": "sigmoid"}, "sigmoid_norm_topk"),
        ({"group_topk": 2}, "group_topk"),
        ({"num_groups": 2}, "num_groups"),
        ({"num_groups": 3, "group_topk": 1}, "num_groups"),
        ({"num_groups": 4, "group_topk": 1, "topk": 3}, "topk"),
        ({"num_groups": 2, "group_topk": 3}, "group_topk"),
        ({"num_groups": 4, "group_topk": 4, "topk": 2}, "topk"),
        ({"group_score_topk": 1}, "group_score_topk"),  # no groups to score
        ({"num_experts": 8, "num_groups": 4, "group_topk": 2, "group_score_topk": 3}, "group_score_topk"),
        ({"num_experts": 8, "num_groups": 4, "group_topk": 2, "group_score_topk": 0}, "group_score_topk"),
        ({"topk_scaling_factor": 0.0}, "topk_scaling_factor"),
        ({"topk_scaling_factor": float("nan")}, "topk_scaling_factor"),
        ({"load_balancing_type": ("aux_loss", "bogus")}, "load_balancing_type"),
        ({"load_balancing_type": ("aux_loss", "aux_loss")}, "load_balancing_type"),
        ({"load_balancing_type": ("aux_loss", "none")}, "load_balancing_type"),
        ({"load_balancing_type": ()}, "load_balancing_type"),
        ({"load_balancing_type": ("aux_loss", "seq_aux_loss"), "aux_loss_coeff": (0.1,)}, "aux_loss_coeff"),
        ({"aux_loss_coeff": float("nan")}, "aux_loss_coeff"),
        ({"aux_loss_coeff": (0.1, -0.1), "load_balancing_type": ("aux_loss", "seq_aux_loss")}, "aux_loss_coeff"),
        ({"z_loss_coeff": -1.0}, "z_loss_coeff"),
        ({"z_loss_coeff": float("nan")}, "z_loss_coeff"),
        ({"bias_update_rate": -1e-3}, "bias_update_rate"),
        ({"enable_expert_bias": "yes"}, "enable_expert_bias"),
        ({"force_load_balancing": None}, "force_load_balancing"),
        ({"add_bias": 1}, "add_bias"),
        ({"capacity_factor": 0.0}, "capacity_factor"),
        ({"capacity_factor": float("inf")}, "capacity_factor"),
        ({"token_drop_policy": "random"}, "token_drop_policy"),
        ({"pad_to_capacity": True}, "pad_to_capacity"),
    ],
)
def test_invalid_combination_carries_the_field_to_change(kwargs, field):
    """``.field`` is a real RouterConfig field the caller set, ``.value`` its value; one line of text."""
    with pytest.raises(RouterConfigError) as excinfo:
        RouterConfig(**{"num_experts": 8, **kwargs})
    err = excinfo.value
    assert err.field in {f.name for f in dataclasses.fields(RouterConfig)}
    assert err.field == field and field in kwargs
    assert err.value == kwargs[field] or err.value != err.value  # nan != nan
    assert str(err) == f"{field}={err.value!r}: {err.reason}" and "\n" not in str(err)


def test_error_reasons_name_no_other_router_field():
    """Reasons describe other fields in words, so moe-models can re-raise them under its own field names."""
    router_fields = {f.name for f in dataclasses.fields(RouterConfig)}
    bad = [
        {"num_experts": 4, "topk": 5},
        {"num_experts": 8, "pre_softmax": True, "score_function": "sigmoid"},
        {"num_experts": 8, "sigmoid_norm_topk": False},
        {"num_experts": 8, "group_topk": 2},
        {"num_experts": 8, "num_groups": 3, "group_topk": 1},
        {"num_experts": 8, "num_groups": 4, "group_topk": 4, "topk": 2},
        {"num_experts": 8, "num_groups": 4, "group_topk": 1, "topk": 3},
        {"num_experts": 8, "load_balancing_type": ("aux_loss", "seq_aux_loss"), "aux_loss_coeff": (0.1,)},
        {"num_experts": 8, "pad_to_capacity": True},
    ]
    for kwargs in bad:
        with pytest.raises(RouterConfigError) as excinfo:
            RouterConfig(**kwargs)
        named = {name for name in router_fields if re.search(rf"\b{name}\b", excinfo.value.reason)}
        assert not named, (kwargs, excinfo.value.reason)


def test_error_pickles_with_its_fields():
    err = RouterConfigError("topk", 9, "too many")
    back = pickle.loads(pickle.dumps(err))
    assert (type(back), back.field, back.value, back.reason, str(back)) == (
        RouterConfigError,
        "topk",
        9,
        "too many",
        "topk=9: too many",
    )


def test_valid_group_limited_config():
    cfg = RouterConfig(
        num_experts=256,
        topk=8,
        score_function="sigmoid",
        num_groups=8,
        group_topk=4,
        topk_scaling_factor=2.5,
        enable_expert_bias=True,
        load_balancing_type="seq_aux_loss",
        aux_loss_coeff=1e-4,
        capacity_factor=1.25,
        pad_to_capacity=True,
    )
    assert (cfg.num_groups, cfg.group_topk) == (8, 4)
