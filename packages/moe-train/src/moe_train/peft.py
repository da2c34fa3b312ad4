"""The ``peft`` config section at work: LoRA adapters on a frozen base model (issue 33).

:func:`add_adapters` gives the model, still on the meta device, its adapters (:func:`moe_models.lora.add_lora_`
with ``peft.rank`` / ``alpha`` / ``dropout`` / ``targets``) and freezes everything else, before the layout is applied:
the model's parallel plan then declares how each adapter splits (as the weight it adapts), and the layout shards them
with the rest. :class:`AdapterSource` materialises the adapters as PEFT starts them (``A`` random from the run's seed
and the parameter's name, ``B`` zero, so every layout starts alike) and the base from ``model.from_hf`` (or the
initial weights). A frozen parameter has no gradient, so it has no optimizer state, no gradient reduction and no part
in the gradient norm; checkpoints hold only the trainable parameters (:mod:`moe_train.checkpoint`) and
:func:`base_reference` (the base's files, by name and size), which resuming checks (:func:`check_base`).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moe_experts import GroupedExperts, LoRAExpertLinear
from moe_experts.lora import initial_expert_adapter
from moe_models.lora import ADAPTER_MARK, adapter_seed, add_lora_, freeze_base_, initial_adapter_value
from moe_parallel import ParameterSource
from moe_train.config import ConfigError, ExperimentConfig, PeftConfig

# the base's files whose names and sizes identify it (weights and their index)
_WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.safetensors.index.json", "*.bin.index.json")


def check_precision_for_adapters(cfg: ExperimentConfig) -> None:
    """A precision recipe swaps the linears for quantised ones, which take no adapter: refused in one line."""
    if cfg.peft.method == "lora" and cfg.precision.enabled:
        raise ConfigError(
            f"precision.recipe={cfg.precision.recipe!r}: quantised linears take no LoRA adapters "
            "(peft.method='lora'); set precision.recipe=none, or peft.method=none"
        )


def add_adapters(model: nn.Module, peft: PeftConfig) -> list[str]:
    """Adapt ``model`` (on any device, meta included) as ``peft`` says and freeze its base, in place; returns the
    adapted modules' names. Errors a config can cause are :class:`ConfigError` naming the ``peft`` key."""
    if peft.method != "lora":
        return []
    try:
        names = add_lora_(model, peft.rank, peft.alpha, peft.dropout, tuple(peft.targets) or None)
    except ValueError as err:  # each starts with the key it names (rank=, dropout=, targets:): the section's
        raise ConfigError(f"peft.{err}") from None
    freeze_base_(model)
    return names


class AdapterSource:
    """A :class:`~moe_parallel.ParameterSource` serving the adapters' starting values (module docstring) and
    everything else from ``base``. ``model``: the adapted model (split or not: only the global sizes of its routed
    experts' adapters are read)."""

    def __init__(self, base: ParameterSource, model: nn.Module, seed: int) -> None:
        self.base, self.model, self.seed = base, model, seed

    def tensor(self, name: str, shape: tuple[int, ...], box: tuple[slice, ...] | None = None) -> torch.Tensor:
        if ADAPTER_MARK not in name:
            return self.base.tensor(name, shape, box)
        value = initial_adapter_value(name, shape, self.seed)
        return value if box is None else value[box]

    def expert(self, path: str, index: int) -> dict[str, torch.Tensor]:
        values = dict(self.base.expert(path, index))
        experts = self.model.get_submodule(path)
        if isinstance(experts, GroupedExperts):
            for projection in ("fc1", "fc2"):
                if isinstance(getattr(experts, projection), LoRAExpertLinear):
                    generator = torch.Generator().manual_seed(adapter_seed(self.seed, f"{path}.{projection}.{index}"))
                    values.update(initial_expert_adapter(experts, projection, generator))
        return values


def weights_fingerprint(directory: str | Path) -> str:
    """A digest of the names and sizes of a checkpoint directory's weight files (reading no weights)."""
    root = Path(directory)
    files = sorted({p for pattern in _WEIGHT_FILES for p in root.glob(pattern) if p.is_file()})
    digest = hashlib.sha256()
    for path in files:
        digest.update(f"{path.name}\0{path.stat().st_size}\n".encode())
    return digest.hexdigest()[:16]


def base_reference(cfg: ExperimentConfig | dict[str, Any]) -> dict[str, Any] | None:
    """What a LoRA checkpoint records of the base it adapts: ``model.from_hf`` and its files' fingerprint, or the
    seed of the initial weights; None without LoRA (the checkpoint then holds the whole model). ``cfg``: the config,
    or its ``to_dict()`` (a checkpoint's ``meta.json`` holds that)."""
    config = cfg.to_dict() if isinstance(cfg, ExperimentConfig) else cfg
    if config.get("peft", {}).get("method", "none") != "lora":
        return None
    from_hf = config.get("model_from_hf", "")
    if from_hf:
        return {"from_hf": str(from_hf), "fingerprint": weights_fingerprint(from_hf)}
    return {"from_hf": None, "seed": config["train"]["seed"]}


def check_base(cfg: ExperimentConfig, meta: dict[str, Any], path: Path) -> None:
    """Refuse, in one line, to resume adapters onto another base than the one they were trained on."""
    saved_method = meta.get("config", {}).get("peft", {}).get("method", "none")
    if saved_method != cfg.peft.method:
        raise ConfigError(
            f"peft.method={cfg.peft.method!r}: {path} was trained with peft.method={saved_method!r}; resume with the "
            "checkpoint's peft settings or start a new run"
        )
    saved = meta.get("peft_base")
    if cfg.peft.method != "lora" or saved is None:
        return
    current = base_reference(cfg)
    if saved != current:
        what = "model.from_hf" if saved.get("from_hf") or cfg.model_from_hf else "train.seed"
        raise ConfigError(
            f"{what}: {path} holds adapters of another base ({_describe(saved)}, here {_describe(current)}); "
            "resume on the base they were trained on, or start a new run"
        )


def _describe(ref: dict[str, Any] | None) -> str:
    if not ref:
        return "none"
    if ref.get("from_hf"):
        return f"{ref['from_hf']} with files {ref.get('fingerprint')}"
    return f"initial weights of seed {ref.get('seed')}"
