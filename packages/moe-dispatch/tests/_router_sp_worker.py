"""One rank of the sequence-parallel router checks in test_router_sequence_parallel.py:
``python _router_sp_worker.py OUT_DIR``.

Every rank builds the same full micro-batch(es) from fixed seeds and computes, without any group, the
single-process reference (a plain router on the full sequences); then it routes only its own chunk of
every sequence with a ``sequence_group`` and, as a control, without one. Gradients of the sharded routers
are summed over the sequence group here (what the parallelize code will do); each case is a scenario of its own
(``_rank_scenarios.py``); the parent asserts.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from _rank_scenarios import Scenarios
from moe_dispatch.config import RouterConfig
from moe_dispatch.router import TopKRouter

HIDDEN, EXPERTS, TOPK = 6, 8, 3
BATCH, SEQ = 3, 8  # full sequences of 8 tokens: chunks of 4 on 2 ranks, of 2 on 4 ranks

# name -> RouterConfig fields; all of them run with the whole world as the sequence group
CASES = {
    "aux_softmax": {"load_balancing_type": "aux_loss", "aux_loss_coeff": 0.3},
    "aux_sigmoid": {"load_balancing_type": "aux_loss", "aux_loss_coeff": 0.3, "score_function": "sigmoid"},
    "seq_softmax": {"load_balancing_type": "seq_aux_loss", "aux_loss_coeff": 0.3},
    "seq_sigmoid": {"load_balancing_type": "seq_aux_loss", "aux_loss_coeff": 0.3, "score_function": "sigmoid"},
    "z_loss": {"load_balancing_type": "none", "z_loss_coeff": 0.05},
    "aux_plus_seq": {"load_balancing_type": ("aux_loss", "seq_aux_loss"), "aux_loss_coeff": (0.3, 0.2)},
    "global": {"load_balancing_type": "global_aux_loss", "aux_loss_coeff": 0.3},
    "all_sigmoid": {
        "load_balancing_type": ("aux_loss", "seq_aux_loss", "global_aux_loss"),
        "aux_loss_coeff": (0.3, 0.2, 0.1),
        "z_loss_coeff": 0.05,
        "score_function": "sigmoid",
    },
}


# packed rows for the padded cases (-1 = padding): every rank's chunk holds a different amount of padding, documents
# cross the chunks' boundaries, one of them every rank's
DOCUMENT_IDS_BS = torch.tensor(
    [
        [0, 0, 0, 1, 1, -1, -1, -1],
        [-1, 2, 2, 2, 2, 2, 2, -1],
        [5, 5, 6, 6, 6, 7, 7, 7],
    ]
)
PADDED_CASES = (
    "aux_softmax",
    "aux_sigmoid",
    "z_loss",
    "global",
    "all_but_seq",
    "seq_softmax",
    "seq_sigmoid",
    "aux_plus_seq",
    "all_sigmoid",
)
LAYOUTS = ("contiguous", "zigzag")
CASES_PADDED_ONLY = {
    "all_but_seq": {
        "load_balancing_type": ("aux_loss", "global_aux_loss"),
        "aux_loss_coeff": (0.3, 0.1),
        "z_loss_coeff": 0.05,
    }
}


def micro_batch(replica: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_BSH, w_BSK): the full micro-batch of a data-parallel replica and the fixed weights of the model
    loss ``sum(probs_TK * w_TK)``."""
    gen = torch.Generator().manual_seed(1000 + replica)
    return torch.randn(BATCH, SEQ, HIDDEN, generator=gen), torch.randn(BATCH, SEQ, TOPK, generator=gen)


def router_weight() -> torch.Tensor:
    return torch.randn(EXPERTS, HIDDEN, generator=torch.Generator().manual_seed(99))


def chunk(t_BSX: torch.Tensor, index: int, size: int) -> torch.Tensor:
    """This rank's contiguous 1/size of every sequence, flattened batch-major."""
    length = t_BSX.shape[1] // size
    return t_BSX[:, index * length : (index + 1) * length].reshape(-1, t_BSX.shape[-1])


class CountAllReduce:
    """Counts ``dist.all_reduce`` calls (the router's collectives) while active."""

    def __init__(self) -> None:
        self.calls = 0
        self._original = dist.all_reduce

    def __enter__(self) -> CountAllReduce:
        def counting(*args, **kwargs):
            self.calls += 1
            return self._original(*args, **kwargs)

        dist.all_reduce = counting
        return self

    def __exit__(self, *exc) -> None:
        dist.all_reduce = self._original


def route(
    fields: dict,
    x_TH: torch.Tensor,
    w_TK: torch.Tensor,
    seq_len: int,
    loss_scale: float = 1.0,
    document_ids_T: torch.Tensor | None = None,
    **groups,
) -> dict:
    """Forward + backward of ``loss_scale * sum(probs_TK * w_TK)`` (the attached losses add their own
    gradient); returns the reported values, the weight gradient and the collectives of the forward."""
    router = TopKRouter(HIDDEN, RouterConfig(num_experts=EXPERTS, topk=TOPK, **fields), **groups)
    with torch.no_grad():
        router.weight.copy_(router_weight())
    with CountAllReduce() as counter:
        out = router(x_TH, seq_len=seq_len, document_ids_T=document_ids_T)
    (loss_scale * (out.probs_TK * w_TK).sum()).backward()
    return {
        "losses": out.losses,
        "aux_loss": out.aux_loss,
        "probs": out.probs_TK.detach(),
        "grad": router.weight.grad.clone(),
        "collectives": counter.calls,
    }


def summed(grad: torch.Tensor, group) -> torch.Tensor:
    grad = grad.clone()
    dist.all_reduce(grad, group=group)
    return grad


def sequence_parallel_case(name: str, rank: int, world: int, group) -> dict:
    """A case with the whole world as one sequence group (and as stats_group, for global_aux_loss)."""
    fields = CASES[name]
    x_BSH, w_BSK = micro_batch()
    x_TH, w_TK = chunk(x_BSH, rank, world), chunk(w_BSK, rank, world)
    ref = route(fields, x_BSH.reshape(-1, HIDDEN), w_BSK.reshape(-1, TOPK), SEQ)
    sharded = route(fields, x_TH, w_TK, SEQ // world, stats_group=group, sequence_group=group)
    sharded["grad_sum"] = summed(sharded["grad"], group)
    naive = route(fields, x_TH, w_TK, SEQ // world, stats_group=group)  # what the router did before
    naive["grad_sum"] = summed(naive["grad"], group)
    return {"ref": ref, "sharded": sharded, "naive": naive}


def zigzag(t_BSX: torch.Tensor, index: int, size: int) -> torch.Tensor:
    """Context parallelism's layout: chunks ``index`` and ``2 size - 1 - index`` of ``2 size``, flattened."""
    length = t_BSX.shape[1] // (2 * size)
    pieces = [t_BSX[:, c * length : (c + 1) * length] for c in (index, 2 * size - 1 - index)]
    return torch.cat(pieces, dim=1).reshape(-1, t_BSX.shape[-1])


def padded_case(name: str, layout: str, rank: int, world: int, group) -> dict:
    """A padded case (:data:`DOCUMENT_IDS_BS`) with the whole world as one sequence group, each rank holding its
    tokens in ``layout``, against one process routing the full padded rows."""
    fields = {**CASES, **CASES_PADDED_ONLY}[name]
    cut = chunk if layout == "contiguous" else zigzag
    x_BSH, w_BSK = micro_batch()
    ids_T = cut(DOCUMENT_IDS_BS.unsqueeze(-1), rank, world).reshape(-1)
    ref = route(
        fields, x_BSH.reshape(-1, HIDDEN), w_BSK.reshape(-1, TOPK), SEQ, document_ids_T=DOCUMENT_IDS_BS.flatten()
    )
    x_TH, w_TK = cut(x_BSH, rank, world), cut(w_BSK, rank, world)
    sharded = route(fields, x_TH, w_TK, SEQ // world, document_ids_T=ids_T, stats_group=group, sequence_group=group)
    sharded["grad_sum"] = summed(sharded["grad"], group)
    return {"ref": ref, "sharded": sharded}


def size_one_cases(rank: int, world: int, group) -> dict:
    """A sequence group of size 1 against None, bit for bit, on this rank's own tokens."""
    singles = [dist.new_group([r]) for r in range(world)]  # every rank creates every group, in order
    x_BSH, w_BSK = micro_batch()
    x_TH, w_TK = chunk(x_BSH, rank, world), chunk(w_BSK, rank, world)
    results = {}
    for name in ("aux_plus_seq", "z_loss", "all_sigmoid"):
        results[name] = {
            label: route(CASES[name], x_TH, w_TK, SEQ // world, stats_group=group, sequence_group=seq_group)
            for label, seq_group in (("none", None), ("one", singles[rank]))
        }
    try:  # a purely data-parallel stats group would give global_aux_loss the wrong weight
        route(CASES["global"], x_TH, w_TK, SEQ // world, stats_group=singles[rank], sequence_group=group)
    except ValueError as err:
        results["bad_stats_group"] = str(err)
    return results


def data_parallel_global_case(rank: int, world: int) -> dict:
    """World 4 as 2 data-parallel replicas x sequence groups of 2: global_aux_loss against the Switch loss
    of both micro-batches, gradients summed over the sequence group and averaged over replicas."""
    sp = 2
    replicas = world // sp
    seq_groups = [dist.new_group(list(range(d * sp, (d + 1) * sp))) for d in range(replicas)]
    dp_groups = [dist.new_group(list(range(i, world, sp))) for i in range(sp)]
    replica, index = divmod(rank, sp)
    batches = [micro_batch(d) for d in range(replicas)]
    x_all = torch.cat([x.reshape(-1, HIDDEN) for x, _ in batches])
    w_all = torch.cat([w.reshape(-1, TOPK) for _, w in batches])
    fields = CASES["global"]
    ref = route({**fields, "load_balancing_type": "aux_loss"}, x_all, w_all, SEQ, loss_scale=1 / replicas)
    x_BSH, w_BSK = batches[replica]
    world_group = dist.new_group(list(range(world)))
    sharded = route(
        fields,
        chunk(x_BSH, index, sp),
        chunk(w_BSK, index, sp),
        SEQ // sp,
        stats_group=world_group,
        sequence_group=seq_groups[replica],
    )
    sharded["grad_avg"] = summed(summed(sharded["grad"], seq_groups[replica]), dp_groups[index]) / replicas
    return {"ref": ref, "sharded": sharded, "replica": replica}


def main(out_dir: Path) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))
    scenarios = Scenarios(out_dir)  # one scenario per case (_rank_scenarios.py)
    for name in CASES:
        scenarios.run(f"sp {name}", sequence_parallel_case, name, rank, world, group)
    for name in PADDED_CASES:
        for layout in LAYOUTS:
            scenarios.run(f"padded {name} {layout}", padded_case, name, layout, rank, world, group)
    scenarios.run("size one", size_one_cases, rank, world, group)
    if world == 4:
        scenarios.run("dp global", data_parallel_global_case, rank, world)
    scenarios.finish()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
