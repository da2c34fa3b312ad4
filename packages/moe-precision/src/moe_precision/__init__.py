"""moe-precision: FP8 / MXFP8 / NVFP4 formats, scaling recipes and quantized GEMMs for MoE training."""

from moe_precision.fp8 import Float8Tensor, FP8Format, current_scale, dequantize_tensorwise, quantize_tensorwise

__version__ = "0.1.0"

__all__ = [
    "FP8Format",
    "Float8Tensor",
    "__version__",
    "current_scale",
    "dequantize_tensorwise",
    "quantize_tensorwise",
]
