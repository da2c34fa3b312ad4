"""Reference FP8 (E4M3 / E5M2) tensorwise quantisation with current scaling.

Current scaling: the scale is computed from the tensor being quantised (``fp8_max / amax``), so the
largest magnitude lands on the format's largest finite value. This is the plain-torch reference that
fused kernels and Transformer Engine's ``Float8CurrentScaling`` recipe are checked against.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from moe_precision.blockwise import scale_from_amax, tensor_amax


class FP8Format(Enum):
    """The two OCP FP8 formats: E4M3 (max 448) and E5M2 (max 57344)."""

    E4M3 = "e4m3"  # forward tensors: more mantissa
    E5M2 = "e5m2"  # gradients: more range

    @property
    def dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn if self is FP8Format.E4M3 else torch.float8_e5m2

    @property
    def max(self) -> float:
        return float(torch.finfo(self.dtype).max)


@dataclass(frozen=True)
class Float8Tensor:
    """FP8 payload plus the fp32 scale it was multiplied by: ``original ~= data / scale``."""

    data: torch.Tensor
    scale: torch.Tensor  # fp32 scalar
    fmt: FP8Format

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_tensorwise(self, dtype)


def current_scale(x: torch.Tensor, fmt: FP8Format, margin: int = 0) -> torch.Tensor:
    """``fp8_max / amax / 2**margin`` in fp32; 1.0 for an all-zero or empty tensor; NaN when ``x`` holds a NaN or an
    infinity (a zero or unit scale there would hide the overflow: the data dequantises to NaN instead)."""
    return scale_from_amax(tensor_amax(x), fmt.max, margin)


def quantize_tensorwise(x: torch.Tensor, fmt: FP8Format = FP8Format.E4M3, margin: int = 0) -> Float8Tensor:
    """Scale ``x`` so its amax lands on the format's max, then cast to FP8 (saturating)."""
    if not x.is_floating_point():
        raise TypeError(f"quantize_tensorwise needs a floating-point tensor, got {x.dtype}")
    scale = current_scale(x, fmt, margin)
    scaled = (x.float() * scale).clamp(-fmt.max, fmt.max)
    return Float8Tensor(scaled.to(fmt.dtype), scale, fmt)


def dequantize_tensorwise(q: Float8Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Back to ``dtype``: ``data / scale``."""
    return (q.data.float() / q.scale).to(dtype)
