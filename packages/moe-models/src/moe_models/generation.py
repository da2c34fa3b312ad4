"""Text generation with a key/value cache, for every family (GQA with sliding windows and sinks, MLA) without a line
of generation code in the attention modules.

The model already computes given positions of a sequence (``model(ids, positions_S)``, as a context-parallel rank
does), and its core attention takes the positions of its keys. :class:`KVCache` is a forward pre-hook on every core
attention, as context parallelism's key gathering is: it appends the new tokens' keys and values to those of the tokens
before them and hands the attention all of them, so each step computes only the new positions. The cache is an
explicit value the caller holds (``with KVCache(model) as cache``), removed from the model when the block ends.
MLA caches its keys and values after the up projection (per head), not the compressed latent: simple, and exact.

Recurrent layers (Gated DeltaNet, Mamba-2) compute given positions as a segment that starts from the states before it
(:mod:`moe_models.sequence_segments`): the cache is a forward hook on their segments modules, which answers where the
positions computed so far end and the states they leave (the recurrent state and the convolution's last inputs), and
keeps the states the new positions leave. A step then costs one token's recurrence, whatever the length before it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from moe_models.attention import CoreAttention
from moe_models.sequence_segments import SequenceSegments


class KVCache(contextlib.AbstractContextManager):
    """The keys and values of the positions computed so far, per core attention of ``model``, and the states they
    leave, per recurrent layer (MTP depths excluded: generation reads the main head alone, so they are not cached and
    compute only the new positions)."""

    def __init__(self, model: nn.Module) -> None:
        self.modules = {
            name: m for name, m in model.named_modules() if isinstance(m, CoreAttention) and not name.startswith("mtp.")
        }
        self.segments = {
            name: m
            for name, m in model.named_modules()
            if isinstance(m, SequenceSegments) and not name.startswith("mtp.")
        }
        self.keys: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        # per recurrent layer: the positions computed ([0, end)), and the states they leave ("state", "tail")
        self.states: dict[str, dict[str, Any]] = {name: {"end": 0} for name in self.segments}
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    @property
    def length(self) -> int:
        """Positions cached (the same in every layer)."""
        return next(iter(self.keys.values()))[0].shape[2] if self.keys else 0

    def __enter__(self) -> KVCache:
        for name, module in self.modules.items():
            hook = self._hook(name)
            self._handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
        for name, module in self.segments.items():
            self._handles.append(module.register_forward_hook(self._segments_hook(self.states[name])))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, name: str):
        def append(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
            q, k_BNSD, v_BNSV, sinks, q_pos, _, *rest = args
            if name in self.keys:
                k_BNSD = torch.cat([self.keys[name][0], k_BNSD], dim=2)
                v_BNSV = torch.cat([self.keys[name][1], v_BNSV], dim=2)
            self.keys[name] = (k_BNSD, v_BNSV)
            k_pos_K = torch.arange(k_BNSD.shape[2], device=k_BNSD.device)
            return (q, k_BNSD, v_BNSV, sinks, q_pos, k_pos_K, *rest), kwargs

        return append

    @staticmethod
    def _segments_hook(cached: dict[str, Any]):
        """The recurrent layer's side of the cache (:mod:`moe_models.sequence_segments`: what each kind is)."""

        def answer(module: nn.Module, args: tuple, values: torch.Tensor) -> torch.Tensor:
            _, kind = args
            if kind == "start":
                return values.new_tensor([cached["end"]])
            if kind == "positions":  # [first, length] per run; the new positions end at the last run's end
                cached["next_end"] = int((values[:, 0] + values[:, 1]).max())
            elif kind in ("state_in", "tail_in") and kind[:-3] in cached:
                return cached[kind[:-3]]
            elif kind in ("state_out", "tail_out"):
                cached[kind[:-4]] = values
                if kind == "state_out":
                    cached["end"] = cached["next_end"]
            return values

        return answer


@dataclass(frozen=True)
class Generated:
    tokens: list[int]  # the new tokens (the stop token included when one ended it)
    stopped: bool  # a stop token ended it (else max_new_tokens did)


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt: Sequence[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    stop_tokens: Sequence[int] = (),
    generator: torch.Generator | None = None,
    use_cache: bool = True,
) -> Generated:
    """Continue ``prompt`` (token ids) by up to ``max_new_tokens`` tokens: greedy for ``temperature`` 0 (what
    transformers' ``generate(do_sample=False)`` does), else sampled from softmax(logits / temperature) with
    ``generator``; stops after a token of ``stop_tokens``. ``use_cache=False`` recomputes the whole sequence each
    step (the reference the cache is tested against). The model is put in eval mode."""
    if not prompt:
        raise ValueError("prompt: empty; give at least one token")
    if max_new_tokens < 0 or temperature < 0:
        raise ValueError("max_new_tokens and temperature must be >= 0")
    model.eval()
    device = next(model.parameters()).device
    ids_1S = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    new: list[int] = []
    with KVCache(model) if use_cache else contextlib.nullcontext():
        computed = 0  # positions whose keys the cache holds
        while len(new) < max_new_tokens:
            positions_S = torch.arange(computed, ids_1S.shape[1], device=device) if use_cache else None
            logits_V = model(ids_1S, positions_S).logits[0, -1].float()
            computed = ids_1S.shape[1]
            if temperature == 0:
                token = int(logits_V.argmax())
            else:
                token = int(torch.multinomial(torch.softmax(logits_V / temperature, -1), 1, generator=generator))
            new.append(token)
            if token in stop_tokens:
                return Generated(new, True)
            ids_1S = torch.cat([ids_1S, ids_1S.new_tensor([[token]])], dim=1)
    return Generated(new, False)
