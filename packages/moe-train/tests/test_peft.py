"""``peft.method=lora`` in one process: the adapters train while the base stays as it was (no gradient, no optimizer
state), checkpoints hold the adapters only, a resume continues bitwise, and a resume onto another base is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from moe_experts import LoRAExpertLinear
from moe_models.lora import ADAPTER_MARK
from moe_train.checkpoint import read_checked_metadata
from moe_train.config import ConfigError, load_config
from moe_train.optim import build_optimizer
from moe_train.peft import base_reference, check_base
from moe_train.resume import find_resume_point
from moe_train.setup import prepare
from moe_train.trainer import train

LORA = {"peft.method": "lora", "peft.rank": "8", "peft.alpha": "16", "train.lr": "1e-2", "run.log_interval": "1"}


def _cfg(micro_overrides: dict[str, str], out: Path, steps: int, **extra: str):
    overrides = {**micro_overrides, **LORA, "run.output_dir": str(out), "train.steps": str(steps), **extra}
    return load_config("tiny", overrides)


def _losses(out: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, data_cache: Path, micro_model: dict[str, str]):
    """An 8-step LoRA run of the micro model, with the base weights it started from."""
    out = tmp_path_factory.mktemp("lora") / "run"
    overrides = {**micro_model, "data.cache_dir": str(data_cache)}
    cfg = _cfg(overrides, out, 8, **{"run.checkpoint_interval": "4"})
    setup = prepare(cfg, 1)
    before = {n: p.detach().clone() for n, p in setup.model.named_parameters()}
    train(setup)
    return cfg, setup, before, out, overrides


def test_the_adapters_train_and_the_base_stays_frozen(run) -> None:
    cfg, setup, before, out, _ = run
    losses = _losses(out)
    assert losses[8] < losses[1] - 0.1  # the adapters alone lower the loss
    params = dict(setup.model.named_parameters())
    adapters = {n for n in params if ADAPTER_MARK in n}
    # every default target kind got its adapters: attention, routed experts (the micro model has no dense MLP)
    assert any(".attention.q_proj.lora_A" in n for n in adapters)
    assert any(".mlp.experts.fc1.lora_A_ERK" in n for n in adapters)
    for name, param in params.items():
        if name in adapters:
            assert param.requires_grad
        else:  # frozen: never given a gradient, never changed
            assert not param.requires_grad and param.grad is None, name
            assert torch.equal(param, before[name]), name
    # B starts at zero (the adapted model is the base) and moved
    assert all(not before[n].any() for n in adapters if n.endswith(("lora_B", "lora_B_EMR")))
    assert any(params[n].any() for n in adapters if n.endswith(("lora_B", "lora_B_EMR")))
    optimizer = build_optimizer(setup.model, cfg.train)
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert held == {id(params[n]) for n in adapters}


def test_checkpoints_hold_the_adapters_only(run) -> None:
    _, setup, _, out, _ = run
    metadata = read_checked_metadata(out / "checkpoints" / "step_8")
    keys = set(metadata.state_dict_metadata)
    name = setup.parallel.global_name  # the rank's stages hold the model under "<stage>."
    params = {name(n): p for n, p in setup.model.named_parameters()}
    adapters = {n for n in params if ADAPTER_MARK in n}
    buffers = {name(n) for n, _ in setup.model.named_buffers() if n in setup.model.state_dict()}
    # the experts' fc1 lora_B as its gate and up rows, as the first projection they adapt (moe_parallel's form)
    gated = {k for k in keys if k.endswith((".gate", ".up"))}
    assert gated and all(".experts.fc1.lora_B_EMR" in k for k in gated)
    keys = {k.rsplit(".", 1)[0] if k in gated else k for k in keys}
    model_keys = {k.removeprefix("model.") for k in keys if k.startswith("model.")}
    assert model_keys == adapters | buffers
    optim_params = {k.removeprefix("optim.state.").rsplit(".", 1)[0] for k in keys if k.startswith("optim.")}
    assert optim_params == adapters
    # the stored tensors: each adapter with its two AdamW moments (fp32), the buffers; nothing of the base
    stored = sum(
        m.size.numel() * 4 for k, m in metadata.state_dict_metadata.items() if hasattr(m, "size") and m.size.numel() > 1
    )
    adapter_numel = sum(params[n].numel() for n in adapters)
    buffer_numel = sum(b.numel() for n, b in setup.model.named_buffers() if name(n) in buffers and b.numel() > 1)
    assert stored == 4 * (3 * adapter_numel + buffer_numel)
    base_numel = sum(p.numel() for n, p in params.items() if n not in adapters)
    assert adapter_numel < base_numel / 2


def test_resume_continues_bitwise(run, tmp_path: Path) -> None:
    _, _, _, out, overrides = run

    resumed = tmp_path / "run"
    shutil.copytree(out, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_8")
    again = _cfg(overrides, resumed, 8, **{"run.resume": "auto"})
    train(prepare(again, 1))
    whole, continued = _losses(out), _losses(resumed)
    assert [continued[s] for s in range(5, 9)] == [whole[s] for s in range(5, 9)]


def test_resuming_onto_another_base_is_refused(run) -> None:
    cfg, _, _, out, overrides = run
    meta_file = out / "checkpoints" / "step_8" / "meta.json"
    meta = json.loads(meta_file.read_text())
    assert meta["peft_base"] == base_reference(cfg) == {"from_hf": None, "seed": cfg.train.seed}
    check_base(cfg, meta, meta_file.parent)  # the same base passes
    other = _cfg(overrides, out, 16, **{"train.seed": "7"})
    with pytest.raises(ConfigError, match=r"^train\.seed: .* holds adapters of another base") as err:
        check_base(other, meta, meta_file.parent)
    assert "\n" not in str(err.value)
    no_lora = load_config("tiny", {**overrides, "run.output_dir": str(out), "train.steps": "16", "run.resume": "auto"})
    with pytest.raises(ConfigError, match=r"^peft\.method='none': .* peft\.method='lora'"):
        find_resume_point(no_lora)


def test_weights_fingerprint_sees_the_files(tmp_path: Path) -> None:
    from moe_train.peft import weights_fingerprint

    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    (tmp_path / "README.md").write_text("not a weight")
    first = weights_fingerprint(tmp_path)
    (tmp_path / "README.md").write_text("still not a weight")
    assert weights_fingerprint(tmp_path) == first
    (tmp_path / "model.safetensors").write_bytes(b"x" * 11)
    assert weights_fingerprint(tmp_path) != first


def test_a_target_that_matches_nothing_names_the_key(micro_overrides: dict[str, str], tmp_path: Path) -> None:
    cfg = _cfg(micro_overrides, tmp_path / "run", 2, **{"peft.targets": '["*nothing*"]'})
    with pytest.raises(ConfigError, match=r"^peft\.targets: '\*nothing\*' matches no module"):
        prepare(cfg, 1)


def test_plan_memory_counts_gradients_and_states_of_the_adapters_only() -> None:
    from moe_train.plan_report import format_memory, memory_estimates, plan_memory_options, plan_report

    cfg = load_config("tiny", {"peft.method": "lora", "peft.rank": "8"})
    m, r = cfg.model, cfg.peft.rank
    h, q, kv = m.hidden_size, m.num_attention_heads * m.kv_channels, m.num_query_groups * m.kv_channels
    e, f = m.num_moe_experts, m.moe_ffn_hidden_size
    # per layer: q, k, v, o (r x in + out x r each), then fc1 (H -> 2F, gated) and fc2 (F -> H) of every expert
    attention = r * ((h + q) + 2 * (h + kv) + (q + h))
    experts = e * r * ((h + 2 * f) + (f + h))
    adapters = m.num_layers * (attention + experts)
    reports = {}
    for peft in (None, cfg.peft):
        report = plan_report(m, cfg.parallel, 1, run=cfg.run, seq_len=cfg.data.seq_len, peft=peft)
        options = plan_memory_options(cfg, report.layout)
        ((kind, estimate),) = memory_estimates(report, m, options)
        reports[peft is None] = (report, kind, estimate, options)
    _, full_kind, full, _ = reports[True]
    report, kind, lora, options = reports[False]
    assert kind.trainable == adapters and full_kind.trainable is None
    assert kind.param_count() == full_kind.param_count() + adapters
    assert lora.gradients == 4 * adapters and full.gradients == 4 * full_kind.param_count()
    # AdamW: two fp32 moments per trainable element and a 4-byte step per trainable tensor (an A and a B for each of
    # a layer's 4 attention and 2 expert projections)
    assert report.trainable_tensors == m.num_layers * 2 * (4 + 2)
    assert lora.optimizer_states == 8 * adapters + 4 * report.trainable_tensors
    saving = (full.gradients + full.optimizer_states) - (lora.gradients + lora.optimizer_states)
    assert saving > 11 * full_kind.param_count() - 12 * adapters  # 12 bytes an element, less the tensors' steps
    text = format_memory([(kind, lora)], options)
    assert f"gradients and AdamW states for {adapters:,} adapter elements of {kind.param_count():,}" in text


def test_adapted_experts_split_over_etp(micro_overrides: dict[str, str], tmp_path: Path) -> None:
    """Expert tensor parallelism takes the experts' adapters (their equality with one process:
    integration/test_lora_layouts.py); the run checks pass with the experts adapted and split over etp."""
    from moe_train.setup import check_run

    cfg = _cfg(micro_overrides, tmp_path / "run", 2, **{"parallel.etp": "2", "train.micro_batch_size": "2"})
    checked = check_run(cfg, 2)
    assert checked.layout.etp == 2
    assert any(isinstance(m, LoRAExpertLinear) for m in checked.model.modules())


def test_a_precision_recipe_with_lora_names_both_keys(micro_overrides: dict[str, str], tmp_path: Path) -> None:
    from moe_train.setup import check_run

    extra = {"precision.recipe": "fp8_tensorwise", "precision.emulate": "true"}
    cfg = _cfg(micro_overrides, tmp_path / "run", 2, **extra)
    with pytest.raises(ConfigError, match=r"^precision\.recipe='fp8_tensorwise': .*peft\.method='lora'.*"):
        check_run(cfg, 1)
    assert not (tmp_path / "run").exists()  # refused before anything is written
