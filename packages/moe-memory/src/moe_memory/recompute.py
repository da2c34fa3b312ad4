"""Selective activation recompute: chosen submodules drop their activations in the forward pass and
recompute them in the backward (``torch.utils.checkpoint``, non-reentrant)."""

from __future__ import annotations

import difflib
import fnmatch
import functools
from collections.abc import Iterable

from torch import nn
from torch.utils.checkpoint import checkpoint


def _checkpointed(forward):  # noqa: ANN001, ANN202
    @functools.wraps(forward)
    def run(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    run.__moe_recompute__ = True  # marks an already-wrapped forward so wrapping twice is a no-op
    return run


def apply_activation_checkpointing(model: nn.Module, patterns: Iterable[str]) -> list[str]:
    """Recompute every submodule whose qualified name matches one of ``patterns`` (fnmatch syntax,
    e.g. ``"layers.*.mlp"``). Parameter names and the state dict are unchanged.

    Returns the names wrapped; a pattern that matches nothing is an error naming close matches.
    """
    names = [name for name, _ in model.named_modules() if name]
    modules = dict(model.named_modules())
    wrapped: list[str] = []
    for pattern in patterns:
        matched = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not matched:
            close = difflib.get_close_matches(pattern, names, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ValueError(f"recompute module pattern {pattern!r} matches no submodule{hint}")
        for name in matched:
            module = modules[name]
            if getattr(module.forward, "__moe_recompute__", False):
                continue
            module.forward = _checkpointed(module.forward)
            wrapped.append(name)
    return wrapped
