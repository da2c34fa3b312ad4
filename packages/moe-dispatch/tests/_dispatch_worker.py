"""One rank of the gloo dispatcher checks in test_dispatchers_dist.py: ``python _dispatch_worker.py OUT_DIR``.

The parent starts WORLD_SIZE processes with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set. Every
case builds the same global batch on every rank (fixed seed): rank r routes its own tokens through a
distributed dispatcher and a sharded SwiGLU expert; the reference is LocalDispatcher on all ranks'
tokens with all experts whole, in this process. Each rank records both sides for its own tokens and
expert shard, each case a scenario of its own (``_rank_scenarios.py``); the parent asserts.

The flex (DeepEP) dispatcher runs the expert-parallel cases on ``_fake_deep_ep`` (DeepEP's contracts over gloo), with
CUDA reported available while it runs. It sends bf16 (DeepEP combines bf16 only): its reference takes the tokens after
a bf16 round trip, and its outputs are bf16-rounded.
"""

from __future__ import annotations

import dataclasses
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import _fake_deep_ep
import torch
import torch.distributed as dist
import torch.nn.functional as F

from _rank_scenarios import Scenarios
from moe_dispatch.accounting import rows_sent
from moe_dispatch.alltoall import AllToAllDispatcher
from moe_dispatch.dispatcher import LocalDispatcher
from moe_dispatch.factory import build_dispatcher
from moe_dispatch.router import RoutingResult

HIDDEN, FFN = 8, 8  # DeepEP moves rows of a multiple of 16 bytes: hidden % 8 == 0 in bf16


class HalfWire:
    """A test wire format (moe_dispatch.wire.WireCodec): each row divided by its amax, in fp16, as bytes, plus the
    fp32 amax. Lossy, so that a dispatcher that skipped decoding or encoding would be seen."""

    name = "half_rows"

    def encode(self, x_RH):
        amax = x_RH.detach().abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
        return (x_RH.detach() / amax).to(torch.float16).view(torch.uint8), amax

    def decode(self, parts, dtype):
        data, amax = parts
        return (data.view(torch.float16).float() * amax).to(dtype)

    def row_bytes(self, hidden):
        return 2 * hidden + 4

    def round_trip(self, x_RH):
        return self.decode(self.encode(x_RH), x_RH.dtype)


def bf16_round_trip(x):
    return x.to(torch.bfloat16).to(x.dtype)


@contextmanager
def fake_deep_ep():
    """``deep_ep`` as the strict stand-in, and CUDA reported available (the adapter checks both)."""
    saved_module, saved_cuda = sys.modules.get("deep_ep"), torch.cuda.is_available
    sys.modules["deep_ep"] = _fake_deep_ep.module()
    torch.cuda.is_available = lambda: True
    try:
        yield
    finally:
        torch.cuda.is_available = saved_cuda
        if saved_module is None:
            sys.modules.pop("deep_ep", None)
        else:
            sys.modules["deep_ep"] = saved_module


# cases also run with HalfWire on the dispatch
WIRE_CASES = {"random", "rank_without_tokens", "random_ep4", "etp_random"}


@dataclass
class Case:
    name: str
    tokens: list[int]  # tokens per global rank
    num_experts: int
    topk: int
    mode: str = "random"  # random | subset (only `pool` experts) | hot (every token to expert `hot`)
    pool: tuple[int, ...] = ()
    hot: int = 0
    capacity: int | None = None  # keep the first C pairs per expert per rank, pad_to = C
    pad_multiple: int = 1
    seed: int = 0


def global_batch(case: Case):
    """Per global rank: x, expert_idx, probs (dropped pairs zeroed), keep; and the full expert weights."""
    gen = torch.Generator().manual_seed(1000 + case.seed)
    per_rank = []
    for num_tokens in case.tokens:
        x = torch.randn(num_tokens, HIDDEN, generator=gen)
        rows = []
        for _ in range(num_tokens):
            if case.mode == "hot":
                rest = [e for e in torch.randperm(case.num_experts, generator=gen).tolist() if e != case.hot]
                rows.append([case.hot, *rest[: case.topk - 1]])
            else:
                choices = list(case.pool) if case.mode == "subset" else list(range(case.num_experts))
                rows.append([choices[i] for i in torch.randperm(len(choices), generator=gen)[: case.topk].tolist()])
        idx = torch.tensor(rows, dtype=torch.int64).reshape(num_tokens, case.topk)
        probs = torch.softmax(torch.randn(num_tokens, case.topk, generator=gen), dim=-1)
        keep = None
        if case.capacity is not None:
            seen = [0] * case.num_experts
            keep_rows = []
            for row in idx.tolist():
                keep_rows.append([seen[e] < case.capacity for e in row])
                for e in row:
                    seen[e] += 1
            keep = torch.tensor(keep_rows, dtype=torch.bool).reshape(num_tokens, case.topk)
            probs = probs * keep
        per_rank.append((x, idx, probs, keep))
    weights = [torch.randn(case.num_experts, *shape, generator=gen) * 0.5 for shape in [(HIDDEN, FFN)] * 2]
    weights.append(torch.randn(case.num_experts, FFN, HIDDEN, generator=gen) * 0.5)
    cot = [torch.randn(n, HIDDEN, generator=gen) for n in case.tokens]
    return per_rank, weights, cot


def swiglu_experts(tokens_NH, tokens_per_expert_E, w_gate, w_up, w_down):
    """Each expert's contiguous rows through silu(x Wg) * (x Wu) @ Wd; with FFN-sharded weights the
    outputs are partial sums of the full expert's."""
    chunks = torch.split(tokens_NH, tokens_per_expert_E.tolist(), dim=0)
    outs = [(F.silu(c @ w_gate[e]) * (c @ w_up[e])) @ w_down[e] for e, c in enumerate(chunks)]
    return torch.cat(outs, dim=0) if outs else tokens_NH.new_zeros(0, HIDDEN)


def routing(idx, probs, keep, num_experts, pad_to):
    counts = torch.bincount(idx[keep] if keep is not None else idx.flatten(), minlength=num_experts)
    return RoutingResult(probs, idx, counts, probs.new_zeros(()), keep, pad_to)


def leaf(t):
    return t.detach().clone().requires_grad_(True)


def reference(case: Case, per_rank, weights, cot):
    """LocalDispatcher on the whole batch, all experts whole: output, grads of x / probs / weights."""
    x = leaf(torch.cat([p[0] for p in per_rank]))
    idx = torch.cat([p[1] for p in per_rank])
    probs = leaf(torch.cat([p[2] for p in per_rank]))
    keep = None if case.capacity is None else torch.cat([p[3] for p in per_rank])
    ws = [leaf(w) for w in weights]
    disp = LocalDispatcher(case.num_experts)
    res = disp.dispatch(x, routing(idx, probs, keep, case.num_experts, None))
    out = disp.combine(swiglu_experts(res.tokens_NH, res.tokens_per_expert_E, *ws), res.handle)
    (out * torch.cat(cot)).sum().backward()
    return out.detach(), x.grad, probs.grad, [w.grad for w in ws]


class Layout:
    """ep x etp grid over the world: ep groups are rows of consecutive ranks, etp groups the columns."""

    def __init__(self, ep: int, etp: int):
        world, rank = dist.get_world_size(), dist.get_rank()
        assert ep * etp == world
        self.ep, self.etp = ep, etp
        self.ep_rank, self.etp_rank = rank % ep, rank // ep
        self.ep_group = self.etp_group = None
        for row in range(etp):  # every rank creates every group, in the same order
            group = dist.new_group(list(range(row * ep, (row + 1) * ep)))
            if row == self.etp_rank:
                self.ep_group = group
        if etp > 1:
            for col in range(ep):
                group = dist.new_group(list(range(col, world, ep)))
                if col == self.ep_rank:
                    self.etp_group = group


def expert_shard(case: Case, layout: Layout, weights):
    """This rank's local experts, FFN slice ``etp_rank`` of ``etp``."""
    local = case.num_experts // layout.ep
    experts = slice(layout.ep_rank * local, (layout.ep_rank + 1) * local)
    width = FFN // layout.etp
    ffn = slice(layout.etp_rank * width, (layout.etp_rank + 1) * width)
    gate, up, down = weights
    return experts, ffn, [leaf(gate[experts][:, :, ffn]), leaf(up[experts][:, :, ffn]), leaf(down[experts][:, ffn])]


def hand_rows_per_local_expert(case: Case, layout: Layout, per_rank) -> list[int]:
    """Kept pairs per local expert over every rank whose tokens reach this one (the whole world with etp,
    this ep group without), padded as the dispatcher should."""
    local = case.num_experts // layout.ep
    rank = dist.get_rank()
    sources = (
        range(len(case.tokens)) if layout.etp > 1 else range(rank - layout.ep_rank, rank - layout.ep_rank + layout.ep)
    )
    counts = [0] * local
    for src in sources:
        _, idx, _, keep = per_rank[src]
        for t, row in enumerate(idx.tolist()):
            for k, e in enumerate(row):
                if e // local == layout.ep_rank and (keep is None or bool(keep[t, k])):
                    counts[e - layout.ep_rank * local] += 1
    if case.capacity is not None:
        return [case.capacity * layout.ep * layout.etp] * local
    m = case.pad_multiple
    return [(c + m - 1) // m * m for c in counts]


def hand_distinct_destinations(case: Case, layout: Layout, idx, keep) -> tuple[int, int]:
    """(all, remote) distinct (token, destination ep rank) pairs of this rank's kept pairs."""
    local = case.num_experts // layout.ep
    pairs = {
        (t, e // local) for t, row in enumerate(idx.tolist()) for k, e in enumerate(row) if keep is None or keep[t, k]
    }
    return len(pairs), sum(1 for _, d in pairs if d != layout.ep_rank)


def handle_is_frozen(handle) -> bool:
    try:
        handle.num_tokens = -1
    except dataclasses.FrozenInstanceError:
        return True
    return False


def run_case(case: Case, name: str, layout: Layout, in_flight: bool = False, wire: HalfWire | None = None) -> dict:
    """With ``wire`` the reference takes the tokens after the wire format's round trip, and the gradient of the
    originals is the gradient of those (straight through)."""
    rank = dist.get_rank()
    cases = [case, Case(**{**case.__dict__, "seed": case.seed + 77})] if in_flight else [case]
    if name == "flex":
        disp = build_dispatcher(name, case.num_experts, layout.ep_group, None, case.pad_multiple, hidden_size=HIDDEN)
    else:
        disp = build_dispatcher(name, case.num_experts, layout.ep_group, layout.etp_group, case.pad_multiple, wire=wire)
    state_before = dict(vars(disp))
    batches = []
    for c in cases:
        per_rank, weights, cot = global_batch(c)
        x, idx, probs, keep = per_rank[rank]
        x, probs = leaf(x), leaf(probs)
        experts, ffn, shard = expert_shard(c, layout, weights)
        res = disp.dispatch(x, routing(idx, probs, keep, c.num_experts, c.capacity))
        batches.append((c, per_rank, weights, cot, x, idx, probs, keep, experts, ffn, shard, res))
    outs = {}
    for i in reversed(range(len(batches))):  # combine in reverse order of dispatch
        c, *_, shard, res = batches[i]
        outs[i] = disp.combine(swiglu_experts(res.tokens_NH, res.tokens_per_expert_E, *shard), res.handle)
    state_unchanged = vars(disp) == state_before  # every per-dispatch value lives in the handles
    loss = sum((outs[i] * batches[i][3][rank]).sum() for i in outs)
    loss.backward()
    with torch.no_grad():  # the experts apply the probabilities themselves, combine sums unweighted
        outs_probs_applied = {}
        for i, (*_, shard, res) in enumerate(batches):
            y_NH = swiglu_experts(res.tokens_NH, res.tokens_per_expert_E, *shard) * res.row_probs().unsqueeze(1)
            outs_probs_applied[i] = disp.combine(y_NH, res.probs_applied())

    records = []
    for i, (c, per_rank, weights, cot, x, idx, probs, keep, experts, ffn, shard, res) in enumerate(batches):
        round_trip = wire.round_trip if wire is not None else bf16_round_trip if name == "flex" else None
        if round_trip is not None:
            per_rank = [(round_trip(px), *rest) for px, *rest in per_rank]
        ref_out, ref_gx, ref_gp, ref_gw = reference(c, per_rank, weights, cot)
        start = sum(c.tokens[:rank])
        mine = slice(start, start + c.tokens[rank])
        rec = {
            "out": outs[i].detach(),
            "out_probs_applied": outs_probs_applied[i],
            "handle_type": type(res.handle).__name__,
            "handle_frozen": handle_is_frozen(res.handle),
            "ref_out": ref_out[mine],
            "grad_x": x.grad,
            "ref_grad_x": ref_gx[mine],
            "grad_probs": probs.grad,
            "ref_grad_probs": ref_gp[mine],
            "grad_w": [w.grad for w in shard],
            "ref_grad_w": [ref_gw[0][experts][:, :, ffn], ref_gw[1][experts][:, :, ffn], ref_gw[2][experts][:, ffn]],
            "tokens_per_expert": res.tokens_per_expert_E.clone(),
            "hand_tokens_per_expert": hand_rows_per_local_expert(c, layout, per_rank),
        }
        if wire is not None:
            rec["wire_changes_tokens"] = not torch.equal(wire.round_trip(x.detach()), x.detach())
        row_bytes = wire.row_bytes(HIDDEN) if wire is not None else HIDDEN * x.element_size()
        if isinstance(disp, AllToAllDispatcher):
            total, remote = hand_distinct_destinations(c, layout, idx, keep)
            rec["bytes"] = {
                "dispatcher_rows_all": disp.rows_sent(res.handle, remote_only=False),
                "dispatcher_bytes": disp.dispatch_bytes(res.handle, HIDDEN, x.element_size()),
                "accounting_bytes": rows_sent("alltoall_dedup", idx, keep, c.num_experts, layout.ep, layout.ep_rank)
                * row_bytes,
                "hand_rows_all": total,
                "hand_bytes": remote * row_bytes,
            }
        records.append(rec)
    return {
        "case": case.name + ("+wire" if wire is not None else ""),
        "dispatcher": name,
        "state_unchanged": state_unchanged,
        "ep": layout.ep,
        "etp": layout.etp,
        "records": records,
    }


def cases_for(world: int) -> list[tuple[Case, int, int, bool]]:
    """(case, ep, etp, two_in_flight)."""
    if world == 2:
        return [
            (Case("random", [5, 7], 4, 2, seed=1), 2, 1, False),
            (Case("rank_without_tokens", [6, 0], 4, 2, seed=2), 2, 1, False),
            (Case("no_tokens_anywhere", [0, 0], 4, 2, seed=3), 2, 1, False),
            (Case("experts_without_tokens", [4, 5], 4, 2, mode="subset", pool=(0, 1), seed=4), 2, 1, False),
            (Case("all_tokens_one_expert", [5, 3], 4, 1, mode="hot", hot=3, seed=5), 2, 1, False),
            (Case("capacity_drop_pad_to", [6, 5], 4, 2, capacity=2, seed=6), 2, 1, False),
            (Case("pad_multiple", [5, 4], 6, 3, pad_multiple=4, seed=7), 2, 1, False),
            (Case("two_in_flight", [5, 6], 4, 2, seed=8), 2, 1, True),
        ]
    return [
        (Case("random_ep4", [5, 0, 7, 3], 8, 3, seed=11), 4, 1, False),
        (Case("many_per_rank_ep4", [6, 4, 5, 2], 8, 4, mode="subset", pool=(0, 1, 2, 3, 6), seed=12), 4, 1, False),
        (Case("capacity_ep4", [6, 5, 7, 4], 8, 2, capacity=1, seed=13), 4, 1, False),
        (Case("two_in_flight_ep4", [4, 6, 3, 5], 8, 2, seed=14), 4, 1, True),
        (Case("etp_random", [4, 6, 0, 5], 4, 2, seed=21), 2, 2, False),
        (Case("etp_hot", [3, 2, 4, 1], 4, 1, mode="hot", hot=1, seed=22), 2, 2, False),
        (Case("etp_capacity_pad_to", [6, 5, 4, 7], 4, 2, capacity=2, seed=23), 2, 2, False),
        (Case("etp_pad_multiple", [5, 3, 6, 2], 4, 2, pad_multiple=4, seed=24), 2, 2, False),
        (Case("etp_two_in_flight", [4, 5, 3, 6], 4, 2, seed=25), 2, 2, True),
    ]


def run_dispatchers(case: Case, layout: Layout, in_flight: bool) -> list[dict]:
    """One case through every dispatcher (the flex one where etp == 1), and again encoded where it is a wire case."""
    results = []
    for name in ("allgather", "alltoall"):
        results.append(run_case(case, name, layout, in_flight))
        if case.name in WIRE_CASES:
            results.append(run_case(case, name, layout, in_flight, HalfWire()))
    if layout.etp == 1:
        with fake_deep_ep():
            result = run_case(case, "flex", layout, in_flight)
            result["buffers_made"] = len(sys.modules["deep_ep"].Buffer.created)
        results.append(result)
    return results


def main(out_dir: Path) -> None:
    dist.init_process_group("gloo")
    cases = cases_for(dist.get_world_size())
    layouts = {(ep, etp): Layout(ep, etp) for _, ep, etp, _ in cases}  # every group made before the first case
    scenarios = Scenarios(out_dir)
    for case, ep, etp, in_flight in cases:  # one scenario per case (_rank_scenarios.py)
        scenarios.run(case.name, run_dispatchers, case, layouts[(ep, etp)], in_flight)
    scenarios.finish()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
