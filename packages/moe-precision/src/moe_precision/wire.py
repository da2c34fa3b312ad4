"""The FP8 dispatch format: token rows as blockwise FP8 (E4M3, 1x128 blocks along the hidden dimension, one fp32
scale per block), decoded on arrival. A ``moe_dispatch.wire.WireCodec``: an ``[R, H]`` row costs
``H + 4 * ceil(H / 128)`` bytes against ``2 H`` in bf16 (0.516x at H = 7168)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moe_precision.blockwise import BlockwiseFP8, quantize_fp8_blockwise
from moe_precision.formats import E4M3


class BlockwiseFP8Wire:
    name = "fp8_blockwise"

    def __init__(self, block: int = 128) -> None:
        self.block = block

    def encode(self, x_RH: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q = quantize_fp8_blockwise(x_RH.detach(), (1, self.block))
        # uint8 on the wire: not every collective backend moves float8 dtypes
        return q.data.view(torch.uint8), q.scale

    def decode(self, parts: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        data, scale = parts
        assert E4M3.torch_dtype is not None
        return BlockwiseFP8(data.view(E4M3.torch_dtype), scale, (1, self.block)).dequantize(dtype)

    def row_bytes(self, hidden: int) -> int:
        return hidden + 4 * -(-hidden // self.block)

    def __repr__(self) -> str:
        return f"BlockwiseFP8Wire(block={self.block})"
