"""One-process checks of moe_parallel's pieces: expert sharding against the whole experts, gradient-norm and
clipping against torch's, replica counting, FSDP placement of experts, and the errors a user can cause."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.tensor import Shard

from moe_experts import GroupedExperts
from moe_models import ModelConfig
from moe_models.presets import preset
from moe_parallel import GradientSync, ParallelConfig, check_model, replica_count, shard_experts
from moe_parallel.fsdp import _expert_placement


@settings(max_examples=20, deadline=None)
@given(
    ep=st.sampled_from([1, 2, 4]),
    etp=st.sampled_from([1, 2]),
    activation=st.sampled_from(["swiglu", "swiglu_oai", "squared_relu"]),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_sharded_experts_sum_to_the_whole(ep: int, etp: int, activation: str, bias: bool, seed: int) -> None:
    torch.manual_seed(seed)
    whole = GroupedExperts(8, 16, 8, activation=activation, backend="loop", bias=bias, seed=seed)
    if bias:
        with torch.no_grad():
            whole.b_gate_up_E2F.normal_()
            whole.b_down_EH.normal_()
    counts_E = torch.randint(0, 4, (8,))
    x_NH = torch.randn(int(counts_E.sum()), 16)
    probs_N = torch.rand(x_NH.shape[0])
    reference = whole(x_NH, counts_E, probs_N)
    local = 8 // ep
    bounds = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.long), counts_E]), 0)
    for ep_rank in range(ep):
        rows = slice(int(bounds[ep_rank * local]), int(bounds[(ep_rank + 1) * local]))
        mine_E = counts_E[ep_rank * local : (ep_rank + 1) * local]
        # the etp ranks' partial outputs sum to the whole experts' output for this rank's experts
        out = sum(
            shard_experts(whole, ep_rank, ep, etp_rank, etp)(x_NH[rows], mine_E, probs_N[rows])
            for etp_rank in range(etp)
        )
        torch.testing.assert_close(out, reference[rows], rtol=1e-5, atol=1e-6)


def test_shard_experts_copies_values_and_refuses_a_shard() -> None:
    whole = GroupedExperts(4, 8, 6, backend="loop", seed=3)
    part = shard_experts(whole, ep_rank=1, ep=2, etp_rank=0, etp=1)
    assert part.first_expert == 2 and part.num_experts == 2
    torch.testing.assert_close(part.w_down_EFH, whole.w_down_EFH[2:])
    with pytest.raises(ValueError, match="whole experts"):
        shard_experts(part, 0, 1, 0, 1)
    with pytest.raises(ValueError, match="not divisible by parallel.ep=3"):
        shard_experts(whole, 0, 3, 0, 1)


def test_single_process_clip_matches_torch() -> None:
    torch.manual_seed(0)
    ours, theirs = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3)), nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3))
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(4, 5)
    for model in (ours, theirs):
        (model(x) ** 2).sum().backward()
    norm = GradientSync().clip_grad_norm_(ours.parameters(), 0.5)
    expected = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.5)
    torch.testing.assert_close(norm, expected)
    assert norm > 0.5  # the clip did something
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad)
    # an infinite bound measures without scaling
    before = [p.grad.clone() for p in ours.parameters()]
    GradientSync().clip_grad_norm_(ours.parameters(), float("inf"))
    assert all(torch.equal(a, p.grad) for a, p in zip(before, ours.parameters(), strict=True))


def test_replicas_divide_the_norm() -> None:
    param = nn.Parameter(torch.zeros(3))
    param.grad = torch.tensor([3.0, 0.0, 4.0])
    assert replica_count(param, 4) == 4 and replica_count(param, 4, extra_shards=2) == 2
    with pytest.raises(ValueError, match="3 distinct shards"):
        replica_count(param, 4, extra_shards=3)
    # one process: a replica count of 4 would quarter the squared norm
    sync = GradientSync(replicas={id(param): 4})
    assert sync.grad_norm([param]).item() == pytest.approx(2.5)


@pytest.mark.parametrize(("shape", "edp", "dim"), [((8, 16, 32), 4, 0), ((2, 16, 32), 4, 1), ((3, 5, 7), 2, 0)])
def test_experts_shard_along_a_dim_that_divides(shape, edp: int, dim: int) -> None:
    assert _expert_placement(edp)(nn.Parameter(torch.empty(shape))) == Shard(dim)


@pytest.mark.parametrize(
    ("changes", "parallel", "message"),
    [
        ({}, {"ep": 3}, "model.num_moe_experts=8 is not divisible by parallel.ep=3"),
        ({}, {"tp": 2, "etp": 3}, "model.moe_ffn_hidden_size=128 is not divisible by parallel.etp=3"),
        ({}, {"tp": 8}, "model.num_attention_heads=4 is not divisible by parallel.tp=8"),
        ({}, {"tp": 4}, "model.num_query_groups=2 is not divisible by parallel.tp=4"),
        ({"softmax_type": "learnable"}, {"tp": 2}, "attention sinks"),
        ({}, {"cp": 2}, "parallel.cp=2: context and pipeline parallelism are not implemented yet"),
        ({}, {"tp": 2, "moe_token_dispatcher_type": "flex"}, "\\(parallel.etp defaults to parallel.tp\\)"),
        ({}, {"ep": 2, "etp": 2, "moe_token_dispatcher_type": "flex"}, "'flex' \\(DeepEP\\) does not support etp"),
    ],
)
def test_layouts_a_model_cannot_take_name_the_field(changes: dict, parallel: dict, message: str) -> None:
    config: ModelConfig = dataclasses.replace(preset("tiny-qwen3-moe"), **changes)
    cfg = ParallelConfig(**parallel)
    with pytest.raises(ValueError, match=message):
        check_model(config, cfg, cfg.layout(48))  # 48 ranks fit every layout here


@pytest.mark.parametrize(
    ("sizes", "unsharded"), [({"ep": 2}, "experts \\(edp\\)"), ({"tp": 2, "etp": 1}, "dense parameters \\(dp\\)")]
)
def test_fsdp_mixed_precision_needs_fsdp_on_both_sides(sizes: dict, unsharded: str) -> None:
    cfg = ParallelConfig(**sizes, mixed_precision_param="bfloat16")
    with pytest.raises(ValueError, match=f"this layout shards no {unsharded}; keep it float32 and set run.dtype=bf16"):
        check_model(preset("tiny-qwen3-moe"), cfg, cfg.layout(2))
    fp32 = ParallelConfig(**sizes)
    check_model(preset("tiny-qwen3-moe"), fp32, fp32.layout(2))


def test_tensor_parallel_checks_the_dense_width_only_with_dense_layers() -> None:
    moe_only = dataclasses.replace(preset("tiny-qwen3-moe"), ffn_hidden_size=255)  # every layer is MoE
    check_model(moe_only, ParallelConfig(tp=2), ParallelConfig(tp=2).layout(2))
    with_dense = dataclasses.replace(moe_only, moe_layer_freq=[0, 1])
    with pytest.raises(ValueError, match="model.ffn_hidden_size=255 is not divisible by parallel.tp=2"):
        check_model(with_dense, ParallelConfig(tp=2), ParallelConfig(tp=2).layout(2))


def test_parallel_config_names_bad_choices() -> None:
    with pytest.raises(ValueError, match="parallel.moe_token_dispatcher_type='deepep'"):
        ParallelConfig(moe_token_dispatcher_type="deepep")
    with pytest.raises(ValueError, match="parallel.backend='glo': choose one of auto, gloo, nccl"):
        ParallelConfig(backend="glo")
    with pytest.raises(ValueError, match="parallel.mixed_precision_param='fp16'"):
        ParallelConfig(mixed_precision_param="fp16")
