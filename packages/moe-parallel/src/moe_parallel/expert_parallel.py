"""Expert parallelism (ep) and expert tensor parallelism (etp) for the MoE blocks of a model, from outside it.

A MoE block is any module with ``router`` (:class:`~moe_dispatch.TopKRouter`), ``dispatcher`` and ``experts``
(:class:`~moe_experts.GroupedExperts` holding every expert) attributes, as moe_models' ``MoEBlock``. Applying
ep x etp swaps in the experts this rank owns (``num_experts / ep`` of them, starting at ``ep_rank * E / ep``, each
the ``etp_rank``-th slice of the FFN width) with their values copied from the whole ones, and a distributed
dispatcher over the ep (and etp) process groups. Every rank must hold the same whole weights before (same seed or
the same checkpoint), which is what makes the split model compute what the whole one did.

Without expert tensor parallelism the experts' parameters become DTensors sharded along the experts over the ep
mesh: checkpoints (DCP) then hold the global tensors, loadable into any other layout, and FSDP2 composes with
them as with tensor parallelism. An etp slice of a gated projection is two column blocks (gate and up) of the whole
tensor, which no DTensor placement describes, so with ``etp > 1`` the parameters stay plain per-rank tensors.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from moe_dispatch import TopKRouter, build_dispatcher
from moe_experts import GroupedExperts
from moe_parallel.mesh import ParallelMeshes


def moe_blocks(model: nn.Module) -> list[nn.Module]:
    """Every module of ``model`` with a router, a dispatcher and grouped experts."""
    return [
        m
        for m in model.modules()
        if isinstance(getattr(m, "router", None), TopKRouter)
        and isinstance(getattr(m, "experts", None), GroupedExperts)
        and hasattr(m, "dispatcher")
    ]


@torch.no_grad()
def shard_experts(whole: GroupedExperts, ep_rank: int, ep: int, etp_rank: int, etp: int) -> GroupedExperts:
    """The experts and FFN slice rank (ep_rank, etp_rank) holds, with ``whole``'s values."""
    if whole.first_expert != 0 or whole.etp_size != 1:
        raise ValueError("shard_experts needs the whole experts (first_expert=0, etp_size=1) as input")
    if whole.num_experts % ep:
        raise ValueError(f"num_experts={whole.num_experts} is not divisible by parallel.ep={ep}")
    local = whole.num_experts // ep
    first = ep_rank * local
    with torch.device("meta"):
        part = GroupedExperts(
            local,
            whole.hidden_size,
            whole.ffn_hidden_size,
            activation=whole.activation_name,
            backend=whole.requested_backend,
            bias=whole.has_bias,
            first_expert=first,
            seed=whole.seed,
            etp_rank=etp_rank,
            etp_size=etp,
        )
    part = part.to_empty(device=whole.w_gate_up_EH2F.device).to(whole.w_gate_up_EH2F.dtype)
    experts = slice(first, first + local)
    cols = part.local_gate_up_columns().to(whole.w_gate_up_EH2F.device)
    fl = part.local_ffn_hidden_size
    rows = slice(etp_rank * fl, (etp_rank + 1) * fl)
    part.w_gate_up_EH2F.copy_(whole.w_gate_up_EH2F[experts].index_select(2, cols))
    part.w_down_EFH.copy_(whole.w_down_EFH[experts, rows])
    if whole.has_bias:
        part.b_gate_up_E2F.copy_(whole.b_gate_up_E2F[experts].index_select(1, cols))
        part.b_down_EH.copy_(whole.b_down_EH[experts])
    return part


def apply_expert_parallel(model: nn.Module, meshes: ParallelMeshes, dispatcher: str = "alltoall") -> None:
    """Split the experts of every MoE block of ``model`` over the ep x etp ranks, in place (module docstring).

    ``dispatcher``: ``alltoall``, ``allgather`` or ``flex`` (DeepEP; no etp). A no-op when ``ep == etp == 1``.
    """
    layout = meshes.layout
    if layout.ep == 1 and layout.etp == 1:
        return
    coords = layout.coords(meshes.rank, "expert")
    ep_group = meshes.group("ep")
    etp_group = meshes.group("etp") if layout.etp > 1 else None
    ep_mesh = meshes.expert["ep"]
    for block in moe_blocks(model):
        block.experts = shard_experts(block.experts, coords["ep"], layout.ep, coords["etp"], layout.etp)
        if layout.etp == 1:
            for name, param in list(block.experts.named_parameters()):
                sharded = DTensor.from_local(param.detach(), ep_mesh, [Shard(0)], run_check=False)
                setattr(block.experts, name, nn.Parameter(sharded))
        block.dispatcher = build_dispatcher(
            dispatcher, block.router.config.num_experts, ep_group=ep_group, etp_group=etp_group
        )
