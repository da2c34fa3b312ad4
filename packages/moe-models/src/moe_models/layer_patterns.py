"""Which layer is which: Megatron's int-or-list per-layer patterns (``moe_layer_freq``, ``no_rope_freq``...) and its
hybrid pattern string (``hybrid_override_pattern``, Nemotron-H), read into one :class:`LayerMixers` per layer."""

from __future__ import annotations

from typing import NamedTuple

from moe_models.config_error import ModelConfigError

# token mixers: softmax attention (GQA or MLA), a linear-attention layer, a Mamba-2 mixer; channel mixers: a routed
# MoE, a dense MLP
TOKEN_MIXERS = ("attention", "linear_attention", "mamba")
CHANNEL_MIXERS = ("moe", "mlp")
# Megatron-Core's hybrid pattern symbols (megatron/core/ssm/mamba_hybrid_layer_allocation.py): each one block
HYBRID_SYMBOLS: dict[str, tuple[str | None, str | None]] = {
    "M": ("mamba", None),
    "*": ("attention", None),
    "-": (None, "mlp"),
    "E": (None, "moe"),
}


class LayerMixers(NamedTuple):
    """A decoder layer's two pre-norm residual blocks: ``x + token(norm(x))`` then ``x + channel(norm(x))``. A hybrid
    pattern's layer has one of the two (the other None): a block of its own, as Nemotron-H's."""

    token: str | None  # one of TOKEN_MIXERS, or None
    channel: str | None  # one of CHANNEL_MIXERS, or None


def layer_pattern(value: int | list[int], num_layers: int, name: str, every_nth_is: int) -> list[int]:
    """Megatron's int-or-list layer patterns: an int N marks layers ``(i + 1) % N == 0`` (1-based every N-th)
    with ``every_nth_is``, a list gives one 0/1 per layer."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise ModelConfigError(name, value, "must be at least 1, or a list of 0/1 per layer")
        return [every_nth_is if (i + 1) % value == 0 else 1 - every_nth_is for i in range(num_layers)]
    pattern = [int(v) for v in value]
    if len(pattern) != num_layers or any(v not in (0, 1) for v in pattern):
        raise ModelConfigError(name, value, f"give one 0/1 per layer (num_layers={num_layers} values), or an int")
    return pattern


def hybrid_layers(pattern: str, num_layers: int) -> list[LayerMixers]:
    """The layers of a hybrid pattern string, one :class:`LayerMixers` per symbol (``hybrid_override_pattern``)."""
    unknown = sorted(set(pattern) - set(HYBRID_SYMBOLS))
    if unknown or not pattern:
        raise ModelConfigError(
            "hybrid_override_pattern",
            pattern,
            "one symbol per layer: M (Mamba-2), * (attention), - (dense MLP), E (MoE)"
            + (f"; {''.join(unknown)!r} is none of them" if unknown else ""),
        )
    if len(pattern) != num_layers:
        raise ModelConfigError(
            "num_layers", num_layers, f"hybrid_override_pattern has {len(pattern)} layers: set num_layers to that"
        )
    return [LayerMixers(*HYBRID_SYMBOLS[symbol]) for symbol in pattern]
