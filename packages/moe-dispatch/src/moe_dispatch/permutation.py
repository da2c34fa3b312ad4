"""Token permutation into expert-major order and its exact inverse (plain torch reference)."""

from __future__ import annotations

import torch


def sort_by_expert(expert_idx_TK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Order of the T*K (token, expert) pairs grouped by expert, stable in token order.

    Returns ``(row_map_N, pair_order_N)``: for permuted row n, the source token id and the index
    of its pair in the flattened ``[T*K]`` routing tensors.
    """
    topk = expert_idx_TK.shape[1]
    pair_order_N = torch.argsort(expert_idx_TK.flatten(), stable=True)
    row_map_N = torch.div(pair_order_N, topk, rounding_mode="floor")
    return row_map_N, pair_order_N


def permute(x_TH: torch.Tensor, row_map_N: torch.Tensor) -> torch.Tensor:
    """Copy each token once per chosen expert, rows in expert-major order."""
    return x_TH.index_select(0, row_map_N)


def unpermute(
    y_NH: torch.Tensor, row_map_N: torch.Tensor, weights_N: torch.Tensor | None, num_tokens: int
) -> torch.Tensor:
    """Sum the expert outputs of each token back into token order, optionally weighted."""
    if weights_N is not None:
        y_NH = y_NH * weights_N.unsqueeze(-1).to(y_NH.dtype)
    out_TH = y_NH.new_zeros(num_tokens, y_NH.shape[-1])
    return out_TH.index_add(0, row_map_N, y_NH)
