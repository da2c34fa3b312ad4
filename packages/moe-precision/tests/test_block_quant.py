"""Blockwise FP8, MXFP8 and NVFP4 against block-by-block references written here, and the scales' behaviour on
zeros, infinities, NaN, subnormals and saturation (a non-finite amax must never give a zero or unit scale)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_precision import (
    FP8Format,
    Recipe,
    quantize_fp8_blockwise,
    quantize_mxfp8,
    quantize_nvfp4,
    quantize_tensorwise,
    random_hadamard_transform,
)
from moe_precision.formats import E2M1, E4M3, decode, encode
from moe_precision.recipes import AmaxHistory

SETTINGS = settings(max_examples=40, deadline=None)


@st.composite
def matrices(draw, max_rows=40, max_cols=300):
    """fp32 [M, K] with magnitudes over many binades, zero rows and blocks, and edge blocks of any size."""
    m, k = draw(st.integers(1, max_rows)), draw(st.integers(1, max_cols))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    exponent = draw(st.integers(-30, 20))
    x = torch.randn(m, k, generator=gen) * 2.0 ** torch.randint(-8, 9, (m, k), generator=gen).float() * 2.0**exponent
    if draw(st.booleans()):
        x[: m // 2] = 0.0
    return x


def blocks_of(m, k, r, c):
    for i in range(0, m, r):
        for j in range(0, k, c):
            yield slice(i, i + r), slice(j, j + c)


@SETTINGS
@given(matrices(), st.sampled_from([(1, 128), (128, 128), (1, 32), (4, 8)]))
def test_blockwise_fp8_matches_block_by_block_reference(x, block):
    q = quantize_fp8_blockwise(x, block)
    assert q.data.dtype == torch.float8_e4m3fn and q.scale.dtype == torch.float32
    ref = torch.empty_like(x)
    for bi, (rows, cols) in enumerate(blocks_of(*x.shape, *block)):
        tile = x[rows, cols]
        amax = tile.abs().max()
        scale = torch.tensor(448.0) / amax if amax > 0 else torch.tensor(1.0)
        ref[rows, cols] = (tile * scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() / scale
        assert q.scale.flatten()[bi] == scale
    assert torch.equal(q.dequantize(), ref)


@SETTINGS
@given(matrices())
def test_mxfp8_matches_block_by_block_reference(x):
    q = quantize_mxfp8(x)
    assert q.scale_e8m0.shape == (x.shape[0], -(-x.shape[1] // 32))
    ref = torch.empty_like(x)
    for rows, cols in blocks_of(*x.shape, 1, 32):
        tile = x[rows, cols]
        ratio = (tile.abs().max() * torch.tensor(1 / 448, dtype=torch.float32)).item()
        scale = 2.0 ** math.ceil(math.log2(ratio)) if ratio > 0 else 2.0**-127
        scale = max(scale, 2.0**-127)
        ref[rows, cols] = (tile / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
        assert (tile.abs() / scale).max() <= 448  # rceil: nothing saturates
    assert torch.equal(q.dequantize(), ref)


@SETTINGS
@given(matrices(max_rows=48, max_cols=80), st.sampled_from([(1, 16), (16, 16)]))
def test_nvfp4_matches_block_by_block_reference(x, block):
    q = quantize_nvfp4(x, block)
    amax = x.abs().max()
    global_scale = torch.tensor(448.0 * 6.0) / amax if amax > 0 else torch.tensor(1.0)
    assert q.global_scale == global_scale
    ref = torch.empty_like(x)
    for bi, (rows, cols) in enumerate(blocks_of(*x.shape, *block)):
        tile = x[rows, cols]
        block_scale = (tile.abs().max() / 6.0 * global_scale).clamp(max=448).to(torch.float8_e4m3fn)
        assert q.block_scale.flatten()[bi].view(torch.uint8) == block_scale.view(torch.uint8)
        decoded = block_scale.float() / global_scale
        codes = encode(tile / decoded if decoded > 0 else torch.zeros_like(tile), E2M1)  # the hand-written encoder
        ref[rows, cols] = decode(codes, E2M1) * decoded
    assert torch.equal(q.dequantize(), ref)
    assert set(q.values.abs().unique().tolist()) <= {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0}


def test_zeros_and_empty_tensors_quantise_to_zeros():
    z = torch.zeros(3, 130)
    assert torch.equal(quantize_fp8_blockwise(z).dequantize(), z)
    assert torch.equal(quantize_mxfp8(z).dequantize(), z)
    assert torch.equal(quantize_nvfp4(z).dequantize(), z)
    assert quantize_tensorwise(z).scale == 1.0
    for r in ("fp8_tensorwise", "fp8_blockwise", "mxfp8", "nvfp4"):
        assert Recipe(r).fake_quantize(torch.zeros(0, 8), "input").shape == (0, 8)


def test_subnormal_inputs_keep_their_magnitude_under_block_scales():
    x = torch.full((1, 32), 1e-40)  # fp32 subnormals: a block scale brings them into range
    x[0, 0] = 3e-40
    for q in (quantize_fp8_blockwise(x), quantize_mxfp8(x)):
        torch.testing.assert_close(q.dequantize(), x, rtol=0.125, atol=0)  # E4M3: 3 mantissa bits


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_amax_gives_nan_not_zero_or_unit_scale(bad):
    x = torch.randn(2, 256)
    x[0, 5] = bad
    t = quantize_tensorwise(x, FP8Format.E4M3)
    assert torch.isnan(t.scale)  # a zero scale would turn everything to 0; a unit one would saturate silently
    assert torch.isnan(t.dequantize()).all()
    b = quantize_fp8_blockwise(x)
    assert torch.isnan(b.scale[0, 0]) and torch.isfinite(b.scale[0, 1]) and torch.isfinite(b.scale[1]).all()
    assert torch.isnan(b.dequantize()[0, :128]).all() and torch.isfinite(b.dequantize()[1]).all()
    m = quantize_mxfp8(x)
    assert m.scale_e8m0[0, 0] == 0xFF and (m.scale_e8m0[1] != 0xFF).all()
    n = quantize_nvfp4(x)
    assert torch.isnan(n.global_scale)
    for r in ("fp8_tensorwise", "fp8_blockwise", "mxfp8", "nvfp4"):
        assert torch.isnan(Recipe(r).fake_quantize(x, "input")[0]).any()


def test_delayed_scaling_history_margin_and_overflow():
    recipe = Recipe("fp8_delayed", margin=1, amax_history_len=3)
    state = recipe.new_state()
    amaxes = [2.0, 8.0, 4.0, 1.0, 1.0]
    scales = []
    for a in amaxes:
        x = torch.tensor([[a, -a / 3]])
        data, scale = recipe.quantize_per_tensor(x, "input", state=state)
        scales.append(scale.item())
    # first use: the current amax; then the max of the last 3 recorded amaxes, halved by margin 1
    expected_amax = [2.0, 2.0, 8.0, 8.0, 8.0]
    assert scales == [448.0 / a / 2 for a in expected_amax]
    # a step whose amax exceeds the history saturates instead of overflowing
    data, scale = recipe.quantize_per_tensor(torch.tensor([[1000.0]]), "input", state=state)
    assert data.float().item() == 448.0
    # a non-finite amax keeps the last finite scale (neither zero nor one) and stays out of the history
    history = state.of("input")
    before = history.recorded
    data, scale = recipe.quantize_per_tensor(torch.tensor([[float("inf"), 1.0]]), "input", state=state)
    assert history.recorded == before and math.isfinite(scale.item()) and scale.item() not in (0.0, 1.0)
    assert isinstance(history, AmaxHistory)
    most_recent = Recipe("fp8_delayed", amax_compute_algo="most_recent")
    s = most_recent.new_state()
    for a in (8.0, 2.0):
        most_recent.quantize_per_tensor(torch.tensor([[a]]), "input", state=s)
    assert most_recent.quantize_per_tensor(torch.tensor([[1.0]]), "input", state=s)[1].item() == 448.0 / 2.0


def test_hadamard_transform_is_orthonormal_and_leaves_the_product():
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(5, 37, generator=gen), torch.randn(7, 37, generator=gen)
    signs = torch.where(torch.rand(16, generator=gen) < 0.5, -1.0, 1.0)
    ta, tb = random_hadamard_transform(a, signs), random_hadamard_transform(b, signs)
    assert ta.shape == (5, 48)  # padded to a multiple of 16
    torch.testing.assert_close(ta @ tb.t(), a @ b.t(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ta.norm(dim=1), a.norm(dim=1), rtol=1e-5, atol=1e-6)
    # it spreads an outlier over its block of 16
    spike = torch.zeros(1, 16)
    spike[0, 3] = 16.0
    assert random_hadamard_transform(spike, signs).abs().max() == 4.0


def test_e4m3_codes_of_blockwise_data_are_the_hand_encoder_s():
    x = torch.randn(4, 256) * 10
    q = quantize_fp8_blockwise(x)
    scaled = x * q.scale.repeat_interleave(128, dim=1)
    assert torch.equal(q.data.view(torch.uint8).to(torch.int64), encode(scaled, E4M3))
