"""Snapshot of moe_dispatch's public interface. Changing it is an interface change: update
docs/interfaces.md and this snapshot together, and bump the version (semver)."""

import importlib.metadata

import moe_dispatch

PUBLIC_NAMES = [
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


def test_version_is_semver_0_1() -> None:
    assert moe_dispatch.__version__ == "0.1.0"
    assert importlib.metadata.version("moe-dispatch") == moe_dispatch.__version__


def test_public_names_match_snapshot() -> None:
    assert sorted(moe_dispatch.__all__) == PUBLIC_NAMES


def test_every_public_name_resolves() -> None:
    missing = [name for name in moe_dispatch.__all__ if not hasattr(moe_dispatch, name)]
    assert missing == []
