"""Data parallel over 2 gloo processes equals one process on the same global batch, balancing losses included: the
default micro-batch size does not depend on the layout; so do two nodes meeting at a c10d rendezvous. ``moe-train
launch`` exits as one process does."""

import json
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from moe_models import build_model
from moe_train.checkpoint import load_checkpoint
from moe_train.config import load_config
from moe_train.trainer import prepare

pytestmark = pytest.mark.dist

# the tiny preset's balancing loss on (0.01): the default micro-batches (4 sequences) are the same under every layout
COMMON = ["train", "--train.steps", "5", "--model.num_layers", "1", "--run.log_interval", "1"]


def _losses(out: Path, key: str = "loss") -> list[float]:
    return [json.loads(line)[key] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory, data_cache: Path, run) -> Path:
    """The one-process run both launches below are compared with, at the default micro-batch size (the README's
    promise: the default run gives the same numbers under every layout; at the old default, global batch over the
    data-parallel size, dp_shard=2 differed from one process by up to 0.9% in aux loss)."""
    out = tmp_path_factory.mktemp("one-process")
    single = run(["moe-train", *COMMON, "--data.cache_dir", str(data_cache), "--run.output_dir", str(out)], cwd=out)
    assert single.returncode == 0, single.stderr[-2000:]
    return out


def test_two_rank_data_parallel_matches_single_process(tmp_path: Path, data_cache: Path, run, one_process) -> None:
    """The torchrun CLI path through ``moe-train launch``, balancing loss on at the default micro-batch size, so that
    every step's loss, balancing loss and gradient norm must match."""
    args = [*COMMON, "--data.cache_dir", str(data_cache)]
    launch = ["moe-train", "launch", "--nproc-per-node", "2"]
    dp = run([*launch, *args, "--run.output_dir", str(tmp_path / "two")], cwd=tmp_path)
    assert dp.returncode == 0, dp.stderr[-2000:]
    assert "2 rank(s)" in dp.stdout and "(micro 4, accumulation 2)" in dp.stdout
    one, two = _losses(one_process), _losses(tmp_path / "two")
    assert len(one) == len(two) == 5
    # same weights, same global batch: the first loss differs only by summation order
    assert two[0] == pytest.approx(one[0], rel=1e-6)
    # the gradient all-reduce makes later steps equal too, balancing losses computed over the same micro-batches
    assert two == pytest.approx(one, rel=1e-5)
    for key in ("aux_loss", "grad_norm"):
        assert _losses(tmp_path / "two", key) == pytest.approx(_losses(one_process, key), rel=1e-4), key
    assert (tmp_path / "two" / "checkpoints" / "step_5" / ".metadata").is_file()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_nodes_through_a_c10d_rendezvous_match_one_process(
    tmp_path: Path, data_cache: Path, run, one_process
) -> None:
    """The README's launch on several machines, on one: two torchrun agents (``--nnodes 2``, one process each) meet
    at a c10d rendezvous on localhost, as nodes meet at the first node's address, and train as one process does."""
    out = tmp_path / "two-nodes"
    rendezvous = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--rdzv-id", "two-nodes"]
    node = ["moe-train", "launch", "--nnodes", "2", "--nproc-per-node", "1", *rendezvous]
    node += [*COMMON, "--data.cache_dir", str(data_cache), "--run.output_dir", str(out)]
    with ThreadPoolExecutor(2) as pool:  # the two agents at once: each waits in the rendezvous for the other
        nodes = list(pool.map(lambda _: run(node, cwd=tmp_path), range(2)))
    for agent in nodes:
        assert agent.returncode == 0, agent.stderr[-2000:]
    assert sum("2 rank(s)" in agent.stdout for agent in nodes) == 1  # the node holding rank 0 reports
    for key in ("loss", "aux_loss", "grad_norm"):
        assert _losses(out, key) == pytest.approx(_losses(one_process, key), rel=1e-4), key


def _no_traceback_names_moe_train(stderr: str) -> bool:
    return "moe_train" not in "".join(line for line in stderr.splitlines() if line.lstrip().startswith("File "))


def test_launch_exits_as_one_process_does(tmp_path: Path, data_cache: Path, run) -> None:
    """``moe-train launch``: a config error is found once, before any worker starts: one line, exit 2, nothing
    written (plain torchrun: each rank's line, exit 1 and torchrun's ChildFailedError traceback). A run that diverges
    on every rank exits 3 with one line, as one process does."""
    launch = ["moe-train", "launch", "--nproc-per-node", "2"]
    args = [*COMMON, "--data.cache_dir", str(data_cache)]
    bad = run([*launch, *args, "--parallel.dp_shard", "4", "--run.output_dir", str(tmp_path / "bad")], cwd=tmp_path)
    assert bad.returncode == 2, bad.stderr[-2000:]
    assert bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr, bad.stderr
    assert (
        "parallel.dp_shard=4: tp(1) x cp(1) x dp_replicate(1) x dp_shard(4) x pp(1) = 4 != world_size 2" in bad.stderr
    )
    assert not (tmp_path / "bad").exists()

    diverging = ["--train.lr", "1e30", "--train.warmup_steps", "0", "--train.clip_grad", "0"]
    out = tmp_path / "diverged"
    diverged = run([*launch, *args, *diverging, "--run.output_dir", str(out)], cwd=tmp_path)
    assert diverged.returncode == 3, diverged.stderr[-2000:]
    assert diverged.stderr.count("\n") == 1 and "is not finite" in diverged.stderr, diverged.stderr
    assert json.loads((out / "summary.json").read_text())["status"] == "diverged"


def test_torchrun_cli_drives_tensor_and_expert_parallel(tmp_path: Path, data_cache: Path, run, one_process) -> None:
    """The flags alone, through torchrun: tp=2 with sequence parallel, the experts split over the same 2 ranks
    (ep borrowing the tp ranks), all-gather dispatch. One data-parallel replica reads the whole batch, as one
    process does, so every step's loss is the single process's, and so is the checkpoint: DCP stores the global
    tensors, which load into one process."""
    args = [*COMMON, "--data.cache_dir", str(data_cache)]
    layout = ["--parallel.tp", "2", "--parallel.ep", "2", "--parallel.etp", "1"]
    layout += ["--parallel.moe_token_dispatcher_type", "allgather"]
    launch = ["moe-train", "launch", "--nproc-per-node", "2"]
    split = run([*launch, *args, *layout, "--run.output_dir", str(tmp_path / "two")], cwd=tmp_path)
    assert split.returncode == 0, split.stderr[-2000:]
    one, two = _losses(one_process), _losses(tmp_path / "two")
    assert len(two) == 5 and two == pytest.approx(one, rel=1e-4)
    assert one[-1] < one[0]

    cfg = load_config(
        "tiny",
        {
            "model.num_layers": "1",
            "model.moe_aux_loss_coeff": "0",
            "data.cache_dir": str(data_cache),
            "run.output_dir": str(tmp_path / "unused"),  # not the preset's outputs/tiny, which a user's run may hold
        },
    )
    config = cfg.model
    initial = build_model(config, seed=cfg.train.seed)  # the weights both runs started from
    # which is what the trainer materialises from the meta-device model
    materialised = dict(prepare(cfg, 1).model[0].named_parameters())  # the one stage, under the model's names
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
