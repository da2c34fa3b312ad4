"""Selective activation recompute: chosen submodules drop their activations in the forward pass and
recompute them in the backward (``torch.utils.checkpoint``, non-reentrant)."""

from __future__ import annotations

import difflib
import fnmatch
import functools
import types
from collections.abc import Iterable

from torch import nn
from torch.utils.checkpoint import checkpoint


def _checkpointed(forward):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    run.__moe_recompute__ = True  # marks an already-wrapped forward so wrapping twice is a no-op
    return run


def select_modules(model: nn.Module, patterns: Iterable[str]) -> list[str]:
    """The names of ``model``'s submodules matching ``patterns`` (fnmatch syntax, e.g. ``"layers.*.mlp"``); a pattern
    that matches nothing is an error naming close matches. Works on a meta-built model, to check patterns before
    anything is allocated."""
    names = [name for name, _ in model.named_modules() if name]
    selected: list[str] = []
    for pattern in patterns:
        matched = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not matched:
            close = difflib.get_close_matches(pattern, names, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ValueError(f"recompute module pattern {pattern!r} matches no submodule{hint}")
        selected.extend(matched)
    return selected


def apply_activation_checkpointing(model: nn.Module, patterns: Iterable[str]) -> list[str]:
    """Recompute every submodule whose qualified name matches one of ``patterns`` (:func:`select_modules`).
    Parameter names and the state dict are unchanged. Apply it to the modules that will run: after a parallel
    layout has swapped modules in (expert parallelism replaces the experts), before FSDP.

    Returns the names wrapped; a pattern that matches nothing is an error naming close matches.
    """
    modules = dict(model.named_modules())
    wrapped: list[str] = []
    for name in select_modules(model, patterns):  # every pattern is checked before any module is touched
        module = modules[name]
        if getattr(module.forward, "__moe_recompute__", False):
            continue
        forward = module.forward
        if isinstance(forward, types.MethodType) and forward.__self__ is module:
            # bound to the module, so copy.deepcopy rebinds it to the copy instead of the original
            module.forward = types.MethodType(_checkpointed(forward.__func__), module)
        else:
            module.forward = _checkpointed(forward)
        wrapped.append(name)
    return wrapped
