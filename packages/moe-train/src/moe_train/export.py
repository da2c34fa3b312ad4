"""``moe-train export``: a training checkpoint as a HuggingFace model directory.

A checkpoint holds global tensors whatever layout it was trained under, so one process loads it into the model its
``meta.json`` describes (:func:`load_trained_model`) and ``moe_models.hf.save_pretrained`` writes ``config.json`` and
safetensors that ``transformers.AutoModelForCausalLM.from_pretrained`` reads. A run that tokenised with a local
``tokenizer.json`` (``data.tokenizer``) gets it copied alongside; a byte-level run has no tokenizer file (its token
ids are the bytes).

The directory appears whole or not at all: everything is written into a hidden sibling first and renamed into place.
Errors are one line: :class:`~moe_train.checkpoint.CheckpointError` (not a checkpoint, no checkpoint in a run
directory, a ``meta.json`` that builds no model), :class:`~moe_models.hf.HFCheckpointError` (the family's HF
layout cannot express the model) and :class:`FileExistsError` (a non-empty output directory without ``overwrite``).

A LoRA run's checkpoint (``peft.method=lora``) holds the adapters only: :func:`load_trained_model` rebuilds the
model as the trainer did (adapters added, base from ``model.from_hf``, or the initial weights of ``train.seed``) and
loads the adapters onto it. :func:`export_hf` then writes the merged model (each adapter folded into its weight);
:func:`export_peft_checkpoint` writes the adapters alone as a PEFT adapter directory (:func:`export_peft`,
``moe_models.hf.save_peft_adapter``) for ``peft.PeftModel.from_pretrained`` on transformers' model of the base.
"""

from __future__ import annotations

import json
import re
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moe_models import ModelConfig, build_model
from moe_models.hf import CheckpointSource, config_to_hf, save_peft_adapter, save_pretrained
from moe_models.hf.files import resolve_inside
from moe_models.lora import merged_state_dict
from moe_parallel import materialize
from moe_train.checkpoint import (
    META_FILE,
    CheckpointError,
    CheckpointInfo,
    latest_checkpoint,
    load_checkpoint,
    read_meta,
)
from moe_train.config import ConfigError, PeftConfig
from moe_train.dtypes import short_name, torch_dtype
from moe_train.peft import AdapterSource, add_adapters, weights_fingerprint

EXPORT_DTYPES = ("fp32", "bf16")  # what a HuggingFace export is written in
# the files of a tokenizer directory transformers reads, copied when present
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# written when the tokenizer came without one: without it AutoTokenizer picks the family's own tokenizer class
# (Qwen2Tokenizer for qwen3_moe, ...), which reads the same tokenizer.json into different token ids
TOKENIZER_CONFIG = {"tokenizer_class": "PreTrainedTokenizerFast"}
_STEP_DIR = re.compile(r"step_\d+")


def resolve_checkpoint(path: Path) -> CheckpointInfo:
    """The checkpoint ``path`` names: a ``step_N`` directory itself, or a run's output directory (or its
    ``checkpoints`` directory), whose latest complete checkpoint is taken (the highest ``step_N`` with a
    ``meta.json``; partial ones are skipped)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such directory; give a checkpoint (step_N) or a run's output directory")
    if (path / META_FILE).is_file() or _STEP_DIR.fullmatch(path.name):
        return CheckpointInfo(path, int(read_meta(path)["step"]))
    for directory in (path / "checkpoints", path):
        found = latest_checkpoint(directory)
        if found is not None:
            return found
    if (path / "checkpoints").is_dir():
        raise CheckpointError(f"{path}: no complete checkpoint in {path / 'checkpoints'} (no step_N with {META_FILE})")
    raise CheckpointError(
        f"{path}: neither a checkpoint (step_N/{META_FILE}) nor a run directory (checkpoints/step_N/{META_FILE})"
    )


def trained_model_config(checkpoint: Path) -> ModelConfig:
    """The ModelConfig a checkpoint (or a run directory's latest checkpoint) was trained with."""
    info = resolve_checkpoint(checkpoint)
    return _model_config(read_meta(info.path), info.path)


def _model_config(meta: dict[str, Any], path: Path) -> ModelConfig:
    fields = (meta.get("config") or {}).get("model")
    if not isinstance(fields, dict):
        raise CheckpointError(f"{path}/{META_FILE} has no config.model section: not written by moe-train train")
    try:
        return ModelConfig(**fields)
    except (TypeError, ValueError) as err:  # unknown fields (another version), ModelConfigError
        raise CheckpointError(f"{path}/{META_FILE}: config.model does not build a ModelConfig here ({err})") from None


def load_trained_model(checkpoint: Path) -> tuple[ModelConfig, nn.Module]:
    """The trained model of a checkpoint (or of a run directory's latest one) on the CPU, in eval mode, in the
    dtype it was trained in (``train.params_dtype``); the one place that calls ``load_checkpoint`` for export."""
    info = resolve_checkpoint(checkpoint)
    meta = read_meta(info.path)
    config = _model_config(meta, info.path)
    # built on the meta device, then uninitialised storage: load_checkpoint checks that the checkpoint holds every
    # model tensor (the routers' expert_bias buffers included), so nothing is left unwritten
    with torch.device("meta"):
        model = build_model(config)
    lora = is_lora_checkpoint(meta)
    if lora:
        _add_trained_adapters(model, meta, info.path)
    if _train_section(meta).get("params_dtype") == "bf16":
        model.to(torch.bfloat16)  # as the trainer does; the routers' expert_bias stays fp32
    if lora:  # the checkpoint holds no frozen tensor: the base comes from where the run read it
        _materialize_base(model, config, meta, info.path)
    else:
        model.to_empty(device="cpu")
        model.tie_weights()  # to_empty replaces the shared parameter by two
    load_checkpoint(info.path, model)  # one process: routed experts come back from their canonical form
    return config, model.eval()


def is_lora_checkpoint(meta: dict[str, Any]) -> bool:
    """Whether a checkpoint's ``meta.json`` is a LoRA run's (adapters only, the base by reference)."""
    return ((meta.get("config") or {}).get("peft") or {}).get("method", "none") == "lora"


def _add_trained_adapters(model: nn.Module, meta: dict[str, Any], path: Path) -> None:
    section = (meta.get("config") or {}).get("peft") or {}
    try:
        add_adapters(model, PeftConfig(**section))
    except (TypeError, ValueError, ConfigError) as err:  # another version's fields, targets this model lacks
        raise CheckpointError(f"{path}/{META_FILE}: config.peft does not adapt the model here ({err})") from None


def _base_checkpoint(meta: dict[str, Any], path: Path) -> str | None:
    """The run's ``model.from_hf`` (None: initial weights), checked to be the files the adapters were trained on."""
    from_hf = (meta.get("config") or {}).get("model_from_hf") or None
    if from_hf is None:
        return None
    if not Path(from_hf).is_dir():
        raise CheckpointError(
            f"{path} holds LoRA adapters of the base model.from_hf={from_hf}, which is not there; put the base "
            "checkpoint back at that path"
        )
    saved = (meta.get("peft_base") or {}).get("fingerprint")
    if saved is not None and saved != weights_fingerprint(from_hf):
        raise CheckpointError(
            f"{path} holds LoRA adapters of model.from_hf={from_hf} as it was when trained (files {saved}); its "
            f"weight files have changed since ({weights_fingerprint(from_hf)}): restore the base they were trained on"
        )
    return str(from_hf)


def _materialize_base(model: nn.Module, config: ModelConfig, meta: dict[str, Any], path: Path) -> None:
    from_hf = _base_checkpoint(meta, path)
    seed = int(_train_section(meta).get("seed", 0))
    source = CheckpointSource(from_hf, config) if from_hf else None
    base = source or model.initial_weights(seed)
    try:  # the adapters' starting values too (overwritten by the checkpoint's): materialize fills every tensor
        materialize(model, model.parallel_plan(), AdapterSource(base, model, seed), "cpu")
    finally:
        if source is not None:
            source.close()


def _merged(model: nn.Module, config: ModelConfig) -> nn.Module:
    """The model without adapters, holding ``model``'s adapted weights (each adapter folded in)."""
    state = merged_state_dict(model)
    with torch.device("meta"):
        merged = build_model(config)
    merged.to_empty(device="cpu")
    merged.tie_weights()
    merged.load_state_dict(state)
    return merged.to(model.embed_tokens.weight.dtype).eval()


def _train_section(meta: dict[str, Any]) -> dict[str, Any]:
    return (meta.get("config") or {}).get("train") or {}


def _torch_dtype(dtype: str | torch.dtype | None, meta: dict[str, Any]) -> torch.dtype:
    if dtype is None:  # as trained: lossless, and no larger than the checkpoint's parameters
        dtype = _train_section(meta).get("params_dtype", "fp32")
    allowed = {torch_dtype(name) for name in EXPORT_DTYPES}
    if isinstance(dtype, torch.dtype) and dtype in allowed:
        return dtype
    if short_name(dtype) in EXPORT_DTYPES:
        return torch_dtype(dtype)
    raise ValueError(f"dtype={dtype!r}: choose {' or '.join(EXPORT_DTYPES)}")


def _tokenizer_files(meta: dict[str, Any]) -> list[Path]:
    """The local tokenizer files of the run (``data.tokenizer``: a tokenizer.json, or a directory holding one).

    ``meta.json`` comes with the checkpoint, which may come from elsewhere: a file is copied only when it is what it
    says it is (JSON, a tokenizers file for ``tokenizer.json``) and lies inside the tokenizer's directory, so a
    ``data.tokenizer`` naming ``~/.ssh/id_ed25519`` does not end up in the export."""
    name = ((meta.get("config") or {}).get("data") or {}).get("tokenizer")
    if not name or not isinstance(name, str):
        return []
    path = Path(name).expanduser()
    if path.is_file():
        directory, names = path.parent, [path.name]
    elif path.is_dir() and (path / "tokenizer.json").is_file():
        directory, names = path, [f for f in TOKENIZER_FILES if (path / f).is_file()]
    else:
        if path.suffix == ".json" or path.is_dir():
            warnings.warn(
                f"data.tokenizer={name!r}: no tokenizer.json there (from this directory); the export has no tokenizer",
                stacklevel=3,
            )
        return []  # a tokenizer by hub name, or none: nothing local to copy
    files = [directory / n for n in names]
    refused = [f for f in files if resolve_inside(directory, f.name) is None or not _is_tokenizer_file(f)]
    if refused:
        warnings.warn(
            f"data.tokenizer={name!r}: {refused[0]} is not a tokenizer file inside its directory; the export has no "
            "tokenizer (copy one in by hand)",
            stacklevel=3,
        )
        return []
    return files


def _is_tokenizer_file(path: Path) -> bool:
    """A JSON file, and for ``tokenizer.json`` (or the one file a run named) one that ``tokenizers`` loads."""
    try:
        json.loads(path.read_text())
        if path.name not in TOKENIZER_FILES[1:]:
            from tokenizers import Tokenizer

            Tokenizer.from_file(str(path))
    except Exception:  # not text, not JSON, not a tokenizer: whatever it is, it is not copied
        return False
    return True


def _check_out_dir(out_dir: Path, overwrite: bool, checkpoint: Path) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"{out_dir} exists and is not a directory: choose another path")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise FileExistsError(f"{out_dir} exists and is not empty: pass overwrite=True (--overwrite) or another path")
    out, ckpt = out_dir.resolve(), checkpoint.resolve()
    if out == ckpt or out in ckpt.parents or ckpt in out.parents:
        raise FileExistsError(f"{out_dir}: the export would replace or sit inside the checkpoint {checkpoint}")


def _move_into_place(staging: Path, out_dir: Path) -> None:
    """Rename ``staging`` to ``out_dir``; an existing (empty, or overwritten) ``out_dir`` goes only once it has."""
    old = None
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}")
        out_dir.rename(old)
    try:
        staging.rename(out_dir)
    except BaseException:
        if old is not None:
            old.rename(out_dir)
        raise
    if old is not None:
        shutil.rmtree(old)


def export_hf(
    checkpoint: Path,
    out_dir: Path,
    dtype: str | torch.dtype | None = None,
    *,
    overwrite: bool = False,
    max_shard_size: int | str = "5GB",
) -> Path:
    """Write the trained model of ``checkpoint`` (a ``step_N`` directory, or a run's output directory: its latest
    complete checkpoint) as a HuggingFace model directory ``out_dir`` (config.json + safetensors, and the run's
    local tokenizer files); returns ``out_dir``. A LoRA run's model is written merged (the adapters folded in).

    ``dtype``: ``"fp32"`` or ``"bf16"`` (or the torch dtype); ``None`` = the dtype the run trained its parameters
    in. DeepSeek-V3 MTP layers are written as DeepSeek's checkpoints hold them (transformers skips them).
    ``overwrite``: replace a non-empty ``out_dir`` (refused otherwise). Nothing is left half-written on error.
    """
    info = resolve_checkpoint(checkpoint)
    out_dir = Path(out_dir)
    meta = read_meta(info.path)
    torch_dtype = _torch_dtype(dtype, meta)
    _check_out_dir(out_dir, overwrite, info.path)
    config_to_hf(_model_config(meta, info.path))  # a model the family's HF layout cannot express fails before loading
    tokenizer = _tokenizer_files(meta)
    config, model = load_trained_model(info.path)
    if is_lora_checkpoint(meta):
        model = _merged(model, config)
    model.to(torch_dtype)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = out_dir.with_name(f".{out_dir.name}.export-{uuid.uuid4().hex[:8]}")
    try:
        save_pretrained(model, staging, max_shard_size=max_shard_size)
        for source in tokenizer:
            shutil.copyfile(source, staging / ("tokenizer.json" if len(tokenizer) == 1 else source.name))
        if tokenizer and not (staging / "tokenizer_config.json").exists():
            (staging / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=2) + "\n")
        _move_into_place(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def export_peft(
    model: nn.Module, config: ModelConfig, out_dir: Path, base: str | None, *, overwrite: bool = False
) -> Path:
    """Write ``model``'s LoRA adapters as a PEFT adapter directory ``out_dir`` (``adapter_config.json`` naming
    ``base``, ``adapter_model.safetensors``), whole or not at all; returns ``out_dir``. What PEFT's config cannot
    express is a one-line :class:`~moe_train.checkpoint.CheckpointError`."""
    try:
        return save_peft_adapter(model, config, out_dir, base, overwrite=overwrite)
    except ValueError as err:
        raise CheckpointError(f"cannot write a PEFT adapter: {err}") from None


def export_peft_checkpoint(
    checkpoint: Path, out_dir: Path, dtype: str | torch.dtype | None = None, *, overwrite: bool = False
) -> Path:
    """Write the adapters of a LoRA run's ``checkpoint`` (or a run directory's latest) as a PEFT adapter directory
    ``out_dir`` for transformers' model of the run's ``model.from_hf`` (recorded as the base); returns ``out_dir``.
    ``dtype`` as :func:`export_hf`'s. A checkpoint without adapters, or of adapters on initial weights (no base
    checkpoint for PEFT to load them onto), is a one-line :class:`~moe_train.checkpoint.CheckpointError`."""
    info = resolve_checkpoint(checkpoint)
    out_dir = Path(out_dir)
    meta = read_meta(info.path)
    torch_dtype = _torch_dtype(dtype, meta)
    _check_out_dir(out_dir, overwrite, info.path)
    if not is_lora_checkpoint(meta):
        raise CheckpointError(
            f"{info.path}: not a LoRA run's checkpoint (peft.method is not lora): export it with --hf"
        )
    base = _base_checkpoint(meta, info.path)
    if base is None:
        raise CheckpointError(
            f"{info.path}: its adapters were trained on initial weights (no model.from_hf), which no base checkpoint "
            "holds for PEFT to load them onto; export the merged model with --hf"
        )
    config, model = load_trained_model(info.path)
    model.to(torch_dtype)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    return export_peft(model, config, out_dir, str(Path(base).resolve()), overwrite=overwrite)
