"""Snapshot of moe_memory's public interface. Changing it is an interface change: update
docs/interfaces.md and this snapshot together, and bump the version (semver)."""

import importlib.metadata

import moe_memory

PUBLIC_NAMES = [
    "LiveTensorBytes",
    "__version__",
    "apply_activation_checkpointing",
    "select_modules",
]


def test_version_is_semver_0_1() -> None:
    assert moe_memory.__version__ == "0.1.1"
    assert importlib.metadata.version("moe-memory") == moe_memory.__version__


def test_public_names_match_snapshot() -> None:
    assert sorted(moe_memory.__all__) == PUBLIC_NAMES


def test_every_public_name_resolves() -> None:
    missing = [name for name in moe_memory.__all__ if not hasattr(moe_memory, name)]
    assert missing == []
