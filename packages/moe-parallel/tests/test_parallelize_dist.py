"""Meshes, parameter placement and a few-experts FSDP step on 4 gloo ranks (one process group for the module)."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_parallel import ParallelConfig

pytestmark = pytest.mark.dist

WORLD = 4
WORKER = Path(__file__).with_name("_parallelize_worker.py")


@pytest.fixture(scope="module")
def ranks(launch_gloo_workers, tmp_path_factory) -> list[dict]:
    return launch_gloo_workers(WORKER, WORLD, tmp_path_factory.mktemp("parallelize"))


def test_mesh_groups_are_the_layouts(ranks) -> None:
    for rank, result in enumerate(ranks):
        for sizes, groups in result["groups"]:
            layout = ParallelConfig(**sizes).layout(WORLD)
            for key, members in groups.items():
                side, dim = key.split(".")
                expected = next(g for g in layout.group_ranks(dim, side) if rank in g)
                assert members == expected, (sizes, key, rank)


def test_experts_are_sharded_over_edp_only(ranks) -> None:
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


def test_fewer_experts_than_shards_train_as_one_process(ranks) -> None:
    kind, mesh, placement, _ = ranks[0]["few_experts_placement"]
    assert kind == "dtensor" and mesh == ("edp",) and placement == ("Shard(dim=1)",)
    for result in ranks:
        assert result["loss"] == pytest.approx(result["ref_loss"], rel=1e-6)
        assert result["norm"] == pytest.approx(result["ref_norm"], rel=1e-5)
