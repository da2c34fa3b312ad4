"""Snapshot of moe_precision's public interface. Changing it is an interface change: update
docs/interfaces.md and this snapshot together, and bump the version (semver)."""

import importlib.metadata

import moe_precision

PUBLIC_NAMES = [
    "BlockwiseFP8",
    "BlockwiseFP8Wire",
    "E2M1",
    "E4M3",
    "E5M2",
    "E8M0",
    "FP8Format",
    "Float8Tensor",
    "MXFP8",
    "MiniFloat",
    "NVFP4",
    "PrecisionConfig",
    "PrecisionConfigError",
    "QuantizedGroupedLinear",
    "QuantizedLinear",
    "RECIPES",
    "Recipe",
    "ScalingState",
    "__version__",
    "apply_precision",
    "current_scale",
    "decode",
    "dequantize_tensorwise",
    "encode",
    "native_recipes",
    "quantize_fp8_blockwise",
    "quantize_mxfp8",
    "quantize_nvfp4",
    "quantize_tensorwise",
    "quantized_matmul",
    "random_hadamard_transform",
]


def test_version_is_semver_0_2() -> None:
    assert moe_precision.__version__ == "0.2.2"
    assert importlib.metadata.version("moe-precision") == moe_precision.__version__


def test_public_names_match_snapshot() -> None:
    assert sorted(moe_precision.__all__) == PUBLIC_NAMES


def test_every_public_name_resolves() -> None:
    missing = [name for name in moe_precision.__all__ if not hasattr(moe_precision, name)]
    assert missing == []
