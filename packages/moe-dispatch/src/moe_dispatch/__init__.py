"""moe-dispatch: routers, token permutation and token dispatchers for Mixture-of-Experts training."""

from moe_dispatch.config import RouterConfig
from moe_dispatch.dispatcher import DispatchHandle, DispatchResult, InFlight, LocalDispatcher, TokenDispatcher
from moe_dispatch.permutation import PermutationMap, make_permutation_map, permute, unpermute
from moe_dispatch.router import RoutingResult, TopKRouter, switch_aux_loss

__version__ = "0.1.0"

__all__ = [
    "DispatchHandle",
    "DispatchResult",
    "InFlight",
    "LocalDispatcher",
    "PermutationMap",
    "RouterConfig",
    "RoutingResult",
    "TokenDispatcher",
    "TopKRouter",
    "__version__",
    "make_permutation_map",
    "permute",
    "switch_aux_loss",
    "unpermute",
]
