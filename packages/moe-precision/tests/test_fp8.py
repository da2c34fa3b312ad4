"""Tensorwise FP8 current scaling against an independent computation and the formats' error bounds."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_precision import Float8Tensor, FP8Format, current_scale, dequantize_tensorwise, quantize_tensorwise

SETTINGS = settings(max_examples=50, deadline=None)
FORMATS = [FP8Format.E4M3, FP8Format.E5M2]
# hand-written format facts: (torch dtype, largest finite, smallest normal, mantissa bits)
FACTS = {
    FP8Format.E4M3: (torch.float8_e4m3fn, 448.0, 2.0**-6, 3),
    FP8Format.E5M2: (torch.float8_e5m2, 57344.0, 2.0**-14, 2),
}


def reference_round_trip(x, fmt):
    """amax scaling, cast, unscale, all in fp32, computed here without the package."""
    dtype, fmt_max, _, _ = FACTS[fmt]
    x = x.float()
    amax = x.abs().max() if x.numel() else torch.tensor(0.0)
    scale = torch.tensor(fmt_max, dtype=torch.float32) / amax if amax > 0 else torch.tensor(1.0)
    return (x * scale).clamp(-fmt_max, fmt_max).to(dtype).float() / scale, scale


@st.composite
def tensors(draw):
    """fp32/bf16 tensors (empty included) whose magnitudes span many binades around 2**exponent."""
    numel = draw(st.integers(0, 64))
    exponent = draw(st.integers(-20, 20))
    spread = draw(st.integers(0, 12))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    mantissa = torch.rand(numel, generator=gen) + 0.5
    binade = torch.randint(-spread, spread + 1, (numel,), generator=gen).float()
    sign = torch.randint(0, 2, (numel,), generator=gen).float() * 2 - 1
    return (sign * mantissa * 2.0 ** (binade + exponent)).to(dtype)


def test_format_constants():
    for fmt, (dtype, fmt_max, _, _) in FACTS.items():
        assert fmt.dtype is dtype
        assert fmt.max == fmt_max
    assert FP8Format("e4m3") is FP8Format.E4M3 and FP8Format("e5m2") is FP8Format.E5M2


@SETTINGS
@given(tensors(), st.sampled_from(FORMATS))
def test_matches_independent_round_trip(x, fmt):
    q = quantize_tensorwise(x, fmt)
    ref, ref_scale = reference_round_trip(x, fmt)
    assert isinstance(q, Float8Tensor) and q.fmt is fmt
    assert q.data.dtype == fmt.dtype and q.data.shape == x.shape
    assert q.scale.dtype == torch.float32 and q.scale.shape == ()
    torch.testing.assert_close(q.scale, ref_scale, rtol=0, atol=0)
    torch.testing.assert_close(dequantize_tensorwise(q), ref, rtol=0, atol=0)
    torch.testing.assert_close(q.dequantize(), ref, rtol=0, atol=0)


@SETTINGS
@given(tensors(), st.sampled_from(FORMATS))
def test_round_trip_error_bounded_by_format_precision(x, fmt):
    """Round to nearest: relative error <= 2**-(mantissa bits + 1) where the scaled value is normal;
    below that (subnormal / flushed) the absolute error is at most half the subnormal spacing."""
    _, _, smallest_normal, mbits = FACTS[fmt]
    q = quantize_tensorwise(x, fmt)
    back = q.dequantize()
    x32 = x.float()
    assert torch.isfinite(back).all()
    err = (back - x32).abs()
    scaled = x32.abs() * q.scale
    normal = scaled >= smallest_normal
    slack = 1 + 1e-6  # fp32 rounding of the scale and the division
    assert (err[normal] <= 2.0 ** -(mbits + 1) * x32.abs()[normal] * slack).all()
    half_subnormal_step = smallest_normal * 2.0**-mbits / 2
    assert (err[~normal] <= half_subnormal_step / q.scale * slack).all()
    # signs survive (zero may come back for values far below amax)
    assert (back * x32 >= 0).all()


@SETTINGS
@given(tensors(), st.sampled_from(FORMATS))
def test_largest_magnitude_maps_to_format_max(x, fmt):
    if x.numel() == 0:
        return
    q = quantize_tensorwise(x, fmt)
    data = q.data.float()
    i = int(x.float().abs().argmax())
    assert data.abs().max().item() == fmt.max
    assert data[i].item() == fmt.max * (1.0 if x[i] > 0 else -1.0)
    torch.testing.assert_close(q.dequantize()[i], x.float()[i], rtol=2.0**-20, atol=0)


@SETTINGS
@given(st.sampled_from(FORMATS), st.integers(-12, 12), st.integers(1, 40), st.integers(0, 2**31 - 1))
def test_representable_values_come_back_exactly(fmt, exponent, numel, seed):
    """Values on the FP8 grid, times a power of two, with amax = fmt.max * 2**exponent: the scale is
    the exact power 2**-exponent and every value survives the round trip bit for bit."""
    dtype, fmt_max, _, _ = FACTS[fmt]
    gen = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 256, (numel,), generator=gen, dtype=torch.uint8)
    grid = bits.view(dtype).float()
    grid = grid[torch.isfinite(grid)]
    grid = torch.cat([grid, torch.tensor([fmt_max])])
    x = grid * 2.0**exponent
    q = quantize_tensorwise(x, fmt)
    assert q.scale.item() == 2.0**-exponent
    assert torch.equal(q.dequantize(), x)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("numel", [0, 7])
def test_all_zero_and_empty_tensors_use_scale_one(fmt, numel):
    x = torch.zeros(numel, 3)
    assert current_scale(x, fmt).item() == 1.0
    assert current_scale(x, fmt).dtype == torch.float32
    q = quantize_tensorwise(x, fmt)
    assert q.scale.item() == 1.0 and q.scale.dtype == torch.float32
    assert q.data.shape == (numel, 3) and q.data.dtype == fmt.dtype
    assert torch.equal(q.dequantize(), x)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_current_scale_hand_value_and_fp32(fmt, dtype):
    x = torch.tensor([0.5, -4.0, 2.0], dtype=dtype)
    scale = current_scale(x, fmt)
    assert scale.dtype == torch.float32
    assert scale.item() == fmt.max / 4.0
    q = quantize_tensorwise(x, fmt)
    assert q.scale.dtype == torch.float32
    # every value here is a power of two inside the range: exact round trip, in the requested dtype
    assert torch.equal(q.dequantize(), x.float())
    assert dequantize_tensorwise(q, dtype).dtype == dtype


@SETTINGS
@given(tensors(), st.sampled_from(FORMATS), st.integers(0, 6))
def test_margin_halves_scale_per_unit(x, fmt, margin):
    base = current_scale(x, fmt)
    scale = current_scale(x, fmt, margin=margin)
    assert scale.dtype == torch.float32
    if x.numel() == 0 or not x.abs().max() > 0:
        assert scale.item() == 1.0
    else:
        assert scale.item() == base.item() / 2**margin
        q = quantize_tensorwise(x, fmt, margin=margin)
        # the largest magnitude now lands 2**margin below the format max (still exactly representable)
        assert q.data.float().abs().max().item() == fmt.max / 2**margin


@pytest.mark.parametrize("fmt", FORMATS)
def test_negative_margin_saturates_instead_of_overflowing(fmt):
    x = torch.tensor([1.0, -0.25, 0.75])
    q = quantize_tensorwise(x, fmt, margin=-2)  # scale 4x too large: the top values clip to +-max
    data = q.data.float()
    assert torch.isfinite(data).all()
    assert data[0].item() == fmt.max
    assert data[2].item() == fmt.max  # 0.75 * 4 * max is out of range too
    assert data[1].item() == -fmt.max


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.bool])
def test_non_float_input_raises_type_error(dtype):
    with pytest.raises(TypeError, match="floating-point"):
        quantize_tensorwise(torch.ones(3, dtype=dtype))


def test_quantize_does_not_track_gradients_through_the_scale():
    x = torch.tensor([1.0, -3.0], requires_grad=True)
    assert not current_scale(x, FP8Format.E4M3).requires_grad
