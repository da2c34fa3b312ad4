"""moe-precision: FP8 / MXFP8 / NVFP4 formats, scaling recipes and quantised GEMMs for MoE training."""

from moe_precision.blockwise import (
    MXFP8,
    NVFP4,
    BlockwiseFP8,
    quantize_fp8_blockwise,
    quantize_mxfp8,
    quantize_nvfp4,
    random_hadamard_transform,
)
from moe_precision.config import PrecisionConfig, PrecisionConfigError
from moe_precision.formats import E2M1, E4M3, E5M2, E8M0, MiniFloat, decode, encode
from moe_precision.fp8 import Float8Tensor, FP8Format, current_scale, dequantize_tensorwise, quantize_tensorwise
from moe_precision.gemm import native_recipes, quantized_matmul
from moe_precision.layers import QuantizedGroupedLinear, QuantizedLinear, apply_precision
from moe_precision.recipes import RECIPES, Recipe, ScalingState
from moe_precision.wire import BlockwiseFP8Wire

__version__ = "0.2.2"

__all__ = [
    "E2M1",
    "E4M3",
    "E5M2",
    "E8M0",
    "MXFP8",
    "NVFP4",
    "RECIPES",
    "BlockwiseFP8",
    "BlockwiseFP8Wire",
    "FP8Format",
    "Float8Tensor",
    "MiniFloat",
    "PrecisionConfig",
    "PrecisionConfigError",
    "QuantizedGroupedLinear",
    "QuantizedLinear",
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
