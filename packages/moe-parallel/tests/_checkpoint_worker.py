"""One rank of test_checkpoint_layout.py: ``python _checkpoint_worker.py OUT_DIR``, OUT_DIR/phase.json saying what
to do (``save``, ``load`` or both) and where the checkpoints are, each save and load a scenario of its own
(``_rank_scenarios.py``). Also imported by the test module, which runs the one-process layout in its own process
through the same functions.

Saving under a layout: the model (``_checkpoint_model.py``, seed 1) split that way, its model state dict from
get_model_state_dict with every routed-expert tensor replaced by its canonical pieces, and an optimizer-state-like
tensor per expert parameter (``exp_avg``: laid out as the parameter, filled with a known function of the global
index), written with dcp.save. Loading under a layout: the same model built from another seed and split that way,
every tensor overwritten with a sentinel, the pieces created from its own state dict, dcp.load, restored, then
set_model_state_dict; every parameter's full value (expert-tensor-parallel slices put together by hand with the column
map) must equal the one-process model's, and every exp_avg the function of the global index.
"""

from __future__ import annotations

import contextlib
import functools
import json
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _checkpoint_model import build
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor, Replicate, Shard

from _rank_scenarios import Scenarios
from moe_experts import GroupedExperts
from moe_parallel import (
    ParallelConfig,
    build_meshes,
    expert_checkpoint_pieces,
    init_distributed,
    parallelize,
    restore_expert_checkpoint_pieces,
)

SAVE_SEED, LOAD_SEED, SENTINEL = 1, 2, -7.0
# name -> (world size, ParallelConfig sizes); "one process" runs without a process group
LAYOUTS: dict[str, tuple[int, dict]] = {
    "one process": (1, {}),
    "ep=2": (2, {"ep": 2}),
    "etp=2": (2, {"etp": 2}),
    "tp=2 x ep=2 (etp=1)": (2, {"tp": 2, "ep": 2, "etp": 1}),
    "dp_shard=2 (edp=2)": (2, {}),
    "ep=2 x etp=2": (4, {"ep": 2, "etp": 2}),
    "ep=2 x dp_shard=4 (edp=2)": (4, {"ep": 2}),
    "etp=2 (edp=2)": (4, {"etp": 2}),
    "tp=2 x ep=2 x dp_shard=2 (etp=1, edp=2)": (4, {"tp": 2, "ep": 2, "etp": 1}),
    "dp_shard=4 (edp=4)": (4, {}),
    "etp=4": (4, {"etp": 4}),
}
# the odd family's 3 and 1 experts do not divide over ep=2 (nor its hidden size 6 over tp=2); the main family leaves
# out the layouts that only add to the odd family's FSDP cases (each layout loads every checkpoint of its family)
FAMILY_LAYOUTS = {
    "main": [n for n in LAYOUTS if n not in ("dp_shard=4 (edp=4)", "etp=4")],
    "odd": [n for n, (_, s) in LAYOUTS.items() if s.get("ep", 1) == 1 and s.get("tp", 1) == 1],
}
NAIVE = "etp=2, gate and up not split"  # the control: etp slices saved as one DTensor sharded along their columns


@contextlib.contextmanager
def _quiet_dcp():
    with warnings.catch_warnings():  # one-process saves and loads are intended: DCP warns there is no process group
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


@functools.cache
def _meshes(layout: str, world: int):
    """Each layout's meshes, built once per process (every build makes new process groups)."""
    if layout == "one process":
        return None
    return build_meshes(ParallelConfig(**LAYOUTS[layout][1]).layout(world), "cpu")


def _split(family: str, layout: str, seed: int, world: int):
    model = build(family, seed)
    return model, parallelize(model, _meshes(layout, world), ParallelConfig(**LAYOUTS[layout][1]))


def _expert_names(model) -> list[str]:
    plan = model.parallel_plan()
    return [f"{path}.{n}" for path in plan.experts_paths() for n, _ in model.get_submodule(path).named_parameters()]


def index_values(family: str) -> dict[str, torch.Tensor]:
    """The global value of each expert parameter's exp_avg: a known function of the global index."""
    model = build(family, SAVE_SEED)
    out = {}
    for k, name in enumerate(_expert_names(model)):
        shape = model.get_parameter(name).shape
        out[name] = (torch.arange(shape.numel(), dtype=torch.float32).reshape(shape) + 10_000 * k) * 0.25
    return out


def _state_model(family: str, layout: str, world: int, fill: bool):
    """A model whose expert parameters serve as an optimizer state laid out as the parameters (exp_avg)."""
    model = build(family, SAVE_SEED)
    if fill:
        with torch.no_grad():
            for name, value in index_values(family).items():
                model.get_parameter(name).copy_(value)
    parallelize(model, _meshes(layout, world), ParallelConfig(**LAYOUTS[layout][1]))
    return model


def _canonical(parallel, state: dict, naive: bool = False) -> dict:
    """``state`` (fqn -> tensor) with routed-expert tensors replaced by their pieces, keyed ``fqn + suffix``;
    returns {fqn: (tensor, pieces)} of what was replaced."""
    replaced = {}
    for fqn in list(state):
        pieces = (_naive_pieces if naive else expert_checkpoint_pieces)(parallel, fqn, state[fqn])
        if pieces is not None:
            replaced[fqn] = (state.pop(fqn), pieces)
            state.update({fqn + suffix: piece for suffix, piece in pieces.items()})
    return replaced


def _canonical_optim(parallel, optim: dict) -> dict:
    """The same for an optimizer state dict ({"state": {fqn: {name: tensor}}}): pieces under ``name + suffix``."""
    replaced = {}
    for fqn, states in optim["state"].items():
        for name in list(states):
            pieces = expert_checkpoint_pieces(parallel, fqn, states[name])
            if pieces is not None:
                replaced[(fqn, name)] = (states.pop(name), pieces)
                states.update({name + suffix: piece for suffix, piece in pieces.items()})
    return replaced


def _naive_pieces(parallel, fqn: str, tensor: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """The control's form: an etp slice as if it were a shard of the whole tensor along its FFN dim (the first
    projection's columns: wrong for gate and up in halves)."""
    path, _, name = fqn.rpartition(".")
    experts = parallel.model.get_submodule(path) if path.startswith("moe.") else None
    if not isinstance(experts, GroupedExperts) or getattr(experts, name, None) is None:
        return None
    if parallel.meshes is None:
        return {"": tensor}
    layout = parallel.meshes.layout
    assert layout.ep == 1 and layout.edp == 1, "the control runs under etp only"
    dim = {"w_gate_up_EH2F": 2, "b_gate_up_E2F": 1, "w_down_EFH": 1}.get(name)
    shape = list(tensor.shape)
    placements = [Replicate(), Replicate(), Replicate() if dim is None else Shard(dim)]
    if dim is not None:
        shape[dim] *= layout.etp
    mesh = parallel.meshes.expert["edp", "ep", "etp"]
    stride = torch.empty(shape, device="meta").stride()
    piece = DTensor.from_local(
        tensor.detach(), mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride
    )
    return {"": piece}


def save(family: str, layout: str, root: Path, world: int, naive: bool = False) -> dict:
    model, parallel = _split(family, layout, SAVE_SEED, world)
    msd = get_model_state_dict(model)
    _canonical(parallel, msd, naive)
    state = {"model": msd}
    if not naive:
        states = _state_model(family, layout, world, fill=True)
        names = _expert_names(states)
        # a scalar step beside each exp_avg, as optimizers keep it: not a routed-expert tensor, saved as it is
        optim = {
            "state": {
                n: {"exp_avg": states.get_parameter(n), "step": torch.tensor(k + 1.0)} for k, n in enumerate(names)
            }
        }
        _canonical_optim(parallel, optim)
        state["optim"] = optim
    pieces = {
        key: (tuple(map(repr, t.placements)), tuple(t.to_local().shape)) if isinstance(t, DTensor) else tuple(t.shape)
        for key, t in msd.items()
        if key.startswith("moe.") and ".experts." in key
    }
    with _quiet_dcp():
        dcp.save(state, checkpoint_id=root / family / (NAIVE if naive else layout))
    return pieces


def _hand_columns(act_layout: str, f: int, r: int, fl: int) -> list[int]:
    """The whole first projection's columns of etp rank r's slice, in its local order, written out by hand."""
    units = list(range(r * fl, (r + 1) * fl))
    if act_layout == "halves":
        return units + [f + u for u in units]
    if act_layout == "interleaved":
        return [c for u in units for c in (2 * u, 2 * u + 1)]
    return units


def _full_values(model, shapes: dict[str, torch.Size], world: int) -> dict[str, torch.Tensor]:
    """The global value of each parameter ``shapes`` names (of shape ``shapes[name]``): DTensors gathered, plain
    per-rank experts (etp > 1) put together from every rank's slice with the column map."""
    out, slices = {}, {}
    for name, p in model.named_parameters():  # the same order on every rank: the gathers line up
        if name not in shapes:
            continue
        value = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        module = model.get_submodule(name.rpartition(".")[0])
        if isinstance(module, GroupedExperts) and module.etp_size > 1:
            slices[name] = (module.first_expert, module.etp_rank, value.clone())
        else:
            out[name] = value.clone()
    if not slices:
        return out
    everyone = [None] * world
    dist.all_gather_object(everyone, slices)
    for name in slices:
        path, _, attr = name.rpartition(".")
        module = model.get_submodule(path)
        f, fl = module.ffn_hidden_size, module.local_ffn_hidden_size
        whole = torch.full(shapes[name], float("nan"))
        # etp rank 0's down bias first, then every other copy must equal it (it is replicated over etp)
        for first, r, value in sorted((theirs[name] for theirs in everyone), key=lambda s: s[1]):
            rows = slice(first, first + value.shape[0])
            if attr == "w_down_EFH":
                whole[rows, r * fl : (r + 1) * fl] = value
            elif attr == "b_down_EH":
                if r == 0:
                    whole[rows] = value
                elif not torch.equal(whole[rows], value):
                    whole[rows] = float("nan")
            else:
                whole[rows][..., _hand_columns(module.activation.layout, f, r, fl)] = value
        out[name] = whole
    return out


def _fill(model, value: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            (p.to_local() if isinstance(p, DTensor) else p).fill_(value)


def load(family: str, layout: str, saved: list[str], root: Path, world: int, naive: bool = False) -> dict:
    """Each checkpoint of ``saved`` loaded under ``layout``: the parameters and exp_avg that differ from what the
    one-process model holds."""
    model, parallel = _split(family, layout, LOAD_SEED, world)
    states = _state_model(family, layout, world, fill=False)
    reference = {n: p.detach() for n, p in build(family, SAVE_SEED).named_parameters()}
    shapes = {n: t.shape for n, t in reference.items()}
    expected_avg = index_values(family)
    out = {}
    for source in saved:
        _fill(model, SENTINEL)
        _fill(states, SENTINEL)
        msd = get_model_state_dict(model)
        replaced = _canonical(parallel, msd, naive)
        state = {"model": msd}
        if not naive:
            names = _expert_names(states)
            optim = {"state": {n: {"exp_avg": states.get_parameter(n), "step": torch.tensor(0.0)} for n in names}}
            avg_replaced = _canonical_optim(parallel, optim)
            state["optim"] = optim
        with _quiet_dcp():
            dcp.load(state, checkpoint_id=root / family / source)
        for fqn, (tensor, pieces) in replaced.items():
            if not naive:
                restore_expert_checkpoint_pieces(parallel, fqn, tensor, pieces)
            for suffix in pieces:
                del msd[fqn + suffix]
            msd[fqn] = tensor
        if not naive:
            for (fqn, _), (tensor, pieces) in avg_replaced.items():
                restore_expert_checkpoint_pieces(parallel, fqn, tensor, pieces)
        set_model_state_dict(model, msd)
        got = _full_values(model, shapes, world)
        case = {"differ": sorted(n for n, want in reference.items() if not torch.equal(got[n], want))}
        if not naive:
            got_avg = _full_values(states, {n: shapes[n] for n in expected_avg}, world)
            case["avg_differ"] = sorted(n for n, want in expected_avg.items() if not torch.equal(got_avg[n], want))
            steps = [optim["state"][n]["step"].item() for n in names]
            case["steps"] = steps == [k + 1.0 for k in range(len(names))]
        case["checked"] = len(reference)
        out[source] = case
    return out


def _wait_for(root: Path, worlds: list[int], timeout: float = 400) -> None:
    """Until every world size of ``worlds`` has saved its checkpoints (the groups run at the same time)."""
    deadline = time.monotonic() + timeout
    while not all((root / f"saved-by-{w}-ranks").exists() for w in worlds):
        failed = sorted(p.name for p in root.glob("failed-*"))
        if failed:
            raise RuntimeError(f"another group failed ({', '.join(failed)}): not waiting for its checkpoints")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the groups of {worlds} ranks did not all save their checkpoints within {timeout} s")
        time.sleep(0.2)


def run(phase: dict, world: int, scenarios: Scenarios) -> None:
    """Save, then load, every layout of this world size (phase.json: mode ``save``, ``load`` or ``save_load``, the
    checkpoint root, and in ``save_load`` the world sizes whose checkpoints to wait for before loading). Each save and
    each load is a scenario of its own (``_rank_scenarios.py``), its value recorded under ``save <family> <layout>``
    or ``load <family> <layout>``."""
    root = Path(phase["root"])
    if "save" in phase["mode"]:
        for family, layouts in FAMILY_LAYOUTS.items():
            for layout in (n for n in layouts if LAYOUTS[n][0] == world):
                scenarios.run(f"save {family} {layout}", save, family, layout, root, world)
            if family == "main" and world == 2:
                scenarios.run(f"save {family} {NAIVE}", save, family, "etp=2", root, world, naive=True)
        # every rank is past its saves: the ranks agree at the end of each scenario
        if scenarios.rank == 0:
            (root / f"saved-by-{world}-ranks").touch()
    if "load" in phase["mode"]:
        _wait_for(root, phase.get("wait_for", []))
        for family, layouts in FAMILY_LAYOUTS.items():
            saved = sorted(p.name for p in (root / family).iterdir() if p.name != NAIVE)
            for layout in (n for n in layouts if LAYOUTS[n][0] == world):
                scenarios.run(f"load {family} {layout}", load, family, layout, saved, root, world)
            if family == "main" and world == 1:
                scenarios.run(f"load {family} {NAIVE}", load, family, "one process", [NAIVE], root, world, naive=True)


def main(out_dir: Path) -> None:
    ctx = init_distributed("gloo", "cpu")
    phase = json.loads((out_dir / "phase.json").read_text())
    try:
        scenarios = Scenarios(out_dir)
        run(phase, ctx.world_size, scenarios)
    except BaseException:
        Path(phase["root"], f"failed-{ctx.world_size}-ranks-rank{ctx.rank}").touch()  # the other group stops waiting
        raise
    scenarios.finish()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
