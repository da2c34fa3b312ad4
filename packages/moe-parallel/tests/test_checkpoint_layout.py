"""The canonical checkpoint form of routed experts (moe_parallel.checkpoint_layout): a DCP checkpoint saved under any
layout loads under any other.

Two model families (``_checkpoint_model.py``): ``main`` with a swiglu bank (gate and up in halves) and a GPT-OSS
swiglu_oai bank (interleaved), both with biases, and a non-gated one; ``odd``, whose 3 and 1 experts FSDP2 shards
along dim 1 or unevenly. Each is saved in one process, under the 2-rank layouts and under the 4-rank ones, and every
checkpoint is loaded under every layout of its family (``_checkpoint_worker.py``): a gloo group of 2 ranks and one of
4, started together, and this process for the one-process layout. A control saves etp slices as one
DTensor sharded along the columns, without splitting gate and up: the same check then finds the halves' first
projection wrong.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import _checkpoint_worker as worker
import pytest
import torch
import torch.distributed.checkpoint as dcp

from _rank_scenarios import Outcomes, Scenarios
from moe_experts import add_expert_lora_
from moe_parallel import ParallelConfig, expert_checkpoint_pieces, parallelize, restore_expert_checkpoint_pieces

WORKER = Path(__file__).with_name("_checkpoint_worker.py")
CASES = [(family, layout) for family, layouts in worker.FAMILY_LAYOUTS.items() for layout in layouts]


@pytest.fixture(scope="module")
def runs(launch_gloo_scenarios, tmp_path_factory) -> dict:
    """This process saves the one-process checkpoints; a 2-rank and a 4-rank group, started together, save theirs,
    wait for each other's and load them all (each save and load a scenario of its own: ``runs[world]`` is what the
    ranks recorded); then this process loads them all."""
    base = tmp_path_factory.mktemp("expert_checkpoints")
    root = base / "checkpoints"

    def spawn(world: int, other: int):
        out = base / f"world{world}"
        out.mkdir()
        phase = {"mode": "save_load", "root": str(root), "wait_for": [1, other]}
        (out / "phase.json").write_text(json.dumps(phase))
        return launch_gloo_scenarios(WORKER, world, out, timeout=600)

    one = Scenarios(base / "world1")  # no process group: this process, one rank
    with torch.random.fork_rng():  # the models seed torch's generator
        worker.run({"mode": "save", "root": str(root)}, 1, one)
        with ThreadPoolExecutor(2) as pool:
            two, four = pool.submit(spawn, 2, 4), pool.submit(spawn, 4, 2)
            two, four = two.result(), four.result()
        worker.run({"mode": "load", "root": str(root), "wait_for": [2, 4]}, 1, one)
    return {"root": root, 1: Outcomes(base / "world1", [None], [""]), 2: two, 4: four}


def _per_rank(runs, kind: str, family: str, layout: str) -> list:
    """Each rank's value of the save or load (``kind``) of ``family`` under ``layout`` (a test asking for one that
    failed fails with its name and the ranks' tracebacks)."""
    return runs[worker.LAYOUTS[layout][0]][f"{kind} {family} {layout}"]


@pytest.mark.dist
@pytest.mark.parametrize(("family", "layout"), CASES)
def test_every_checkpoint_loads_under_every_layout(runs, family: str, layout: str) -> None:
    """Every parameter and every exp_avg equal the one-process model's after loading each checkpoint of the family."""
    results = _per_rank(runs, "load", family, layout)
    assert len(results) == worker.LAYOUTS[layout][0]  # every rank of the layout reported
    for rank, loads in enumerate(results):
        assert sorted(loads) == sorted(worker.FAMILY_LAYOUTS[family]), rank
        for source, case in loads.items():
            assert case["checked"] > 0
            assert case["differ"] == [], (source, rank)
            assert case["avg_differ"] == [], (source, rank)
            assert case["steps"], (source, rank)  # the scalar states beside them, saved as they are


@pytest.mark.dist
@pytest.mark.parametrize("family", list(worker.FAMILY_LAYOUTS))
def test_every_layout_saves_the_same_keys_and_global_shapes(runs, family: str) -> None:
    stored = {}
    for layout in worker.FAMILY_LAYOUTS[family]:
        _per_rank(runs, "save", family, layout)  # saved on every rank (else this fails with the ranks' tracebacks)
        metadata = dcp.FileSystemReader(runs["root"] / family / layout).read_metadata().state_dict_metadata
        stored[layout] = {key: tuple(m.size) for key, m in metadata.items() if ".experts." in key}
    first = stored["one process"]
    for layout, keys in stored.items():
        assert keys == first, layout
    if family == "main":
        hidden, f = 16, 8
        for state in ("model.", "optim.state."):
            avg = ".exp_avg" if state != "model." else ""
            for bank, experts in (("a", 4), ("b", 2)):  # gated, in halves and interleaved: gate and up apart
                p = f"{state}moe.{bank}.experts."
                assert (
                    first[f"{p}w_gate_up_EH2F{avg}.gate"] == first[f"{p}w_gate_up_EH2F{avg}.up"] == (experts, hidden, f)
                )
                assert first[f"{p}b_gate_up_E2F{avg}.gate"] == first[f"{p}b_gate_up_E2F{avg}.up"] == (experts, f)
                assert first[f"{p}w_down_EFH{avg}"] == (experts, f, hidden)
                assert first[f"{p}b_down_EH{avg}"] == (experts, hidden)
            assert first[f"{state}moe.c.experts.w_gate_up_EH2F{avg}"] == (2, hidden, f)  # not gated: whole
        assert "model.moe.a.experts.w_gate_up_EH2F" not in first


def _pieces(runs, family: str, layout: str, rank: int = 0) -> dict:
    return _per_rank(runs, "save", family, layout)[rank]


@pytest.mark.dist
def test_pieces_are_dtensors_over_edp_ep_etp(runs) -> None:
    """(placements over (edp, ep, etp), local shape) of a few pieces, on rank 0."""
    etp = _pieces(runs, "main", "etp=2")
    assert etp["moe.a.experts.w_gate_up_EH2F.gate"] == (("Replicate()", "Replicate()", "Shard(dim=2)"), (4, 16, 4))
    assert etp["moe.a.experts.b_down_EH"] == (("Replicate()",) * 3, (4, 16))  # whole on every etp rank
    both = _pieces(runs, "main", "ep=2 x etp=2")
    assert both["moe.b.experts.w_down_EFH"] == (("Replicate()", "Shard(dim=0)", "Shard(dim=1)"), (1, 4, 16))
    # FSDP2 over edp inside ep's block of experts, as FSDP2 places it over tensor parallelism
    fsdp = _pieces(runs, "main", "ep=2 x dp_shard=4 (edp=2)")
    assert fsdp["moe.a.experts.w_gate_up_EH2F.up"] == (
        ("_StridedShard(dim=0, sf=2)", "Shard(dim=0)", "Replicate()"),
        (1, 16, 8),
    )
    assert fsdp["moe.b.experts.w_gate_up_EH2F.up"][0] == ("Shard(dim=1)", "Shard(dim=0)", "Replicate()")  # 1 expert
    odd = _pieces(runs, "odd", "etp=2 (edp=2)")
    # 3 experts over 2 edp ranks: FSDP2 splits the FFN rows inside the etp slice
    assert odd["moe.a.experts.w_down_EFH"] == (("_StridedShard(dim=1, sf=2)", "Replicate()", "Shard(dim=1)"), (3, 1, 6))
    # a halves bias split along its columns would cut gate from up: its pieces are gathered over edp
    assert odd["moe.a.experts.b_gate_up_E2F.gate"] == (("Replicate()", "Replicate()", "Shard(dim=1)"), (3, 2))
    # interleaved, the same split keeps whole (gate, up) pairs on each rank
    assert odd["moe.b.experts.b_gate_up_E2F.up"][0] == ("_StridedShard(dim=1, sf=2)", "Replicate()", "Shard(dim=1)")
    # uneven FSDP2 shards (1 expert, hidden 6 over 4 ranks) are gathered too
    assert _pieces(runs, "odd", "dp_shard=4 (edp=4)")["moe.b.experts.w_gate_up_EH2F.gate"][0] == ("Replicate()",) * 3


@pytest.mark.dist
def test_the_check_fails_when_gate_and_up_are_not_split(runs) -> None:
    """The control: etp=2 slices saved as one DTensor sharded along the FFN dim, loaded in one process. Only the
    halves bank's first projection comes out wrong (an interleaved slice is a column block of the whole)."""
    (naive,) = runs[1][f"load main {worker.NAIVE}"]
    naive = naive[worker.NAIVE]
    assert naive["differ"] == ["moe.a.experts.b_gate_up_E2F", "moe.a.experts.w_gate_up_EH2F"]


def _one_process(family: str):
    model = worker.build(family, seed=1)
    return model, parallelize(model, None, ParallelConfig())


def test_one_process_pieces_are_gate_and_up_apart() -> None:
    model, parallel = _one_process("main")
    halves, interleaved = model.moe.a.experts, model.moe.b.experts
    pieces = expert_checkpoint_pieces(parallel, "moe.a.experts.w_gate_up_EH2F", halves.w_gate_up_EH2F)
    assert torch.equal(pieces[".gate"], halves.w_gate_up_EH2F[..., :8])
    assert torch.equal(pieces[".up"], halves.w_gate_up_EH2F[..., 8:])
    pieces = expert_checkpoint_pieces(parallel, "moe.b.experts.b_gate_up_E2F", interleaved.b_gate_up_E2F)
    assert torch.equal(pieces[".gate"], interleaved.b_gate_up_E2F[:, 0::2])
    assert torch.equal(pieces[".up"], interleaved.b_gate_up_E2F[:, 1::2])
    down = expert_checkpoint_pieces(parallel, "moe.a.experts.w_down_EFH", halves.w_down_EFH)
    assert list(down) == [""] and torch.equal(down[""], halves.w_down_EFH)


def test_restore_writes_the_pieces_back_in_place() -> None:
    model, parallel = _one_process("main")
    for name, param in model.moe.b.experts.named_parameters():
        fqn = f"moe.b.experts.{name}"
        state = torch.randn(param.shape)  # an optimizer state shaped like the parameter
        want = state.clone()
        pieces = expert_checkpoint_pieces(parallel, fqn, state)
        saved = {k: v.clone() for k, v in pieces.items()}
        state.zero_()
        for key, piece in pieces.items():  # what dcp.load does: fill the pieces in place
            piece.copy_(saved[key])
        restore_expert_checkpoint_pieces(parallel, fqn, state, pieces)
        assert torch.equal(state, want), fqn


def test_one_process_adapter_pieces_follow_the_weight_they_adapt() -> None:
    """fc1's lora_B rows are the first projection's columns (gate and up apart, along dim 1, in either column
    layout), fc2's lora_A and the factors whole on every etp rank keep their own name; each comes back in place."""
    model, parallel = _one_process("main")
    for experts in (model.moe.a.experts, model.moe.b.experts):
        add_expert_lora_(experts, rank=8, alpha=16)
    rows = {"a": (slice(0, 8), slice(8, 16)), "b": (slice(0, None, 2), slice(1, None, 2))}  # halves, interleaved
    for block, (gate, up) in rows.items():
        experts = model.moe.get_submodule(block).experts
        for name, param in experts.named_parameters():
            if "lora_" not in name:
                continue
            fqn = f"moe.{block}.experts.{name}"
            state = torch.randn(param.shape)
            want = state.clone()
            pieces = expert_checkpoint_pieces(parallel, fqn, state)
            if name == "fc1.lora_B_EMR":
                assert torch.equal(pieces[".gate"], want[:, gate]) and torch.equal(pieces[".up"], want[:, up]), fqn
            else:
                assert list(pieces) == [""] and torch.equal(pieces[""], want), fqn
            saved = {k: v.clone() for k, v in pieces.items()}
            state.zero_()
            for key, piece in pieces.items():
                piece.copy_(saved[key])
            restore_expert_checkpoint_pieces(parallel, fqn, state, pieces)
            assert torch.equal(state, want), fqn


def test_what_is_not_a_routed_expert_tensor() -> None:
    model, parallel = _one_process("main")
    assert expert_checkpoint_pieces(parallel, "tok.weight", model.tok.weight) is None
    assert expert_checkpoint_pieces(parallel, "moe.a.router.weight", model.moe.a.router.weight) is None
    assert expert_checkpoint_pieces(parallel, "moe.a.experts.w_down_EFH", torch.tensor(3.0)) is None  # a step
    with pytest.raises(ValueError, match="laid out as the parameter"):
        expert_checkpoint_pieces(parallel, "moe.a.experts.w_down_EFH", torch.zeros(2, 8, 16))
    param = model.moe.a.experts.w_gate_up_EH2F
    with pytest.raises(ValueError, match=r"expected pieces \['.gate', '.up'\]"):
        restore_expert_checkpoint_pieces(parallel, "moe.a.experts.w_gate_up_EH2F", param, {"": param})
