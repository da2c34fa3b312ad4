"""Routing replay: record the experts each forward chose, then make later forwards reuse them."""

from __future__ import annotations

import torch

REPLAY_MODES = ("off", "record", "replay")


class RoutingReplay:
    """Give one to ``TopKRouter(..., replay=RoutingReplay())``.

    * ``record()``: forget what was recorded; every later forward appends its ``expert_idx_TK``.
    * ``replay()``: rewind; every later forward reuses the next recorded ids, in recording order
      (probabilities are still computed from the current logits, so gradients flow). Running out of
      recorded forwards, or a [T, K] shape that differs from the recorded one, raises ``RuntimeError``.
    * ``off()``: route normally; the recording is kept.

    Several routers may share one object as long as they run in the same order when replaying.
    """

    def __init__(self, mode: str = "off") -> None:
        if mode not in REPLAY_MODES:
            raise ValueError(f"mode={mode!r}: choose one of {REPLAY_MODES}")
        self.mode = mode
        self.recorded: list[torch.Tensor] = []
        self.cursor = 0

    def record(self) -> RoutingReplay:
        self.mode, self.recorded, self.cursor = "record", [], 0
        return self

    def replay(self) -> RoutingReplay:
        self.mode, self.cursor = "replay", 0
        return self

    def off(self) -> RoutingReplay:
        self.mode = "off"
        return self

    def __len__(self) -> int:
        return len(self.recorded)

    def store(self, expert_idx_TK: torch.Tensor) -> None:
        """Called by the router in record mode."""
        self.recorded.append(expert_idx_TK.detach().clone())

    def next(self, num_tokens: int, topk: int, num_experts: int, device: torch.device) -> torch.Tensor:
        """Called by the router in replay mode: the next recorded ids, checked against this forward."""
        if self.cursor >= len(self.recorded):
            raise RuntimeError(
                f"routing replay ran out: {len(self.recorded)} forward(s) recorded, forward {self.cursor + 1} asked"
            )
        idx_TK = self.recorded[self.cursor]
        if tuple(idx_TK.shape) != (num_tokens, topk):
            raise RuntimeError(
                f"routing replay shape mismatch at forward {self.cursor + 1}: recorded {tuple(idx_TK.shape)}, "
                f"this forward routes [{num_tokens}, {topk}]"
            )
        if idx_TK.numel() and (int(idx_TK.min()) < 0 or int(idx_TK.max()) >= num_experts):
            raise RuntimeError(f"routing replay at forward {self.cursor + 1}: expert ids outside [0, {num_experts})")
        self.cursor += 1
        return idx_TK.to(device)
