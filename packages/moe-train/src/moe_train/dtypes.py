"""The config's one dtype vocabulary: short names (``fp32``, ``bf16``, ``fp64``, as Megatron-Core's flags and
moe-parallel's ``parallel.mixed_precision_*``), torch's names (``float32``, ``bfloat16``, ``float64``) accepted as
aliases in every section and written back in the short form."""

from __future__ import annotations

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}
ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float64": "fp64"}
# (section, key) of every dtype-valued key of the config
DTYPE_KEYS = (
    ("model", "moe_router_dtype"),
    ("parallel", "mixed_precision_param"),
    ("parallel", "mixed_precision_reduce"),
    ("train", "optimizer_states_dtype"),
    ("train", "params_dtype"),
    ("train", "master_weights_dtype"),
    ("run", "dtype"),
)


def short_name(value: object) -> object:
    """``value`` in the short spelling when it is a dtype name (anything else as it is: the section checks it)."""
    return ALIASES.get(value, value) if isinstance(value, str) else value


def torch_dtype(name: str) -> torch.dtype:
    return DTYPES[short_name(name)]


def dtype_bytes(name: str) -> int:
    return torch_dtype(name).itemsize
