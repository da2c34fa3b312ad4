"""The element and scale formats against torch's own casts and against hand-written facts of their bit layouts."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_precision.blockwise import cast_saturating
from moe_precision.formats import (
    E2M1,
    E4M3,
    E5M2,
    E8M0,
    decode,
    e8m0_scale_rceil,
    e8m0_value,
    encode,
    representable,
    round_e2m1,
    round_e2m1_stochastic,
)

SETTINGS = settings(max_examples=60, deadline=None)


def by_hand(code: int, exponent_bits: int, mantissa_bits: int, bias: int) -> float:
    """A sign / exponent / mantissa code read with the textbook formula (subnormals at exponent 0)."""
    sign = -1.0 if code >> (exponent_bits + mantissa_bits) & 1 else 1.0
    e = (code >> mantissa_bits) & ((1 << exponent_bits) - 1)
    m = code & ((1 << mantissa_bits) - 1)
    if e == 0:
        return sign * m / 2**mantissa_bits * 2.0 ** (1 - bias)
    return sign * (1 + m / 2**mantissa_bits) * 2.0 ** (e - bias)


def test_format_facts():
    assert (E4M3.max, E5M2.max, E2M1.max, E8M0.max) == (448.0, 57344.0, 6.0, 2.0**127)
    assert representable(E2M1).tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert E4M3.min_subnormal == 2.0**-9 and E5M2.min_subnormal == 2.0**-16
    assert E4M3.min_normal == 2.0**-6 and E5M2.min_normal == 2.0**-14


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_decode_matches_torch_and_the_formula_for_every_code(fmt):
    codes = torch.arange(256, dtype=torch.int64)
    ours = decode(codes, fmt)
    torchs = codes.to(torch.uint8).view(fmt.torch_dtype).float()
    assert torch.equal(torch.isnan(ours), torch.isnan(torchs))
    finite = ~torch.isnan(ours)
    assert torch.equal(ours[finite], torchs[finite])
    for code in range(256):
        value = ours[code].item()
        if math.isfinite(value):
            assert value == by_hand(code, fmt.exponent_bits, fmt.mantissa_bits, fmt.bias), code
    assert int(torch.isnan(ours).sum()) == (2 if fmt is E4M3 else 6)  # E4M3: S.1111.111; E5M2: exponent 31, m != 0
    assert int(torch.isinf(ours).sum()) == (0 if fmt is E4M3 else 2)


def test_e8m0_decode_matches_torch_for_every_code():
    codes = torch.arange(256, dtype=torch.int64)
    torchs = codes.to(torch.uint8).view(torch.float8_e8m0fnu).float()
    for ours in (decode(codes, E8M0), e8m0_value(codes)):
        assert torch.equal(torch.isnan(ours), torchs.isnan())
        assert torch.equal(ours[:255], torchs[:255])
    assert e8m0_value(torch.tensor([0, 127, 254])).tolist() == [2.0**-127, 1.0, 2.0**127]


def test_e2m1_decode_by_hand():
    codes = torch.arange(16)
    assert decode(codes, E2M1).tolist() == [by_hand(c, 2, 1, 1) for c in range(16)]
    assert decode(codes, E2M1)[:8].tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


floats = st.floats(width=32, allow_nan=True, allow_infinity=True)
small = st.floats(min_value=-(2.0**-10), max_value=2.0**-10, width=32)  # subnormals of both FP8 formats


@SETTINGS
@given(st.lists(st.one_of(floats, small, st.floats(-65536, 65536, width=32)), min_size=1, max_size=64))
@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_encode_is_torchs_saturating_cast_bit_for_bit(fmt, values):
    x = torch.tensor(values, dtype=torch.float32)
    ours = encode(x, fmt)
    torchs = cast_saturating(x, fmt).view(torch.uint8).to(torch.int64)
    nan = torch.isnan(x)
    assert torch.equal(ours[~nan], torchs[~nan])
    assert torch.isnan(decode(ours[nan], fmt)).all()


@SETTINGS
@given(st.lists(st.one_of(floats, st.floats(-8, 8, width=32)), min_size=1, max_size=64))
def test_e2m1_rounding_is_the_nearest_value_ties_to_even(values):
    x = torch.tensor(values, dtype=torch.float32)
    fast = round_e2m1(x)
    reference = decode(encode(x, E2M1), E2M1)
    nan = torch.isnan(x)
    assert torch.equal(fast[~nan], reference[~nan].copysign(x[~nan]))
    assert torch.isnan(fast[nan]).all()
    # nearest: no representable value is strictly closer (brute force over the grid)
    grid = torch.cat([representable(E2M1), -representable(E2M1)])
    finite = x[~nan].clamp(-6, 6)
    best = (finite[:, None] - grid[None]).abs().min(dim=1).values
    assert torch.equal((finite - fast[~nan]).abs(), best)


def test_e2m1_round_trip_of_every_code_and_ties():
    codes = torch.arange(16)
    assert torch.equal(encode(decode(codes, E2M1), E2M1), codes)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert round_e2m1(ties).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]  # the even code of each pair


def test_e2m1_stochastic_rounding_is_unbiased_and_picks_neighbours():
    gen = torch.Generator().manual_seed(0)
    for value in [0.3, 1.1, 2.4, 4.5, 5.9, -3.3]:
        x = torch.full((200_000,), value)
        r = round_e2m1_stochastic(x, gen)
        assert set(r.unique().abs().tolist()) <= set(representable(E2M1).tolist())
        assert len(r.unique()) == 2  # the two neighbours, nothing else
        assert abs(r.mean().item() - value) < 0.01
    exact = torch.tensor([0.0, 0.5, 3.0, 6.0, 9.0, -6.0])
    assert round_e2m1_stochastic(exact, gen).tolist() == [0.0, 0.5, 3.0, 6.0, 6.0, -6.0]


@SETTINGS
@given(st.floats(min_value=0, max_value=2.0**127, width=32, allow_subnormal=True))
def test_e8m0_rceil_is_the_smallest_power_of_two_that_does_not_saturate(amax):
    code = e8m0_scale_rceil(torch.tensor([amax]), E4M3.max)
    scale = e8m0_value(code).item()
    ratio = (torch.tensor(amax, dtype=torch.float32) * (1.0 / 448.0)).item()  # the hardware's fp32 product
    assert math.log2(scale).is_integer()
    assert scale >= ratio
    if code.item() > 0:
        assert scale / 2 < ratio or (code.item() == 1 and ratio <= 2.0**-126)
    # bit-exact with torch's E8M0 cast of the (exact) power of two
    assert torch.tensor([scale]).to(torch.float8_e8m0fnu).view(torch.uint8).item() == code.item()


def test_e8m0_rceil_specials():
    amax = torch.tensor([0.0, float("inf"), float("nan"), 448.0, 449.0, 3e38])
    codes = e8m0_scale_rceil(amax, E4M3.max).tolist()
    assert codes[:3] == [0, 0xFF, 0xFF]  # zero: the smallest scale; non-finite: NaN, not 0 or 1
    assert codes[3] == 127 and codes[4] == 128  # 448 fits scale 1; 449 needs 2
    assert codes[5] == 127 + math.ceil(math.log2(3e38 / 448))  # fp32's range: 2**120 at most
