"""What the expert-parallel dispatchers share: the ep / etp groups, the local expert range, padding.

Layout: rank ``r`` of the expert-parallel group ``ep_group`` owns experts ``[r*E/ep, (r+1)*E/ep)``. With
expert tensor parallelism, the ranks of one ``etp_group`` hold the same experts (the same ep rank in
their ep groups), each a slice of the FFN width: after the ep exchange they all-gather their tokens so
each computes its slice for all of them, and on combine the partial outputs are summed by a
reduce-scatter over etp before the ep return.

Capacity padding: a routing with ``pad_to=C`` caps every expert at C pairs per source rank, so an expert
block on the receiving side is padded to ``C * ep * etp`` rows (every source rank of the ep x etp grid
may fill its C), as Megatron's drop-and-pad all-to-all does. All ranks must use the same ``pad_to``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from moe_dispatch.collectives import all_gather_uneven, all_to_all, group_rank, group_size
from moe_dispatch.delayed_link import DelayedLink
from moe_dispatch.dispatcher import HandleT, StateT, TokenDispatcher
from moe_dispatch.lanes import Lanes
from moe_dispatch.permutation import PermutationMap, make_permutation_map
from moe_dispatch.wire import WireCodec, all_gather_encoded, all_to_all_encoded


class ExpertParallelDispatcher(TokenDispatcher[StateT, HandleT]):
    """Base of the dispatchers that move tokens between the ranks of an expert-parallel group."""

    def __init__(
        self,
        num_experts: int,
        ep_group: ProcessGroup | None = None,
        etp_group: ProcessGroup | None = None,
        pad_multiple: int = 1,
        wire: WireCodec | None = None,
        link: DelayedLink | None = None,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(f"{type(self).__name__} needs an initialised torch.distributed process group")
        if pad_multiple < 1:
            raise ValueError(f"pad_multiple={pad_multiple}: must be at least 1")
        self.ep_group = ep_group if ep_group is not None else dist.group.WORLD
        self.etp_group = etp_group
        self.ep_size = group_size(self.ep_group)
        self.ep_rank = group_rank(self.ep_group)
        self.etp_size = 1 if etp_group is None else group_size(etp_group)
        if num_experts % self.ep_size:
            raise ValueError(f"num_experts={num_experts} is not divisible by the expert-parallel size {self.ep_size}")
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.ep_size
        self.first_local_expert = self.ep_rank * self.num_local_experts
        self.pad_multiple = pad_multiple
        self.wire = wire  # the tokens' dispatch format (moe_dispatch.wire); None: the compute dtype
        self.link = link  # a modelled link every collective waits for (moe_dispatch.delayed_link); None: real only
        # two micro-batches in flight take turns at this dispatcher's all-to-alls (moe_dispatch.lanes); set by
        # moe_parallel for ep_overlap microbatch, None otherwise
        self.lanes: Lanes | None = None

    def row_bytes(self, hidden: int, element_size: int) -> int:
        """Bytes a dispatched token row takes on the wire."""
        return self.wire.row_bytes(hidden) if self.wire is not None else hidden * element_size

    def send_tokens(
        self, x: torch.Tensor, out_splits: tuple[int, ...], in_splits: tuple[int, ...], group: ProcessGroup | None
    ) -> torch.Tensor:
        """The dispatch's all-to-all of token rows, in the wire format when there is one."""
        if self.wire is None:
            return all_to_all(x, out_splits, in_splits, group, self.link)
        return all_to_all_encoded(x, out_splits, in_splits, group, self.wire, self.link)

    def gather_tokens(self, x: torch.Tensor, sizes: tuple[int, ...], group: ProcessGroup | None) -> torch.Tensor:
        """The dispatch's all-gather of token rows, in the wire format when there is one."""
        if self.wire is None:
            return all_gather_uneven(x, sizes, group, self.link)
        return all_gather_encoded(x, sizes, group, self.wire, self.link)

    @property
    def uses_etp(self) -> bool:
        return self.etp_size > 1

    def local_permutation_map(
        self, local_idx_RK: torch.Tensor, keep_RK: torch.Tensor, pad_to: int | None
    ) -> PermutationMap:
        """Expert-major map of the received rows onto the local experts (``local_idx`` is ignored where
        ``keep`` is False)."""
        padded = None if pad_to is None else pad_to * self.ep_size * self.etp_size
        return make_permutation_map(
            torch.where(keep_RK, local_idx_RK, torch.zeros_like(local_idx_RK)),
            self.num_local_experts,
            keep_RK,
            self.pad_multiple,
            padded,
        )
