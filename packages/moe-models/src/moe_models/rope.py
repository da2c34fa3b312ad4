"""Rotary position embeddings: plain RoPE, YaRN and Llama 3.1's context extension, in the rotate-half or interleaved
layout.

Tables are computed on the fly from the config (no cached state on modules), in fp32.
"""

from __future__ import annotations

import math

import torch

from moe_models.config import ModelConfig, yarn_mscale


def _yarn_inv_freq(c: ModelConfig, dim: int, device: torch.device) -> torch.Tensor:
    """YaRN: interpolated frequencies for the long wavelengths, original ones for the short, a linear ramp between."""
    base, factor = c.rotary_base, c.rotary_scaling_factor
    pos_freqs = base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)

    def correction_dim(rotations: float) -> float:
        # the dimension whose wavelength completes `rotations` turns over the original context
        return dim * math.log(c.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(c.beta_fast), correction_dim(c.beta_slow)
    if c.rope_yarn_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, device=device, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep_original = 1 - ramp
    return interpolated * (1 - keep_original) + extrapolated * keep_original


def _yarn_attention_factor(c: ModelConfig) -> float:
    """Scale of cos/sin under YaRN: mscale(f, mscale) / mscale(f, mscale_all_dim), or mscale(f) if either is 0."""
    if c.mscale and c.mscale_all_dim:
        return yarn_mscale(c.rotary_scaling_factor, c.mscale) / yarn_mscale(c.rotary_scaling_factor, c.mscale_all_dim)
    return yarn_mscale(c.rotary_scaling_factor)


def _llama3_inv_freq(c: ModelConfig, dim: int, device: torch.device | None) -> torch.Tensor:
    """Llama 3.1's frequencies: wavelengths longer than the original context / low_freq_factor slowed down by the
    factor, those shorter than ... / high_freq_factor kept, a smooth interpolation between."""
    inv_freq = 1.0 / c.rotary_base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
    factor, low, high = c.rotary_scaling_factor, c.rope_low_freq_factor, c.rope_high_freq_factor
    context = c.original_max_position_embeddings
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > context / low, inv_freq / factor, inv_freq)
    if high == low:  # a hard cut at the original context (Llama 4 Scout), no ramp
        return scaled
    smooth = (context / wavelength - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelength >= context / high) & (wavelength <= context / low)
    return torch.where(medium, smoothed, scaled)


def rotary_cos_sin(
    c: ModelConfig, positions: int | torch.Tensor, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[S, D/2]`` (one column per frequency), D = ``c.rotary_dim``, for positions 0..S-1
    (``positions`` an int S) or for the given positions of the sequence (an int tensor ``[S]``, on its device); for
    per-row positions (``[B, S]``: each token's position in its packed document) tables ``[B, S, D/2]``."""
    if isinstance(positions, torch.Tensor):
        device = positions.device
    dim = c.rotary_dim
    if c.rope_type == "yarn":
        inv_freq, scale = _yarn_inv_freq(c, dim, device), _yarn_attention_factor(c)
    elif c.rope_type == "llama3":
        inv_freq, scale = _llama3_inv_freq(c, dim, device), 1.0
    else:
        inv_freq = 1.0 / c.rotary_base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
        scale = 1.0
    pos_S = positions.float() if isinstance(positions, torch.Tensor) else torch.arange(positions, device=device).float()
    angles_SF = torch.outer(pos_S, inv_freq) if pos_S.dim() == 1 else pos_S.unsqueeze(-1) * inv_freq
    return angles_SF.cos() * scale, angles_SF.sin() * scale


def apply_rotary(
    x_BNSD: torch.Tensor, cos_SF: torch.Tensor, sin_SF: torch.Tensor, interleaved: bool = False
) -> torch.Tensor:
    """Rotate ``x`` (``[..., S, D]``) by the angles of ``[S, D/2]`` tables, or of per-row ``[B, S, D/2]`` tables for
    ``x`` of ``[B, N, S, D]`` (the same angles for every head).

    Rotate-half pairs dimension j with j + D/2 (HuggingFace Llama/Qwen/Mixtral/GPT-OSS); interleaved pairs 2j
    with 2j+1 (DeepSeek-V3 checkpoints) and returns the result in the rotate-half order: q and k are permuted
    alike, so their dot products are those of the interleaved rotation.
    """
    if interleaved:
        x1, x2 = x_BNSD[..., 0::2], x_BNSD[..., 1::2]
    else:
        x1, x2 = x_BNSD.chunk(2, dim=-1)
    cos, sin = cos_SF.to(x_BNSD.dtype), sin_SF.to(x_BNSD.dtype)
    if cos.dim() == 3:  # per-row tables [B, S, F]: broadcast over the heads
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
