"""Muon on split matrices (2 gloo ranks, one process group for the module): each kind of split a layout makes (FSDP2's
row shards, even and uneven; tensor parallelism's column shards; grouped experts split along the experts, which need
no gathering, or along a matrix dimension; an expert-tensor-parallel slice of a gated projection, which no placement
shows) updates the rank's piece exactly as one process's Muon updates the whole tensor, several matrices sharing the
orthogonalisation between the ranks; a control orthogonalising the shards apart differs. Then a dp_shard=2 training
run resumes from its checkpoint as it ran on (rel 1e-6). Whole layouts against one process: integration/
test_parallel_equivalence.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from moe_parallel import HiddenSplit
from moe_train.config import load_config
from moe_train.muon import MuonWithAdamW
from moe_train.setup import prepare
from moe_train.trainer import train

pytestmark = pytest.mark.dist

WORLD = 2
STEPS = 3
# rounding: the etp slices gather into the whole matrix with its columns in another order ([g0 u0 g1 u1]), whose
# products sum in another order (2e-6 here); every other case is bitwise one process's
TOLERANCE = 1e-5
HYPER = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.9}
# name -> (shapes of the parameters of one group, placements over the 2 ranks, or "etp" for a hidden split)
CASES: dict[str, tuple[list[tuple[int, ...]], object]] = {
    "rows (FSDP2)": ([(40, 24)], [Shard(0)]),
    "uneven rows": ([(23, 16)], [Shard(0)]),
    "columns (tp row-parallel)": ([(24, 40)], [Shard(1)]),
    # three matrices: the ranks take turns at orthogonalising, and hand each other the results
    "three matrices, turns": ([(40, 24), (16, 48), (32, 32)], [Shard(0)]),
    "replicated (plain data parallelism)": ([(24, 40)], [Replicate()]),
    "experts along E (ep)": ([(4, 40, 24)], [Shard(0)]),
    "experts along K (FSDP2 over edp)": ([(2, 40, 24)], [Shard(1)]),
    "gated experts, etp slices": ([(2, 16, 48)], "etp"),
}
CONTROL = "rows (FSDP2), each shard apart"
PARALLEL = {"parallel.dp_shard": "2", "train.micro_batch_size": "2"}


def _etp_slice(whole_EH2F: torch.Tensor, rank: int) -> torch.Tensor:
    """An etp rank's columns of a gated first projection: its block of the gate columns, then of the up columns."""
    gate, up = whole_EH2F.chunk(2, dim=-1)
    return torch.cat([gate.chunk(WORLD, dim=-1)[rank], up.chunk(WORLD, dim=-1)[rank]], dim=-1)


def _case(mesh, shapes: list[tuple[int, ...]], split, whole_matrices: bool = True) -> float:
    """The largest relative difference between how far this rank's pieces moved and how far the same pieces moved in
    one process's MuonWithAdamW run on the whole tensors, over STEPS steps of the same gradients."""
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(sum(sum(s) for s in shapes))
    wholes = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(STEPS)]

    def piece(t: torch.Tensor) -> torch.Tensor:  # this rank's piece of a whole tensor
        return _etp_slice(t, rank) if split == "etp" else distribute_tensor(t, mesh, split)

    reference = [nn.Parameter(w.clone()) for w in wholes]
    params = [nn.Parameter(piece(w.clone())) for w in wholes]  # a piece may be a view of what it was cut from
    hidden = {id(p): HiddenSplit(2, dist.group.WORLD) for p in params} if split == "etp" else {}
    one = MuonWithAdamW([{"params": reference, "rule": "muon"}], **HYPER)
    ours = MuonWithAdamW(
        [{"params": params, "rule": "muon"}], hidden_splits=hidden, whole_matrices=whole_matrices, **HYPER
    )
    for step_grads in grads:
        for p, q, g in zip(params, reference, step_grads, strict=True):
            q.grad, p.grad = g.clone(), piece(g)
        one.step()
        ours.step()
    worst = 0.0
    for p, q, w in zip(params, reference, wholes, strict=True):
        got, want, start = p.detach(), piece(q.detach()), piece(w)
        if isinstance(got, DTensor):
            got, want, start = got.to_local(), want.to_local(), start.to_local()
        moved = want - start
        assert moved.norm() > 1e-3 * start.norm()  # it moved: equal untouched pieces would prove nothing
        worst = max(worst, ((got - start - moved).norm() / moved.norm()).item())
    return worst


def _worker(out: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (WORLD,))
    results = {name: _case(mesh, shapes, split) for name, (shapes, split) in CASES.items()}
    results[CONTROL] = _case(mesh, *CASES["rows (FSDP2)"], whole_matrices=False)

    overrides = {**json.loads((out / "overrides.json").read_text()), **PARALLEL}
    first = {**overrides, "train.steps": "8", "run.checkpoint_interval": "4", "run.output_dir": str(out / "whole")}
    train(prepare(load_config("tiny", first), WORLD))
    resume = str(out / "whole" / "checkpoints" / "step_4")
    again = {**overrides, "train.steps": "8", "run.output_dir": str(out / "resumed"), "run.resume": resume}
    train(prepare(load_config("tiny", again), WORLD))
    torch.save(results, out / f"rank{dist.get_rank()}.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(
    launch_gloo_workers, micro_model: dict[str, str], data_cache: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[list, Path]:
    out = tmp_path_factory.mktemp("muon-ranks")
    overrides = {**micro_model, **MUON_RUN, "data.cache_dir": str(data_cache)}
    (out / "overrides.json").write_text(json.dumps(overrides))
    return launch_gloo_workers(Path(__file__), WORLD, out, timeout=300), out


MUON_RUN = {"train.optimizer": "muon", "run.log_interval": "1", "train.lr": "1e-2"}


@pytest.mark.parametrize("name", list(CASES))
def test_split_matrices_update_as_one_process(ranks: tuple[list, Path], name: str) -> None:
    for rank, result in enumerate(ranks[0]):
        assert result[name] < TOLERANCE, (rank, result[name])


def test_control_orthogonalising_shards_apart_differs(ranks: tuple[list, Path]) -> None:
    assert all(result[CONTROL] > 0.1 for result in ranks[0]), [r[CONTROL] for r in ranks[0]]


def _losses(out: Path) -> dict[int, tuple[float, float]]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in records if "loss" in r}


def test_a_dp_shard_run_resumes_as_it_ran_on(ranks: tuple[list, Path]) -> None:
    whole, resumed = _losses(ranks[1] / "whole"), _losses(ranks[1] / "resumed")
    assert sorted(resumed) == list(range(5, 9))
    for step in range(5, 9):
        assert resumed[step] == pytest.approx(whole[step], rel=1e-6), step
    assert whole[8][0] < whole[1][0] - 0.1  # it trained


if __name__ == "__main__":
    import sys

    _worker(Path(sys.argv[1]))
