"""Quantised linears under tensor parallelism (2 gloo ranks, ``_tp_worker.py``) against the unsplit model.

Per-tensor recipes reduce their amaxes over the tp group, so the split model computes what the unsplit one does
(the failure torchtitan 3109 reports is an amax reduced over the wrong group); block recipes scale local blocks, so
the split model stays within the recipe's error of the unsplit one, and finite.
"""

from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("_tp_worker.py")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, launch_gloo_workers):
    return launch_gloo_workers(WORKER, 2, tmp_path_factory.mktemp("tp2"))


@pytest.mark.dist
@pytest.mark.parametrize("recipe", ["fp8_tensorwise", "fp8_delayed"])
def test_per_tensor_recipes_split_compute_the_unsplit_model(ranks, recipe):
    for rank in ranks:
        for step, rows in enumerate(rank[recipe]):
            torch.testing.assert_close(rows["split"]["y"], rows["single"]["y"], rtol=1e-5, atol=1e-5, msg=f"{step}")
            for got, ref in zip(rows["split"]["grads"], rows["single"]["grads"], strict=True):
                torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4, msg=f"step {step}")


@pytest.mark.dist
@pytest.mark.parametrize("recipe", ["fp8_blockwise", "mxfp8", "nvfp4"])
def test_block_recipes_split_stay_finite_and_close(ranks, recipe):
    bound = 0.3 if recipe == "nvfp4" else 0.08
    for rank in ranks:
        for rows in rank[recipe]:
            y, ref = rows["split"]["y"], rows["single"]["y"]
            assert torch.isfinite(y).all()
            assert ((y - ref).norm() / ref.norm()).item() < bound
            for got in rows["split"]["grads"]:
                assert torch.isfinite(got).all()


@pytest.mark.dist
def test_a_shard_scaled_by_its_own_amax_differs(ranks):
    for rank in ranks:
        r = rank["amax_group"]
        torch.testing.assert_close(r["with_group"], r["whole"], rtol=1e-6, atol=1e-6)
    # rank 1's shard has the smaller amax: scaled alone, it rounds differently
    assert not torch.allclose(ranks[1]["amax_group"]["without_group"], ranks[1]["amax_group"]["whole"], atol=1e-4)
