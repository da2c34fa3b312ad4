"""init_distributed / all_reduce_mean: one process, and 2 gloo ranks on CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from moe_parallel import DistributedContext, all_reduce_mean, init_distributed

WORLD = 2
WORKER = Path(__file__).with_name("_dist_worker.py")
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


# ----------------------------------------------------------------------------- one process


@pytest.fixture
def no_torchrun_env(monkeypatch):
    for var in TORCHRUN_VARS:
        monkeypatch.delenv(var, raising=False)


def test_init_without_torchrun_is_a_single_rank(no_torchrun_env):
    ctx = init_distributed("gloo", "cpu")
    assert ctx == DistributedContext(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    assert ctx.is_main
    assert not dist.is_initialized()


def test_auto_device_follows_cuda_availability(no_torchrun_env):
    expected = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    assert init_distributed().device == expected


def test_is_main_only_on_rank_zero():
    assert not DistributedContext(1, 1, 2, torch.device("cpu")).is_main


def test_all_reduce_mean_without_group_is_a_detached_copy():
    value = torch.tensor([1.0, -2.0, 3.5], requires_grad=True)
    out = all_reduce_mean(value)
    assert torch.equal(out, value.detach())
    assert out.data_ptr() != value.data_ptr()
    assert not out.requires_grad
    out += 1
    assert torch.equal(value.detach(), torch.tensor([1.0, -2.0, 3.5]))


# ----------------------------------------------------------------------------- 2 gloo ranks


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory, launch_gloo_workers) -> list[dict]:
    """Start the WORLD ranks once, as torchrun would, and load what each one recorded."""
    return launch_gloo_workers(WORKER, WORLD, tmp_path_factory.mktemp("gloo"))


@pytest.mark.dist
def test_gloo_context_from_torchrun_env(gloo_results):
    for rank, res in enumerate(gloo_results):
        assert res["ctx"] == (rank, rank, WORLD, "cpu", rank == 0)
        assert res["initialized"]
        assert res["backend"] == "gloo"
        assert res["dist_world"] == WORLD
        assert res["initialized_after_shutdown"] is False


@pytest.mark.dist
def test_gloo_all_reduce_mean_equals_hand_mean(gloo_results):
    hand_mean = sum(res["value"] for res in gloo_results) / WORLD
    assert torch.equal(hand_mean, torch.tensor([1.5, 15.0, -1.5]))
    for res in gloo_results:
        torch.testing.assert_close(res["reduced"], hand_mean, rtol=0, atol=1e-7)
        assert res["input_untouched"]
