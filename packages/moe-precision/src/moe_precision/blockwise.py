"""Block-scaled quantisation references: blockwise FP8, MXFP8 and NVFP4, for 2-D tensors ``[M, K]``.

Blocks tile the tensor from its first element: ``(1, b)`` blocks run along the last dimension (the reduction dimension
of the GEMM the tensor feeds, so that one scale multiplies whole dot-product partial sums), ``(b, b)`` blocks tile
both. A tensor whose sizes are not multiples of the block has smaller blocks at its edges (Megatron pads the
operands instead; the quantised values are the same).

- blockwise FP8 (DeepSeek-V3): E4M3 elements, one fp32 scale per block, ``fp8_max / amax``.
- MXFP8 (OCP microscaling): E4M3 elements, one E8M0 scale per 1x32 block, rounded up ("rceil").
- NVFP4: E2M1 elements, one E4M3 scale per 1x16 (or 16x16) block, and one fp32 scale for the whole tensor that puts
  the block scales in E4M3's range: ``global = 448 * 6 / amax(tensor)``, ``block = e4m3(amax(block) / 6 * global)``,
  elements ``e2m1(x * global / block)``, dequantised as ``q * block / global``.

A NaN or infinite amax gives a NaN scale, so that the whole block (or tensor) dequantises to NaN: training then
stops on a non-finite loss, instead of going on with a zero or unit scale that hides the overflow.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_precision.formats import E2M1, E4M3, MiniFloat, e8m0_scale_rceil, e8m0_value, round_e2m1, round_e2m1_stochastic

NVFP4_GLOBAL = E4M3.max * E2M1.max  # 448 * 6


def _check_2d(x: torch.Tensor) -> None:
    if x.ndim != 2:
        raise ValueError(f"block quantisation takes a 2-D [M, K] tensor, got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"block quantisation needs a floating-point tensor, got {x.dtype}")


def _padded_blocks(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``[M, K]`` zero-padded and viewed as ``[Mb, r, Kb, c]`` blocks."""
    (m, k), (r, c) = x.shape, block
    mb, kb = -(-m // r), -(-k // c)
    padded = torch.nn.functional.pad(x, (0, kb * c - k, 0, mb * r - m))
    return padded.view(mb, r, kb, c)


def block_amax(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``[Mb, Kb]`` fp32 amax of each block; NaN where the block holds a NaN (torch's amax propagates it)."""
    return _padded_blocks(x.float(), block).abs().amax(dim=(1, 3))


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """fp32 amax of the whole tensor: NaN if it holds a NaN, 0 if it is empty."""
    x = x.detach()
    return x.abs().amax().float() if x.numel() else torch.zeros((), device=x.device)


def expand_blocks(values_MbKb: torch.Tensor, block: tuple[int, int], shape: torch.Size) -> torch.Tensor:
    """One value per block broadcast to every element of its block, cropped to ``shape``."""
    r, c = block
    full = values_MbKb.repeat_interleave(r, dim=0).repeat_interleave(c, dim=1)
    return full[: shape[0], : shape[1]]


def scale_from_amax(amax: torch.Tensor, fmt_max: float, margin: int = 0) -> torch.Tensor:
    """``fmt_max / amax / 2**margin`` in fp32 (a correctly rounded division), at most fp32's largest value; 1 where
    amax is 0 (an all-zero block quantises to zeros whatever its scale); NaN where amax is NaN or infinite."""
    amax = amax.float()
    # tensor / tensor: torch computes python_scalar / tensor as reciprocal * scalar, one ulp off for some amaxes
    scale = torch.full_like(amax, fmt_max) / (amax * 2.0**margin)
    # a tiny amax (fp32 subnormal) would overflow the scale to inf, and inf * x / inf is NaN: clamp as TE does
    scale = scale.clamp(max=torch.finfo(torch.float32).max)
    scale = torch.where(amax > 0, scale, torch.ones_like(scale))
    return torch.where(torch.isfinite(amax), scale, torch.full_like(scale, torch.nan))


def cast_saturating(x_scaled: torch.Tensor, fmt: MiniFloat) -> torch.Tensor:
    """fp32 values already scaled into ``fmt``'s range cast to its torch dtype, magnitudes past the largest finite
    value clamped to it; NaN stays NaN."""
    assert fmt.torch_dtype is not None
    return x_scaled.clamp(-fmt.max, fmt.max).to(fmt.torch_dtype)


@dataclass(frozen=True)
class BlockwiseFP8:
    """``data`` FP8 ``[M, K]`` and ``scale`` fp32 ``[Mb, Kb]``: ``x ~= data / scale`` block by block."""

    data: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        scale = expand_blocks(self.scale, self.block, self.data.shape)
        return (self.data.float() / scale).to(dtype)


def quantize_fp8_blockwise(x: torch.Tensor, block: tuple[int, int] = (1, 128), fmt: MiniFloat = E4M3) -> BlockwiseFP8:
    """Blockwise FP8 with one fp32 scale per block (1x128 for activations and gradients, 128x128 for weights)."""
    _check_2d(x)
    scale = scale_from_amax(block_amax(x, block), fmt.max)
    scaled = x.float() * expand_blocks(scale, block, x.shape)
    return BlockwiseFP8(cast_saturating(scaled, fmt), scale, block)


@dataclass(frozen=True)
class MXFP8:
    """``data`` E4M3 ``[M, K]``, ``scale_e8m0`` uint8 codes ``[M, ceil(K / 32)]``: ``x ~= data * 2**(code - 127)``."""

    data: torch.Tensor
    scale_e8m0: torch.Tensor
    block: int = 32

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        scale = expand_blocks(e8m0_value(self.scale_e8m0), (1, self.block), self.data.shape)
        return (self.data.float() * scale).to(dtype)


def quantize_mxfp8(x: torch.Tensor, block: int = 32, fmt: MiniFloat = E4M3) -> MXFP8:
    """MXFP8: per 1x``block`` block the power-of-two scale rounded up from ``amax / fmt.max`` (so nothing
    saturates), elements ``x / scale`` cast to ``fmt`` (a power-of-two division is exact)."""
    _check_2d(x)
    codes = e8m0_scale_rceil(block_amax(x, (1, block)), fmt.max)
    scale = expand_blocks(e8m0_value(codes), (1, block), x.shape)
    return MXFP8(cast_saturating(x.float() / scale, fmt), codes, block)


@dataclass(frozen=True)
class NVFP4:
    """``values`` E2M1 values held in fp32 ``[M, K]`` (:func:`moe_precision.formats.encode` packs them into codes),
    ``block_scale`` E4M3 ``[Mb, Kb]`` and ``global_scale`` fp32 scalar: ``x ~= values * block_scale / global_scale``."""

    values: torch.Tensor
    block_scale: torch.Tensor
    global_scale: torch.Tensor
    block: tuple[int, int]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        scale = expand_blocks(self.block_scale.float(), self.block, self.values.shape) / self.global_scale
        return (self.values * scale).to(dtype)


def nvfp4_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """The per-tensor fp32 scale that maps the tensor's amax onto E4M3's max times E2M1's max."""
    return scale_from_amax(amax, NVFP4_GLOBAL)


def quantize_nvfp4(
    x: torch.Tensor,
    block: tuple[int, int] = (1, 16),
    *,
    stochastic: bool = False,
    global_amax: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> NVFP4:
    """NVFP4 (module docstring): 1x16 blocks for activations and gradients, 16x16 for weights; ``stochastic``
    rounds the elements stochastically (gradients). ``global_amax`` overrides the tensor's own amax (a tensor split
    over ranks shares one global scale)."""
    _check_2d(x)
    xf = x.float()
    global_scale = nvfp4_global_scale(tensor_amax(xf) if global_amax is None else global_amax)
    block_scale = cast_saturating(block_amax(xf, block) / E2M1.max * global_scale, E4M3)
    # the elements' scale as the decoder sees it: e4m3 block scale over the global scale
    decoded = expand_blocks(block_scale.float(), block, x.shape) / global_scale
    scaled = torch.where(decoded == 0, torch.zeros_like(xf), xf / decoded)  # a NaN scale stays NaN
    values = round_e2m1_stochastic(scaled, generator) if stochastic else round_e2m1(scaled)
    return NVFP4(values, block_scale, global_scale, block)


def hadamard_16(device: torch.device | str | None = None) -> torch.Tensor:
    """The 16x16 Sylvester Hadamard matrix divided by 4 (orthonormal), on ``device`` (None: the default device)."""
    h = torch.ones(1, 1, device=device)
    for _ in range(4):
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / 4.0


def random_hadamard_transform(x_MK: torch.Tensor, signs_16: torch.Tensor) -> torch.Tensor:
    """``x`` times the orthonormal block-diagonal ``diag(signs) H16`` along its last dimension (zero-padded to a
    multiple of 16, which the output keeps: the GEMM both operands feed sums over that dimension, so applying the same
    orthonormal map to both leaves the product unchanged while spreading outliers over 16 elements)."""
    m, k = x_MK.shape
    kb = -(-k // 16)
    padded = torch.nn.functional.pad(x_MK.float(), (0, kb * 16 - k)).view(m, kb, 16)
    # built on the operand's device: the signs and the matrix must meet there, not on the default (CPU) device
    rotation = signs_16.to(x_MK.device, torch.float32)[:, None] * hadamard_16(x_MK.device)
    return (padded @ rotation).view(m, kb * 16)
