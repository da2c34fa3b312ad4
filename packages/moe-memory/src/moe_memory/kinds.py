"""Megatron-Core's names for the parts of a transformer layer that can be recomputed (``--recompute-modules``) or
whose saved activations can be offloaded (``--offload-modules``), and the error for choosing them wrongly.

A model says which of its submodules are of each kind (``{kind: [qualified module names]}``); moe-memory only knows
the names and what recomputing or offloading a kind means.
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the names alone need no torch (moe_memory.estimate uses them)
    from torch import nn

# recompute: the module keeps only its inputs and runs again in the backward; ``layer`` is a whole decoder layer
# (Megatron-Core's --recompute-granularity full with --recompute-num-layers 1)
RECOMPUTE_KINDS = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts", "layer")
WHOLE_LAYER = "layer"
# cheap ops whose OUTPUT is freed too once its consumers have saved it, and recomputed before they need it back
OUTPUT_DISCARDING_KINDS = frozenset({"moe_act", "layernorm", "mla_up_proj"})
# offload: the tensors the module saves for backward wait in host memory
OFFLOAD_KINDS = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act")

ModuleKinds = Mapping[str, Sequence[str]]  # kind -> qualified names of the model's modules of that kind


class MemoryConfigError(ValueError):
    """A recompute or offload choice that cannot work; ``field`` is the setting to change (``recompute_modules``,
    ``offload_modules``, ``offload_min_tensor_bytes``). ``str(err)`` is ``"{field}={value!r}: {reason}"``."""

    def __init__(self, field: str, value: object, reason: str) -> None:
        super().__init__(f"{field}={value!r}: {reason}")
        self.field, self.value, self.reason = field, value, reason

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return type(self), (self.field, self.value, self.reason)


def resolve_modules(
    model: nn.Module,
    module_kinds: ModuleKinds,
    entries: Iterable[str],
    *,
    field: str,
    valid_kinds: Sequence[str],
    part: bool = False,
) -> dict[str, str]:
    """The modules ``entries`` select: each entry is a kind of ``valid_kinds`` (its modules from ``module_kinds``)
    or an fnmatch pattern over qualified module names (``layers.*.mlp``). Returns ``{module name: kind or pattern}``.

    A name that is neither a valid kind nor matches a module, or a valid kind this model has no module of
    (``mla_up_proj`` without multi-latent attention), is a :class:`MemoryConfigError` listing what would work. Works
    on a meta-built model, so it can run before anything is allocated. ``part=True``: ``model`` is one part (a
    pipeline stage) of a whole already checked, and an entry that selects nothing in it selects nothing, silently.
    """
    entries = list(entries)
    names = [name for name, _ in model.named_modules() if name]
    present = [kind for kind in valid_kinds if module_kinds.get(kind)]
    selected: dict[str, str] = {}
    for entry in entries:
        if entry in valid_kinds:
            if entry not in present and part:
                continue
            if entry not in present:
                raise MemoryConfigError(
                    field, entries, f"this model has no {entry!r} modules; its kinds are {', '.join(present)}"
                )
            matched = list(module_kinds[entry])
        else:
            matched = [n for n in names if fnmatch.fnmatchcase(n, entry)]
            if not matched and not part:
                close = difflib.get_close_matches(entry, list(valid_kinds) + names, n=3)
                hint = f" (did you mean {', '.join(close)}?)" if close else ""
                raise MemoryConfigError(
                    field,
                    entries,
                    f"{entry!r} is neither a module kind nor a pattern matching a submodule{hint}; "
                    f"kinds: {', '.join(valid_kinds)}",
                )
        for name in matched:
            selected.setdefault(name, entry)
    return selected
