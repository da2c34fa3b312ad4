"""Snapshot of moe_precision's public interface. Changing it is an interface change: update
docs/interfaces.md and this snapshot together, and bump the version (semver)."""

import importlib.metadata

import moe_precision

PUBLIC_NAMES = [
    "FP8Format",
    "Float8Tensor",
    "__version__",
    "current_scale",
    "dequantize_tensorwise",
    "quantize_tensorwise",
]


def test_version_is_semver_0_1() -> None:
    assert moe_precision.__version__ == "0.1.0"
    assert importlib.metadata.version("moe-precision") == moe_precision.__version__


def test_public_names_match_snapshot() -> None:
    assert sorted(moe_precision.__all__) == PUBLIC_NAMES


def test_every_public_name_resolves() -> None:
    missing = [name for name in moe_precision.__all__ if not hasattr(moe_precision, name)]
    assert missing == []
