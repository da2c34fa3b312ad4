from pathlib import Path

import pytest

# a model small enough that a few dozen steps take seconds on 2 CPU cores
MICRO_OVERRIDES = {
    "model.hidden_size": "32",
    "model.num_layers": "1",
    "model.num_attention_heads": "2",
    "model.num_query_groups": "1",
    "model.kv_channels": "16",
    "model.num_moe_experts": "4",
    "model.moe_ffn_hidden_size": "32",
    "data.seq_len": "32",
    "train.global_batch_size": "4",
    "train.warmup_steps": "2",
}


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("data-cache")


@pytest.fixture
def micro_overrides(data_cache: Path, tmp_path: Path) -> dict[str, str]:
    return {**MICRO_OVERRIDES, "data.cache_dir": str(data_cache), "run.output_dir": str(tmp_path / "run")}


@pytest.fixture(scope="session")
def micro_model() -> dict[str, str]:
    """The micro model's overrides for module-scoped fixtures, which cannot take the per-test ``micro_overrides``."""
    return dict(MICRO_OVERRIDES)


@pytest.fixture
def refused_in_one_line(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch):
    """``check(overrides, expected)``: the tiny preset with ``overrides`` is refused by ``load_config`` with a
    ConfigError naming ``expected``'s key, and by ``moe-train train`` in one line holding ``expected`` (exit 2),
    before joining a process group (as under a 4-rank torchrun) and before writing anything."""
    from moe_train import cli
    from moe_train.config import ConfigError, load_config

    def check(overrides: dict[str, str], expected: str) -> None:
        key = expected.split(":")[0].replace(".", r"\.").replace("[", r"\[").replace("(", r"\(")
        with pytest.raises(ConfigError, match="^" + key):
            load_config("tiny", overrides)
        monkeypatch.setenv("WORLD_SIZE", "4")
        args = [token for key, value in overrides.items() for token in (f"--{key}", value)]
        assert cli.main(["train", *args]) == cli.EXIT_USAGE
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and expected in err, err
        if "run.output_dir" in overrides:
            assert not Path(overrides["run.output_dir"]).exists()

    return check
