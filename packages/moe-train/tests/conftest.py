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
