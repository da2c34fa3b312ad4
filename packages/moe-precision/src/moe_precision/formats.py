"""The element and scale formats, written out from their bit layouts.

Each :class:`MiniFloat` is a sign / exponent / mantissa layout (OCP 8-bit floating point and microscaling specs):

- E4M3 (``float8_e4m3fn``): bias 7, no infinities, only S.1111.111 is NaN, largest 448.
- E5M2 (``float8_e5m2``): bias 15, IEEE-like infinities and NaNs, largest 57344.
- E2M1 (FP4, NVFP4's elements): bias 1, no infinities or NaN, values 0, 0.5, 1, 1.5, 2, 3, 4, 6.
- E8M0 (microscaling scales): 8 exponent bits, no sign or mantissa, ``2**(code - 127)``, 0xFF is NaN.

:func:`decode` turns codes into fp32 from the layout alone; :func:`encode` rounds fp32 to the nearest code (ties to
even, saturating at the largest finite value, NaN to the NaN code where there is one). For E4M3 and E5M2 torch's
casts do the same and are what the quantisers use (tests hold the two bit for bit); FP4 has no torch cast, so its
quantiser uses :func:`round_e2m1` (and its stochastic variant), tested against :func:`encode` / :func:`decode`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MiniFloat:
    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int
    has_sign: bool = True
    ieee_specials: bool = False  # all-ones exponent is inf / NaN (E5M2); otherwise only the codes in nan_codes
    nan_codes: tuple[int, ...] = ()
    torch_dtype: torch.dtype | None = None

    @property
    def bits(self) -> int:
        return int(self.has_sign) + self.exponent_bits + self.mantissa_bits

    @property
    def max(self) -> float:
        """Largest finite value."""
        top_exponent = (1 << self.exponent_bits) - 1
        if self.ieee_specials:
            top_exponent -= 1
        mantissa = (1 << self.mantissa_bits) - 1
        top_code = (top_exponent << self.mantissa_bits) | mantissa
        while top_code in self.nan_codes:
            top_code -= 1
        e, m = top_code >> self.mantissa_bits, top_code & ((1 << self.mantissa_bits) - 1)
        return _value(e, m, self)

    @property
    def min_normal(self) -> float:
        return 2.0 ** (1 - self.bias)

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (1 - self.bias - self.mantissa_bits) if self.mantissa_bits else self.min_normal


def _value(e: int, m: int, fmt: MiniFloat) -> float:
    if fmt.mantissa_bits == 0:
        return 2.0 ** (e - fmt.bias)
    if e == 0:  # subnormal
        return m * 2.0 ** (1 - fmt.bias - fmt.mantissa_bits)
    return (1 + m / (1 << fmt.mantissa_bits)) * 2.0 ** (e - fmt.bias)


E4M3 = MiniFloat("e4m3", 4, 3, 7, nan_codes=(0x7F,), torch_dtype=torch.float8_e4m3fn)
E5M2 = MiniFloat("e5m2", 5, 2, 15, ieee_specials=True, torch_dtype=torch.float8_e5m2)
E2M1 = MiniFloat("e2m1", 2, 1, 1)
E8M0 = MiniFloat("e8m0", 8, 0, 127, has_sign=False, nan_codes=(0xFF,), torch_dtype=torch.float8_e8m0fnu)


def decode(codes: torch.Tensor, fmt: MiniFloat) -> torch.Tensor:
    """fp32 values of integer ``codes`` (any integer dtype, one code per element) of format ``fmt``."""
    c = codes.to(torch.int64) & ((1 << fmt.bits) - 1)
    payload_bits = fmt.exponent_bits + fmt.mantissa_bits
    payload = c & ((1 << payload_bits) - 1)
    e = payload >> fmt.mantissa_bits
    m = (payload & ((1 << fmt.mantissa_bits) - 1)).double()
    if fmt.mantissa_bits:
        frac = m / (1 << fmt.mantissa_bits)
        normal = (1 + frac) * torch.exp2((e - fmt.bias).double())
        sub = frac * 2.0 ** (1 - fmt.bias)
        magnitude = torch.where(e == 0, sub, normal)
    else:
        magnitude = torch.exp2((e - fmt.bias).double())
    sign = torch.where((c >> payload_bits) & 1 == 1, -1.0, 1.0) if fmt.has_sign else torch.ones_like(magnitude)
    out = sign * magnitude
    if fmt.ieee_specials:
        top = e == (1 << fmt.exponent_bits) - 1
        out = torch.where(top & (m == 0), sign * torch.inf, out)
        out = torch.where(top & (m != 0), torch.nan, out)
    for nan in fmt.nan_codes:
        out = torch.where(payload == (nan & ((1 << payload_bits) - 1)), torch.nan, out)
    return out.float()


def representable(fmt: MiniFloat) -> torch.Tensor:
    """The finite non-negative values of ``fmt``, ascending (for a signed format, the magnitudes)."""
    return decode(encode_grid_codes(fmt), fmt)


def encode(x: torch.Tensor, fmt: MiniFloat) -> torch.Tensor:
    """int64 codes of the values of ``fmt`` nearest to fp32 ``x``: ties to the even code, magnitudes past the largest
    finite value saturate to it (infinities too), NaN to the format's NaN code (0 where it has none). A hand-written
    reference: it searches the sorted representable values, with no floating-point tricks."""
    x = x.float()
    payload_bits = fmt.exponent_bits + fmt.mantissa_bits
    grid_codes = encode_grid_codes(fmt)
    grid = decode(grid_codes, fmt).double()
    mag = x.abs().double().clamp(max=grid[-1].item())
    hi = torch.searchsorted(grid, mag).clamp(max=len(grid) - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = mag - grid[lo], grid[hi] - mag
    code_lo, code_hi = grid_codes[lo], grid_codes[hi]
    take_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (code_hi % 2 == 0) & (code_lo % 2 == 1))
    codes = torch.where(take_hi, code_hi, code_lo)
    if fmt.has_sign:
        codes = torch.where(torch.signbit(x), codes | (1 << payload_bits), codes)
    nan_code = fmt.nan_codes[0] if fmt.nan_codes else ((1 << payload_bits) - 1 if fmt.ieee_specials else 0)
    return torch.where(torch.isnan(x), torch.tensor(nan_code), codes)


def encode_grid_codes(fmt: MiniFloat) -> torch.Tensor:
    """The codes of :func:`representable`'s values, in the same order."""
    payload_bits = fmt.exponent_bits + fmt.mantissa_bits
    codes = torch.arange(1 << payload_bits)
    values = decode(codes, fmt)
    finite = torch.isfinite(values)
    codes, values = codes[finite], values[finite]
    order = torch.argsort(values, stable=True)
    codes, values = codes[order], values[order]
    first = torch.ones_like(values, dtype=torch.bool)
    first[1:] = values[1:] != values[:-1]
    return codes[first]


def _e2m1_step(mag: torch.Tensor) -> torch.Tensor:
    """The spacing of E2M1 values around a magnitude in [0, 6]: 0.5 below 2, 1 below 4, 2 up to 6."""
    return torch.where(mag < 2, 0.5, torch.where(mag < 4, 1.0, 2.0)).to(mag.dtype)


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """``x`` (fp32, already scaled) rounded to the nearest E2M1 value, ties to even, saturating at +-6 (NaN stays
    NaN so that a bad scale is seen). The fast path of the FP4 quantiser, equal to ``decode(encode(x))``: within each
    binade the values are evenly spaced and an even multiple of the spacing is an even code, so ``torch.round``'s
    ties-to-even is the format's."""
    mag = x.abs().clamp(max=6.0)
    step = _e2m1_step(mag)
    out = (torch.round(mag / step) * step).copysign(x)
    return torch.where(torch.isnan(x), x, out)


def round_e2m1_stochastic(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """``x`` rounded to one of its two neighbouring E2M1 values with probability proportional to closeness, so that
    the expectation is ``x`` inside the range (gradients, as NVFP4 training rounds them); saturating at +-6."""
    mag = x.abs().clamp(max=6.0)
    step = _e2m1_step(mag)
    low = torch.floor(mag / step) * step
    u = torch.rand(x.shape, generator=generator, device=x.device, dtype=x.dtype)
    out = torch.where(u * step < mag - low, low + step, low).copysign(x)
    return torch.where(torch.isnan(x), x, out)


def e8m0_scale_rceil(amax: torch.Tensor, element_max: float) -> torch.Tensor:
    """The E8M0 code of the smallest power of two ``s`` with ``amax / s <= element_max`` (the "rceil" rounding of
    the scale: up, so that no element saturates), as the hardware's round-up conversion of ``amax / element_max``.

    Zero amax gives the smallest scale (code 0); NaN or infinite amax gives the NaN code 0xFF, so that the block
    dequantises to NaN rather than to silently wrong values.
    """
    ratio = amax.float() * (1.0 / element_max)
    bits = ratio.view(torch.int32).to(torch.int64)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    code = exponent + (mantissa != 0).to(torch.int64)  # a subnormal ratio rounds up to 2**-126 (code 1)
    code = code.clamp(max=0xFE)
    bad = ~torch.isfinite(amax)
    return torch.where(bad, torch.tensor(0xFF, device=amax.device), code).to(torch.uint8)


def e8m0_value(code: torch.Tensor) -> torch.Tensor:
    """fp32 value of E8M0 codes: ``2**(code - 127)``, NaN for 0xFF."""
    c = code.to(torch.int64)
    value = torch.exp2((c - 127).double()).float()
    return torch.where(c == 0xFF, torch.nan, value)
