"""The FP8 dispatch wire (``BlockwiseFP8Wire``): what arrives is the blockwise quantiser's own (1, 128) round trip of
each token, block by block, whatever the spread of the blocks' magnitudes in a row; each block's error stays within
E4M3's rounding of that block's amax; a row costs H + 4 ceil(H / 128) bytes."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_precision import BlockwiseFP8Wire, quantize_fp8_blockwise
from moe_precision.formats import E4M3

BLOCK = 128


def _tokens(rows: int, hidden: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows whose 128-wide blocks differ in magnitude by up to 2^24, in a different order in each row."""
    gen = torch.Generator().manual_seed(seed)
    blocks = -(-hidden // BLOCK)
    exponents = torch.randint(-12, 13, (rows, blocks), generator=gen).float()
    scale_RH = (2.0**exponents).repeat_interleave(BLOCK, dim=1)[:, :hidden]
    return (torch.randn(rows, hidden, generator=gen) * scale_RH).to(dtype)


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 9),
    hidden=st.sampled_from([256, 384, 300, 1024]),
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_decode_of_encode_is_the_blockwise_round_trip(rows: int, hidden: int, seed: int, dtype: torch.dtype) -> None:
    x_RH = _tokens(rows, hidden, seed, dtype)
    wire = BlockwiseFP8Wire()
    got_RH = wire.decode(wire.encode(x_RH), dtype)
    want_RH = quantize_fp8_blockwise(x_RH, (1, BLOCK)).dequantize(dtype)
    assert got_RH.dtype == dtype and got_RH.shape == x_RH.shape
    assert torch.equal(got_RH, want_RH)
    # and that round trip is close, block by block: E4M3 keeps 3 mantissa bits, the scale maps each block's amax to
    # 448 (below 2^-6 of the amax the subnormals' absolute step 2^-9 of 448 applies)
    for start in range(0, hidden, BLOCK):
        block = slice(start, start + BLOCK)
        x_b, got_b = x_RH[:, block].float(), got_RH[:, block].float()
        amax_R1 = x_b.abs().amax(dim=1, keepdim=True)
        bound = x_b.abs() * 2.0**-4 + amax_R1 / E4M3.max * 2.0**-9 + amax_R1 * 2.0**-8 * (dtype == torch.bfloat16)
        assert bool(((got_b - x_b).abs() <= bound).all()), f"block at {start}"


def test_row_bytes_are_what_the_encoded_parts_hold() -> None:
    wire = BlockwiseFP8Wire()
    for hidden in (128, 256, 300, 7168):
        parts = wire.encode(torch.randn(3, hidden))
        assert sum(p.nbytes for p in parts) == 3 * wire.row_bytes(hidden) == 3 * (hidden + 4 * -(-hidden // BLOCK))
        assert all(p.dtype in (torch.uint8, torch.float32) for p in parts)  # what every collective backend moves
