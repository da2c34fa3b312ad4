"""One-process checks of moe_parallel's pieces: expert sharding against the whole experts, gradient-norm and
clipping against torch's, replica counting, FSDP placement of experts, and the errors a user (or a model's parallel
plan) can cause."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from _toy_plan_model import EXPERTS, PLAN, ToyMoE
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.tensor import Shard

from moe_experts import GroupedExperts
from moe_models import ModelConfig, build_model
from moe_models.presets import preset
from moe_parallel import (
    GradientSync,
    LayoutError,
    MoEBlockPlan,
    ParallelConfig,
    check_plan,
    materialize,
    moe_blocks,
    replica_count,
    shard_experts,
)
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


def _meta_model(config: ModelConfig):
    with torch.device("meta"):
        return build_model(config)


def _check(config: ModelConfig, **parallel) -> None:
    model, cfg = _meta_model(config), ParallelConfig(**parallel)
    check_plan(model, model.parallel_plan(), cfg, cfg.layout(48))  # 48 ranks fit every layout here


def test_a_plan_without_context_parallel_attention_refuses_cp() -> None:
    model, cfg = _meta_model(preset("tiny-qwen3-moe")), ParallelConfig(cp=2)
    plan = dataclasses.replace(model.parallel_plan(), context_parallel=())
    with pytest.raises(LayoutError, match="cp=2: the model declares no context-parallel attention; it takes cp=1 only"):
        check_plan(model, plan, cfg, cfg.layout(4))
    check_plan(model, model.parallel_plan(), cfg, cfg.layout(4))  # moe_models' plan lists every core attention


@pytest.mark.parametrize(
    ("changes", "parallel", "field", "message"),
    [
        (
            {},
            {"ep": 3},
            "ep",
            "ep=3: the model's 8 experts per MoE layer do not divide over it; they divide over ep in [1, 2, 4, 8]",
        ),
        (
            {},
            {"tp": 2, "etp": 3},
            "etp",
            "etp=3: the experts' FFN width 128 is not divisible by it; "
            "it divides over etp in [1, 2, 4, 8, 16, 32, 64, 128]",
        ),
        (
            {},
            {"tp": 8},
            "tp",
            "tp=8: the model's num_attention_heads=4 is not divisible by it; "
            "the sizes tp splits divide over tp in [1, 2]",
        ),
        (
            {},
            {"tp": 4},
            "tp",
            "tp=4: the model's num_query_groups=2 is not divisible by it; the sizes tp splits divide over tp in [1, 2]",
        ),
        (
            {},
            {"tp": 2, "moe_token_dispatcher_type": "flex"},
            "moe_token_dispatcher_type",
            "moe_token_dispatcher_type='flex': DeepEP does not support etp > 1 (etp defaults to tp)",
        ),
        (
            {},
            {"ep": 2, "etp": 2, "moe_token_dispatcher_type": "flex"},
            "moe_token_dispatcher_type",
            "moe_token_dispatcher_type='flex': DeepEP does not support etp > 1: use 'alltoall', or etp=1",
        ),
        (
            {},
            {"ep_overlap": "chunked"},
            "ep_overlap",
            "ep_overlap='chunked': overlaps expert-parallel all-to-alls, and ep=1 has none: set ep > 1, or ep_overlap "
            "none",
        ),
        (
            {},
            {"ep": 2, "ep_overlap": "chunked", "moe_token_dispatcher_type": "allgather"},
            "ep_overlap",
            "ep_overlap='chunked': overlaps the alltoall dispatcher's exchanges, not allgather's: set "
            "moe_token_dispatcher_type alltoall, or ep_overlap none",
        ),
        (
            {},
            {"ep": 2, "ep_overlap": "microbatch", "moe_token_dispatcher_type": "flex"},
            "ep_overlap",
            "ep_overlap='microbatch': overlaps the alltoall dispatcher's exchanges, not flex's",
        ),
        (
            {},
            {"ep": 2, "pp": 2, "ep_overlap": "microbatch"},
            "ep_overlap",
            "ep_overlap='microbatch': overlaps a pipeline's micro-batches in DualPipeV's paired forward-backward "
            "actions, which 1F1B has none of: set pp_schedule DualPipeV, or ep_overlap chunked",
        ),
        (
            {"num_layers": 4},
            {"ep": 2, "pp": 2, "ep_overlap": "microbatch", "pp_schedule": "DualPipeV", "delay_wgrad_compute": True},
            "delay_wgrad_compute",
            "delay_wgrad_compute=True: DualPipeV already computes weight gradients apart from input gradients",
        ),
    ],
)
def test_layouts_a_model_cannot_take_name_the_field(changes: dict, parallel: dict, field: str, message: str) -> None:
    config: ModelConfig = dataclasses.replace(preset("tiny-qwen3-moe"), **changes)
    with pytest.raises(LayoutError) as err:
        _check(config, **parallel)
    assert str(err.value).startswith(message), str(err.value)
    assert err.value.field == field


@pytest.mark.parametrize(
    ("sizes", "unsharded"), [({"ep": 2}, "experts (edp)"), ({"tp": 2, "etp": 1}, "dense parameters (dp x cp)")]
)
def test_fsdp_mixed_precision_needs_fsdp_on_both_sides(sizes: dict, unsharded: str) -> None:
    model, cfg = _meta_model(preset("tiny-qwen3-moe")), ParallelConfig(**sizes, mixed_precision_param="bfloat16")
    with pytest.raises(LayoutError) as err:
        check_plan(model, model.parallel_plan(), cfg, cfg.layout(2))
    assert err.value.field == "mixed_precision_param"
    assert str(err.value) == (
        f"mixed_precision_param='bf16': applies to FSDP-sharded parameters and this layout shards no {unsharded}; "
        "keep it fp32 and compute in bf16 with autocast instead"
    )
    fp32 = ParallelConfig(**sizes)
    check_plan(model, model.parallel_plan(), fp32, fp32.layout(2))


def test_tensor_parallel_checks_the_dense_width_only_with_dense_layers() -> None:
    moe_only = dataclasses.replace(preset("tiny-qwen3-moe"), ffn_hidden_size=255)  # every layer is MoE
    _check(moe_only, tp=2)
    with_dense = dataclasses.replace(moe_only, moe_layer_freq=[0, 1])
    with pytest.raises(LayoutError, match=re.escape("tp=2: the model's ffn_hidden_size=255 is not divisible by it")):
        _check(with_dense, tp=2)


def test_dtype_names_take_torch_spellings_as_aliases() -> None:
    # moe-train's sections take the same names: short, torch's accepted and written back short
    config = ParallelConfig(mixed_precision_param="bfloat16", mixed_precision_reduce="float32")
    assert (config.mixed_precision_param, config.mixed_precision_reduce) == ("bf16", "fp32")
    assert ParallelConfig(mixed_precision_param="bf16") == config


def test_parallel_config_names_bad_choices() -> None:
    for kwargs, field, message in [
        ({"moe_token_dispatcher_type": "deepep"}, "moe_token_dispatcher_type", "'deepep': choose one of alltoall"),
        ({"backend": "glo"}, "backend", "'glo': choose one of auto, gloo, nccl"),
        ({"mixed_precision_param": "fp16"}, "mixed_precision_param", "'fp16': choose one of fp32, bf16"),
        ({"mixed_precision_reduce": "fp8"}, "mixed_precision_reduce", "'fp8': choose one of fp32, bf16"),
    ]:
        with pytest.raises(LayoutError) as err:
            ParallelConfig(**kwargs)
        assert err.value.field == field and str(err.value).startswith(f"{field}={message}"), str(err.value)


# ----------------------------------------------------------------------------- a model's own parallel plan


def test_check_plan_reads_the_sizes_where_the_plan_says() -> None:
    model = ToyMoE()
    cfg = ParallelConfig(ep=2)
    check_plan(model, PLAN, cfg, cfg.layout(4))
    (block,) = moe_blocks(model, PLAN)
    assert block.router is model.moe.gate and block.experts is model.moe.bank
    assert block.dispatcher is model.moe.token_mover
    # the toy's 4 experts (under .bank) and dense FFN width 32 (declared in tp_divides) set the limits
    with pytest.raises(LayoutError, match=re.escape(f"ep=3: the model's {EXPERTS} experts per MoE layer")):
        check_plan(model, PLAN, ParallelConfig(ep=3), ParallelConfig(ep=3).layout(6))
    with pytest.raises(LayoutError, match=re.escape("tp=3: the model's FFN=32 is not divisible by it")):
        check_plan(model, PLAN, ParallelConfig(tp=3, etp=1), ParallelConfig(tp=3, etp=1).layout(3))


@pytest.mark.parametrize(
    ("block", "message"),
    [
        (MoEBlockPlan("mo", router="gate", dispatcher="token_mover", experts="bank"), "names module 'mo'"),
        # the defaults (router, experts) are not the toy's names
        (MoEBlockPlan("moe"), "MoE block 'moe' needs a TopKRouter at .router and GroupedExperts at .experts"),
        (MoEBlockPlan("moe", router="gate", experts="ffn"), "needs a TopKRouter at .gate and GroupedExperts at .ffn"),
        (MoEBlockPlan("moe", router="bank", experts="gate"), "needs a TopKRouter at .bank and GroupedExperts at .gate"),
    ],
)
def test_a_plan_naming_what_the_model_lacks_is_a_clear_error(block: MoEBlockPlan, message: str) -> None:
    plan = dataclasses.replace(PLAN, moe_blocks=(block,))
    cfg = ParallelConfig(ep=2)
    with pytest.raises(ValueError, match=re.escape(message)):
        check_plan(ToyMoE(), plan, cfg, cfg.layout(2))


def test_materialize_refuses_a_tie_to_a_missing_module() -> None:
    with torch.device("meta"):
        model = ToyMoE()
    plan = dataclasses.replace(PLAN, tied_parameters=(("tok.weight", "head.weight"),))
    with pytest.raises(ValueError, match=re.escape("the parallel plan names module 'head'")):
        materialize(model, plan, None, "cpu")
