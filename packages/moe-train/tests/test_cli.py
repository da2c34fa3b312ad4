"""The command line, in process: exit codes, one-line errors, nothing half-written."""

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import moe_train
from moe_models import ModelConfig, build_model
from moe_train import cli
from moe_train.checkpoint import load_checkpoint
from moe_train.config import load_config
from moe_train.trainer import prepare, train

METRIC_KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "tflops_per_gpu", "mfu"}


def _args(overrides: dict[str, str]) -> list[str]:
    return [token for key, value in overrides.items() for token in (f"--{key}", value)]


def _error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--train.stepz", "5"], "did you mean 'train.steps'?"),
        (["--train.steps", "x"], "expects int"),
        (["--config", "missing.yaml"], "config file 'missing.yaml' not found"),
        (["--parallel.dp_shard", "3"], "!= world_size 1"),
        (["--parallel.tp", "2"], "world_size 1"),
        (["--model.moe_expert_backend", "grouped_gemm"], "expert backend 'grouped_gemm' is not available here"),
        (
            ["--run.recompute_modules", "layers.*.mlpp"],
            "run.recompute_modules=['layers.*.mlpp']: 'layers.*.mlpp' is neither a module kind nor a pattern",
        ),
        (
            ["--run.recompute_modules", "layernorm,mla_up_proj"],
            "run.recompute_modules=['layernorm', 'mla_up_proj']: this model has no 'mla_up_proj' modules; its kinds "
            "are core_attn, moe_act, layernorm, moe",
        ),
        (["--run.offload_modules", "expert_fc2"], "kinds: attn_norm, qkv_linear, core_attn, attn_proj, mlp_norm"),
        (
            ["--run.recompute_modules", "moe", "--run.offload_modules", "expert_fc1"],
            "run.offload_modules=['expert_fc1']: 'expert_fc1' (layers.0.mlp.experts.fc1) is recomputed by "
            "recompute_modules 'moe'",
        ),
        (["--run.offload_min_tensor_bytes", "-5"], "run.offload_min_tensor_bytes=-5: must be >= 0"),
        (["--train.global_batch_size", "4", "--train.micro_batch_size", "3"], "train.global_batch_size=4"),
        (["--train.steps"], "needs a value"),
        (["stray"], "unexpected argument 'stray'"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(
    micro_overrides: dict[str, str], capsys: pytest.CaptureFixture[str], extra: list[str], expected: str
) -> None:
    code = cli.main(["train", *_args(micro_overrides), *extra])
    assert code == cli.EXIT_USAGE
    assert expected in _error_line(capsys)
    assert not Path(micro_overrides["run.output_dir"]).exists()


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (
            ["--parallel.cp", "2", "--data.seq_len", "30"],
            "data.seq_len=30 is not divisible by 2 x parallel.cp=2 = 4 (context parallelism cuts every sequence into "
            "2 x cp load-balanced chunks)",
        ),
        (
            ["--parallel.cp", "2", "--parallel.tp", "2", "--model.num_query_groups", "2", "--data.seq_len", "36"],
            "data.seq_len=36 is not divisible by 2 x parallel.cp=2 x parallel.tp=2 = 8",
        ),
    ],
)
def test_a_sequence_context_parallelism_cannot_split_is_one_line_exit_2(
    micro_overrides: dict[str, str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    extra: list[str],
    expected: str,
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")  # as torchrun would launch it: refused before joining a process group
    code = cli.main(["train", *_args(micro_overrides), *extra])
    assert code == cli.EXIT_USAGE
    assert expected in _error_line(capsys)
    assert not Path(micro_overrides["run.output_dir"]).exists()
    assert not torch.distributed.is_initialized()


def test_env_prints_the_capability_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["env"]) == 0
    out = capsys.readouterr().out
    for row in ("torch", "dist gloo", "experts backend torch", "experts backend loop", "deep_ep", "transformer_engine"):
        assert row in out
    assert cli.main(["env", "extra"]) == cli.EXIT_USAGE


def _fake_transformer_engine(monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    import importlib.machinery
    import sys
    import types

    for name in ("transformer_engine", "transformer_engine.pytorch"):
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        module.__version__ = version  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, name, module)


@pytest.mark.parametrize(
    ("version", "verdict"),
    [
        ("2.20.2", "supported (transformer_engine >= 2.1, < 2.21)"),
        ("2.21.0", "not usable: transformer_engine 2.21.0 is installed; supported: transformer_engine >= 2.1, < 2.21"),
    ],
)
def test_env_reports_vendor_versions_support_and_what_they_are_used_for(
    monkeypatch: pytest.MonkeyPatch, version: str, verdict: str
) -> None:
    from moe_train.env import capability_rows

    _fake_transformer_engine(monkeypatch, version)
    rows = {name: (status, detail) for name, status, detail in capability_rows()}
    status, detail = rows["transformer_engine"]
    assert status == version
    assert detail == f"{verdict}; used for expert back end 'te' (grouped GEMM, bf16/fp16; fp32 as TF32)"
    # only what the code uses: no FP8 recipes through TE (moe-precision's recipes do not run on TE)
    assert not any("FP8" in d and name == "transformer_engine" for name, (_, d) in rows.items())
    assert "used for token dispatcher 'flex' (DeepEP normal kernels, bf16 on the wire)" in rows["deep_ep"][1]


def test_a_named_expert_backend_that_does_not_take_the_run_dtype_is_a_config_error() -> None:
    import torch

    from moe_train.config import ConfigError, load_config
    from moe_train.setup import _check_expert_backend_dtype

    cfg = load_config("tiny", {"model.moe_expert_backend": "grouped_gemm", "run.dtype": "fp32"})
    with pytest.raises(ConfigError) as err:
        _check_expert_backend_dtype(cfg, torch.float32)
    assert str(err.value) == (
        "model.moe_expert_backend='grouped_gemm': its kernels take bfloat16 only, and this run computes the experts "
        "in float32 (run.dtype='fp32'); set run.dtype bf16, or use backend torch or auto"
    )
    _check_expert_backend_dtype(cfg, torch.bfloat16)  # bf16: fine


def test_no_arguments_means_train_tiny(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}
    monkeypatch.setattr(cli, "_train", lambda config, rest: seen.update(config=config, rest=rest) or 0)
    assert cli.main([]) == 0
    assert seen == {"config": "tiny", "rest": []}
    assert cli.main(["--train.steps", "3"]) == 0
    assert seen == {"config": "tiny", "rest": ["--train.steps", "3"]}


def test_train_writes_metrics_for_every_step_and_loss_falls(
    micro_overrides: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["train", *_args(micro_overrides), "--train.steps", "40", "--train.lr", "0.01"]) == 0
    out_dir = Path(micro_overrides["run.output_dir"])
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 41))
    assert all(r.keys() >= METRIC_KEYS for r in records)
    assert records[-1]["loss"] < 0.75 * records[0]["loss"]
    assert records[0]["loss"] == pytest.approx(torch.log(torch.tensor(256.0)).item(), rel=0.05)  # near uniform at init
    assert all(r["tflops_per_gpu"] > 0 and r["mfu"] > 0 for r in records)
    assert (out_dir / "checkpoints" / "step_40").is_dir()
    assert not list((out_dir / "checkpoints").glob(".*partial"))
    for picture in ("loss.svg", "expert_load.svg"):
        assert (out_dir / picture).read_text().startswith("<svg")
    stdout = capsys.readouterr().out
    assert "step 40/40" in stdout and "done: 40 steps" in stdout


def test_checkpoint_restores_the_trained_weights(micro_overrides: dict[str, str]) -> None:
    cfg = load_config("tiny", {**micro_overrides, "train.steps": "3"})
    setup = prepare(cfg, world_size=1)
    summary = train(setup)
    fresh = build_model(cfg.model)
    assert not torch.equal(fresh.lm_head.weight, setup.model[0].lm_head.weight)  # the one stage
    assert load_checkpoint(Path(summary.checkpoint), fresh) == 3
    for (name, trained), (_, restored) in zip(
        setup.model.state_dict().items(), fresh.state_dict().items(), strict=True
    ):
        assert torch.equal(trained, restored), name


def test_python_dash_m_entry_point() -> None:
    done = subprocess.run([sys.executable, "-m", "moe_train", "--version"], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == f"moe-train {moe_train.__version__}"
    assert isinstance(ModelConfig(), ModelConfig)


def test_gradient_accumulation_matches_one_big_micro_batch(micro_overrides: dict[str, str]) -> None:
    # the aux loss balances each micro-batch on its own, so it is off for an exact comparison
    common = {"train.steps": "3", "run.save_checkpoint": "false", "model.moe_aux_loss_coeff": "0"}
    losses = []
    for micro in ("4", "1"):  # 1 micro-batch of 4 sequences vs 4 accumulated micro-batches of 1
        overrides = {**micro_overrides, **common, "train.micro_batch_size": micro}
        overrides["run.output_dir"] += micro
        summary_setup = prepare(load_config("tiny", overrides), world_size=1)
        assert summary_setup.grad_accum == 4 // int(micro)
        train(summary_setup)
        records = Path(overrides["run.output_dir"], "metrics.jsonl").read_text().splitlines()
        losses.append([(json.loads(r)["loss"], json.loads(r)["grad_norm"]) for r in records])
    # Adam hides a gradient scale, the gradient norm does not
    assert [v for pair in losses[0] for v in pair] == pytest.approx([v for pair in losses[1] for v in pair], rel=1e-5)


def test_plan_prints_the_rank_map_without_a_run(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out_dir = tmp_path / "run"
    args = ["plan", "--parallel.ep", "4", "--parallel.tp", "2", "--run.output_dir", str(out_dir)]
    assert cli.main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    # smallest world for tp=2 on the attention side and ep=4 (etp = tp = 2) on the expert side: 8 ranks
    assert lines[0] == "8 ranks, 8 experts per MoE layer (qwen3_moe)"
    assert len(lines) == 2 + 8 + 4  # the rank map, then the shard sizes: title, header, one rank kind, the check
    assert lines[2].endswith("holds experts 0..1") and lines[9].endswith("holds experts 6..7")
    assert lines[12].startswith("0-7 ") and "; matches moe_models.count_parameters" in lines[13]
    assert not out_dir.exists()
    assert cli.main(["plan", "--world-size", "4", "--parallel.ep", "3"]) == cli.EXIT_USAGE
    assert cli.main(["plan", "--parallel.ep", "3"]) == cli.EXIT_USAGE  # 8 experts over 3 ranks
    err = capsys.readouterr().err
    assert "parallel.ep=3: the model's 8 experts per MoE layer do not divide over it" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            {"parallel.tp": "2", "model.num_query_groups": "2", "data.seq_len": "33"},
            "data.seq_len=33 is not divisible by parallel.tp=2",
        ),
        (
            {"parallel.ep": "2", "parallel.etp": "2", "parallel.moe_token_dispatcher_type": "flex"},
            "parallel.moe_token_dispatcher_type='flex': DeepEP does not support etp > 1",
        ),
        pytest.param(
            {"parallel.ep": "2", "parallel.moe_token_dispatcher_type": "flex", "run.save_checkpoint": "false"},
            "parallel.moe_token_dispatcher_type='flex': DeepEP unavailable: ",
            marks=pytest.mark.skipif(
                importlib.util.find_spec("deep_ep") is not None and torch.cuda.is_available(), reason="DeepEP runs"
            ),
        ),
        (
            {"parallel.pp": "2"},
            "parallel.pp=2: 2 pipeline stages (pp x vpp) for a model of 1 layers: every stage needs a layer; pp x vpp "
            "can be at most 1",
        ),
        (
            {
                "model.num_layers": "4",
                "parallel.pp": "2",
                "parallel.pp_schedule": "Interleaved1F1B",
                "parallel.vpp": "4",
            },
            "parallel.vpp=4: 8 pipeline stages (pp x vpp) for a model of 4 layers",
        ),
        (
            {"model.num_layers": "4", "parallel.pp": "2", "parallel.vpp": "2"},
            "parallel.vpp=2: pp_schedule=1F1B runs one stage per rank; use Interleaved1F1B for vpp > 1",
        ),
        (
            {"model.num_layers": "4", "parallel.pp": "2", "parallel.pp_schedule": "ZBVZeroBubble", "parallel.vpp": "3"},
            "parallel.vpp=3: pp_schedule=ZBVZeroBubble is V-shaped: two stages per rank, vpp=2",
        ),
        (
            {"model.num_layers": "4", "parallel.pp": "2", "parallel.pp_first_stage_layers": "4"},
            "parallel.pp_first_stage_layers=4: leaves the other 1 stages fewer layers than stages",
        ),
        (
            {"model.num_layers": "4", "parallel.pp": "2", "train.micro_batch_size": "2"},
            "train.global_batch_size=4: 1 micro-batches of train.micro_batch_size=2 per data-parallel rank, and "
            "pp_schedule=1F1B at pp=2 needs at least 2 micro-batches a step",
        ),
        (
            {"model.num_layers": "4", "parallel.pp": "2", "model.share_embeddings_and_output_weights": "true"},
            "parallel.pp=2: model.share_embeddings_and_output_weights: tied embeddings do not support pipeline",
        ),
        ({"parallel.pp_first_stage_layers": "1"}, "parallel.pp_first_stage_layers=1: applies to pipeline parallelism"),
        ({"parallel.tp": "2"}, "parallel.tp=2: the model's num_query_groups=1 is not divisible by it"),
        (
            {"parallel.ep": "4", "model.num_moe_experts": "6"},
            "parallel.ep=4: the model's 6 experts per MoE layer do not divide over it; with world_size 4 and this "
            "model, ep can be one of [1, 2]",
        ),
        (
            {"run.recompute_modules": "layers.*.mpl"},
            "run.recompute_modules=['layers.*.mpl']: 'layers.*.mpl' is neither",
        ),
        (
            {"run.recompute_modules": "mla_up_proj"},
            "run.recompute_modules=['mla_up_proj']: this model has no 'mla_up_proj' modules",
        ),
    ],
)
def test_layouts_the_model_cannot_take_fail_before_any_process_group(
    micro_overrides: dict[str, str], overrides: dict[str, str], expected: str
) -> None:
    from moe_train.config import ConfigError

    cfg = load_config("tiny", {**micro_overrides, **overrides})
    with pytest.raises(ConfigError, match=re.escape(expected)):
        prepare(cfg, 4)  # validated against a 4-rank launch before joining any process group
    assert not torch.distributed.is_initialized()
