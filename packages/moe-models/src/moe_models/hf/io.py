"""load_pretrained / read_state_dict / save_pretrained: HuggingFace safetensors checkpoints <-> our models."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import uuid
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch import nn

from moe_models.config import ModelConfig
from moe_models.hf.config_map import FAMILIES, config_from_hf, config_to_hf
from moe_models.hf.errors import HFCheckpointError, name_list
from moe_models.hf.files import CheckpointReader, ShardWriter, inside_or_refuse, parse_size
from moe_models.hf.state_dict_map import Plan, build_plan, mtp_prefixes
from moe_models.model import build_model

# router tensors kept in fp32 whatever the load dtype (transformers keeps DeepSeek's in fp32 too)
FP32_SUFFIXES = (".router.expert_bias",)


def _left_unread(config: ModelConfig, available: set[str]) -> set[str]:
    """The checkpoint's tensors the family's checkpoints may carry and transformers does not read either: layers
    ``model.layers.{i}`` with ``i >= num_layers`` (``layers_past_the_last_ignored``), names matching the family's
    ``unread_key_pattern``."""
    family, unread = FAMILIES[config.family], set()
    if family.layers_past_the_last_ignored:
        layer_of = (re.match(r"model\.layers\.(\d+)\.", key) for key in available)
        unread |= {m.string for m in layer_of if m is not None and int(m.group(1)) >= config.num_layers}
    if family.unread_key_pattern is not None:
        unread |= {key for key in available if re.search(family.unread_key_pattern, key)}
    return unread


def _check_keys(plan: Plan, full_plan: Plan, available: set[str]) -> None:
    missing = plan.hf_keys() - available
    if missing:
        raise HFCheckpointError(
            f"checkpoint lacks {len(missing)} tensor(s) the config needs: {name_list(missing)}; "
            "check that config.json matches the weights (layers, experts, family)"
        )
    unexpected = available - full_plan.hf_keys() - full_plan.ignored
    if unexpected:
        raise HFCheckpointError(
            f"checkpoint has {len(unexpected)} tensor(s) the config does not use: {name_list(unexpected)}; "
            "check that config.json matches the weights (layers, experts, MTP layers, tied embeddings)"
        )


# where a multimodal checkpoint (Qwen3.5's) keeps its language model's tensors: the text-only model's ``model.`` names
_LANGUAGE_MODEL = "model.language_model."


def _text_model_names(stored: set[str]) -> tuple[set[str], bool]:
    """A checkpoint's tensor names as the text-only model's (``model.language_model.`` read as ``model.``), and
    whether any was so nested."""
    if not any(k.startswith(_LANGUAGE_MODEL) for k in stored):
        return stored, False
    return {"model." + k.removeprefix(_LANGUAGE_MODEL) if k.startswith(_LANGUAGE_MODEL) else k for k in stored}, True


def _as_stored(plan: Plan) -> Plan:
    """``plan`` with its HF names under ``model.language_model.`` instead of ``model.``."""

    def stored(key: str) -> str:
        return _LANGUAGE_MODEL + key.removeprefix("model.") if key.startswith("model.") else key

    entries = [
        dataclasses.replace(e, sources=tuple(dataclasses.replace(s, key=stored(s.key)) for s in e.sources))
        for e in plan.entries
    ]
    copies = {stored(k): v for k, v in plan.copies.items()}
    zeros = {stored(k): v for k, v in plan.zeros.items()}
    return Plan(entries, copies, zeros, {stored(k) for k in plan.ignored})


def stored_plan(stored: set[str], config: ModelConfig, experts: Sequence[int] | None) -> Plan:
    """``build_plan`` over a checkpoint's tensor names ``stored``, its HF names spelled as the checkpoint spells them
    (a multimodal one's language model under ``model.language_model.``); unchecked."""
    available, nested = _text_model_names(stored)
    plan = build_plan(config, experts=experts, available=available)
    return _as_stored(plan) if nested else plan


def plan_for(reader: CheckpointReader, config: ModelConfig, experts: Sequence[int] | None) -> Plan:
    """The plan reading ``config``'s tensors from ``reader``'s checkpoint (:func:`stored_plan`), the checkpoint's
    names checked against it first."""
    available, nested = _text_model_names(reader.names())
    plan = build_plan(config, experts=experts, available=available)
    _check_keys(plan, build_plan(config, available=available), available - _left_unread(config, available))
    return _as_stored(plan) if nested else plan


def _tensors(reader: CheckpointReader, plan: Plan, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(our name, tensor) one entry at a time, so a loader never holds a second copy of the model."""
    for entry in plan.entries:
        tensors = []
        for source in entry.sources:
            shape = reader.shape(source.key)
            if shape != source.shape:
                raise HFCheckpointError(
                    f"tensor {source.key} has shape {list(shape)}, the config needs {list(source.shape)}: "
                    "check config.json against the weights"
                )
            tensors.append(reader.read(source))
        tensor = entry.to_ours(tensors)
        if tensor.is_floating_point():
            tensor = tensor.to(torch.float32 if entry.ours.endswith(FP32_SUFFIXES) else dtype)
        yield entry.ours, tensor.contiguous()


def read_state_dict(
    path: str | Path,
    config: ModelConfig,
    *,
    experts: Sequence[int] | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """Our state dict (CPU tensors) from the HF checkpoint at ``path``; ``experts``: keep only those routed
    experts, in that order (the others are never read)."""
    if experts is not None:
        experts = [int(e) for e in experts]
        bad = [e for e in experts if not 0 <= e < config.num_moe_experts]
        if bad or not experts or len(set(experts)) != len(experts):
            raise ValueError(f"experts={experts}: give one or more distinct ids in [0, {config.num_moe_experts})")
    with CheckpointReader(path) as reader:
        out = dict(_tensors(reader, plan_for(reader, config, experts), dtype))
    if config.share_embeddings_and_output_weights:
        out["lm_head.weight"] = out["embed_tokens.weight"]
    return out


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _empty_model(config: ModelConfig, dtype: torch.dtype, device: str | torch.device) -> nn.Module:
    # build on the meta device (no init cost), then allocate uninitialised storage the checkpoint overwrites
    with torch.device("meta"), _default_dtype(dtype):
        model = build_model(config)
    model.to_empty(device=device)
    model.tie_weights()  # to_empty replaces the shared parameter by two
    return model


def _check_model_names(model: nn.Module, plan: Plan) -> dict[str, torch.Tensor]:
    """The model's state dict, after checking that the plan maps exactly its tensors."""
    state = model.state_dict()
    mapped = {e.ours for e in plan.entries}
    if model.config.share_embeddings_and_output_weights:
        mapped.add("lm_head.weight")
    if set(state) != mapped:
        raise HFCheckpointError(
            f"the model's tensors and the {model.config.family} mapping disagree: model only "
            f"{name_list(set(state) - mapped)}, mapping only {name_list(mapped - set(state))} (a bug: report it)"
        )
    return state


def _load_into(model: nn.Module, reader: CheckpointReader, plan: Plan, dtype: torch.dtype) -> None:
    own = _check_model_names(model, plan)
    with torch.no_grad():
        for name, tensor in _tensors(reader, plan, dtype):
            if own[name].shape != tensor.shape:
                raise HFCheckpointError(
                    f"tensor {name} has shape {list(tensor.shape)}, the model needs {list(own[name].shape)} (a bug)"
                )
            own[name].copy_(tensor)


def checkpoint_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of the HuggingFace checkpoint directory ``path``: its config.json's, without the MTP layers
    when config.json declares them and the weights have none (transformers keeps ``num_nextn_predict_layers`` in the
    config.json it writes, and never writes MTP layers)."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise HFCheckpointError(f"{path} has no config.json: point at a HuggingFace checkpoint directory")
    inside_or_refuse(path, "config.json")
    config = config_from_hf(json.loads(config_file.read_text()))
    prefixes = tuple(mtp_prefixes(config))
    if prefixes:
        with CheckpointReader(path) as reader:
            has_mtp = any(k.startswith(prefixes) for k in reader.names())
        if not has_mtp:
            warnings.warn(
                f"{path}: config.json has num_nextn_predict_layers={config.mtp_num_layers} but the checkpoint has no "
                "MTP tensors; loading the model without MTP",
                stacklevel=2,
            )
            config = dataclasses.replace(config, mtp_num_layers=None)
    return config


def load_pretrained(
    path: str | Path, dtype: torch.dtype = torch.float32, *, device: str | torch.device = "cpu"
) -> nn.Module:
    """The model of the HuggingFace safetensors checkpoint directory ``path`` (config.json + weights), in eval mode."""
    config = checkpoint_config(path)
    with CheckpointReader(Path(path)) as reader:
        plan = plan_for(reader, config, None)  # checks the names before any allocation
        model = _empty_model(config, dtype, device)
        _load_into(model, reader, plan, dtype)
    return model.eval()


def _hf_tensors(model: nn.Module, plan: Plan) -> Iterator[tuple[str, torch.Tensor]]:
    state = _check_model_names(model, plan)
    for entry in plan.entries:
        assert entry.to_hf is not None  # a plan built without `available` only has writable layouts
        for source, tensor in zip(entry.sources, entry.to_hf(state[entry.ours]), strict=True):
            yield source.key, tensor
    for key, ours in plan.copies.items():
        yield key, state[ours].clone()  # safetensors refuses tensors sharing storage
    for key, shape in plan.zeros.items():
        yield key, torch.zeros(shape, dtype=torch.float32)


def _umask() -> int:
    """The process's umask, read without setting it where Linux shows it (setting it, even back at once, changes it
    for every thread in between)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0)
    os.umask(mask)
    return mask


def apply_default_modes(directory: Path) -> None:
    """Give the files under ``directory`` the mode a plain ``open()`` would (0666 less the umask): safetensors writes
    its files 0600, unreadable to the other users who serve or copy the model, unlike every other file."""
    mode = 0o666 & ~_umask()
    for path in Path(directory).rglob("*"):
        if path.is_file() and not path.is_symlink():
            path.chmod(mode)


@contextlib.contextmanager
def written_whole(path: Path, tag: str) -> Iterator[Path]:
    """A hidden sibling directory of ``path`` to fill; once filled it takes ``path``'s place (an existing ``path``,
    empty or one the caller may overwrite, is moved aside first and removed after), so ``path`` is never half-written.
    On an error the sibling is removed and ``path`` left as it was."""
    tmp = path.with_name(f".{path.name}.{tag}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir(parents=True)
    old = None
    try:
        yield tmp
        apply_default_modes(tmp)
        if path.exists():
            old = path.with_name(f".{path.name}.old-{uuid.uuid4().hex[:8]}")
            path.rename(old)
        tmp.rename(path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not path.exists():
            old.rename(path)
        raise
    if old is not None and old.is_dir():
        shutil.rmtree(old)
    elif old is not None:
        old.unlink()


def save_pretrained(
    model: nn.Module, path: str | Path, *, max_shard_size: int | str = "5GB", overwrite: bool = False
) -> None:
    """Writes ``model`` as a HuggingFace checkpoint (config.json + safetensors, sharded above ``max_shard_size``),
    atomically: on error nothing is left at ``path``."""
    path = Path(path)
    if path.exists() and (not path.is_dir() or any(path.iterdir())) and not overwrite:
        raise FileExistsError(f"{path} exists and is not empty: pass overwrite=True or choose another path")
    config: ModelConfig = model.config
    hf_config = config_to_hf(config)
    hf_config["dtype"] = str(model.embed_tokens.weight.dtype).removeprefix("torch.")
    plan = build_plan(config)
    with written_whole(path, "tmp") as tmp:
        writer = ShardWriter(tmp, parse_size(max_shard_size))
        for key, tensor in _hf_tensors(model, plan):
            writer.add(key, tensor)
        writer.finish()
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
