"""Selective activation recompute: chosen submodules drop their activations in the forward pass and
recompute them in the backward (``torch.utils.checkpoint``, non-reentrant)."""

from __future__ import annotations

import difflib
import fnmatch
import functools
import types
from collections.abc import Callable, Iterable

from torch import nn
from torch.utils.checkpoint import checkpoint


def wrap_forward(module: nn.Module, tag: str, make: Callable[[Callable], Callable]) -> bool:
    """Replace ``module.forward`` by ``make(forward)`` unless a wrapper tagged ``tag`` is already there (wrapping
    twice is a no-op). Parameter names and the state dict are unchanged. Returns whether it wrapped."""
    forward = module.forward
    if tag in getattr(forward, "__moe_memory__", ()):
        return False
    bound = isinstance(forward, types.MethodType) and forward.__self__ is module
    inner = forward.__func__ if bound else forward
    wrapped = functools.wraps(inner)(make(inner))
    wrapped.__moe_memory__ = (*getattr(inner, "__moe_memory__", ()), tag)
    # a method bound to the module, so that copy.deepcopy rebinds it to the copy instead of the original
    module.forward = types.MethodType(wrapped, module) if bound else wrapped
    return True


def _checkpointed(forward: Callable) -> Callable:
    def run(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

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


def checkpoint_modules(model: nn.Module, names: Iterable[str]) -> list[str]:
    """Recompute the submodules called ``names`` (non-reentrant checkpoint); returns those newly wrapped."""
    modules = dict(model.named_modules())
    return [name for name in names if wrap_forward(modules[name], "recompute", _checkpointed)]


def apply_activation_checkpointing(model: nn.Module, patterns: Iterable[str]) -> list[str]:
    """Recompute every submodule whose qualified name matches one of ``patterns`` (:func:`select_modules`).
    Parameter names and the state dict are unchanged. Apply it to the modules that will run: after a parallel
    layout has swapped modules in (expert parallelism replaces the experts), before FSDP.

    Returns the names wrapped; a pattern that matches nothing is an error naming close matches.
    """
    return checkpoint_modules(model, select_modules(model, patterns))  # every pattern checked before any wrapping
