"""``moe-train export CHECKPOINT --hf OUT``: a trained checkpoint -> a HuggingFace directory that transformers loads
with the trainer's logits; the latest checkpoint of a run directory; one-line errors; nothing half-written."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers  # the reference implementation: in the dev group, so a missing one fails here
from safetensors import safe_open

from moe_models import ModelConfig, build_model, count_parameters
from moe_models.hf import config_from_hf, config_to_hf, load_pretrained
from moe_train import cli
from moe_train.checkpoint import load_checkpoint, read_meta
from moe_train.export import export_hf, load_trained_model

# tiny and quick: 2 steps of 4 sequences x 32 tokens, 2 layers
RUN = ["--train.steps", "2", "--train.global_batch_size", "4", "--data.seq_len", "32", "--run.log_interval", "1"]
FAMILIES = {
    "qwen3_moe": ["--config", "tiny", "--model.num_layers", "2"],
    "deepseek_v3": ["--config", "tiny", "--model.preset", "tiny-deepseek-v3"],  # MLA, dense + MoE, MTP, expert bias
    "gpt_oss": ["--config", "tiny", "--model.preset", "tiny-gpt-oss"],  # sinks, biases, sliding window, YaRN
    "mixtral": ["--config", "tiny", "--model.preset", "tiny-mixtral"],
}
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


def _train(out_dir: Path, data_cache: Path, family_args: list[str], *extra: str) -> Path:
    args = ["train", *family_args, *RUN, "--data.cache_dir", str(data_cache), "--run.output_dir", str(out_dir)]
    assert cli.main([*args, *extra]) == 0
    return out_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, data_cache: Path) -> dict[str, Path]:
    """One trained run directory per family (trained once for the module)."""
    root = tmp_path_factory.mktemp("runs")
    return {family: _train(root / family, data_cache, args) for family, args in FAMILIES.items()}


def _checkpoint(run: Path, step: int = 2) -> Path:
    return run / "checkpoints" / f"step_{step}"


def _trainer_model(checkpoint: Path) -> torch.nn.Module:
    """The trainer's model, restored the trainer's way (not through moe_train.export)."""
    config = ModelConfig(**read_meta(checkpoint)["config"]["model"])
    model = build_model(config)
    load_checkpoint(checkpoint, model)
    return model.eval()


def _ids(vocab_size: int) -> torch.Tensor:
    # 64 tokens: longer than the runs' 32-token sequences and than GPT-OSS's 32-token window
    return torch.randint(0, vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))


def _export(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli.main(["export", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _error_line(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    code, _, err = _export(capsys, *args)
    assert code == cli.EXIT_USAGE, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_export_loads_in_transformers_with_the_trainers_logits(
    family: str, runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoint = _checkpoint(runs[family])
    out = tmp_path / "hf"
    code, stdout, err = _export(capsys, str(checkpoint), "--hf", str(out))
    assert code == 0, err
    assert f"exported step 2 ({checkpoint}): {family}, " in stdout and f"float32 -> {out}" in stdout
    assert "M parameters" in stdout
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left behind

    trainer = _trainer_model(checkpoint)
    config = trainer.config
    # config.json is the trained config's (HF keeps no training-only fields such as the load-balancing type)
    written = json.loads((out / "config.json").read_text())
    assert written == config_to_hf(config) | {"dtype": "float32"}
    assert config_from_hf(written).moe_layer_pattern() == config.moe_layer_pattern()

    hf, info = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    if not config.mtp_num_layers:  # transformers leaves DeepSeek's MTP layer in the file, unused
        assert not info["unexpected_keys"], info
    ids = _ids(config.vocab_size)
    with torch.no_grad():
        expected, got = trainer(ids).logits, hf.eval()(ids).logits
    abs_err = (got - expected).abs().max().item()
    print(
        f"\nexport parity {family}: max abs {abs_err:.2e}, max abs / max |logit| {abs_err / expected.abs().max():.2e}"
    )
    torch.testing.assert_close(got, expected, **TOLERANCE)

    # the very tensors of the checkpoint, and they are the trained ones, not a fresh model's
    exported = _state(load_pretrained(out))
    trained = _state(trainer)
    assert exported.keys() == trained.keys()
    assert all(torch.equal(exported[k], trained[k]) for k in trained)
    fresh = build_model(config, seed=read_meta(checkpoint)["config"]["train"]["seed"]).eval()  # step 0's weights
    initial = _state(fresh)
    unchanged = [k for k in trained if torch.equal(trained[k], initial[k])]
    assert not unchanged, f"{unchanged} still hold their initial values"
    with torch.no_grad():
        assert (fresh(ids).logits - got).abs().max() > 0.1


def test_load_trained_model_is_the_trainers_model(runs: dict[str, Path]) -> None:
    checkpoint = _checkpoint(runs["deepseek_v3"])
    config, model = load_trained_model(runs["deepseek_v3"])  # a run directory: its latest checkpoint
    trainer = _trainer_model(checkpoint)
    assert config == trainer.config and not model.training
    trained = _state(trainer)
    assert all(torch.equal(v, trained[k]) for k, v in _state(model).items())
    assert all(r.expert_bias.dtype == torch.float32 for r in model.routers())
    counts = count_parameters(config)  # what `moe-train export` prints
    assert sum(p.numel() for p in model.parameters()) == counts.total + counts.mtp > counts.total


def test_a_run_directory_exports_its_latest_complete_checkpoint(
    runs: dict[str, Path], data_cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    shutil.copytree(runs["qwen3_moe"], run)
    _train(run, data_cache, FAMILIES["qwen3_moe"], "--train.steps", "3", "--run.resume", "auto")  # step_3 beside step_2
    (run / "checkpoints" / ".step_9.partial").mkdir()  # a save that never finished
    (run / "checkpoints" / "step_10").mkdir()  # no meta.json: not complete
    capsys.readouterr()
    out = tmp_path / "hf"
    code, stdout, _ = _export(capsys, str(run), "--hf", str(out))
    assert code == 0 and f"exported step 3 ({run / 'checkpoints' / 'step_3'})" in stdout
    exported = _state(load_pretrained(out))
    latest, older = _state(_trainer_model(_checkpoint(run, 3))), _state(_trainer_model(_checkpoint(run, 2)))
    assert all(torch.equal(exported[k], latest[k]) for k in latest)
    assert not torch.equal(exported["lm_head.weight"], older["lm_head.weight"])
    # the checkpoints directory itself names the same run
    assert export_hf(run / "checkpoints", tmp_path / "again") == tmp_path / "again"
    assert torch.equal(_state(load_pretrained(tmp_path / "again"))["lm_head.weight"], latest["lm_head.weight"])


@pytest.mark.dist
def test_a_checkpoint_of_two_expert_parallel_ranks_exports_from_one_process(
    data_cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    args = [*FAMILIES["qwen3_moe"], *RUN, "--data.cache_dir", str(data_cache), "--run.output_dir", str(run)]
    torchrun = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", "2", "-m"]
    # experts split over 2 ranks, everything else FSDP-sharded over them; a session of its own, killed whole on timeout
    with subprocess.Popen(
        [
            *torchrun,
            "moe_train",
            "train",
            *args,
            "--parallel.ep",
            "2",
            "--parallel.dp_shard",
            "2",
            "--train.micro_batch_size",
            "2",
        ],
        cwd=tmp_path,
        text=True,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    ) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    assert proc.returncode == 0, stderr[-2000:]
    assert "2 rank(s)" in stdout and read_meta(_checkpoint(run))["world_size"] == 2
    out = tmp_path / "hf"
    code, _, err = _export(capsys, str(run), "--hf", str(out))
    assert code == 0, err
    trainer = _trainer_model(_checkpoint(run))
    trained, exported = _state(trainer), _state(load_pretrained(out))
    assert all(torch.equal(exported[k], v) for k, v in trained.items())
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = _ids(trainer.config.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(hf.eval()(ids).logits, trainer(ids).logits, **TOLERANCE)


def test_bf16_export(runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    checkpoint = _checkpoint(runs["deepseek_v3"])
    out = tmp_path / "hf"
    code, stdout, _ = _export(capsys, str(checkpoint), "--hf", str(out), "--dtype", "bf16")
    assert code == 0 and "bfloat16 -> " in stdout
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    trained = _state(_trainer_model(checkpoint))
    with safe_open(out / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
        dtypes = {f.get_tensor(k).dtype for k in names if "e_score_correction_bias" not in k}
        assert f.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias").dtype == torch.float32
        assert torch.equal(f.get_tensor("model.embed_tokens.weight"), trained["embed_tokens.weight"].bfloat16())
    assert dtypes == {torch.bfloat16}
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    ids = _ids(hf.config.vocab_size)
    with torch.no_grad():
        expected = _trainer_model(checkpoint)(ids).logits
        got = hf.eval()(ids).logits.float()
    assert (got - expected).abs().max() < 0.05 * expected.abs().max()


def test_a_bf16_run_exports_in_bf16_unless_asked(
    data_cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _train(tmp_path / "run", data_cache, FAMILIES["qwen3_moe"], "--train.params_dtype", "bf16")
    capsys.readouterr()
    assert _export(capsys, str(run), "--hf", str(tmp_path / "as-trained"))[0] == 0
    assert _export(capsys, str(run), "--hf", str(tmp_path / "fp32"), "--dtype", "fp32")[0] == 0
    model = build_model(ModelConfig(**read_meta(_checkpoint(run))["config"]["model"])).to(torch.bfloat16)
    load_checkpoint(_checkpoint(run), model)
    trained = _state(model)
    as_trained, fp32 = (
        _state(load_pretrained(tmp_path / "as-trained", torch.bfloat16)),
        _state(load_pretrained(tmp_path / "fp32")),
    )
    assert json.loads((tmp_path / "as-trained" / "config.json").read_text())["dtype"] == "bfloat16"
    assert all(torch.equal(as_trained[k], v) for k, v in trained.items())
    assert all(fp32[k].dtype == torch.float32 and torch.equal(fp32[k], v.float()) for k, v in trained.items())


def _tokenizer_file(path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=280, special_tokens=["<unk>", "<eos>"])
    tokenizer.train_from_iterator(["def export(checkpoint, out):\n    return out\n"] * 20, trainer)
    tokenizer.save(str(path))
    return path


def _with_meta(checkpoint: Path, where: Path, **changes: dict) -> Path:
    """A copy of ``checkpoint`` whose meta.json config sections are updated with ``changes``."""
    copy = where / checkpoint.name
    shutil.copytree(checkpoint, copy)
    meta = json.loads((copy / "meta.json").read_text())
    for section, values in changes.items():
        meta["config"][section].update(values)
    (copy / "meta.json").write_text(json.dumps(meta))
    return copy


def test_a_local_tokenizer_json_is_copied_alongside(
    runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tokenizer = _tokenizer_file(tmp_path / "my-tokenizer.json")
    checkpoint = _with_meta(_checkpoint(runs["qwen3_moe"]), tmp_path, data={"tokenizer": str(tokenizer)})
    out = tmp_path / "hf"
    code, stdout, _ = _export(capsys, str(checkpoint), "--hf", str(out))
    assert code == 0 and stdout.rstrip().endswith("; tokenizer.json copied")
    assert (out / "tokenizer.json").read_bytes() == tokenizer.read_bytes()
    from tokenizers import Tokenizer

    text = "def export(out):"
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tokenizer(text)["input_ids"] == Tokenizer.from_file(str(tokenizer)).encode(text).ids

    # a tokenizer that is not there any more: the model is exported, with a one-line warning
    checkpoint = _with_meta(_checkpoint(runs["qwen3_moe"]), tmp_path / "gone", data={"tokenizer": "/gone/t.json"})
    code, stdout, err = _export(capsys, str(checkpoint), "--hf", str(tmp_path / "hf2"))
    assert code == 0 and "tokenizer.json copied" not in stdout
    assert err.count("\n") == 1 and "data.tokenizer='/gone/t.json': no tokenizer.json there" in err
    assert not (tmp_path / "hf2" / "tokenizer.json").exists()


def test_bad_checkpoints_are_one_line_exit_2(
    runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "hf"
    assert "no such directory" in _error_line(capsys, str(tmp_path / "missing"), "--hf", str(out))
    (tmp_path / "stray").mkdir()
    (tmp_path / "stray" / "notes.txt").write_text("x")
    assert "neither a checkpoint (step_N/meta.json) nor a run directory" in _error_line(
        capsys, str(tmp_path / "stray"), "--hf", str(out)
    )
    (tmp_path / "run" / "checkpoints" / ".step_5.partial").mkdir(parents=True)
    assert "no complete checkpoint in" in _error_line(capsys, str(tmp_path / "run"), "--hf", str(out))
    (tmp_path / "step_3").mkdir()
    assert "not a complete moe-train checkpoint (no meta.json)" in _error_line(
        capsys, str(tmp_path / "step_3"), "--hf", str(out)
    )
    # a checkpoint whose DCP files are gone
    broken = _with_meta(_checkpoint(runs["qwen3_moe"]), tmp_path / "broken")
    for data in broken.glob("*.distcp"):
        data.unlink()
    assert "__0_0.distcp: missing (named by .metadata): the checkpoint is damaged" in _error_line(
        capsys, str(broken), "--hf", str(out)
    )
    # a model the family's HF layout cannot express (Qwen3-MoE has no sliding windows): refused before loading
    windowed = _with_meta(_checkpoint(runs["qwen3_moe"]), tmp_path / "windowed", model={"window_size": 16})
    assert "window_size=16 cannot be written as a qwen3_moe checkpoint" in _error_line(
        capsys, str(windowed), "--hf", str(out)
    )
    checkpoint = str(_checkpoint(runs["qwen3_moe"]))
    assert "needs --hf OUT" in _error_line(capsys, checkpoint)
    assert "--dtype fp16: choose fp32 or bf16" in _error_line(capsys, checkpoint, "--hf", str(out), "--dtype", "fp16")
    assert "takes CHECKPOINT --hf OUT" in _error_line(capsys, checkpoint, "--hf", str(out), "--extra")
    assert not out.exists()


def test_a_non_empty_output_is_refused_unless_overwrite(
    runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoint = str(_checkpoint(runs["qwen3_moe"]))
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert "exists and is not empty" in _error_line(capsys, checkpoint, "--hf", str(out))
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    (tmp_path / "file").write_text("x")
    assert "exists and is not a directory" in _error_line(capsys, checkpoint, "--hf", str(tmp_path / "file"))
    # nor may the export replace the run it comes from
    assert "sit inside the checkpoint" in _error_line(capsys, checkpoint, "--hf", str(runs["qwen3_moe"]), "--overwrite")
    assert _checkpoint(runs["qwen3_moe"]).is_dir()

    assert _export(capsys, checkpoint, "--hf", str(out), "--overwrite")[0] == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _export(capsys, checkpoint, "--hf", str(empty))[0] == 0  # an empty directory is fine


def test_a_failed_export_leaves_nothing_half_written(
    runs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import moe_train.export as export

    def fail_after_writing(model, path, **kwargs):
        real_save(model, path, **kwargs)
        raise OSError("disk full")

    real_save = export.save_pretrained
    monkeypatch.setattr(export, "save_pretrained", fail_after_writing)
    checkpoint = _checkpoint(runs["qwen3_moe"])
    with pytest.raises(OSError, match="disk full"):
        export_hf(checkpoint, tmp_path / "hf")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "old.txt").write_text("previous export")
    with pytest.raises(OSError, match="disk full"):
        export_hf(checkpoint, tmp_path / "hf", overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]
    assert (tmp_path / "hf" / "old.txt").read_text() == "previous export"
