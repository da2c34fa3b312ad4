"""Data parallel over 2 gloo processes equals one process on the same global batch."""

import json
from pathlib import Path

import pytest
import torch

from moe_models import build_model
from moe_train.checkpoint import load_checkpoint
from moe_train.config import load_config

pytestmark = pytest.mark.dist

COMMON = ["train", "--train.steps", "5", "--model.num_layers", "1", "--run.log_interval", "1"]


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("aux_loss_coeff", ["0.01", "0"])
def test_two_rank_data_parallel_matches_single_process(
    tmp_path: Path, data_cache: Path, run, aux_loss_coeff: str
) -> None:
    args = [*COMMON, "--data.cache_dir", str(data_cache), "--model.moe_aux_loss_coeff", aux_loss_coeff]
    single = run(["moe-train", *args, "--run.output_dir", str(tmp_path / "one")], cwd=tmp_path)
    assert single.returncode == 0, single.stderr[-2000:]
    launch = ["torchrun", "--standalone", "--nproc-per-node", "2", "-m", "moe_train"]
    dp = run([*launch, *args, "--run.output_dir", str(tmp_path / "two")], cwd=tmp_path)
    assert dp.returncode == 0, dp.stderr[-2000:]
    assert "2 rank(s)" in dp.stdout and "micro 8" in dp.stdout
    one, two = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert len(one) == len(two) == 5
    # same weights, same global batch: the first loss differs only by summation order
    assert two[0] == pytest.approx(one[0], rel=1e-6)
    if aux_loss_coeff == "0":
        # the gradient all-reduce makes later steps equal too. With the (micro-batch local) aux loss
        # on, each rank balances its own half batch, so later steps legitimately differ.
        assert two == pytest.approx(one, rel=1e-5)
    assert (tmp_path / "two" / "checkpoints" / "step_5" / ".metadata").is_file()


def test_layout_that_does_not_fit_the_world_fails_on_every_rank(tmp_path: Path, run) -> None:
    launch = ["torchrun", "--nproc-per-node", "2", "--standalone", "-m", "moe_train"]
    bad = run([*launch, *COMMON, "--parallel.dp_shard", "4", "--run.output_dir", str(tmp_path / "bad")], cwd=tmp_path)
    assert bad.returncode != 0
    # each rank prints the one-line error; torchrun then reports the failed children in its own words
    assert bad.stderr.count("moe-train: error: tp(1) x cp(1) x dp_replicate(1) x dp_shard(4)") == 2
    assert "moe_train" not in "".join(line for line in bad.stderr.splitlines() if line.lstrip().startswith("File "))
    assert not (tmp_path / "bad").exists()


def test_torchrun_cli_drives_tensor_and_expert_parallel(tmp_path: Path, data_cache: Path, run) -> None:
    """The flags alone, through torchrun: tp=2 with sequence parallel, the experts split over the same 2 ranks
    (ep borrowing the tp ranks), all-gather dispatch. One data-parallel replica reads the whole batch, as one
    process does, so every step's loss is the single process's, and so is the checkpoint: DCP stores the global
    tensors, which load into one process."""
    args = [*COMMON, "--data.cache_dir", str(data_cache)]
    single = run(["moe-train", *args, "--run.output_dir", str(tmp_path / "one")], cwd=tmp_path)
    assert single.returncode == 0, single.stderr[-2000:]
    layout = ["--parallel.tp", "2", "--parallel.ep", "2", "--parallel.etp", "1"]
    layout += ["--parallel.moe_token_dispatcher_type", "allgather"]
    launch = ["torchrun", "--standalone", "--nproc-per-node", "2", "-m", "moe_train"]
    split = run([*launch, *args, *layout, "--run.output_dir", str(tmp_path / "two")], cwd=tmp_path)
    assert split.returncode == 0, split.stderr[-2000:]
    one, two = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert len(two) == 5 and two == pytest.approx(one, rel=1e-4)
    assert one[-1] < one[0]

    cfg = load_config("tiny", {"model.num_layers": "1"})
    config = cfg.model
    torch.manual_seed(cfg.train.seed)
    initial = build_model(config)  # the weights both runs started from
    models = {}
    for name in ("one", "two"):
        models[name] = build_model(config)
        assert load_checkpoint(tmp_path / name / "checkpoints" / "step_5", models[name]) == 5
    trained = dict(models["one"].named_parameters())
    for key, value in models["two"].named_parameters():
        torch.testing.assert_close(value, trained[key], rtol=1e-3, atol=1e-5, msg=key)
    # the checkpoints hold trained experts, not the initial ones
    assert not torch.allclose(trained["layers.0.mlp.experts.w_down_EFH"], initial.layers[0].mlp.experts.w_down_EFH)
