"""On 4 gloo ranks (one process group for the module): meshes, parameter placement, and one training step under
several layouts against the same model in one process: a few-experts FSDP step, a model declaring its own parallel
plan, the experts' gradient scale with ep and dp > 1, recompute applied before FSDP, context-parallel attention, and
Qwen3-Next's Gated DeltaNet layers split over tp.
Also: a meta build materialised equals an eager build, tensor for tensor."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moe_models.presets import preset
from moe_parallel import ParallelConfig

pytestmark = pytest.mark.dist

WORLD = 4
WORKER = Path(__file__).with_name("_parallelize_worker.py")


@pytest.fixture(scope="module")
def outcomes(launch_gloo_scenarios, tmp_path_factory):
    """Each rank's record per section of the worker (a scenario each): ``outcomes[name]`` is the ranks' dicts."""
    return launch_gloo_scenarios(WORKER, WORLD, tmp_path_factory.mktemp("parallelize"))


def test_mesh_groups_are_the_layouts(outcomes) -> None:
    ranks = outcomes["groups"]
    for rank, result in enumerate(ranks):
        for sizes, groups in result["groups"]:
            layout = ParallelConfig(**sizes).layout(WORLD)
            for key, members in groups.items():
                side, dim = key.split(".")
                expected = next(g for g in layout.group_ranks(dim, side) if rank in g)
                assert members == expected, (sizes, key, rank)


def test_parallel_timeout_reaches_every_group(outcomes) -> None:
    """parallel.timeout_minutes (3.5 here) on the default group and on every group of the meshes (Megatron-Core #2238:
    the expert-parallel group ignored the user's timeout)."""
    for result in outcomes["timeouts"]:
        before, after = result["world"]
        assert before != 210.0 and after == 210.0
        for sizes, timeouts in result["layouts"].items():
            assert len(timeouts) >= 3 and set(timeouts) == {210.0}, (sizes, timeouts)


def test_experts_are_sharded_over_edp_only(outcomes) -> None:
    ranks = outcomes["placements"]
    placements = ranks[0]["placements"]
    # ep=2 on 4 ranks: the experts are a DTensor split over ep (a rank's 4 experts), then by FSDP over their 2 edp
    # copies, and over nothing else; its shape is the global one, as a checkpoint stores it
    kind, mesh, split, shape = placements["ep=2 (edp=2)"]["layers.0.mlp.experts.w_gate_up_EH2F"]
    assert kind == "dtensor" and mesh == ("edp", "ep") and shape == (8, 128, 256), split
    assert placements["ep=2 (edp=2)"]["layers.0.attention.q_proj.weight"][1] == ("dp_shard",)
    # ep=4: each rank's 2 experts are its own, so FSDP leaves them alone while it shards the rest over 4 ranks
    kind, mesh, split, shape = placements["ep=4 (edp=1)"]["layers.0.mlp.experts.w_gate_up_EH2F"]
    assert (kind, mesh, split, shape) == ("dtensor", ("ep",), ("Shard(dim=0)",), (8, 128, 256))
    assert placements["ep=4 (edp=1)"]["layers.0.mlp.router.weight"][1] == ("dp_shard",)
    # tp=2 x ep=2 x dp_shard=2: attention 2-D (FSDP over TP), experts over edp and ep
    assert placements["tp=2 x ep=2"]["layers.0.attention.q_proj.weight"][1] == ("dp_shard", "tp")
    assert placements["tp=2 x ep=2"]["layers.0.mlp.experts.w_down_EFH"][1] == ("edp", "ep")


def test_etp_slices_are_the_hidden_matrix_splits(outcomes) -> None:
    """The experts' etp slices, plain tensors no placement describes, are what hidden_matrix_splits names: the first
    projection's columns and the second's rows of every MoE layer, over the rank's etp group; nothing without etp."""
    for rank, result in enumerate(outcomes["placements"]):
        hidden = result["hidden"]
        assert hidden["ep=2 (edp=2)"] == hidden["tp=2 x ep=2"] == {}, rank
        layers = range(preset("tiny-qwen3-moe").num_layers)
        want = {f"layers.{i}.mlp.experts.{w}": d for i in layers for w, d in (("w_gate_up_EH2F", 2), ("w_down_EFH", 1))}
        assert {name: dim for name, (dim, _) in hidden["etp=2 x ep=2"].items()} == want, rank
        groups = {tuple(ranks) for _, ranks in hidden["etp=2 x ep=2"].values()}
        assert len(groups) == 1 and rank in next(iter(groups)) and len(next(iter(groups))) == 2, groups
        kind, *_ = result["placements"]["etp=2 x ep=2"]["layers.0.mlp.experts.w_gate_up_EH2F"]
        assert kind != "dtensor"  # a plain tensor: its placements could not have said it is split


def test_fewer_experts_than_shards_train_as_one_process(outcomes) -> None:
    ranks = outcomes["few experts"]
    kind, mesh, placement, _ = ranks[0]["few_experts_placement"]
    assert kind == "dtensor" and mesh == ("edp",) and placement == ("Shard(dim=1)",)
    for result in ranks:
        assert result["loss"] == pytest.approx(result["ref_loss"], rel=1e-6)
        assert result["norm"] == pytest.approx(result["ref_norm"], rel=1e-5)


def _assert_grads_match(grads: dict, where: str) -> None:
    for name, (got, want) in grads.items():
        assert got is not None, f"{where}: {name} has no gradient"
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{where}: {n}: {m}")


PROTOCOL_LAYOUTS = ("ep=2", "tp=2 x ep=2 (etp=1)", "tp=2 x ep=2 (etp=2)")


@pytest.mark.parametrize("layout", PROTOCOL_LAYOUTS)
def test_a_model_with_its_own_plan_trains_as_one_process(outcomes, layout: str) -> None:
    """_toy_plan_model.py: not moe_models', its MoE parts under other names than the plan's defaults."""
    ranks = outcomes["protocol"]
    for rank, result in enumerate(ranks):
        case = result["protocol"][layout]
        # the plan's attribute names are the ones parallelize swapped; nothing appeared under the default names
        assert case["dispatcher"] == "AllToAllDispatcher" and case["local_experts"] == 2
        assert case["default_names"] == []
        assert case["loss"] == pytest.approx(case["ref_loss"], rel=1e-6), (layout, rank)
        assert case["norm"] == pytest.approx(case["ref_norm"], rel=1e-5), (layout, rank)
        _assert_grads_match(case["grads"], f"{layout}, rank {rank}")
    # each data-parallel replica read its own slice of the batch (rank 1 is dp 1 under ep=2, dp 0 under tp=2)
    losses = [r["protocol"][layout]["loss"] for r in ranks]
    assert (losses[0] != losses[1]) == (layout == "ep=2") and losses[0] != losses[2]


def test_context_parallel_attention_equals_one_process(outcomes) -> None:
    ranks = outcomes["context_parallel"]
    for rank, result in enumerate(ranks):
        for case, diffs in result["context_parallel"].items():
            assert all(d < 1e-5 for d in diffs.values()), (case, rank, diffs)


@pytest.mark.parametrize("case", ["rows", "packed documents", "cp=2", "cp=2 x tp=2"])
def test_gated_deltanet_layers_split_over_tp_or_cp_train_as_one_process(outcomes, case: str) -> None:
    ranks = outcomes["linear_attention"]
    for rank, result in enumerate(ranks):
        got = result["linear_attention"][case]
        placements = got["placements"]
        for name in ("in_proj.weight", "conv1d.weight", "A_log", "dt_bias", "out_proj.weight"):
            kind, mesh, split, _ = placements[f"layers.0.attention.{name}"]
            fsdp = "dp_shard_cp" if "cp" in case else "dp_shard"  # FSDP over dp_shard x cp
            if "tp" in case or "cp" not in case:  # heads split over tp, then FSDP over the rest
                dim = 1 if name == "out_proj.weight" else 0
                assert (kind, mesh, split[-1]) == ("dtensor", (fsdp, "tp"), f"Shard(dim={dim})"), (name, split)
            else:  # the heads whole
                assert (kind, mesh) == ("dtensor", (fsdp,)), (name, mesh)
        assert placements["layers.0.attention.norm.weight"][1] == (fsdp,)  # whole over tp
        assert got["loss"] == pytest.approx(got["ref_loss"], rel=1e-6), (case, rank)
        if "cp" not in case:
            assert got["ref_loss"] == pytest.approx(got["ref_replica_loss"], rel=1e-6)
        assert got["norm"] == pytest.approx(got["ref_norm"], rel=1e-5), (case, rank)
        # the decay's parameters sum many cancelling terms: their fp32 gradients move by ~1e-5..1e-3 relative with the
        # summation order alone (moe-models' test_linear_attention.py), so they are compared as a whole
        decay = {n: g for n, g in got["grads"].items() if n.endswith((".A_log", ".dt_bias"))}
        _assert_grads_match({n: g for n, g in got["grads"].items() if n not in decay}, f"{case}, rank {rank}")
        for name, (grad, want) in decay.items():
            assert (grad - want).norm() <= 1e-3 * want.norm(), (case, rank, name)


def test_a_plan_naming_a_missing_parameter_or_unit_is_a_clear_error(outcomes) -> None:
    ranks = outcomes["bad_plans"]
    bad = ranks[0]["bad_plans"]
    assert bad["tp_partial_grads"] == (
        "ValueError",
        "the parallel plan names parameter 'moe.gate.wieght', which the model does not have",
    )
    assert bad["fsdp_units"] == ("ValueError", "the parallel plan names module 'mo', which the model does not have")


def test_a_plan_naming_a_missing_tensor_parallel_module_is_a_clear_error(outcomes) -> None:
    ranks = outcomes["bad_plans"]
    # torch's parallelize_module alone would only warn and leave the module unsplit: check_plan refuses it first
    kind, message = ranks[0]["bad_plans"]["tensor_parallel"]
    assert (kind, message) == ("ValueError", "the parallel plan names module 'ffn.w1', which the model does not have")


def test_meta_build_materialised_equals_the_eager_build(outcomes) -> None:
    ranks = outcomes["meta"]
    for rank, result in enumerate(ranks):
        for layout, case in result["meta"].items():
            got, want = case["names"]
            assert got == want, (layout, rank)
            assert case["differ"] == [], (layout, rank)
            assert case["on_meta"] == [], (layout, rank)
            assert case["tied"] == (("tied" in layout),) * 2, (layout, rank)
            # one step of each: the same gradients, and the same global norm of them
            assert case["grads_differ"] == [], (layout, rank)
            assert case["norms"][1] == case["norms"][0] > 0, (layout, rank)


def test_expert_gradients_are_scaled_by_edp_over_dp(outcomes) -> None:
    """ep=2 x dp_shard=4: each expert has edp=2 copies, reached by the tokens of all 4 replicas."""
    ranks = outcomes["expert_scale"]
    for rank, result in enumerate(ranks):
        case = result["expert_scale"]
        assert case["sizes"] == (2, 4, 2)  # (ep, dp, edp): expert_scale = 1/2, not 1
        assert case["loss"] == pytest.approx(case["ref_loss"], rel=1e-6)
        assert case["norm"] == pytest.approx(case["ref_norm"], rel=1e-5), rank
        assert len(case["expert_grads"]) == 4  # 2 MoE layers x 2 weights
        for name, (got, want) in case["expert_grads"].items():
            assert got.shape[0] == 8  # the global experts, gathered from ep and edp
            for expert in range(8):
                torch.testing.assert_close(
                    got[expert], want[expert], rtol=1e-5, atol=1e-7, msg=lambda m, n=name, e=expert: f"{n}[{e}]: {m}"
                )
    assert len({r["expert_scale"]["loss"] for r in ranks}) == 4  # the 4 replicas read different slices


@pytest.mark.parametrize("layout", ["ep=2", "tp=2 x ep=2 (etp=1)"])
def test_recompute_applied_before_fsdp_reruns_the_experts_that_run(outcomes, layout: str) -> None:
    ranks = outcomes["recompute"]
    for result in ranks:
        case = result["recompute"][layout]
        assert case["wrapped"] == ["layers.0.mlp.experts", "layers.1.mlp.experts"]
        # once per MoE layer in the forward, and once more in the backward when recomputed
        assert case["calls"] == (case["moe_layers"], 2 * case["moe_layers"]) == (2, 4)
        assert case["differ"] == []


def test_each_rank_materialises_only_its_shard(outcomes) -> None:
    """64 experts at ep=4 and tp=2 x ep=2 (4 ranks): a rank never holds more than 1.1x its expert shard plus the
    whole non-expert parameters at any moment; building the whole model first (the old way) does, by far."""
    ranks = outcomes["bytes"]
    for rank, result in enumerate(ranks):
        for layout, (meta_peak, whole_first_peak, bound) in result["bytes"].items():
            assert meta_peak <= 1.1 * bound, (layout, rank, meta_peak / bound)
            assert whole_first_peak > 2 * bound, (layout, rank, whole_first_peak / bound)  # the counter sees it all


def test_ranks_read_only_their_experts_and_slices_of_a_checkpoint(outcomes) -> None:
    """tp=2 x ep=2 over 4 ranks from a HuggingFace checkpoint: every local shard equals the whole checkpoint loaded
    and split; a rank reads only the experts of its FSDP shard of its expert-parallel share, and q_proj (stored as it
    is) only as its box of rows."""
    ranks = outcomes["checkpoint"]
    for rank, result in enumerate(ranks):
        case = result["checkpoint"]
        assert case["differ"] == [], rank
        first, count = case["first_expert"], case["local_experts"]
        # ep=2 gives each rank 4 of the 8 experts; FSDP over edp=2 keeps 2 of those on each rank: the ones read
        assert set(case["experts_read"]) <= set(range(first, first + count)), rank
        assert len(case["experts_read"]) == count // 2, (rank, case["experts_read"])
        assert not case["q_proj_whole_read"], rank
        (row_start, row_stop), (col_start, col_stop) = case["q_proj_box"]
        rows, cols = case["q_proj_shape"]
        # tensor parallel halves the rows, FSDP over dp_shard=2 halves them again; columns stay whole
        assert (row_stop - row_start, col_start, col_stop) == (rows // 4, 0, cols), (rank, case["q_proj_box"])


def test_flex_dispatcher_shares_one_deepep_buffer_over_the_layers(outcomes) -> None:
    """DeepEP expects one buffer per process group: every MoE layer's dispatcher holds the same one."""
    ranks = outcomes["flex"]
    for result in ranks:
        flex = result["flex"]
        assert flex["dispatcher"] == "FlexDispatcher"
        assert flex["buffers_made"] == 1
        assert flex["layers_sharing"] == (2, 1)
        assert flex["loss"] == pytest.approx(flex["ref_loss"], rel=1e-2)  # bf16 on the wire
