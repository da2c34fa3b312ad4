"""Snapshot of moe_memory's public interface. Changing it is an interface change: update
docs/interfaces.md and this snapshot together, and bump the version (semver)."""

import importlib.metadata

import moe_memory

PUBLIC_NAMES = [
    "ExpertsShape",
    "GQAShape",
    "GatedDeltaNetShape",
    "KimiDeltaShape",
    "LayerShape",
    "LiveTensorBytes",
    "LocalParameters",
    "MLAShape",
    "Mamba2Shape",
    "MemoryConfigError",
    "MemoryEstimate",
    "MemoryPolicy",
    "ModelShape",
    "OFFLOAD_KINDS",
    "OUTPUT_DISCARDING_KINDS",
    "PipelineShare",
    "RECOMPUTE_KINDS",
    "RunShape",
    "SavedTensor",
    "SavedTensorBytes",
    "SavedTensorPolicy",
    "SavedTensorStats",
    "__version__",
    "apply_activation_checkpointing",
    "apply_memory_policy",
    "check_memory_options",
    "estimate_memory",
    "format_estimates",
    "select_modules",
]


def test_version() -> None:
    assert moe_memory.__version__ == "0.7.2"
    assert importlib.metadata.version("moe-memory") == moe_memory.__version__


def test_public_names_match_snapshot() -> None:
    assert sorted(moe_memory.__all__) == PUBLIC_NAMES


def test_every_public_name_resolves() -> None:
    missing = [name for name in moe_memory.__all__ if not hasattr(moe_memory, name)]
    assert missing == []
