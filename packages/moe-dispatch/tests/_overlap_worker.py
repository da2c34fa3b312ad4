"""One rank of the chunked-overlap checks in test_overlap_dist.py: ``python _overlap_worker.py OUT_DIR``.

Equivalence: every case of ``_dispatch_worker`` (random routings, empty ranks, capacity dropping with pad_to,
pad_multiple, ep=4, ep=2 x etp=2) goes through ``AllToAllDispatcher.exchange`` pipelined over 2, 3 and 5 chunks
(more chunks than some ranks have tokens), against LocalDispatcher on every rank's tokens with every expert whole, as
the unchunked dispatcher is checked: output and gradients of the tokens, probabilities and expert weights.

Overlap: with a :class:`~moe_dispatch.DelayedLink` of 40 ms a collective and experts that take 40 ms a chunk
(sleeping, forward and backward), the step's time without overlap and with 4 chunks, forward and backward apart.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from _dispatch_worker import Layout, cases_for, expert_shard, global_batch, leaf, reference, routing, swiglu_experts

from _rank_scenarios import Scenarios
from moe_dispatch import DelayedLink, build_dispatcher

CHUNKS = (2, 3, 5)
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


def main(out_dir: Path) -> None:
    dist.init_process_group("gloo")
    cases = [(case, ep, etp) for case, ep, etp, in_flight in cases_for(dist.get_world_size()) if not in_flight]
    layouts = {(ep, etp): Layout(ep, etp) for _, ep, etp in cases}  # every group made before the first case
    scenarios = Scenarios(out_dir)
    for case, ep, etp in cases:
        for chunks in CHUNKS:
            scenarios.run(f"{case.name} chunks={chunks}", run_chunked, case, layouts[(ep, etp)], chunks)
    if dist.get_world_size() == 2:
        for chunks in (1, 4):
            scenarios.run(f"timed chunks={chunks}", timed_step, layouts[(2, 1)], chunks)
    scenarios.finish()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
