"""``build_dispatcher(name, ...)``: one entry point for the token dispatchers."""

from __future__ import annotations

from typing import Any

from torch.distributed import ProcessGroup

from moe_dispatch.delayed_link import DelayedLink
from moe_dispatch.dispatcher import LocalDispatcher, TokenDispatcher
from moe_dispatch.wire import WireCodec

DISPATCHERS = ("local", "allgather", "alltoall", "flex")


def build_dispatcher(
    name: str,
    num_experts: int,
    ep_group: ProcessGroup | None = None,
    etp_group: ProcessGroup | None = None,
    pad_multiple: int = 1,
    wire: WireCodec | None = None,
    link: DelayedLink | None = None,
    overlap_chunks: int = 1,
    **kwargs: Any,
) -> TokenDispatcher:
    """``local`` (one process, all experts), ``allgather``, ``alltoall`` (deduplicated) or ``flex`` (DeepEP).

    ``ep_group`` defaults to the whole world for the distributed ones; ``etp_group`` turns on expert
    tensor parallelism (allgather / alltoall). ``wire`` (allgather / alltoall) sends the tokens encoded, e.g. as
    blockwise FP8 (:mod:`moe_dispatch.wire`). Extra keyword arguments go to ``FlexDispatcher``
    (``hidden_size``, or ``buffer``: one :class:`~moe_dispatch.deepep.DeepEPBuffer` shared by every layer).
    ``link`` (allgather / alltoall): a modelled link their collectives wait for (:mod:`moe_dispatch.delayed_link`).
    ``overlap_chunks`` (alltoall): pipeline the exchange over that many chunks (:mod:`moe_dispatch.overlap`).
    """
    if name not in DISPATCHERS:
        raise ValueError(f"dispatcher {name!r}: choose one of {DISPATCHERS}")
    if kwargs and name != "flex":
        raise TypeError(f"dispatcher {name!r} takes no extra arguments, got {sorted(kwargs)}")
    if wire is not None and name not in ("allgather", "alltoall"):
        raise ValueError(
            f"dispatcher {name!r} sends tokens in the compute dtype: an encoded wire needs allgather or alltoall"
        )
    if link is not None and name not in ("allgather", "alltoall"):
        raise ValueError(f"dispatcher {name!r} takes no modelled link: allgather and alltoall do")
    if overlap_chunks != 1 and name != "alltoall":
        raise ValueError(f"dispatcher {name!r} runs its exchange in turn: overlap_chunks needs alltoall")
    if name == "local":
        if ep_group is not None or etp_group is not None:
            raise ValueError("dispatcher 'local' keeps every expert in one process: pass no ep_group / etp_group")
        return LocalDispatcher(num_experts, pad_multiple)
    if name == "flex":
        if etp_group is not None:
            raise ValueError("dispatcher 'flex' does not support expert tensor parallelism: use 'alltoall'")
        from moe_dispatch.deepep import FlexDispatcher

        return FlexDispatcher(num_experts, ep_group, pad_multiple, **kwargs)
    if name == "allgather":
        from moe_dispatch.allgather import AllGatherDispatcher

        return AllGatherDispatcher(num_experts, ep_group, etp_group, pad_multiple, wire, link)
    from moe_dispatch.alltoall import AllToAllDispatcher

    return AllToAllDispatcher(num_experts, ep_group, etp_group, pad_multiple, wire, link, overlap_chunks)
