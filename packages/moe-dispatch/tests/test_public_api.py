"""Snapshot of moe_dispatch's public interface. Changing it is an interface change: update
docs/interfaces.md and this snapshot together, and bump the version (semver)."""

import importlib.metadata

import moe_dispatch

PUBLIC_NAMES = [
    "AllGatherDispatcher",
    "AllGatherHandle",
    "AllToAllDispatcher",
    "AllToAllHandle",
    "AuxLossAutoScaler",
    "DISPATCHERS",
    "DeepEPBuffer",
    "DeepEPUnavailableError",
    "DelayedLink",
    "DispatchHandle",
    "DispatchResult",
    "ExpertParallelDispatcher",
    "FlexDispatcher",
    "FlexHandle",
    "InFlight",
    "Lanes",
    "LocalDispatcher",
    "OVERLAP_MODES",
    "OtherLaneFailed",
    "PermutationMap",
    "RouterConfig",
    "RouterConfigError",
    "RouterGroups",
    "RoutingReplay",
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
    "bytes_sent",
    "capacity_keep_mask",
    "deepep_buffer",
    "exchange_chunked",
    "finish_all_to_all",
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


def test_version() -> None:
    assert moe_dispatch.__version__ == "0.8.1"
    assert importlib.metadata.version("moe-dispatch") == moe_dispatch.__version__


def test_public_names_match_snapshot() -> None:
    assert sorted(moe_dispatch.__all__) == PUBLIC_NAMES


def test_every_public_name_resolves() -> None:
    missing = [name for name in moe_dispatch.__all__ if not hasattr(moe_dispatch, name)]
    assert missing == []
