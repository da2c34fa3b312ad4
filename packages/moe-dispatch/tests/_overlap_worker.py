"""One rank of the overlap checks in test_overlap_dist.py: ``python _overlap_worker.py OUT_DIR``.

Equivalence: every case of ``_dispatch_worker`` (random routings, empty ranks, capacity dropping with pad_to,
pad_multiple, ep=4, ep=2 x etp=2) goes through ``AllToAllDispatcher.exchange`` pipelined over 2, 3 and 5 chunks
(more chunks than some ranks have tokens), against LocalDispatcher on every rank's tokens with every expert whole, as
the unchunked dispatcher is checked: output and gradients of the tokens, probabilities and expert weights.

Overlap: with a :class:`~moe_dispatch.DelayedLink` of 40 ms a collective and experts that take 40 ms a chunk
(sleeping, forward and backward), the step's time without overlap and with 4 chunks, forward and backward apart.

Two micro-batches in flight (:class:`~moe_dispatch.Lanes`): every case's tokens as two micro-batches, the first's
backward taking turns with the second's forward, against the same two run one after the other: the same outputs and
gradients to the bit. Timed: micro-batches of sleeping attention, experts and loss around the exchange, the pair
with lanes against the same pair in turn.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from _dispatch_worker import Layout, cases_for, expert_shard, global_batch, leaf, reference, routing, swiglu_experts

from _rank_scenarios import Scenarios
from moe_dispatch import DelayedLink, Lanes, build_dispatcher

CHUNKS = (2, 3, 5)
TWO_IN_FLIGHT_CHUNKS = (1, 3)  # ep_overlap microbatch's exchanges whole, and in chunks
SLEEP_S = 0.04  # one chunk's experts, forward or backward (4 chunks' worth a step)
# a dispatch and combine of the timed step's 64 tokens send about 4 kB (rows, probabilities, expert ids): about
# 0.16 s on this link, as long as the experts
LATENCY_S, BANDWIDTH = 0.001, 25_000.0


def run_chunked(case, layout: Layout, chunks: int) -> dict:
    rank = dist.get_rank()
    per_rank, weights, cot = global_batch(case)
    x, idx, probs, keep = per_rank[rank]
    x, probs = leaf(x), leaf(probs)
    experts, ffn, shard = expert_shard(case, layout, weights)
    disp = build_dispatcher(
        "alltoall", case.num_experts, layout.ep_group, layout.etp_group, case.pad_multiple, overlap_chunks=chunks
    )
    calls = []

    def weighted_experts(dispatched):
        calls.append(int(dispatched.tokens_per_expert_E.sum()))
        y = swiglu_experts(dispatched.tokens_NH, dispatched.tokens_per_expert_E, *shard)
        return y * dispatched.row_probs().unsqueeze(1)

    out, side = disp.exchange(
        x, routing(idx, probs, keep, case.num_experts, case.capacity), weighted_experts, lambda: "alongside"
    )
    (out * cot[rank]).sum().backward()
    ref_out, ref_gx, ref_gp, ref_gw = reference(case, per_rank, weights, cot)
    start = sum(case.tokens[:rank])
    mine = slice(start, start + case.tokens[rank])
    return {
        "out": out.detach(),
        "ref_out": ref_out[mine],
        "grad_x": x.grad,
        "ref_grad_x": ref_gx[mine],
        "grad_probs": probs.grad,
        "ref_grad_probs": ref_gp[mine],
        "grad_w": [w.grad for w in shard],
        "ref_grad_w": [ref_gw[0][experts][:, :, ffn], ref_gw[1][experts][:, :, ffn], ref_gw[2][experts][:, ffn]],
        "expert_calls": len(calls),
        "side": side,
    }


class _SleepingExperts(torch.autograd.Function):
    """Rows through unchanged, SLEEP_S in the forward and in the backward: compute that leaves the CPU free."""

    @staticmethod
    def forward(ctx, rows):  # type: ignore[override]
        time.sleep(SLEEP_S)
        return rows.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        time.sleep(SLEEP_S)
        return grad


def timed_step(layout: Layout, chunks: int) -> dict:
    """Forward and backward seconds of one exchange of 64 tokens, and the link's modelled communication."""
    link = DelayedLink(latency_s=LATENCY_S, bandwidth_bytes_per_s=BANDWIDTH)
    disp = build_dispatcher("alltoall", 4, layout.ep_group, overlap_chunks=chunks, link=link)
    gen = torch.Generator().manual_seed(5)
    x = leaf(torch.randn(64, 8, generator=gen))
    idx = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(64)])
    probs = leaf(torch.full((64, 2), 0.5))
    # experts per chunk, as the chunks' share of the whole: the same compute whatever the chunking
    per_chunk = [chunks]

    def experts(dispatched):
        rows = dispatched.tokens_NH * dispatched.row_probs().unsqueeze(1)
        for _ in range(4 // per_chunk[0]):
            rows = _SleepingExperts.apply(rows)
        return rows

    dist.barrier()
    link.reset()
    begin = time.perf_counter()
    out, _ = disp.exchange(x, routing(idx, probs, None, 4, None), experts)
    forward_s = time.perf_counter() - begin
    forward_comm = link.busy_s
    dist.barrier()
    begin = time.perf_counter()
    out.sum().backward()
    backward_s = time.perf_counter() - begin
    return {
        "forward_s": forward_s,
        "backward_s": backward_s,
        "forward_comm_s": forward_comm,
        "backward_comm_s": link.busy_s - forward_comm,
    }


def run_two_in_flight(case, layout: Layout, chunks: int) -> dict:
    """The case's tokens as two micro-batches (the second scaled and shifted), run as F0, (B0 | F1), B1 on a
    dispatcher with lanes and as F0, B0, F1, B1 on one without, each exchange in ``chunks`` chunks."""
    rank = dist.get_rank()
    per_rank, weights, cot = global_batch(case)
    x, idx, probs, keep = per_rank[rank]
    _, _, shard = expert_shard(case, layout, weights)
    results = {}
    for mode in ("in turn", "lanes"):
        disp = build_dispatcher(
            "alltoall", case.num_experts, layout.ep_group, layout.etp_group, case.pad_multiple, overlap_chunks=chunks
        )
        disp.lanes = Lanes() if mode == "lanes" else None
        w = [leaf(t.detach()) for t in shard]
        inputs = [(leaf(x.detach()), leaf(probs.detach())), (leaf(x.detach() * 0.5 + 1), leaf(probs.detach()))]

        def forward(micro: int, disp=disp, w=w, inputs=inputs) -> torch.Tensor:
            xm, pm = inputs[micro]

            def experts(dispatched):
                y = swiglu_experts(dispatched.tokens_NH, dispatched.tokens_per_expert_E, *w)
                return y * dispatched.row_probs().unsqueeze(1)

            out, _ = disp.exchange(xm, routing(idx, pm, keep, case.num_experts, case.capacity), experts)
            return (out * cot[rank]).sum()

        loss0 = forward(0)
        if disp.lanes is None:
            loss0.backward()
            loss1 = forward(1)
        else:
            loss1 = disp.lanes.run(loss0.backward, lambda forward=forward: forward(1))
        loss1.backward()
        results[mode] = {
            "losses": [loss0.detach(), loss1.detach()],
            "grads": [t.grad for pair in inputs for t in pair] + [t.grad for t in w],
            "switches": 0 if disp.lanes is None else disp.lanes.switches,
        }
    return results


class _Sleep(torch.autograd.Function):
    """Computation that leaves the CPU free: ``seconds`` in the forward and in the backward."""

    @staticmethod
    def forward(ctx, rows, seconds):  # type: ignore[override]
        ctx.seconds = seconds
        time.sleep(seconds)
        return rows.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        time.sleep(ctx.seconds)
        return grad, None


def timed_two_in_flight(layout: Layout, lanes: bool) -> dict:
    """Seconds of B0 and F1 of two micro-batches of attention, exchange (experts) and loss, SLEEP_S each, on a link
    that takes about as long per exchange; and the link's modelled communication in those seconds."""
    link = DelayedLink(latency_s=LATENCY_S, bandwidth_bytes_per_s=40_000.0)  # 25-45 ms an exchange
    disp = build_dispatcher("alltoall", 4, layout.ep_group, link=link)
    disp.lanes = Lanes() if lanes else None
    gen = torch.Generator().manual_seed(5)
    idx = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(64)])
    probs = torch.full((64, 2), 0.5)

    def forward(seed: int) -> torch.Tensor:
        x = leaf(torch.randn(64, 8, generator=torch.Generator().manual_seed(seed)))
        h = _Sleep.apply(x, SLEEP_S)  # attention

        def experts(dispatched):
            return _Sleep.apply(dispatched.tokens_NH * dispatched.row_probs().unsqueeze(1), SLEEP_S)

        out, _ = disp.exchange(h, routing(idx, leaf(probs), None, 4, None), experts)
        return _Sleep.apply(out, SLEEP_S).sum()  # the loss

    loss0 = forward(0)
    dist.barrier()
    link.reset()
    begin = time.perf_counter()
    if disp.lanes is None:
        loss0.backward()
        forward(1)
    else:
        disp.lanes.run(loss0.backward, lambda: forward(1))
    return {"seconds": time.perf_counter() - begin, "comm_s": link.busy_s}


def main(out_dir: Path) -> None:
    dist.init_process_group("gloo")
    cases = [(case, ep, etp) for case, ep, etp, in_flight in cases_for(dist.get_world_size()) if not in_flight]
    layouts = {(ep, etp): Layout(ep, etp) for _, ep, etp in cases}  # every group made before the first case
    scenarios = Scenarios(out_dir)
    for case, ep, etp in cases:
        for chunks in CHUNKS:
            scenarios.run(f"{case.name} chunks={chunks}", run_chunked, case, layouts[(ep, etp)], chunks)
    for case, ep, etp in cases:
        for chunks in TWO_IN_FLIGHT_CHUNKS:
            scenarios.run(
                f"{case.name} two in flight chunks={chunks}", run_two_in_flight, case, layouts[(ep, etp)], chunks
            )
    if dist.get_world_size() == 2:
        for chunks in (1, 4):
            scenarios.run(f"timed chunks={chunks}", timed_step, layouts[(2, 1)], chunks)
        for lanes in (False, True):
            scenarios.run(f"timed two in flight lanes={lanes}", timed_two_in_flight, layouts[(2, 1)], lanes)
    scenarios.finish()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
