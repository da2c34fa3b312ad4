"""Recompute and offload by module kind (Megatron-Core's ``--recompute-modules`` / ``--offload-modules``), or by
qualified-name pattern, applied to a model from outside.

The model names its modules of each kind (``{kind: [qualified names]}``, e.g. ``moe_models``'
``model.module_kinds()``); :func:`check_memory_options` validates a choice on the meta-built model and
:func:`apply_memory_policy` wraps the chosen modules' forwards:

- recompute, normal: ``core_attn``, ``mlp``, ``moe``, ``shared_experts`` and patterns keep their inputs only and run
  again in the backward (non-reentrant ``torch.utils.checkpoint``);
- recompute, output-discarding: ``moe_act``, ``layernorm``, ``mla_up_proj`` do the same and their output is also
  freed once its consumers have saved it, then recomputed when the backward first needs it (Megatron's
  ``CheckpointWithoutOutput``): what remains of a norm is its input, which the residual stream holds anyway;
- offload: tensors an offloaded module saves for backward wait in host memory
  (:class:`~moe_memory.saved_tensors.SavedTensorPolicy`).

Recomputation runs the same ops on the same inputs, so gradients are unchanged (the modules draw no random
numbers). Anything that counts per forward (router statistics, expert-bias counts) must count what the forward
returns, not module calls: recomputed modules run more than once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

from moe_memory.kinds import (
    OFFLOAD_KINDS,
    OUTPUT_DISCARDING_KINDS,
    RECOMPUTE_KINDS,
    MemoryConfigError,
    ModuleKinds,
    resolve_modules,
)
from moe_memory.recompute import checkpoint_modules, wrap_forward
from moe_memory.saved_tensors import SavedTensorPolicy, SavedTensorStats


@dataclass
class MemoryPolicy:
    """What :func:`apply_memory_policy` did: module name -> the kind (or pattern) that selected it."""

    recomputed: dict[str, str] = field(default_factory=dict)
    offloaded: dict[str, str] = field(default_factory=dict)
    saved: SavedTensorPolicy | None = None  # installed around the model's forward when a module needs it

    @property
    def stats(self) -> SavedTensorStats:
        return self.saved.stats if self.saved is not None else SavedTensorStats()


def _inside(name: str, outer: str) -> bool:
    return name == outer or name.startswith(outer + ".")


def check_memory_options(
    model: nn.Module,
    module_kinds: ModuleKinds,
    recompute_modules: Sequence[str] = (),
    offload_modules: Sequence[str] = (),
    offload_min_tensor_bytes: int = 0,
    *,
    part: bool = False,
) -> tuple[dict[str, str], dict[str, str]]:
    """The modules to recompute and to offload (``{name: kind or pattern}``), every rule checked: unknown names,
    kinds the model lacks, a negative threshold, and offloaded modules inside recomputed ones (whose saved tensors
    are recomputed, so there is nothing to offload) are :class:`MemoryConfigError`. ``part=True``: ``model`` is one
    pipeline stage of a whole model already checked; what selects nothing in it is skipped."""
    recompute = resolve_modules(
        model, module_kinds, recompute_modules, field="recompute_modules", valid_kinds=RECOMPUTE_KINDS, part=part
    )
    offload = resolve_modules(
        model, module_kinds, offload_modules, field="offload_modules", valid_kinds=OFFLOAD_KINDS, part=part
    )
    if offload_min_tensor_bytes < 0:
        raise MemoryConfigError("offload_min_tensor_bytes", offload_min_tensor_bytes, "must be >= 0")
    for name, kind in offload.items():
        for outer, outer_kind in recompute.items():
            if _inside(name, outer):
                raise MemoryConfigError(
                    "offload_modules",
                    list(offload_modules),
                    f"{kind!r} ({name}) is recomputed by recompute_modules {outer_kind!r}: its activations are not "
                    "kept, so there is nothing to offload; drop one of the two",
                )
    return recompute, offload


def _layer_of(name: str) -> str:
    """The unit of prefetching: the name up to its first numeric part (``layers.3.attention.q_proj``: ``layers.3``)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return name


def _replay(forward: Callable, args: tuple, kwargs: dict) -> Callable[[], object]:
    """``forward(*args, **kwargs)`` again without autograd, under the autocast state of this call."""
    device = next((a.device.type for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)), "cpu")
    enabled = torch.is_autocast_enabled(device)
    dtype = torch.get_autocast_dtype(device)

    def run() -> object:
        with torch.no_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
            return forward(*args, **kwargs)

    return run


def _output_discarding(saved: SavedTensorPolicy) -> Callable[[Callable], Callable]:
    def make(forward: Callable) -> Callable:
        def run(*args, **kwargs):
            out = checkpoint(forward, *args, use_reentrant=False, **kwargs)
            if torch.is_grad_enabled():
                saved.register_outputs(out, _replay(forward, args, kwargs))
            return out

        return run

    return make


def _offloading(saved: SavedTensorPolicy, group: str) -> Callable[[Callable], Callable]:
    def make(forward: Callable) -> Callable:
        def run(*args, **kwargs):
            with saved.offload(group):
                return forward(*args, **kwargs)

        return run

    return make


def _with_hooks(saved: SavedTensorPolicy) -> Callable[[Callable], Callable]:
    def make(forward: Callable) -> Callable:
        def run(*args, **kwargs):
            with saved.hooks():
                return forward(*args, **kwargs)

        return run

    return make


def apply_memory_policy(
    model: nn.Module,
    module_kinds: ModuleKinds,
    recompute_modules: Sequence[str] = (),
    offload_modules: Sequence[str] = (),
    offload_min_tensor_bytes: int = 0,
    *,
    part: bool = False,
) -> MemoryPolicy:
    """Recompute and offload the modules ``recompute_modules`` / ``offload_modules`` select (kinds of
    :data:`~moe_memory.kinds.RECOMPUTE_KINDS` / :data:`~moe_memory.kinds.OFFLOAD_KINDS`, or fnmatch patterns over
    qualified names; module docstring). Apply it to the modules that will run: after a parallel layout has swapped
    modules in, before FSDP. Every choice is checked (:func:`check_memory_options`) before any module is wrapped;
    ``part=True`` for one pipeline stage of a model checked whole (what selects nothing in it is skipped)."""
    recompute, offload = check_memory_options(
        model, module_kinds, recompute_modules, offload_modules, offload_min_tensor_bytes, part=part
    )
    discarding = {n for n, kind in recompute.items() if kind in OUTPUT_DISCARDING_KINDS}
    saved = SavedTensorPolicy(offload_min_tensor_bytes) if offload or discarding else None
    modules = dict(model.named_modules())
    policy = MemoryPolicy(saved=saved)
    checkpoint_modules(model, [n for n in recompute if n not in discarding])
    for name in discarding:
        assert saved is not None
        wrap_forward(modules[name], "recompute", _output_discarding(saved))
    for name in offload:
        assert saved is not None
        wrap_forward(modules[name], "offload", _offloading(saved, _layer_of(name)))
    if saved is not None:
        wrap_forward(model, "saved_tensors", _with_hooks(saved))
    policy.recomputed, policy.offloaded = recompute, offload
    return policy
