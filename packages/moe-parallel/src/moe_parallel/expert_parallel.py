"""Expert parallelism (ep) and expert tensor parallelism (etp) for the MoE blocks of a model, from outside it.

The MoE blocks are those the model's :class:`~moe_parallel.plan.ParallelPlan` names, each with a router
(:class:`~moe_dispatch.TopKRouter`), a token dispatcher and :class:`~moe_experts.GroupedExperts` holding every expert
(on the meta device or with values). Applying
ep x etp swaps in the experts this rank owns (``num_experts / ep`` of them, starting at ``ep_rank * E / ep``, each
the ``etp_rank``-th slice of the FFN width) with their values copied from the whole ones, and a distributed
dispatcher over the ep (and etp) process groups. Every rank must hold the same whole weights before (same seed or
the same checkpoint), or none at all (built on meta, materialised afterwards: :mod:`moe_parallel.materialize`).

Without expert tensor parallelism the experts' parameters become DTensors sharded along the experts over the ep
mesh: checkpoints (DCP) then hold the global tensors, loadable into any other layout, and FSDP2 composes with
them as with tensor parallelism. An etp slice of a gated projection is two column blocks (gate and up) of the whole
tensor, which no DTensor placement describes, so with ``etp > 1`` the parameters stay plain per-rank tensors;
for checkpoints, :mod:`moe_parallel.checkpoint_layout` gives every expert tensor a global form (gate and up apart)
that is the same under every layout, etp included.

LoRA adapters on the experts (:mod:`moe_experts.lora`) go with them: this rank's experts, each adapter split over
etp as the weight it adapts (:func:`moe_experts.lora.adapter_local_slice`); frozen parameters stay frozen.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from moe_dispatch import TopKRouter, WireCodec, build_dispatcher
from moe_experts import GroupedExperts, LoRAExpertLinear, add_expert_lora_
from moe_experts.lora import adapter_local_slice
from moe_parallel.mesh import ParallelMeshes
from moe_parallel.plan import MoEBlockPlan, ParallelPlan, submodule


class MoEBlockParts:
    """One planned MoE block's router, dispatcher and experts, read and swapped by the plan's attribute names."""

    def __init__(self, model: nn.Module, plan: MoEBlockPlan) -> None:
        self.plan, self.module = plan, submodule(model, plan.path)
        if not isinstance(getattr(self.module, plan.router, None), TopKRouter) or not isinstance(
            getattr(self.module, plan.experts, None), GroupedExperts
        ):
            raise ValueError(
                f"the parallel plan's MoE block {plan.path!r} needs a TopKRouter at .{plan.router} and GroupedExperts "
                f"at .{plan.experts}"
            )

    @property
    def router(self) -> TopKRouter:
        return getattr(self.module, self.plan.router)

    @property
    def experts(self) -> GroupedExperts:
        return getattr(self.module, self.plan.experts)

    @experts.setter
    def experts(self, value: GroupedExperts) -> None:
        setattr(self.module, self.plan.experts, value)

    @property
    def dispatcher(self):
        return getattr(self.module, self.plan.dispatcher)

    @dispatcher.setter
    def dispatcher(self, value) -> None:
        setattr(self.module, self.plan.dispatcher, value)


def moe_blocks(model: nn.Module, plan: ParallelPlan) -> list[MoEBlockParts]:
    """The MoE blocks ``plan`` names, as :class:`MoEBlockParts`."""
    return [MoEBlockParts(model, block) for block in plan.moe_blocks]


@torch.no_grad()
def shard_experts(whole: GroupedExperts, ep_rank: int, ep: int, etp_rank: int, etp: int) -> GroupedExperts:
    """The experts and FFN slice rank (ep_rank, etp_rank) holds, with ``whole``'s values (none on the meta device).

    ``whole.num_experts`` must divide by ``ep`` (:func:`~moe_parallel.check_plan` says so to users, once)."""
    if whole.first_expert != 0 or whole.etp_size != 1:
        raise ValueError("shard_experts needs the whole experts (first_expert=0, etp_size=1) as input")
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
        for projection in ("fc1", "fc2"):
            adapter = getattr(whole, projection)
            if isinstance(adapter, LoRAExpertLinear):
                dropout = getattr(adapter.dropout, "p", 0.0)
                add_expert_lora_(part, adapter.rank, adapter.alpha, dropout, projections=(projection,))
    part = part.to_empty(device=whole.w_gate_up_EH2F.device).to(whole.w_gate_up_EH2F.dtype)
    wholes = dict(whole.named_parameters())
    for name, mine in part.named_parameters():
        mine.requires_grad_(wholes[name].requires_grad)
        if not whole.w_gate_up_EH2F.is_meta:
            slicer = adapter_local_slice if "lora_" in name else GroupedExperts.local_slice
            for e in range(local):
                mine[e].copy_(slicer(part, name, wholes[name][first + e]))
    return part


def apply_expert_parallel(
    model: nn.Module,
    meshes: ParallelMeshes,
    plan: ParallelPlan,
    dispatcher: str = "alltoall",
    wire: WireCodec | None = None,
    overlap_chunks: int = 1,
) -> None:
    """Split the experts of every MoE block ``plan`` names over the ep x etp ranks, in place (module docstring).

    ``dispatcher``: ``alltoall``, ``allgather`` or ``flex`` (DeepEP; no etp). ``wire``: the tokens' dispatch format
    (e.g. moe-precision's blockwise FP8; ``moe_dispatch.wire``). ``overlap_chunks`` (alltoall): each layer's exchange
    pipelined over that many chunks (``moe_dispatch.overlap``). A no-op when ``ep == etp == 1``.
    """
    layout = meshes.layout
    if layout.ep == 1 and layout.etp == 1:
        return
    coords = layout.coords(meshes.rank, "expert")
    ep_group = meshes.group("ep")
    etp_group = meshes.group("etp") if layout.etp > 1 else None
    ep_mesh = meshes.expert["ep"]
    blocks = list(moe_blocks(model, plan))
    extra = {}
    if dispatcher == "flex" and blocks:  # one DeepEP buffer for every layer, sized for the widest
        from moe_dispatch.deepep import deepep_buffer

        extra["buffer"] = deepep_buffer(ep_group, max(block.experts.hidden_size for block in blocks))
    for block in blocks:
        block.experts = shard_experts(block.experts, coords["ep"], layout.ep, coords["etp"], layout.etp)
        if layout.etp == 1:
            for name, param in list(block.experts.named_parameters()):
                sharded = DTensor.from_local(param.detach(), ep_mesh, [Shard(0)], run_check=False)
                owner, _, attr = name.rpartition(".")
                module = block.experts.get_submodule(owner) if owner else block.experts
                setattr(module, attr, nn.Parameter(sharded, requires_grad=param.requires_grad))
        if overlap_chunks > 1:
            extra["overlap_chunks"] = overlap_chunks
        block.dispatcher = build_dispatcher(
            dispatcher, block.router.config.num_experts, ep_group=ep_group, etp_group=etp_group, wire=wire, **extra
        )
