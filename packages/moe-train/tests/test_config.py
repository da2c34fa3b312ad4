from pathlib import Path

import pytest
import torch

from moe_models import ModelConfig
from moe_parallel import ParallelConfig
from moe_train.config import ConfigError, ExperimentConfig, load_config, preset_names


def test_tiny_preset_is_the_default_and_loads() -> None:
    assert "tiny" in preset_names()
    cfg = load_config()
    assert isinstance(cfg, ExperimentConfig)
    assert isinstance(cfg.model, ModelConfig) and isinstance(cfg.parallel, ParallelConfig)
    assert cfg.model.num_moe_experts == 8 and cfg.model.moe_router_topk == 2
    assert cfg.run.output_dir == "outputs/tiny"


def test_overrides_are_parsed_to_the_field_type() -> None:
    cfg = load_config(
        "tiny",
        {
            "train.steps": "7",
            "train.lr": "1e-3",
            "model.qk_layernorm": "false",
            "run.recompute_modules": "layers.*.mlp,layers.0.attention",
            "parallel.etp": "none",
            "run.output_dir": "123",
        },
    )
    assert cfg.train.steps == 7
    assert cfg.train.lr == pytest.approx(1e-3) and isinstance(cfg.train.lr, float)
    assert cfg.model.qk_layernorm is False
    assert cfg.run.recompute_modules == ["layers.*.mlp", "layers.0.attention"]
    assert cfg.parallel.etp is None
    assert cfg.run.output_dir == "123"


def test_yaml_file_with_sections(tmp_path: Path) -> None:
    path = tmp_path / "exp.yaml"
    path.write_text("train:\n  steps: 3\n  lr: 0.01\nmodel:\n  num_layers: 1\n")
    cfg = load_config(str(path), {"train.steps": "4"})
    assert (cfg.train.steps, cfg.train.lr, cfg.model.num_layers) == (4, 0.01, 1)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"train.stepz": "5"}, "unknown config key 'train.stepz'; did you mean 'train.steps'?"),
        ({"trian.steps": "5"}, "unknown config section 'trian'; did you mean 'train'?"),
        ({"train.steps": "five"}, "config key 'train.steps' expects int, got 'five'"),
        ({"train.steps": "1.5"}, "config key 'train.steps' expects int, got 1.5"),
        ({"model.qk_layernorm": "maybe"}, "config key 'model.qk_layernorm' expects bool"),
        ({"model.moe_router_topk": "9"}, "model.moe_router_topk=9: must be between 1 and the number of experts (8)"),
        ({"model.num_attention_heads": "3"}, "model.num_attention_heads=3: must be a multiple of num_query_groups (2)"),
        ({"parallel.moe_token_dispatcher_type": "nccl"}, "parallel.moe_token_dispatcher_type='nccl': choose one of"),
        (
            {"parallel.ep_overlap": "dualpipe"},
            "parallel.ep_overlap='dualpipe': choose one of none, chunked, microbatch",
        ),
        ({"parallel.ep_overlap_chunks": "0"}, "parallel.ep_overlap_chunks=0: must be at least 1"),
        (
            {"parallel.ep_overlap": "chunked", "parallel.ep_overlap_chunks": "1"},
            "parallel.ep_overlap_chunks=1: must be at least 2 with ep_overlap chunked",
        ),
        (
            {"parallel.ep_overlap": "chunked", "precision.dispatch_fp8": "true"},
            "parallel.ep_overlap=chunked: the FP8 token dispatch (precision.dispatch_fp8) cannot be overlapped yet",
        ),
        (
            {"parallel.ep_overlap": "microbatch", "precision.dispatch_fp8": "true"},
            "parallel.ep_overlap=microbatch: the FP8 token dispatch (precision.dispatch_fp8) cannot be overlapped yet",
        ),
        (
            {"parallel.ep_overlap": "microbatch", "run.recompute_modules": "moe_act"},
            "parallel.ep_overlap=microbatch: run.recompute_modules moe_act keeps one forward's saved tensors at a time",
        ),
        (
            {"parallel.ep_overlap": "microbatch", "run.offload_modules": "expert_fc1"},
            "parallel.ep_overlap=microbatch: run.offload_modules=['expert_fc1'] keeps one forward's saved tensors",
        ),
        (
            {"parallel.ep_overlap": "chunked", "parallel.delay_wgrad_compute": "true"},
            "parallel.delay_wgrad_compute=True: moves the experts' weight gradients into the waits of ep_overlap "
            "microbatch's backward, and ep_overlap is chunked: set ep_overlap microbatch",
        ),
        (
            {"parallel.timeout_minutes": "0"},
            "parallel.timeout_minutes=0.0: must be positive and at most 10080 (a week)",
        ),
        ({"parallel.backend": "mpi"}, "parallel.backend='mpi': choose one of auto, gloo, nccl"),
        ({"parallel.pp_schedule": "1f1b"}, "parallel.pp_schedule='1f1b': choose one of 1F1B, GPipe, Interleaved1F1B"),
        ({"parallel.vpp": "0"}, "parallel.vpp=0: must be at least 1 (or unset)"),
        ({"train.steps": "0"}, "train.steps=0: must be positive"),
        ({"train.min_lr": "1.0"}, "train.min_lr=1.0"),
        ({"run.device": "tpu"}, "run.device='tpu'"),
        ({"train.eval_interval": "10"}, "train.eval_interval=10: there is no validation data to evaluate on"),
    ],
)
def test_bad_values_name_the_field(overrides: dict[str, str], expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config("tiny", overrides)
    assert expected in str(err.value)
    assert "\n" not in str(err.value)


def test_missing_file_and_unknown_preset() -> None:
    with pytest.raises(ConfigError, match="config file 'nope.yaml' not found"):
        load_config("nope.yaml")
    with pytest.raises(ConfigError, match="did you mean tiny"):
        load_config("tinyy")


def test_bad_yaml_shapes(tmp_path: Path) -> None:
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must be a mapping of sections"):
        load_config(str(tmp_path / "list.yaml"))
    (tmp_path / "sec.yaml").write_text("train: 5\n")
    with pytest.raises(ConfigError, match="section 'train' must be a mapping"):
        load_config(str(tmp_path / "sec.yaml"))
    (tmp_path / "bad.yaml").write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_config(str(tmp_path / "bad.yaml"))


def test_a_model_preset_on_the_command_line_replaces_the_files_model() -> None:
    from dataclasses import replace

    from moe_models.presets import preset

    # tiny.yaml describes a 4-layer model of its own; the named preset (2 layers, MLA, MTP) is what runs
    cfg = load_config("tiny", {"model.preset": "tiny-deepseek-v3", "model.init_method_std": "0.01"})
    assert cfg.model == replace(preset("tiny-deepseek-v3"), init_method_std=0.01)
    assert cfg.train.steps == load_config("tiny").train.steps  # the other sections still come from the file


def test_one_dtype_vocabulary_in_every_section() -> None:
    # short names everywhere (as parallel.mixed_precision_*), torch's names accepted and written back short
    cfg = load_config(
        "tiny",
        {
            "model.moe_router_dtype": "float64",
            "parallel.mixed_precision_param": "bfloat16",
            "train.params_dtype": "bfloat16",
            "train.optimizer_states_dtype": "bf16",
            "run.dtype": "float32",
        },
    )
    assert (cfg.model.moe_router_dtype, cfg.parallel.mixed_precision_param) == ("fp64", "bf16")
    assert (cfg.train.params_dtype, cfg.train.optimizer_states_dtype, cfg.run.dtype) == ("bf16", "bf16", "fp32")
    assert cfg.to_dict()["train"]["params_dtype"] == "bf16"
    with pytest.raises(ConfigError, match="train.params_dtype='float16': choose fp32 or bf16"):
        load_config("tiny", {"train.params_dtype": "float16"})


@pytest.mark.parametrize("backend", ["te", "grouped_gemm"])
def test_delayed_weight_gradients_need_a_back_end_that_can_delay_them(backend: str) -> None:
    from moe_train.setup import _check_delayed_wgrad_backend

    delayed = {"parallel.ep_overlap": "microbatch", "parallel.delay_wgrad_compute": "true"}
    _check_delayed_wgrad_backend(load_config("tiny", delayed), torch.bfloat16)  # auto: torch here, which can
    cfg = load_config("tiny", {**delayed, "model.moe_expert_backend": backend})
    with pytest.raises(ConfigError) as err:
        _check_delayed_wgrad_backend(cfg, torch.bfloat16)
    assert str(err.value) == (
        f"parallel.delay_wgrad_compute=true: the experts' back end {backend!r} (model.moe_expert_backend={backend!r}) "
        "has no separate weight-gradient kernel to delay; set model.moe_expert_backend torch, or "
        "parallel.delay_wgrad_compute false"
    )
