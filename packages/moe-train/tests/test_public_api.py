"""Snapshot of moe_train's public interface. Changing it is an interface change: update
docs/interfaces.md and this snapshot together, and bump the version (semver)."""

import importlib.metadata

import moe_train

PUBLIC_NAMES = [
    "ConfigError",
    "DataConfig",
    "ExperimentConfig",
    "PeftConfig",
    "RunConfig",
    "TrainConfig",
    "__version__",
    "load_config",
    "preset_names",
]


def test_version() -> None:
    assert moe_train.__version__ == "0.20.0"
    assert importlib.metadata.version("moe-train") == moe_train.__version__


def test_public_names_match_snapshot() -> None:
    assert sorted(moe_train.__all__) == PUBLIC_NAMES


def test_every_public_name_resolves() -> None:
    missing = [name for name in moe_train.__all__ if not hasattr(moe_train, name)]
    assert missing == []
