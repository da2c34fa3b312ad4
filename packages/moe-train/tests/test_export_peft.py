"""``moe-train export CHECKPOINT --peft OUT`` on a LoRA run: peft's own loading of the adapter onto transformers'
model of ``model.from_hf`` gives the trained model's logits (routed and shared experts, MLA, dense layers); ``--hf``
writes the merged model, which transformers loads with the same logits; one-line errors, nothing half-written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers  # the reference implementation: in the dev group, so a missing one fails here

from moe_models import build_model
from moe_models.hf import save_pretrained
from moe_models.presets import preset
from moe_train import cli
from moe_train.export import load_trained_model

peft = pytest.importorskip("peft")

TOLERANCE = 1e-4
LORA_RUN = {
    "peft.method": "lora",
    "peft.rank": "8",
    "peft.alpha": "16",
    "train.lr": "3e-2",
    "train.warmup_steps": "0",
    "train.steps": "2",
    "train.global_batch_size": "4",
    "data.seq_len": "32",
}


def _rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def _hf(path: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory, data_cache: Path) -> tuple[Path, Path]:
    """(base HF directory, LoRA run directory): DeepSeek-V3 (MLA, a dense and a MoE layer, a shared expert, MTP)."""
    root = tmp_path_factory.mktemp("lora-export")
    torch.manual_seed(3)
    save_pretrained(build_model(preset("tiny-deepseek-v3")), root / "base")
    overrides = {**LORA_RUN, "model.from_hf": str(root / "base"), "data.cache_dir": str(data_cache)}
    args = [token for key, value in overrides.items() for token in (f"--{key}", value)]
    assert cli.main(["train", *args, "--run.output_dir", str(root / "run")]) == 0
    return root / "base", root / "run"


def _ids() -> torch.Tensor:
    return torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))


def test_peft_loads_the_exported_adapters_with_the_trained_logits(lora_run, tmp_path, capsys) -> None:
    base, run = lora_run
    assert cli.main(["export", str(run), "--peft", str(tmp_path / "adapter")]) == 0
    out = capsys.readouterr()
    assert "MTP" in out.err  # the MTP layer's adapters are left out, and said so
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base.resolve()) and config["r"] == 8 and config["lora_alpha"] == 16

    _, ours = load_trained_model(run)
    ids = _ids()
    want = _logits(ours, ids)
    assert _rel_err(_logits(_hf(base).eval(), ids), want) > 1e-3, "the trained adapters change nothing"
    adapted = peft.PeftModel.from_pretrained(_hf(config["base_model_name_or_path"]), tmp_path / "adapter").eval()
    err = _rel_err(_logits(adapted, ids), want)
    print(f"\nPEFT adapter of a LoRA run: {err:.2e}")
    assert err < TOLERANCE

    # --hf: the merged model, which transformers loads alone
    assert cli.main(["export", str(run), "--hf", str(tmp_path / "merged")]) == 0
    err = _rel_err(_logits(_hf(tmp_path / "merged").eval(), ids), want)
    print(f"merged HF export of a LoRA run: {err:.2e}")
    assert err < TOLERANCE


def _edited_checkpoint(run: Path, tmp_path: Path, **config: object) -> Path:
    checkpoint = tmp_path / "step_2"
    shutil.copytree(run / "checkpoints" / "step_2", checkpoint)
    meta = json.loads((checkpoint / "meta.json").read_text())
    for dotted, value in config.items():
        section, key = dotted.split("__")
        (meta["config"].setdefault(section, {}) if section != "top" else meta["config"])[key] = value
    (checkpoint / "meta.json").write_text(json.dumps(meta))
    return checkpoint


def _error(capsys, *args: str) -> str:
    assert cli.main(["export", *args]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_what_cannot_be_exported_is_one_line_and_writes_nothing(lora_run, tmp_path, capsys) -> None:
    base, run = lora_run
    out = tmp_path / "out"
    one_of = "needs --hf OUT (a HuggingFace model directory) or --peft OUT (a PEFT adapter): one"
    assert one_of in _error(capsys, str(run), "--hf", str(out), "--peft", str(out))
    assert one_of in _error(capsys, str(run))
    full = _edited_checkpoint(run, tmp_path / "full", peft__method="none")
    assert "not a LoRA run's checkpoint" in _error(capsys, str(full), "--peft", str(out))
    seeded = _edited_checkpoint(run, tmp_path / "seeded", top__model_from_hf="")
    assert "trained on initial weights" in _error(capsys, str(seeded), "--peft", str(out))

    (base / "extra.safetensors").write_bytes(b"not the weights the adapters were trained on")
    try:
        assert "weight files have changed" in _error(capsys, str(run), "--peft", str(out))
    finally:
        (base / "extra.safetensors").unlink()
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging directory left behind


def test_a_lora_run_on_initial_weights_reloads_as_the_trainer_left_it(data_cache, tmp_path, capsys) -> None:
    from moe_train.config import load_config
    from moe_train.setup import prepare
    from moe_train.trainer import train

    micro = {"model.hidden_size": "32", "model.num_layers": "2", "model.num_attention_heads": "2"}
    micro |= {"model.num_query_groups": "1", "model.kv_channels": "16", "model.num_moe_experts": "4"}
    overrides = {**LORA_RUN, **micro, "data.cache_dir": str(data_cache), "run.output_dir": str(tmp_path / "run")}
    setup = prepare(load_config("tiny", overrides), 1)
    train(setup)
    (stage,) = setup.model  # one process: the one stage is the whole model, under its own names
    trained = {k: v.detach().clone() for k, v in stage.state_dict().items()}
    assert any("lora_B" in k and v.abs().max() > 0 for k, v in trained.items())

    _, loaded = load_trained_model(tmp_path / "run")  # the base rebuilt from train.seed, the adapters read
    assert loaded.state_dict().keys() == trained.keys()
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in trained.items())
    assert "no model.from_hf" in _error(capsys, str(tmp_path / "run"), "--peft", str(tmp_path / "adapter"))
    assert cli.main(["export", str(tmp_path / "run"), "--hf", str(tmp_path / "merged")]) == 0
    ids = _ids()
    err = _rel_err(_logits(_hf(tmp_path / "merged").eval(), ids), _logits(loaded.eval(), ids))
    assert err < TOLERANCE
