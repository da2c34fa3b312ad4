"""Pipeline bubble (idle fraction) of torch.distributed.pipelining schedules, simulated from their own action lists.

For each schedule and (pipeline ranks ``p``, micro-batches ``m``), the per-rank action lists come from torch itself:
the schedule is constructed on stand-in stage objects (no process group, no model) and its IR is read back:

- ``ScheduleGPipe``, ``Schedule1F1B`` (one stage per rank): ``pipeline_order``, which their ``__init__`` fills from
  ``_get_pipeline_order()``. The runtime of these two does not execute that IR (``_step_microbatches`` is a
  hand-written loop), so the IR is also compared with the order that loop runs; an IR that is not a valid schedule
  (a missing or extra action) is reported, and then the loop's order is simulated instead, labelled as derived.
- ``ScheduleInterleaved1F1B`` (2 stages per rank, looped), ``ScheduleZBVZeroBubble`` (2 per rank, V-shaped),
  ``ScheduleDualPipeV`` (2 per rank, V-shaped; if this torch has it): ``pipeline_order_with_comms``, the lowered list
  (compute, SEND/RECV, WAIT_SEND, UNSHARD/RESHARD, REDUCE_GRAD) that ``_PipelineScheduleRuntime`` executes. The
  compute-only ``pipeline_order`` (from ``_calculate_single_rank_operations``) is simulated too, as a cross-check.

Simulation: each rank runs its actions in list order, an action starting when the rank is free and its inputs exist.
Forward of stage s, micro-batch i needs the forward of stage s-1 for i; a full backward B or input-gradient I of
stage s needs the forward of stage s and the B/I of stage s+1 for i; a weight-gradient W needs the I of the same
stage and micro-batch. Costs (command-line options): F = 1, B = 2, I = 1, W = 1; communication, UNSHARD/RESHARD and
REDUCE_GRAD cost 0. In the lowered lists, an input from another rank is there once the sender has run its SEND (and
the receiver has posted its RECV); a WAIT_SEND blocks until the peer has posted the matching RECV. DualPipeV's
OVERLAP_F_B runs its sub-actions one after the other, as the runtime does without a registered custom function
(``--overlap-f-b max`` models a perfect overlap instead). A simulation that cannot advance raises.

Bubble = 1 - (sum of busy time over ranks) / (ranks x makespan), next to the textbook figure (``TEXTBOOK``). With
the default costs the script asserts that GPipe and 1F1B equal (p-1)/(m+p-1), and that ZBV's bubble is below 1F1B's.

    uv run python benchmarks/pipeline_bubble.py [--quick] [--out benchmarks/results/pipeline_bubble.json]

``--quick`` (the nox benchmarks session; ``--smoke`` is the same) runs p=2, m=4 and p=4, m=8 only, and writes only
where ``--out`` says, never over the committed full results. The simulations take well under a second (importing
torch is most of the run).
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass, field

from _harness import cli, header, parse, write  # benchmarks/_harness.py, beside this script
from torch.distributed.pipelining import schedules
from torch.distributed.pipelining.schedules import _Action, _ComputationType

FULL_CONFIGS = [(p, m) for p in (2, 4, 8) for m in (8, 16)]
QUICK_CONFIGS = [(2, 4), (4, 8)]
DEFAULT_COSTS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
CT = _ComputationType
FREE_ACTIONS = {CT.UNSHARD, CT.RESHARD, CT.REDUCE_GRAD, CT.WAIT_REDUCE_GRAD}  # cost 0, wait for nothing

# name -> (schedule class name in torch.distributed.pipelining.schedules, stages per rank)
SCHEDULES = {
    "GPipe": ("ScheduleGPipe", 1),
    "1F1B": ("Schedule1F1B", 1),
    "Interleaved1F1B": ("ScheduleInterleaved1F1B", 2),
    "ZBVZeroBubble": ("ScheduleZBVZeroBubble", 2),
    "DualPipeV": ("ScheduleDualPipeV", 2),
}
TEXTBOOK = {
    "GPipe": "(p-1)/(m+p-1) (GPipe, Huang et al. 2019: bubble (p-1)/m of the ideal time)",
    "1F1B": "(p-1)/(m+p-1) (same bubble as GPipe; Narayanan et al. 2021)",
    "Interleaved1F1B": "(p-1)/(v*m+p-1), v=2 (Megatron-LM interleaved, Narayanan et al. 2021: (p-1)/(v*m) of ideal)",
    "ZBVZeroBubble": "0 when T_F = T_I = T_W (Zero Bubble PP, Qi et al. 2024, Sec. 6); no closed form otherwise",
    "DualPipeV": "b/(b + 2m(F+B)), b = (PP/2-1)(F&B + B - 3W) with PP = 2p stages (DualPipe README); "
    "F&B = F+B (serial) or max(F,B) (--overlap-f-b max)",
}

NOTES = [
    "Schedule1F1B._get_pipeline_order numbers the last rank's forwards 1..m instead of 0..m-1 (no warm-up forward "
    "there, yet the steady phase increments the index before its first forward), so that IR cannot run (simulated, "
    "every rank deadlocks at its first backward: ir_simulation in the JSON) and differs from what "
    "Schedule1F1B._step_microbatches executes; the latter is simulated. On every other rank the IR equals the "
    "runtime loop (ir_equals_runtime_loop_per_rank in the JSON).",
    "DualPipeV: the lowered list issues the SEND_F/SEND_B of an OVERLAP_F_B only after the whole composite; run "
    "serially (the runtime's default without a registered overlap function) a forward's output therefore waits for "
    "the paired backward, hence a higher bubble than the compute-only IR. With --overlap-f-b max the two agree.",
    "ZBVZeroBubble computes its order for max(2p-1, m) micro-batches and drops the extra ones, so with m < 2p-1 "
    "(p=8, m=8) it runs an order laid out for 15 micro-batches with 7 missing: far from zero bubble.",
    "GPipe and 1F1B are single-stage schedules whose runtime is a hand-written loop, not their IR; their lists carry "
    "no SEND/RECV, so each input is ready when its producer ends (zero-cost transfer).",
]

Key = tuple[str, int, int]  # (event, stage, micro-batch): "F" output, "G" input grad, "W" weight grad, comm events


class ScheduleError(RuntimeError):
    """An action list that cannot run: a missing or duplicated action, or a simulation that cannot advance."""


@dataclass
class StandInStage:
    """What the schedule constructors read from a stage (and the mapping they write), so no process group is needed.

    ``PipelineScheduleSingle`` reads ``num_stages``; ``PipelineScheduleMulti`` reads ``num_stages``, ``group_size``
    and ``group_rank`` and writes ``stage_index_to_group_rank``; the zero-bubble schedules look at ``submod`` for
    torch.compile. The action lists are computed for every rank whichever rank the stand-in claims to be.
    """

    num_stages: int
    group_size: int
    group_rank: int = 0
    stage_index: int = 0
    submod: None = None
    stage_index_to_group_rank: dict[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Step:
    """One timed unit on one rank: its label, duration, the events it waits for and those it produces."""

    label: str
    cost: float
    needs: tuple[Key, ...]
    makes: tuple[Key, ...]


@dataclass
class Timeline:
    """What a simulation measured: the step's end over all ranks, and each rank's busy time and end."""

    makespan: float
    busy: list[float]
    finish: list[float]

    @property
    def bubble(self) -> float:
        """Idle fraction over all ranks for the whole step: 1 - busy / (ranks x makespan)."""
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan)


@dataclass
class Model:
    """The cost model and the stage placement a simulation needs."""

    costs: dict[str, float]
    num_stages: int
    stage_rank: dict[int, int]
    overlap_max: bool = False


def build_schedule(name: str, pp: int, microbatches: int) -> schedules._PipelineSchedule | None:
    """Construct torch's schedule on stand-in stages; ``None`` when this torch lacks the class."""
    class_name, per_rank = SCHEDULES[name]
    cls = getattr(schedules, class_name, None)
    if cls is None:
        return None
    stages = [StandInStage(num_stages=pp * per_rank, group_size=pp, stage_index=i) for i in range(per_rank)]
    return cls(stages[0], microbatches) if per_rank == 1 else cls(stages, microbatches)


def single_stage_runtime_order(name: str, pp: int, microbatches: int) -> dict[int, list[_Action]]:
    """The compute order ``_step_microbatches`` of ScheduleGPipe / Schedule1F1B runs on each rank (stage = rank).

    GPipe: every forward, then every backward. 1F1B: ``min(m, p - rank)`` warm-up forwards, then backward/forward
    pairs until the forwards are done, then the remaining backwards. Used to check torch's IR, and in its place
    (labelled) where the IR is not a valid schedule.
    """
    order: dict[int, list[_Action]] = {}
    for rank in range(pp):
        fwd = [_Action(rank, CT.FORWARD, i) for i in range(microbatches)]
        bwd = [_Action(rank, CT.FULL_BACKWARD, i) for i in range(microbatches)]
        if name == "GPipe":
            order[rank] = fwd + bwd
            continue
        warmup = min(microbatches, pp - rank)
        actions = fwd[:warmup]
        for i in range(microbatches - warmup):
            actions += [bwd[i], fwd[warmup + i]]
        order[rank] = actions + bwd[microbatches - warmup :]
    return order


def compute_only(order: dict[int, list[_Action | None]]) -> dict[int, list[_Action]]:
    """Drop the ``None`` spacers (the runtime skips them) and anything that is not F, B, I, W or OVERLAP_F_B."""
    return {rank: [a for a in actions if a is not None and a.is_compute_op] for rank, actions in order.items()}


def leaves(action: _Action) -> tuple[_Action, ...]:
    """An OVERLAP_F_B's sub-actions, or the action itself."""
    return action.sub_actions if action.computation_type == CT.OVERLAP_F_B else (action,)


def validate(order: dict[int, list[_Action | None]], num_stages: int, microbatches: int) -> list[str]:
    """Problems with a compute schedule: each stage needs F and a backward (B, or I and W) for every micro-batch once,
    all on one rank. Returns readable problems (e.g. "rank 3: 3F8 (no such stage or micro-batch)"), empty when valid."""
    problems: list[str] = []
    seen: dict[tuple[int, str, int], int] = {}
    for rank, actions in compute_only(order).items():
        for action in (leaf for a in actions for leaf in leaves(a)):
            stage, kind, mb = action.stage_index, action.computation_type.value, action.microbatch_index
            if not (0 <= stage < num_stages and mb is not None and 0 <= mb < microbatches):
                problems.append(f"rank {rank}: {action} (no such stage or micro-batch)")
            elif (stage, kind, mb) in seen:
                problems.append(f"rank {rank}: {action} runs twice")
            seen[(stage, kind, mb)] = rank
    for stage in range(num_stages):
        ranks = {r for (s, _, _), r in seen.items() if s == stage}
        if len(ranks) > 1:
            problems.append(f"stage {stage} runs on ranks {sorted(ranks)}")
        for mb in range(microbatches):
            has = {kind for kind in ("F", "B", "I", "W") if (stage, kind, mb) in seen}
            if has not in ({"F", "B"}, {"F", "I", "W"}):
                rank = next(iter(ranks), "?")
                got = "+".join(sorted(has)) or "nothing"
                problems.append(f"rank {rank}: stage {stage} micro-batch {mb} has {got} (needs F+B or F+I+W)")
    return problems


def stage_to_rank(order: dict[int, list[_Action | None]]) -> dict[int, int]:
    """Which rank runs each stage, read off the action lists."""
    placed = compute_only(order)
    return {leaf.stage_index: rank for rank, actions in placed.items() for a in actions for leaf in leaves(a)}


def compute_step(action: _Action, model: Model, comms: bool) -> Step:
    """The timed step of one F / B / I / W. ``comms``: an input from another rank is ready at the sender's SEND (and
    this rank's RECV); otherwise at the producing compute's end (zero-cost transfer)."""
    stage, mb, kind = action.stage_index, action.microbatch_index, action.computation_type.value
    here = model.stage_rank[stage]

    def remote(event: str, src: int, send: str, recv: str) -> tuple[Key, ...]:
        if not comms or model.stage_rank[src] == here:
            return ((event, src, mb),)
        return ((send, src, mb), (recv, stage, mb))

    needs: tuple[Key, ...] = ()
    if kind == "F" and stage > 0:
        needs = remote("F", stage - 1, "SEND_F", "RECV_F")
    elif kind in ("B", "I"):
        needs = (("F", stage, mb),)
        if stage < model.num_stages - 1:
            needs += remote("G", stage + 1, "SEND_B", "RECV_B")
    elif kind == "W":
        needs = (("G", stage, mb),)
    makes = {"F": ("F",), "B": ("G", "W"), "I": ("G",), "W": ("W",)}[kind]
    return Step(str(action), model.costs[kind], needs, tuple((event, stage, mb) for event in makes))


def comm_step(action: _Action) -> Step:
    """SEND and RECV post at once (cost 0) and record that they did; a WAIT_SEND waits for the peer's RECV."""
    kind, stage, mb = action.computation_type.value, action.stage_index, action.microbatch_index
    if kind == "SEND_F":
        return Step(str(action), 0.0, (("F", stage, mb),), (("SEND_F", stage, mb),))
    if kind == "SEND_B":
        return Step(str(action), 0.0, (("G", stage, mb),), (("SEND_B", stage, mb),))
    if kind in ("RECV_F", "RECV_B"):
        return Step(str(action), 0.0, (), ((kind, stage, mb),))
    if kind == "WAIT_SEND_F":
        return Step(str(action), 0.0, (("RECV_F", stage + 1, mb),), ())
    if kind == "WAIT_SEND_B":
        return Step(str(action), 0.0, (("RECV_B", stage - 1, mb),), ())
    raise ScheduleError(f"no simulation rule for {action}")


def steps_of(action: _Action, model: Model, comms: bool) -> list[Step]:
    """One action as timed steps: an OVERLAP_F_B is its sub-actions in order (or one merged step of the longer
    cost with ``overlap_max``); zero-cost bookkeeping actions become nothing."""
    kind = action.computation_type
    if kind in FREE_ACTIONS:
        return []
    if kind == CT.OVERLAP_F_B:
        parts = [compute_step(sub, model, comms) for sub in action.sub_actions]
        if not model.overlap_max:
            return parts
        made = {key for p in parts for key in p.makes}
        needs = tuple(key for p in parts for key in p.needs if key not in made)
        cost = max(p.cost for p in parts)
        return [Step(str(action), cost, needs, tuple(key for p in parts for key in p.makes))]
    if action.is_compute_op:
        return [compute_step(action, model, comms)]
    return [comm_step(action)]


def simulate(order: dict[int, list[_Action | None]], model: Model, comms: bool) -> Timeline:
    """Run every rank's list in order, each step as early as its rank and its inputs allow; raise if stuck."""
    ranks = sorted(order)
    steps = {r: [s for a in order[r] if a is not None for s in steps_of(a, model, comms)] for r in ranks}
    done: dict[Key, float] = {}
    pos = dict.fromkeys(ranks, 0)
    clock = dict.fromkeys(ranks, 0.0)
    busy = dict.fromkeys(ranks, 0.0)
    while any(pos[r] < len(steps[r]) for r in ranks):
        progressed = False
        for r in ranks:
            while pos[r] < len(steps[r]) and all(key in done for key in steps[r][pos[r]].needs):
                step = steps[r][pos[r]]
                start = max([clock[r], *(done[key] for key in step.needs)])
                clock[r] = start + step.cost
                busy[r] += step.cost
                for key in step.makes:
                    if key in done:
                        raise ScheduleError(f"rank {r}: {step.label} produces {key} a second time")
                    done[key] = clock[r]
                pos[r] += 1
                progressed = True
        if not progressed:
            stuck = [
                f"rank {r} at {steps[r][pos[r]].label} waits for {[k for k in steps[r][pos[r]].needs if k not in done]}"
                for r in ranks
                if pos[r] < len(steps[r])
            ]
            raise ScheduleError("simulation cannot advance: " + "; ".join(stuck))
    return Timeline(makespan=max(clock.values()), busy=[busy[r] for r in ranks], finish=[clock[r] for r in ranks])


def textbook(name: str, pp: int, microbatches: int, costs: dict[str, float], overlap_max: bool) -> float | None:
    """The published bubble as an idle fraction (formulas in ``TEXTBOOK``); ``None`` where none applies."""
    f, b, w = costs["F"], costs["B"], costs["W"]
    if name in ("GPipe", "1F1B"):
        return (pp - 1) / (microbatches + pp - 1)
    if name == "Interleaved1F1B":
        return (pp - 1) / (SCHEDULES[name][1] * microbatches + pp - 1)
    if name == "ZBVZeroBubble":
        return 0.0 if costs["F"] == costs["I"] == costs["W"] else None
    if name == "DualPipeV":
        f_and_b = max(f, b) if overlap_max else f + b
        idle = (pp - 1) * (f_and_b + b - 3 * w)
        return idle / (idle + 2 * microbatches * (f + b))
    raise KeyError(name)


def run_schedule(name: str, pp: int, microbatches: int, costs: dict[str, float], overlap_max: bool) -> dict:
    """Build one schedule, pick its action list (see the module docstring), simulate it and describe the source."""
    try:
        schedule = build_schedule(name, pp, microbatches)
    except ValueError as error:  # the schedule refuses this (p, m): e.g. DualPipeV needs m >= 2p
        return {"skipped": f"{SCHEDULES[name][0]} refuses p={pp}, m={microbatches}: {error}"}
    if schedule is None:
        return {"skipped": f"this torch has no {SCHEDULES[name][0]}"}
    per_rank = SCHEDULES[name][1]
    num_stages = pp * per_rank
    ir = schedule.pipeline_order
    problems = validate(ir, num_stages, microbatches)
    record: dict = {"stages_per_rank": per_rank}
    if per_rank == 1:
        loop = single_stage_runtime_order(name, pp, microbatches)
        record["ir_equals_runtime_loop_per_rank"] = [compute_only(ir)[r] == loop[r] for r in range(pp)]
        if problems:
            record["ir_problems"] = problems
            try:
                simulate(ir, Model(costs, num_stages, stage_to_rank(ir)), comms=False)
            except ScheduleError as error:
                record["ir_simulation"] = str(error)
            order, source = loop, f"derived from {SCHEDULES[name][0]}._step_microbatches (torch's IR is invalid)"
        else:
            order, source = ir, f"{SCHEDULES[name][0]}.pipeline_order (_get_pipeline_order)"
        comms = False
    else:
        if problems:
            raise ScheduleError(f"{name} p={pp} m={microbatches}: " + "; ".join(problems))
        order, comms = schedule.pipeline_order_with_comms, True
        source = f"{SCHEDULES[name][0]}.pipeline_order_with_comms"
    model = Model(costs, num_stages, stage_to_rank(order), overlap_max)
    timeline = simulate(order, model, comms)
    if per_rank > 1:  # the compute-only IR, each input ready when its producer ends (sends not placed yet)
        compute = simulate(ir, model, comms=False)
        record.update(compute_only_makespan=compute.makespan, compute_only_bubble=compute.bubble)
    expected = textbook(name, pp, microbatches, costs, overlap_max)
    record.update(
        action_list=source,
        actions_per_rank=[len([a for a in order[r] if a is not None]) for r in range(pp)],
        makespan=timeline.makespan,
        busy_per_rank=timeline.busy,
        finish_per_rank=timeline.finish,
        bubble=timeline.bubble,
        textbook_bubble=expected,
        textbook_formula=TEXTBOOK[name],
    )
    return record


def check(configurations: dict, costs: dict[str, float]) -> list[str]:
    """The sanity checks (asserted with the default costs): GPipe and 1F1B equal the textbook, ZBV beats 1F1B."""
    notes = []
    for label, config in configurations.items():
        runs = config["schedules"]
        for name in ("GPipe", "1F1B"):
            run = runs[name]
            ok = math.isclose(run["bubble"], run["textbook_bubble"], abs_tol=1e-12)
            notes.append(f"{label} {name}: simulated {run['bubble']:.6f} vs textbook {run['textbook_bubble']:.6f}")
            if costs == DEFAULT_COSTS:
                assert ok, notes[-1]
        zbv, one = runs["ZBVZeroBubble"], runs["1F1B"]
        if "bubble" in zbv:
            below = zbv["bubble"] < one["bubble"]
            notes.append(f"{label}: ZBV {zbv['bubble']:.4f} < 1F1B {one['bubble']:.4f}: {below}")
            if costs == DEFAULT_COSTS and config["pp"] == 4:
                assert below, notes[-1]
    return notes


def markdown(result: dict) -> str:
    """One row per configuration and schedule (makespan, busy per rank, simulated vs textbook bubble), then where
    each schedule's action list came from, the formulas, and the torch IRs that are not valid schedules."""
    costs = result["cost_model"]
    rows = [
        f"Pipeline bubble from torch {result['torch']}'s own action lists (`benchmarks/pipeline_bubble.py`, "
        f"{result['date']}). Costs F={costs['F']:g}, B={costs['B']:g}, I={costs['I']:g}, W={costs['W']:g}; "
        f"communication, unshard/reshard, reduce_grad 0; OVERLAP_F_B {costs['overlap_f_b']}. "
        "Bubble = 1 - busy / (ranks x makespan). Compute-only: the schedule's `pipeline_order` before lowering "
        "(each input ready when its producer ends).",
        "",
        "| p | m | schedule | stages/rank | makespan | busy per rank | simulated bubble | textbook | compute-only |",
        "|---:|---:|---|---:|---:|---|---:|---:|---:|",
    ]
    sources: dict[str, set[str]] = {}
    for config in result["configurations"].values():
        for name, run in config["schedules"].items():
            head = f"| {config['pp']} | {config['microbatches']} | {name} |"
            if "skipped" in run:
                rows.append(f"{head} | | | skipped: {run['skipped']} | | |")
                continue
            sources.setdefault(name, set()).add(run["action_list"])
            expected = "n/a" if run["textbook_bubble"] is None else f"{run['textbook_bubble']:.4f}"
            compute = f"{run['compute_only_bubble']:.4f}" if "compute_only_bubble" in run else ""
            busy = ", ".join(f"{b:g}" for b in run["busy_per_rank"])
            rows.append(
                f"{head} {run['stages_per_rank']} | {run['makespan']:g} | {busy} | {run['bubble']:.4f} | "
                f"{expected} | {compute} |"
            )
    rows += ["", "Action lists simulated:", ""]
    rows += [f"- {name}: {'; '.join(sorted(s))}" for name, s in sources.items()]
    rows += ["", "Notes:", ""]
    rows += [f"- {note}" for note in result["notes"]]
    rows += ["", "Textbook formulas (idle fraction):", ""]
    rows += [f"- {name}: {formula}" for name, formula in TEXTBOOK.items()]
    problems = {
        f"p={c['pp']} m={c['microbatches']} {n}": r["ir_problems"]
        for c in result["configurations"].values()
        for n, r in c["schedules"].items()
        if r.get("ir_problems")
    }
    if problems:
        rows += ["", "torch IRs that are not valid schedules (simulated from the runtime loop instead):", ""]
        rows += [f"- {where}: {'; '.join(p)}" for where, p in problems.items()]
    return "\n".join(rows) + "\n"


def parse_args() -> argparse.Namespace:
    parser = cli("pipeline_bubble", __doc__, "p=2 m=4 and p=4 m=8 only (nox benchmarks)")
    parser.add_argument("--pp", type=int, nargs="+", help="pipeline ranks (default 2 4 8)")
    parser.add_argument("--microbatches", type=int, nargs="+", help="micro-batches (default 8 16)")
    for kind, cost in DEFAULT_COSTS.items():
        parser.add_argument(f"--cost-{kind.lower()}", type=float, default=cost, help=f"cost of one {kind}")
    parser.add_argument(
        "--overlap-f-b",
        choices=("serial", "max"),
        default="serial",
        help="DualPipeV OVERLAP_F_B: sub-actions in turn (torch's runtime default) or max of the two costs",
    )
    return parse(parser)


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    costs = {kind: getattr(args, f"cost_{kind.lower()}") for kind in DEFAULT_COSTS}
    configs = QUICK_CONFIGS if args.quick else FULL_CONFIGS
    if args.pp or args.microbatches:
        configs = [(p, m) for p in args.pp or (2, 4, 8) for m in args.microbatches or (8, 16)]
    overlap_max = args.overlap_f_b == "max"
    configurations = {}
    for pp, m in configs:
        runs = {name: run_schedule(name, pp, m, costs, overlap_max) for name in SCHEDULES}
        configurations[f"p={pp} m={m}"] = {"pp": pp, "microbatches": m, "schedules": runs}
    result = header(args) | {
        "cost_model": {
            **costs,
            "overlap_f_b": args.overlap_f_b,
            "communication": 0,
            "unshard_reshard_reduce_grad": 0,
            "inputs": "F(s,i) <- F(s-1,i); B/I(s,i) <- F(s,i), B/I(s+1,i); W(s,i) <- I(s,i); "
            "across ranks via SEND (and RECV) in the lowered lists; WAIT_SEND <- peer's RECV",
        },
        "bubble_definition": "1 - sum(busy over ranks) / (ranks * makespan)",
        "textbook_formulas": TEXTBOOK,
        "notes": NOTES,
        "configurations": configurations,
    }
    result["checks"] = check(configurations, costs)
    result["seconds"] = round(time.perf_counter() - started, 2)
    md = markdown(result)
    write(args.out, result, {".md": md})
    print(md, end="")
    print("\n".join(result["checks"]))


if __name__ == "__main__":
    main()
