"""moe-dispatch: routers, token permutation and token dispatchers for Mixture-of-Experts training."""

from moe_dispatch.config import RouterConfig
from moe_dispatch.dispatcher import DispatchHandle, DispatchResult, LocalDispatcher
from moe_dispatch.permutation import permute, sort_by_expert, unpermute
from moe_dispatch.router import RoutingResult, TopKRouter, switch_aux_loss

__version__ = "0.1.0"

__all__ = [
    "DispatchHandle",
    "DispatchResult",
    "LocalDispatcher",
    "RouterConfig",
    "RoutingResult",
    "TopKRouter",
    "__version__",
    "permute",
    "sort_by_expert",
    "switch_aux_loss",
    "unpermute",
]
