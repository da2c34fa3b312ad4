"""moe-dispatch: routers, token permutation and token dispatchers for Mixture-of-Experts training."""

from moe_dispatch.accounting import bytes_sent, rows_sent
from moe_dispatch.allgather import AllGatherDispatcher, AllGatherHandle
from moe_dispatch.alltoall import AllToAllDispatcher, AllToAllHandle
from moe_dispatch.capacity import capacity_keep_mask, get_capacity
from moe_dispatch.collectives import (
    all_gather_uneven,
    all_to_all,
    finish_all_to_all,
    reduce_scatter_uneven,
    start_all_to_all,
)
from moe_dispatch.config import RouterConfig, RouterConfigError
from moe_dispatch.deepep import DeepEPBuffer, DeepEPUnavailableError, FlexDispatcher, FlexHandle, deepep_buffer
from moe_dispatch.delayed_link import DelayedLink
from moe_dispatch.dispatcher import DispatchHandle, DispatchResult, InFlight, LocalDispatcher, TokenDispatcher
from moe_dispatch.ep_base import ExpertParallelDispatcher
from moe_dispatch.expert_bias import update_expert_bias
from moe_dispatch.factory import DISPATCHERS, build_dispatcher
from moe_dispatch.lanes import Lanes, OtherLaneFailed
from moe_dispatch.load_balancing import (
    AuxLossAutoScaler,
    attach_aux_loss,
    global_aux_loss,
    seq_aux_loss,
    switch_aux_loss,
    z_loss,
)
from moe_dispatch.overlap import OVERLAP_MODES, exchange_chunked
from moe_dispatch.permutation import (
    PermutationMap,
    make_permutation_map,
    permute,
    permute_probs,
    triton_available,
    unpermute,
)
from moe_dispatch.replay import RoutingReplay
from moe_dispatch.router import RouterGroups, RoutingResult, TopKRouter
from moe_dispatch.scores import group_limited_topk
from moe_dispatch.stats import routing_stats
from moe_dispatch.wire import WireCodec, all_gather_encoded, all_to_all_encoded

__version__ = "0.8.1"

__all__ = [
    "DISPATCHERS",
    "OVERLAP_MODES",
    "AllGatherDispatcher",
    "AllGatherHandle",
    "AllToAllDispatcher",
    "AllToAllHandle",
    "AuxLossAutoScaler",
    "DeepEPBuffer",
    "DelayedLink",
    "DeepEPUnavailableError",
    "DispatchHandle",
    "DispatchResult",
    "ExpertParallelDispatcher",
    "FlexDispatcher",
    "FlexHandle",
    "InFlight",
    "Lanes",
    "LocalDispatcher",
    "OtherLaneFailed",
    "PermutationMap",
    "RouterConfig",
    "RouterConfigError",
    "RoutingReplay",
    "RouterGroups",
    "RoutingResult",
    "TokenDispatcher",
    "TopKRouter",
    "WireCodec",
    "__version__",
    "all_gather_encoded",
    "all_gather_uneven",
    "all_to_all",
    "all_to_all_encoded",
    "attach_aux_loss",
    "build_dispatcher",
    "deepep_buffer",
    "exchange_chunked",
    "finish_all_to_all",
    "bytes_sent",
    "capacity_keep_mask",
    "get_capacity",
    "global_aux_loss",
    "group_limited_topk",
    "make_permutation_map",
    "permute",
    "permute_probs",
    "reduce_scatter_uneven",
    "routing_stats",
    "rows_sent",
    "seq_aux_loss",
    "start_all_to_all",
    "switch_aux_loss",
    "triton_available",
    "unpermute",
    "update_expert_bias",
    "z_loss",
]
