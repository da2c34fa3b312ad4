"""``moe-train train --model.from_hf PATH``: the architecture and the weights come from a HuggingFace directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moe_models import build_model, causal_lm_loss
from moe_models.hf import save_pretrained
from moe_models.presets import preset
from moe_train import cli
from moe_train.config import load_config
from moe_train.data import TokenStream, stdlib_token_file

RUN = {"train.steps": "2", "train.global_batch_size": "4", "train.warmup_steps": "0", "data.seq_len": "32"}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(7)
    model = build_model(preset("tiny-deepseek-v3"))  # MLA, dense + MoE layers, shared expert, MTP
    path = tmp_path_factory.mktemp("hf") / "tiny-dsv3"
    save_pretrained(model, path)
    return path


def _args(overrides: dict[str, str]) -> list[str]:
    return [token for key, value in overrides.items() for token in (f"--{key}", value)]


def test_from_hf_replaces_the_preset_model_section(hf_dir: Path) -> None:
    cfg = load_config("tiny", {"model.from_hf": str(hf_dir), "model.moe_aux_loss_coeff": "0.0"})
    assert cfg.model_from_hf == str(hf_dir)
    assert cfg.model.family == "deepseek_v3" and cfg.model.multi_latent_attention
    assert cfg.model.num_layers == preset("tiny-deepseek-v3").num_layers  # not the tiny preset's 4 layers
    assert cfg.model.moe_aux_loss_coeff == [0.0]  # model.* overrides still apply on top


def test_training_starts_from_the_checkpoint_weights(hf_dir: Path, data_cache: Path, tmp_path: Path) -> None:
    run = {**RUN, "data.cache_dir": str(data_cache), "run.output_dir": str(tmp_path / "run")}
    assert cli.main(["train", "--model.from_hf", str(hf_dir), *_args(run)]) == 0
    first = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    # the same first batch through the saved model, computed here
    from moe_models.hf import load_pretrained

    model = load_pretrained(hf_dir).train()
    batch = TokenStream(stdlib_token_file(data_cache), 32, 1234).batch(0, 4, 0, 4)
    with torch.no_grad():
        expected = causal_lm_loss(model(batch.input_ids_BS), batch.labels_BS).lm.item()
    assert first["loss"] == pytest.approx(expected, rel=1e-5)
    assert first["mtp_loss"] > 0


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--model.from_hf", "/nonexistent/dir"], "model.from_hf='/nonexistent/dir': no config.json"),
        (["--model.preset", "tiny-deepsek-v3"], "did you mean tiny-deepseek-v3"),
        (["--model.hidden_size", "48"], "must not change the checkpoint's sizes"),
    ],
)
def test_bad_model_sources_are_one_line_exit_2(
    hf_dir: Path, data_cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], extra, expected
) -> None:
    run = {**RUN, "data.cache_dir": str(data_cache), "run.output_dir": str(tmp_path / "run")}
    source = [] if extra[0] != "--model.hidden_size" else ["--model.from_hf", str(hf_dir)]
    assert cli.main(["train", *source, *extra, *_args(run)]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expected in err, err
    assert not (tmp_path / "run").exists()
