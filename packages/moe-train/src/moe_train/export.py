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
from moe_models.hf import config_to_hf, save_pretrained
from moe_models.hf.files import resolve_inside
from moe_train.checkpoint import (
    META_FILE,
    CheckpointError,
    CheckpointInfo,
    latest_checkpoint,
    load_checkpoint,
    read_meta,
)
from moe_train.dtypes import short_name, torch_dtype

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
    if _train_section(meta).get("params_dtype") == "bf16":
        model.to(torch.bfloat16)  # as the trainer does; the routers' expert_bias stays fp32
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty replaces the shared parameter by two
    load_checkpoint(info.path, model)  # one process: routed experts come back from their canonical form
    return config, model.eval()


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
    local tokenizer files); returns ``out_dir``.

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
    _, model = load_trained_model(info.path)
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
