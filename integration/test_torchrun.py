"""Data parallel over 2 gloo processes equals one process on the same global batch."""

import json
from pathlib import Path

import pytest
import torch

from moe_models import build_model
from moe_train.checkpoint import load_checkpoint
from moe_train.config import load_config
from moe_train.trainer import prepare

pytestmark = pytest.mark.dist

COMMON = ["train", "--train.steps", "5", "--model.num_layers", "1", "--run.log_interval", "1"]
COMMON += ["--model.moe_aux_loss_coeff", "0"]


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory, data_cache: Path, run) -> Path:
    """The one-process run both launches below are compared with (balancing loss off: with it on, each data-parallel
    rank balances its own half batch; integration/test_parallel_equivalence.py holds the layouts to one process
    with the same micro-batches, balancing loss on, at every step)."""
    out = tmp_path_factory.mktemp("one-process")
    single = run(["moe-train", *COMMON, "--data.cache_dir", str(data_cache), "--run.output_dir", str(out)], cwd=out)
    assert single.returncode == 0, single.stderr[-2000:]
    return out


def test_two_rank_data_parallel_matches_single_process(tmp_path: Path, data_cache: Path, run, one_process) -> None:
    """The torchrun CLI path, balancing loss off (COMMON), so that every step must match."""
    args = [*COMMON, "--data.cache_dir", str(data_cache)]
    launch = ["torchrun", "--standalone", "--nproc-per-node", "2", "-m", "moe_train"]
    dp = run([*launch, *args, "--run.output_dir", str(tmp_path / "two")], cwd=tmp_path)
    assert dp.returncode == 0, dp.stderr[-2000:]
    assert "2 rank(s)" in dp.stdout and "micro 8" in dp.stdout
    one, two = _losses(one_process), _losses(tmp_path / "two")
    assert len(one) == len(two) == 5
    # same weights, same global batch: the first loss differs only by summation order
    assert two[0] == pytest.approx(one[0], rel=1e-6)
    # the gradient all-reduce makes later steps equal too
    assert two == pytest.approx(one, rel=1e-5)
    assert (tmp_path / "two" / "checkpoints" / "step_5" / ".metadata").is_file()


def _no_traceback_names_moe_train(stderr: str) -> bool:
    return "moe_train" not in "".join(line for line in stderr.splitlines() if line.lstrip().startswith("File "))


def _layout_error(line: str) -> bool:
    """The one-line error for --parallel.dp_shard 4 on 2 ranks; its stable part."""
    return line.startswith("moe-train: error: ") and "dp_shard(4)" in line and "= 4 != world_size 2" in line


def test_layout_that_does_not_fit_the_world_fails_on_every_rank(tmp_path: Path, run) -> None:
    """The error comes before any process group is joined, so each rank finishes alone: the launch fails, each rank
    reporting the one-line error at most once (the first rank to exit can get the other killed before it prints),
    with no traceback through moe_train. (Exit code 2 and the single line per process: moe-train's
    test_cli.py.)"""
    args = [*COMMON, "--parallel.dp_shard", "4", "--run.output_dir", str(tmp_path / "bad")]
    launch = ["torchrun", "--nproc-per-node", "2", "--standalone", "-m", "moe_train"]
    bad = run([*launch, *args], cwd=tmp_path)
    assert bad.returncode != 0
    assert 1 <= sum(map(_layout_error, bad.stderr.splitlines())) <= 2, bad.stderr[-2000:]
    assert _no_traceback_names_moe_train(bad.stderr), bad.stderr[-2000:]
    assert not (tmp_path / "bad").exists()


def test_torchrun_cli_drives_tensor_and_expert_parallel(tmp_path: Path, data_cache: Path, run, one_process) -> None:
    """The flags alone, through torchrun: tp=2 with sequence parallel, the experts split over the same 2 ranks
    (ep borrowing the tp ranks), all-gather dispatch. One data-parallel replica reads the whole batch, as one
    process does, so every step's loss is the single process's, and so is the checkpoint: DCP stores the global
    tensors, which load into one process."""
    args = [*COMMON, "--data.cache_dir", str(data_cache)]
    layout = ["--parallel.tp", "2", "--parallel.ep", "2", "--parallel.etp", "1"]
    layout += ["--parallel.moe_token_dispatcher_type", "allgather"]
    launch = ["torchrun", "--standalone", "--nproc-per-node", "2", "-m", "moe_train"]
    split = run([*launch, *args, *layout, "--run.output_dir", str(tmp_path / "two")], cwd=tmp_path)
    assert split.returncode == 0, split.stderr[-2000:]
    one, two = _losses(one_process), _losses(tmp_path / "two")
    assert len(two) == 5 and two == pytest.approx(one, rel=1e-4)
    assert one[-1] < one[0]

    cfg = load_config(
        "tiny", {"model.num_layers": "1", "model.moe_aux_loss_coeff": "0", "data.cache_dir": str(data_cache)}
    )
    config = cfg.model
    initial = build_model(config, seed=cfg.train.seed)  # the weights both runs started from
    # which is what the trainer materialises from the meta-device model
    materialised = dict(prepare(cfg, 1).model.named_parameters())
    assert materialised.keys() == dict(initial.named_parameters()).keys()
    for key, value in initial.named_parameters():
        torch.testing.assert_close(materialised[key], value, rtol=0, atol=0, msg=key)
    models = {}
    for name, out in (("one", one_process), ("two", tmp_path / "two")):
        models[name] = build_model(config)
        assert load_checkpoint(out / "checkpoints" / "step_5", models[name]) == 5
    trained = dict(models["one"].named_parameters())
    for key, value in models["two"].named_parameters():
        torch.testing.assert_close(value, trained[key], rtol=1e-3, atol=1e-5, msg=key)
    # the checkpoints hold trained experts, not the initial ones
    assert not torch.allclose(trained["layers.0.mlp.experts.w_down_EFH"], initial.layers[0].mlp.experts.w_down_EFH)
