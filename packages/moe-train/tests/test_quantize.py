"""``moe-train quantize``: modelopt's FP8 and NVFP4 exports of a trained tiny model, read back with this stack's own
format decoders and compared with the unquantised export; and the one-line errors."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from moe_precision.formats import E2M1, E4M3, decode
from moe_train import cli

SMALL = ["--model.num_layers", "2", "--data.seq_len", "32", "--train.global_batch_size", "4"]


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("quantize")
    assert cli.main(["train", *SMALL, "--train.steps", "2", "--run.output_dir", str(root / "run")]) == 0
    out = {"hf": root / "hf"}
    assert cli.main(["export", str(root / "run"), "--hf", str(out["hf"])]) == 0
    for recipe in ("fp8", "nvfp4"):
        out[recipe] = root / recipe
        assert cli.main(["quantize", str(root / "run"), "--recipe", recipe, "--out", str(out[recipe])]) == 0
    out["run"] = root / "run"
    return out


def tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is not a mapping


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_fp8_export_decodes_to_the_trained_weights(exports):
    plain, q = tensors(exports["hf"]), tensors(exports["fp8"])
    config = json.loads((exports["fp8"] / "config.json").read_text())["quantization_config"]
    assert config["quant_algo"] == "FP8" and config["quant_method"] == "modelopt"
    quantised = [k[: -len(".weight")] for k, t in q.items() if t.dtype == torch.float8_e4m3fn]
    assert any(".mlp.experts.7.down_proj" in k for k in quantised) and any("self_attn.o_proj" in k for k in quantised)
    assert all(
        q[k].dtype == torch.float32 for k in q if k.endswith(("gate.weight", "lm_head.weight", "embed_tokens.weight"))
    )
    for name in quantised:
        codes = q[f"{name}.weight"].view(torch.uint8)
        value = decode(codes, E4M3) * q[f"{name}.weight_scale"]  # this stack's E4M3 decoder
        assert torch.equal(value, q[f"{name}.weight"].float() * q[f"{name}.weight_scale"])
        assert rel(value, plain[f"{name}.weight"]) < 0.05, name
        assert q[f"{name}.input_scale"].item() > 0


def test_nvfp4_export_decodes_to_the_trained_weights(exports):
    plain, q = tensors(exports["hf"]), tensors(exports["nvfp4"])
    assert json.loads((exports["nvfp4"] / "hf_quant_config.json").read_text())["quantization"]["quant_algo"] == "NVFP4"
    names = [k[: -len(".weight_scale_2")] for k in q if k.endswith(".weight_scale_2")]
    assert len(names) == 2 * (4 + 3 * 8)  # 2 layers: q, k, v, o and 8 experts x (gate, up, down)
    for name in names:
        packed = q[f"{name}.weight"]
        codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)  # low nibble first
        block_scale = q[f"{name}.weight_scale"].float().repeat_interleave(16, dim=1)
        value = decode(codes, E2M1) * block_scale * q[f"{name}.weight_scale_2"]
        assert value.shape == plain[f"{name}.weight"].shape
        assert rel(value, plain[f"{name}.weight"]) < 0.15, name


def test_quantize_errors_are_one_line(exports, tmp_path, capsys, monkeypatch):
    run = str(exports["run"])
    assert cli.main(["quantize", run, "--recipe", "int3", "--out", str(tmp_path / "a")]) == 2
    assert "--recipe int3: choose fp8 or nvfp4" in capsys.readouterr().err
    assert cli.main(["quantize", run, "--recipe", "fp8", "--out", str(exports["fp8"])]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "modelopt.torch.quantization", None)  # as if not installed
    assert cli.main(["quantize", run, "--recipe", "fp8", "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs nvidia-modelopt" in err and "pip install 'moe-train[quantize]'" in err
    assert not (tmp_path / "b").exists() and not (tmp_path / "a").exists()


def test_quantized_files_have_the_modes_of_every_other_file(exports):
    """modelopt writes its safetensors 0600 (safetensors does); the rest of the directory follows the umask."""
    mask = os.umask(0)
    os.umask(mask)
    for recipe in ("fp8", "nvfp4"):
        modes = {p.name: p.stat().st_mode & 0o777 for p in exports[recipe].iterdir() if p.is_file()}
        assert "model.safetensors" in modes and set(modes.values()) == {0o666 & ~mask}, (recipe, modes)
