"""RouterConfig validation: every bad field is rejected with a ValueError that names it."""

import pytest
import torch

from moe_dispatch import RouterConfig


def test_defaults_follow_megatron():
    cfg = RouterConfig(num_experts=8)
    assert (cfg.topk, cfg.score_function, cfg.load_balancing_type) == (2, "softmax", "aux_loss")
    assert cfg.aux_loss_coeff == pytest.approx(1e-2)
    assert cfg.router_dtype == "fp32"
    assert cfg.torch_router_dtype is torch.float32


def test_router_dtype_fp64_maps_to_float64():
    assert RouterConfig(num_experts=4, router_dtype="fp64").torch_router_dtype is torch.float64


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"num_experts": 0, "topk": 1}, ["num_experts"]),
        ({"num_experts": -3, "topk": 1}, ["num_experts"]),
        ({"num_experts": 4, "topk": 5}, ["topk", "num_experts"]),
        ({"num_experts": 4, "topk": 0}, ["topk"]),
        ({"num_experts": 4, "topk": -1}, ["topk"]),
        ({"num_experts": 4, "score_function": "tanh"}, ["score_function", "tanh"]),
        ({"num_experts": 4, "load_balancing_type": "switch"}, ["load_balancing_type", "switch"]),
        ({"num_experts": 4, "aux_loss_coeff": -1e-3}, ["aux_loss_coeff"]),
        ({"num_experts": 4, "router_dtype": "bf16"}, ["router_dtype", "bf16"]),
    ],
)
def test_invalid_field_raises_value_error_naming_it(kwargs, names):
    with pytest.raises(ValueError) as excinfo:
        RouterConfig(**kwargs)
    message = str(excinfo.value)
    for name in names:
        assert name in message, f"{name!r} missing from {message!r}"


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
    ("kwargs", "names"),
    [
        ({"topk": 2.0}, ["topk"]),
        ({"topk": True}, ["topk"]),
        ({"pre_softmax": True, "score_function": "sigmoid"}, ["pre_softmax", "score_function"]),
        ({"group_topk": 2}, ["group_topk", "num_groups"]),
        ({"num_groups": 2}, ["num_groups", "group_topk"]),
        ({"num_groups": 3, "group_topk": 1}, ["num_experts", "num_groups"]),
        ({"num_groups": 4, "group_topk": 1, "topk": 3}, ["topk", "group_topk"]),
        ({"num_groups": 2, "group_topk": 3}, ["group_topk", "num_groups"]),
        ({"num_groups": 4, "group_topk": 4, "topk": 2}, ["topk", "group_topk"]),
        ({"topk_scaling_factor": 0.0}, ["topk_scaling_factor"]),
        ({"topk_scaling_factor": float("nan")}, ["topk_scaling_factor"]),
        ({"load_balancing_type": ("aux_loss", "bogus")}, ["load_balancing_type", "bogus"]),
        ({"load_balancing_type": ("aux_loss", "aux_loss")}, ["load_balancing_type"]),
        ({"load_balancing_type": ("aux_loss", "none")}, ["load_balancing_type", "none"]),
        ({"load_balancing_type": ()}, ["load_balancing_type"]),
        (
            {"load_balancing_type": ("aux_loss", "seq_aux_loss"), "aux_loss_coeff": (0.1,)},
            ["aux_loss_coeff", "load_balancing_type"],
        ),
        ({"aux_loss_coeff": float("nan")}, ["aux_loss_coeff"]),
        ({"aux_loss_coeff": (0.1, -0.1), "load_balancing_type": ("aux_loss", "seq_aux_loss")}, ["aux_loss_coeff"]),
        ({"z_loss_coeff": -1.0}, ["z_loss_coeff"]),
        ({"z_loss_coeff": float("nan")}, ["z_loss_coeff"]),
        ({"bias_update_rate": -1e-3}, ["bias_update_rate"]),
        ({"capacity_factor": 0.0}, ["capacity_factor"]),
        ({"capacity_factor": float("inf")}, ["capacity_factor"]),
        ({"token_drop_policy": "random"}, ["token_drop_policy", "random"]),
        ({"pad_to_capacity": True}, ["pad_to_capacity", "capacity_factor"]),
    ],
)
def test_invalid_combination_names_both_fields_on_one_line(kwargs, names):
    with pytest.raises(ValueError) as excinfo:
        RouterConfig(**{"num_experts": 8, **kwargs})
    message = str(excinfo.value)
    assert "\n" not in message
    for name in names:
        assert name in message, f"{name!r} missing from {message!r}"


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
