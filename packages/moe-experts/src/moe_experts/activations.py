"""Gated activations applied to the fused gate+up projection output ``[N, 2F]``."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def swiglu(gate_up_N2F: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, gate in the first F columns and up in the last F."""
    gate, up = gate_up_N2F.chunk(2, dim=-1)
    return F.silu(gate) * up


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"swiglu": swiglu}


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation called ``name``; a ValueError lists the known ones."""
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"activation={name!r}: choose one of {tuple(ACTIVATIONS)}") from None
