"""Expert-parallel communication hidden behind computation: a training step's time without overlap and with the
chunked in-layer overlap (``parallel.ep_overlap chunked``), on a modelled link.

On one machine gloo's all-to-alls are memory copies, so each rank's dispatchers are given a
:class:`~moe_dispatch.DelayedLink`: every collective of the MoE layers (forward and backward) completes no earlier
than a link of latency ``LATENCY_S`` and a bandwidth set so that the step's communication ``T_comm`` is 0.5, 1 and 2
times its computation ``T_compute`` (the step's time on the real gloo, without the link; both measured here). Per
ratio, the step without overlap and with it run head to head, interleaved, medians over the repetitions; the hidden
fraction of each pair is ``(T_none - T_overlap) / T_comm``, with ``T_comm`` the link's modelled time of the step
without overlap. Each mode's step also splits into compute (``T_compute``) and exposed communication (the rest). The
real gloo step (no link) is compared the same way, whichever way it goes.

The model: 2 MoE layers of 8 experts (top-2, 1024 wide) on a 256-wide residual stream and a 512-token vocabulary, so
that the experts, which the overlap hides the all-to-alls behind, are most of the computation; a step is forward and
backward of sequences of 256 tokens (no optimizer) over gloo ranks of one thread each: 4,096 tokens a rank (a
micro-batch of one sequence of the published runs) at ep=2 and ep=4 (4 ranks on these 2 cores), and 1,024 at ep=2.
``--quick`` (the nox benchmarks session): ep=2, 256 tokens, ratio 1, a smaller model, 3 repetitions.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from _harness import cli, head_to_head, header, launch_ranks, parse, ratio_spread, spread, write

from moe_dispatch import AllToAllDispatcher, DelayedLink, Lanes
from moe_models import build_model
from moe_models.presets import preset
from moe_parallel import ParallelLayout, apply_expert_parallel, build_meshes, moe_blocks

LATENCY_S = 50e-6  # per collective: a fast fabric's order
RATIOS = (0.5, 1.0, 2.0)
CHUNKS = 4  # parallel.ep_overlap_chunks' default
# ep x tokens a rank: a 4,096-token micro-batch (one sequence of the published runs) at ep=2 and ep=4, and a quarter of
# it, where each chunk's grouped GEMMs are small enough on these CPUs to cost more than the overlap hides
RUNS = "2x4096,4x4096,2x1024"
# parallel.ep_overlap microbatch (each exchange also in --chunks chunks, as ep_overlap_chunks does there): a step of
# MICRO_BATCHES micro-batches of 1,024 tokens a rank (in flight two at a time but the first forward and the last
# backward), at ep=2 and ep=4
MICRO_BATCHES = 8
MICROBATCH_RUNS = "2x8192,4x8192"
# microbatch_delayed: the same with the experts' weight gradients delayed (parallel.delay_wgrad_compute)
MICROBATCH_MODES = ("microbatch", "microbatch_delayed")


def _seq(quick: bool) -> int:
    return 128 if quick else 256


def _config(quick: bool):
    sizes = (
        {"hidden_size": 128, "moe_ffn_hidden_size": 256} if quick else {"hidden_size": 256, "moe_ffn_hidden_size": 1024}
    )
    return preset(
        "tiny-qwen3-moe", vocab_size=512, num_layers=2, num_moe_experts=8, moe_router_topk=2, kv_channels=32, **sizes
    )


def _rank(
    out: Path, quick: bool, reps: int, chunks: int, ratios: tuple[float, ...], batch: int, mode: str, micro: int
) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    config = _config(quick)
    model = build_model(config, seed=0)
    plan = model.parallel_plan()
    apply_expert_parallel(model, build_meshes(ParallelLayout(world, ep=world)), plan, "alltoall")
    blocks = moe_blocks(model, plan)
    dispatchers = [block.dispatcher for block in blocks]
    assert all(isinstance(d, AllToAllDispatcher) for d in dispatchers)
    in_flight, delayed = mode in MICROBATCH_MODES, mode == "microbatch_delayed"
    gen = torch.Generator().manual_seed(100 + rank)
    seq = _seq(quick)
    tokens = torch.randint(0, config.vocab_size, (batch, seq + 1), generator=gen)

    lanes = Lanes()

    def use(link: DelayedLink | None, overlap: bool) -> None:
        for d in dispatchers:
            d.link = link
            d.overlap_chunks = chunks if overlap else 1
            d.lanes = lanes if overlap and in_flight else None
        for block in blocks:  # parallel.delay_wgrad_compute
            block.experts.defer_wgrad = lanes.defer if overlap and delayed else None

    def forward(part: torch.Tensor) -> torch.Tensor:
        logits = model(part[:, :-1]).logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), part[:, 1:].flatten())

    def step() -> None:
        dist.barrier()  # the ranks start together: a step's time is not another rank's lateness
        parts = tokens.chunk(micro)  # one micro-batch, or parallel.ep_overlap microbatch's micro-batches
        loss = forward(parts[0])
        for part in parts[1:]:
            if dispatchers[0].lanes is None:
                loss.backward()
                loss = forward(part)
            else:  # the previous micro-batch's backward and this one's forward in flight together
                loss = lanes.run(loss.backward, lambda part=part: forward(part))
        if dispatchers[0].lanes is not None and delayed:  # the last backward alone, as moe_parallel runs it
            lanes.run(loss.backward, lambda: None)
        else:
            loss.backward()
        model.zero_grad(set_to_none=True)

    # the real gloo step, and the computation the link's bandwidth is set against (every rank the slowest's)
    use(None, False)
    step()

    def without_link(overlap: bool):
        def timed():
            use(None, overlap)
            step()

        return timed

    real = head_to_head(without_link(False), without_link(True), reps, warmup=1)
    compute = torch.tensor([statistics.median(real[0])])
    dist.all_reduce(compute, op=dist.ReduceOp.MAX)
    t_compute = float(compute)
    counter = DelayedLink()  # no delay: counts the bytes and collectives of a step without overlap
    use(counter, False)
    step()
    sent = torch.tensor([float(counter.bytes_sent), float(counter.collectives)])
    dist.all_reduce(sent, op=dist.ReduceOp.MAX)
    step_bytes, collectives = float(sent[0]), int(sent[1])
    result = {
        "rank": rank,
        "t_compute_s": t_compute,
        "step_bytes_sent": step_bytes,
        "step_collectives": collectives,
        "real_gloo": {
            "none_s": spread(real[0]),
            f"{mode}_s": spread(real[1]),
            f"{mode}_over_none": ratio_spread(real[1], real[0]),
        },
        "ratios": {},
    }
    for ratio in ratios:
        bandwidth = step_bytes / (ratio * t_compute - collectives * LATENCY_S)
        link = DelayedLink(LATENCY_S, bandwidth)
        comm = []

        def none_step(link=link, comm=comm):
            use(link, False)
            link.reset()
            step()
            comm.append(link.busy_s)

        def overlap_step(link=link):
            use(link, True)
            step()

        t_none, t_overlap = head_to_head(none_step, overlap_step, reps, warmup=1)
        comm = comm[1:]  # the warm-up's
        hidden = [(a - b) / c for a, b, c in zip(t_none, t_overlap, comm, strict=True)]
        result["ratios"][str(ratio)] = {
            "bandwidth_bytes_per_s": bandwidth,
            "t_comm_s": spread(comm),
            "none_s": spread(t_none),
            f"{mode}_s": spread(t_overlap),
            "hidden_fraction": spread(hidden),
            "exposed_comm_none_s": statistics.median(t_none) - t_compute,
            f"exposed_comm_{mode}_s": statistics.median(t_overlap) - t_compute,
        }
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def _summary(ranks: list[dict], mode: str) -> dict:
    """Over the ranks: the median of their medians, and the lowest and highest repetition of any rank."""

    def over(get) -> dict:
        stats = [get(r) for r in ranks]
        return {
            "median": statistics.median(s["median"] for s in stats),
            "min": min(s["min"] for s in stats),
            "max": max(s["max"] for s in stats),
        }

    keys = ("hidden_fraction", "none_s", f"{mode}_s", "t_comm_s")
    ratios = {
        ratio: {key: over(lambda r, q=ratio, k=key: r["ratios"][q][k]) for key in keys} for ratio in ranks[0]["ratios"]
    }
    for ratio, row in ratios.items():
        # the overlapped step can compute faster than the other (the chunks' smaller working sets): the hidden
        # fraction of the formula then counts that too. Against the overlapped step's own computation (its
        # real gloo time), only what the link's time adds to it is exposed
        exposed = [
            (r["ratios"][ratio][f"{mode}_s"]["median"] - r["real_gloo"][f"{mode}_s"]["median"])
            / r["ratios"][ratio]["t_comm_s"]["median"]
            for r in ranks
        ]
        row["hidden_of_own_compute"] = {
            "median": 1 - statistics.median(exposed),
            "min": 1 - max(exposed),
            "max": 1 - min(exposed),
        }
    return {
        "t_compute_s": statistics.median(r["t_compute_s"] for r in ranks),
        "ratios": ratios,
        f"real_gloo_{mode}_over_none": over(lambda r: r["real_gloo"][f"{mode}_over_none"]),
    }


def main(mode: str = "chunked") -> None:
    """``mode``: the overlap measured against none, ``chunked`` (this script), ``microbatch``
    (ep_overlap_microbatch.py) or ``microbatch_delayed`` (ep_overlap_delayed_wgrad.py); each writes its own results
    file."""
    micro = MICRO_BATCHES if mode in MICROBATCH_MODES else 1
    name = {"chunked": "ep_overlap", "microbatch_delayed": "ep_overlap_delayed_wgrad"}.get(mode, f"ep_overlap_{mode}")
    default_runs = MICROBATCH_RUNS if mode in MICROBATCH_MODES else RUNS
    quick_runs = f"2x{256 * micro}"
    parser = cli(name, __doc__, f"ep=2, {quick_runs} tokens, ratio 1, a smaller model, 3 repetitions", ranks=True)
    parser.add_argument("--reps", type=int, default=None, help="repetitions of each mode (default 7; --quick 3)")
    parser.add_argument("--chunks", type=int, default=CHUNKS, help=f"parallel.ep_overlap_chunks (default {CHUNKS})")
    parser.add_argument(
        "--runs", default=None, help=f"comma-separated EPxTOKENS, tokens a rank (default {default_runs})"
    )
    parser.add_argument("--ratios", default=None, help="comma-separated comm/compute ratios (default 0.5,1,2)")
    parser.add_argument("--batch", type=int, default=None, help=argparse.SUPPRESS)  # a rank's sequences
    parser.add_argument("--mode", default=mode, help=argparse.SUPPRESS)  # the ranks' (launched as this file)
    parser.add_argument("--summarise", type=Path, default=None, help="recompute the summaries of a results file")
    args = parse(parser)
    mode = args.mode  # a rank runs this file's main() with the launcher's --mode
    micro = MICRO_BATCHES if mode in MICROBATCH_MODES else 1
    if args.summarise is not None:
        report = json.loads(args.summarise.read_text())
        for run in report["runs"].values():
            run["summary"] = _summary(run["ranks"], mode)
        write(args.summarise, report)
        return
    reps = args.reps or (3 if args.quick else 7)
    ratios = tuple(float(r) for r in args.ratios.split(",")) if args.ratios else (1.0,) if args.quick else RATIOS
    if args.rank_dir is not None:
        _rank(args.rank_dir, args.quick, reps, args.chunks, ratios, args.batch, mode, micro)
        return
    runs = [
        tuple(int(x) for x in run.split("x"))
        for run in (args.runs or (quick_runs if args.quick else default_runs)).split(",")
    ]
    config = _config(args.quick)
    report = header(
        args,
        what=f"training step (forward + backward) with parallel.ep_overlap {mode} vs none, on a modelled link",
        baseline="the same step without overlap, interleaved",
        device="cpu (gloo, one thread a rank)",
        model={k: getattr(config, k) for k in ("hidden_size", "moe_ffn_hidden_size", "num_moe_experts", "num_layers")},
        mode=mode,
        chunks=args.chunks,
        micro_batches=micro,
        seq_len=_seq(args.quick),
        latency_s=LATENCY_S,
        reps=reps,
    )
    report["runs"] = {}
    for ep, tokens in runs:
        extra = [*(["--quick"] if args.quick else []), "--reps", str(reps), "--chunks", str(args.chunks)]
        extra += ["--batch", str(tokens // _seq(args.quick)), "--ratios", ",".join(map(str, ratios)), "--mode", mode]
        with tempfile.TemporaryDirectory() as tmp:
            ranks = launch_ranks(__file__, ep, Path(tmp), *extra, timeout=3600)
        name = f"ep={ep}, {tokens} tokens a rank"
        report["runs"][name] = {"ep": ep, "tokens_per_rank": tokens, "ranks": ranks, "summary": _summary(ranks, mode)}
        for ratio, row in report["runs"][name]["summary"]["ratios"].items():
            h, own = row["hidden_fraction"], row["hidden_of_own_compute"]
            print(
                f"{name}, comm/compute {ratio}: hidden fraction {h['median']:.3f} ({h['min']:.3f}-{h['max']:.3f}), "
                f"of its own compute {own['median']:.3f}"
            )
        real = report["runs"][name]["summary"][f"real_gloo_{mode}_over_none"]
        print(f"{name}, real gloo: {mode} / none {real['median']:.3f} ({real['min']:.3f}-{real['max']:.3f})")
    write(args.out, report)


if __name__ == "__main__":
    main()
