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
        ({"num_experts": 4, "score_function": "sigmoid"}, ["score_function", "sigmoid"]),
        ({"num_experts": 4, "load_balancing_type": "seq_aux_loss"}, ["load_balancing_type", "seq_aux_loss"]),
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
