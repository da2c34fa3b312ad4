"""``moe-train quantize``: a training checkpoint as a quantised HuggingFace checkpoint, through NVIDIA Model Optimizer.

The checkpoint is exported as a HuggingFace model (:func:`~moe_train.export.export_hf`, into a temporary directory),
loaded by transformers, calibrated by modelopt (``mtq.quantize`` with its ``FP8_DEFAULT_CFG`` or
``NVFP4_DEFAULT_CFG``: max calibration of the weights' and inputs' amaxes over batches of the run's configured data),
and written by modelopt's ``export_hf_checkpoint``: ``config.json`` with a ``quantization_config``,
``hf_quant_config.json`` and safetensors whose linear weights are FP8 (``weight`` float8_e4m3fn, ``weight_scale``,
``input_scale``) or NVFP4 (two E2M1 values a byte, E4M3 ``weight_scale`` per 16 inputs, ``weight_scale_2``). The
routed experts are quantised one by one; routers, embeddings and the output layer are not. Serving stacks
(TensorRT-LLM, vLLM, SGLang) read this format; transformers itself does not dequantise it.

Both recipes calibrate and export on CPU. modelopt's NVFP4 fake quantisation needs CUDA, but calibration only
collects amaxes, so it is not needed here.

nvidia-modelopt is optional (``pip install 'moe-train[quantize]'``); without it the command is a one-line error.
The output directory appears whole or not at all.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

import torch

from moe_models.hf.io import apply_default_modes
from moe_train.checkpoint import read_checked_metadata
from moe_train.config import DataConfig
from moe_train.data import prepare_data
from moe_train.export import _check_out_dir, _move_into_place, export_hf, read_meta, resolve_checkpoint

MODELOPT_CONFIGS = {"fp8": "FP8_DEFAULT_CFG", "nvfp4": "NVFP4_DEFAULT_CFG"}
INSTALL_HINT = "pip install 'moe-train[quantize]' (nvidia-modelopt, transformers)"


class QuantizeError(ValueError):
    """A quantisation the user asked for cannot run (unknown recipe, missing modelopt); one line."""


def load_modelopt() -> tuple[Any, Any]:
    """modelopt's quantisation module and its HF export function, or :class:`QuantizeError` saying how to install
    them (any import failure: modelopt also raises other errors when its own dependencies are missing)."""
    try:
        import modelopt.torch.quantization as mtq
        from modelopt.torch.export import export_hf_checkpoint
    except Exception as err:  # any import failure is reported, not hidden
        reason = f"{type(err).__name__}: {err}".splitlines()[0]
        raise QuantizeError(
            f"moe-train quantize needs nvidia-modelopt ({reason}); install it: {INSTALL_HINT}"
        ) from None
    return mtq, export_hf_checkpoint


def modelopt_version() -> str:
    return importlib.metadata.version("nvidia-modelopt")


def calibration_batches(meta: dict[str, Any], num_batches: int, batch_size: int) -> list[torch.Tensor]:
    """``num_batches`` batches of the run's configured training data (``data`` section of the checkpoint's config,
    its windows of ``data.seq_len`` tokens), as the trainer draws them from step 1."""
    config = meta.get("config") or {}
    # the token cache goes where this machine keeps it, never where a checkpoint's meta.json says
    data = dataclasses.replace(DataConfig(**(config.get("data") or {})), cache_dir="")
    seed = int((config.get("train") or {}).get("seed", 0))
    vocab = (config.get("model") or {}).get("vocab_size")
    prepared = prepare_data(data, seed=seed, model_vocab_size=vocab, model_from_hf=config.get("model_from_hf", ""))
    return [prepared.train.batch(step, batch_size, 0, batch_size).input_ids_BS for step in range(1, num_batches + 1)]


def quantize_checkpoint(
    checkpoint: Path,
    recipe: str,
    out_dir: Path,
    *,
    calib_batches: int = 8,
    calib_batch_size: int = 4,
    overwrite: bool = False,
) -> Path:
    """Write ``checkpoint``'s model quantised with modelopt's ``recipe`` (``fp8`` or ``nvfp4``) to ``out_dir``
    (module docstring); returns ``out_dir``. Checks (recipe, checkpoint, output directory, modelopt) come first."""
    if recipe not in MODELOPT_CONFIGS:
        raise QuantizeError(f"--recipe {recipe}: choose {' or '.join(MODELOPT_CONFIGS)}")
    if calib_batches < 1 or calib_batch_size < 1:
        raise QuantizeError(f"--calib-batches {calib_batches}: need at least one batch of at least one sequence")
    info = resolve_checkpoint(Path(checkpoint))
    out_dir = Path(out_dir)
    _check_out_dir(out_dir, overwrite, info.path)
    meta = read_meta(info.path)
    read_checked_metadata(info.path)  # a damaged or tampered-with checkpoint, before modelopt's slow import
    mtq, export_hf_checkpoint = load_modelopt()
    from transformers import AutoModelForCausalLM

    batches = calibration_batches(meta, calib_batches, calib_batch_size)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = out_dir.with_name(f".{out_dir.name}.quantize-{uuid.uuid4().hex[:8]}")
    try:
        with tempfile.TemporaryDirectory(prefix="moe-train-quantize-") as tmp:
            hf_dir = export_hf(info.path, Path(tmp) / "hf")
            model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()

            def forward_loop(m: torch.nn.Module) -> None:
                with torch.no_grad():
                    for ids in batches:
                        m(input_ids=ids)

            model = mtq.quantize(model, getattr(mtq, MODELOPT_CONFIGS[recipe]), forward_loop)
            export_hf_checkpoint(model, export_dir=staging)
            for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
                if (hf_dir / name).is_file():
                    shutil.copyfile(hf_dir / name, staging / name)
            apply_default_modes(staging)  # modelopt writes its safetensors 0600, as safetensors does
        _move_into_place(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir
