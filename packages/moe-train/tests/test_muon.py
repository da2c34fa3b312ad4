"""Muon (moe_train.muon) against torch.optim.Muon on plain matrices and on grouped experts (one torch.optim.Muon
parameter per expert), its AdamW groups against torch.optim.AdamW, which parameter takes which rule, a short training
run that resumes bitwise, and the layouts and settings it refuses."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch

import moe_train.muon
from moe_models import build_model
from moe_train import cli
from moe_train.adamw import optimizer_state_bytes
from moe_train.config import load_config
from moe_train.muon import MuonWithAdamW
from moe_train.optim import build_optimizer, lr_at, set_lr
from moe_train.setup import prepare
from moe_train.trainer import train

MUON = {"train.optimizer": "muon"}
STEPS = 10


def _rel(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust_lr", ["original", "match_rms_adamw"])
def test_plain_matrices_match_torch_muon(nesterov: bool, adjust_lr: str) -> None:
    # tall, wide and square matrices: Newton-Schulz transposes tall ones, and the lr adjustment depends on the shape
    gen = torch.Generator().manual_seed(0)
    shapes = [(48, 16), (16, 40), (24, 24)]
    ours_p = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    ref_p = [torch.nn.Parameter(p.detach().clone()) for p in ours_p]
    hyper = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.9, "nesterov": nesterov, "ns_steps": 5}
    # torch.optim.Muon runs Newton-Schulz in bf16 (ours does by default on GPUs; on CPU, fp32)
    ours = MuonWithAdamW([{"params": ours_p, "rule": "muon"}], adjust_lr=adjust_lr, ns_dtype=torch.bfloat16, **hyper)
    ref = torch.optim.Muon(ref_p, adjust_lr_fn=adjust_lr, **hyper)
    for step in range(STEPS):
        for p, q in zip(ours_p, ref_p, strict=True):
            q.grad = torch.randn(p.shape, generator=gen)
            p.grad = q.grad.clone()
        set_lr(ours, 0.02 * (1 - step / STEPS))  # the schedule changes lr between steps
        set_lr(ref, 0.02 * (1 - step / STEPS))
        ours.step()
        ref.step()
        for p, q in zip(ours_p, ref_p, strict=True):
            assert _rel(p.detach(), q.detach()) < 1e-6, (step, tuple(p.shape))
            assert not torch.equal(p.detach(), torch.zeros_like(p))
    for p, q in zip(ours_p, ref_p, strict=True):
        assert torch.equal(ours.state[p]["momentum_buffer"], ref.state[q]["momentum_buffer"])


@pytest.mark.parametrize("adjust_lr", ["original", "match_rms_adamw"])
def test_grouped_experts_are_orthogonalised_expert_by_expert(adjust_lr: str) -> None:
    # an [E, K, M] weight against torch.optim.Muon over E separate [K, M] parameters (tall: K > M, so the per-expert
    # transpose and the per-expert lr adjustment by (K, M) are exercised)
    gen = torch.Generator().manual_seed(1)
    E, K, M = 4, 40, 24
    weight_EKM = torch.nn.Parameter(torch.randn(E, K, M, generator=gen))
    experts = [torch.nn.Parameter(weight_EKM[e].detach().clone()) for e in range(E)]
    hyper = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95, "nesterov": True}
    ours = MuonWithAdamW(
        [{"params": [weight_EKM], "rule": "muon"}], adjust_lr=adjust_lr, ns_dtype=torch.bfloat16, **hyper
    )
    ref = torch.optim.Muon(experts, adjust_lr_fn=adjust_lr, **hyper)
    for step in range(STEPS):
        # experts of very different gradient scales: one norm over the whole [E, K, M] tensor would differ
        grad_EKM = torch.randn(E, K, M, generator=gen) * torch.tensor([1.0, 10.0, 0.1, 3.0]).view(E, 1, 1)
        weight_EKM.grad = grad_EKM.clone()
        for e, p in enumerate(experts):
            p.grad = grad_EKM[e].clone()
        ours.step()
        ref.step()
        reference_EKM = torch.stack([p.detach() for p in experts])
        assert _rel(weight_EKM.detach(), reference_EKM) < 1e-6, step

    # control: torch.optim.Muon cannot take the 3-D weight, and orthogonalising it as one [E*K, M] matrix differs
    flat = torch.nn.Parameter(weight_EKM.detach().reshape(E * K, M).clone())
    again = copy.deepcopy(weight_EKM)
    flat.grad = torch.randn(E * K, M, generator=gen)
    again.grad = flat.grad.view(E, K, M).clone()
    torch.optim.Muon([flat], adjust_lr_fn=adjust_lr, **hyper).step()
    MuonWithAdamW([{"params": [again], "rule": "muon"}], adjust_lr=adjust_lr, ns_dtype=torch.bfloat16, **hyper).step()
    assert _rel(again.detach().reshape(E * K, M), flat.detach()) > 1e-4


def _names(optimizer: torch.optim.Optimizer, model: torch.nn.Module, rule: str) -> set[str]:
    name_of = {id(p): n for n, p in model.named_parameters()}
    return {name_of[id(p)] for g in optimizer.param_groups if g["rule"] == rule for p in g["params"]}


GROUPING_MODEL = {
    "model.num_layers": "2",
    "model.moe_layer_freq": "[0,1]",  # a dense MLP layer, then a MoE layer
    "model.moe_shared_expert_intermediate_size": "64",
    "model.moe_shared_expert_gate": "true",
    "model.moe_router_score_function": "sigmoid",
    "model.moe_router_enable_expert_bias": "true",
    "model.mtp_num_layers": "1",
    "train.optimizer": "muon",
}


def test_grouping_and_adamw_groups_match_torch_adamw() -> None:
    cfg = load_config("tiny", GROUPING_MODEL)
    model = build_model(cfg.model, seed=0)
    optimizer = build_optimizer(model, cfg.train)
    assert isinstance(optimizer, MuonWithAdamW)
    # the hand list of what Muon takes: attention and dense-MLP matrices, shared experts, routed experts
    attention = {f"{p}.attention.{w}_proj.weight" for p in ("layers.0", "layers.1", "mtp.0.layer") for w in "qkvo"}
    dense = {f"layers.0.mlp.{w}_proj.weight" for w in ("gate", "up", "down")}
    shared = {
        f"{p}.mlp.shared_experts.{w}" for p in ("layers.1", "mtp.0.layer") for w in ("w_gate_up_H2F", "w_down_FH")
    }
    routed = {f"{p}.mlp.experts.{w}" for p in ("layers.1", "mtp.0.layer") for w in ("w_gate_up_EH2F", "w_down_EFH")}
    assert _names(optimizer, model, "muon") == attention | dense | shared | routed
    adamw = _names(optimizer, model, "adamw")
    assert {"embed_tokens.weight", "lm_head.weight", "mtp.0.eh_proj.weight", "layers.1.mlp.router.weight"} <= adamw
    assert "layers.1.mlp.shared_experts.w_gate_H1" in adamw and "norm.weight" in adamw
    assert adamw | _names(optimizer, model, "muon") == {n for n, _ in model.named_parameters()}

    # the AdamW groups update as torch.optim.AdamW (foreach) with the same groups (fp32 states), given the same
    # gradients (drawn here, so the Muon matrices moving differently from AdamW's cannot make the gradients part)
    reference = copy.deepcopy(model)
    by_position = dict(zip(map(id, model.parameters()), reference.parameters(), strict=True))
    adamw_groups = [g for g in optimizer.param_groups if g["rule"] == "adamw"]
    groups = [
        {"params": [by_position[id(p)] for p in g["params"]], "weight_decay": g["weight_decay"]} for g in adamw_groups
    ]
    initial = {id(p): p.detach().clone() for p in model.parameters()}
    assert sorted(g["weight_decay"] for g in groups) == [0.0, cfg.train.weight_decay]
    betas = (cfg.train.adam_beta1, cfg.train.adam_beta2)
    ref = torch.optim.AdamW(groups, lr=cfg.train.lr, betas=betas, eps=cfg.train.adam_eps, foreach=True)
    gen = torch.Generator().manual_seed(5)
    for step in range(STEPS):
        for p in model.parameters():
            q = by_position[id(p)]
            q.grad = torch.randn(p.shape, generator=gen)
            p.grad = q.grad.clone()
        set_lr(optimizer, lr_at(step, cfg.train))
        set_lr(ref, lr_at(step, cfg.train))
        optimizer.step()
        ref.step()
        for group in adamw_groups:
            for p in group["params"]:
                assert torch.equal(p, by_position[id(p)]), step
    # both rules moved every parameter they hold (a comparison of untouched copies would pass trivially)
    assert all(not torch.equal(p, initial[id(p)]) for p in model.parameters())


def _losses(out: Path) -> dict[int, tuple[float, float]]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in records if "loss" in r}


def test_a_muon_run_trains_and_resumes_bitwise(
    micro_overrides: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    overrides = {**micro_overrides, **MUON, "train.lr": "1e-2", "run.log_interval": "1", "run.checkpoint_interval": "4"}
    out = Path(overrides["run.output_dir"])
    train(prepare(load_config("tiny", {**overrides, "train.steps": "12"}), 1))
    started = capsys.readouterr().out
    assert "optimizer muon " in started and " tensors / " in started and "adamw " in started
    whole = _losses(out)
    assert sum(whole[s][0] for s in (10, 11, 12)) < sum(whole[s][0] for s in (1, 2, 3)) - 0.3  # the loss falls

    resumed = tmp_path / "resumed"
    shutil.copytree(out, resumed)
    for step in (8, 12):
        shutil.rmtree(resumed / "checkpoints" / f"step_{step}")
    again = {**overrides, "run.output_dir": str(resumed), "train.steps": "12", "run.resume": "auto"}
    summary = train(prepare(load_config("tiny", again), 1))
    assert summary.resumed_from is not None and summary.resumed_from.endswith("step_4")
    continued = _losses(resumed)
    assert [continued[s] for s in range(5, 13)] == [whole[s] for s in range(5, 13)]


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({"train.optimizer": "sgd"}, "train.optimizer='sgd': choose adamw or muon"),
        ({**MUON, "train.muon_adjust_lr_fn": "spectral"}, "train.muon_adjust_lr_fn='spectral'"),
        ({**MUON, "train.muon_momentum": "1.0"}, "train.muon_momentum=1.0: must be in [0, 1)"),
        ({**MUON, "train.muon_ns_dtype": "fp16"}, "train.muon_ns_dtype='fp16': choose auto, bf16 or fp32"),
        ({**MUON, "train.muon_ns_coefficients": "[3.0, -4.0]"}, "train.muon_ns_coefficients=[3.0, -4.0]: give"),
    ],
)
def test_refusals_are_one_line_exit_2(micro_overrides: dict[str, str], refused_in_one_line, extra, expected) -> None:
    refused_in_one_line({**micro_overrides, **extra}, expected)


def test_muon_trains_lora_adapters_only(micro_overrides: dict[str, str]) -> None:
    # Muon's RMS-matched update (0.2 lr) is smaller than AdamW's first steps (~lr): 3x AdamW's lr here
    lora = {"peft.method": "lora", "peft.rank": "8", "peft.alpha": "16", "train.lr": "3e-2", "run.log_interval": "1"}
    setup = prepare(load_config("tiny", {**micro_overrides, **MUON, **lora, "train.steps": "8"}), 1)
    before = {n: p.detach().clone() for n, p in setup.model.named_parameters()}
    train(setup)
    losses = _losses(Path(micro_overrides["run.output_dir"]))
    assert losses[8][0] < losses[1][0] - 0.1  # the adapters alone lower the loss
    optimizer = build_optimizer(setup.model, setup.cfg.train)
    muon = _names(optimizer, setup.model, "muon")
    # the adapter matrices (dense [r, K] / [M, r], the experts' [E, r, K] / [E, M, r]) are Muon's; nothing else trains
    assert muon and all(".lora_" in n for n in muon)
    assert any(n.endswith("experts.fc1.lora_A_ERK") for n in muon) and any(n.endswith("q_proj.lora_B") for n in muon)
    for name, param in setup.model.named_parameters():
        moved = not torch.equal(param, before[name])
        assert moved == (".lora_" in name), name


def test_bf16_momentum_is_updated_in_fp32_and_stored_rounded() -> None:
    gen = torch.Generator().manual_seed(3)
    shapes = [(48, 16), (4, 24, 40)]
    weights = [torch.randn(s, generator=gen) for s in shapes]
    params = {dtype: [torch.nn.Parameter(w.clone()) for w in weights] for dtype in (torch.float32, torch.bfloat16)}
    optimizers = {
        dtype: MuonWithAdamW([{"params": ps, "rule": "muon"}], lr=0.02, states_dtype=dtype)
        for dtype, ps in params.items()
    }
    for step in range(STEPS):
        grads = [torch.randn(s, generator=gen) for s in shapes]
        for dtype, ps in params.items():
            for p, g in zip(ps, grads, strict=True):
                p.grad = g.clone()
            optimizers[dtype].step()
        buffers = {dtype: [optimizers[dtype].state[p]["momentum_buffer"] for p in ps] for dtype, ps in params.items()}
        if step == 0:  # from zeros, one update: the fp32 buffer rounded to nearest
            for low, high in zip(buffers[torch.bfloat16], buffers[torch.float32], strict=True):
                assert low.dtype == torch.bfloat16 and torch.equal(low, high.to(torch.bfloat16))
    for low, high in zip(params[torch.bfloat16], params[torch.float32], strict=True):
        assert _rel(low.detach(), high.detach()) < 1e-3  # bf16's rounding (2e-3 relative) of a momentum, not drift
    numel = sum(w.numel() for w in weights)
    assert optimizer_state_bytes(optimizers[torch.bfloat16])["momentum_buffer"] == 2 * numel
    assert optimizer_state_bytes(optimizers[torch.float32])["momentum_buffer"] == 4 * numel


def test_resuming_under_the_other_optimizer_is_one_line(micro_overrides: dict[str, str], capsys) -> None:
    overrides = {**micro_overrides, "train.steps": "2", "run.checkpoint_interval": "2"}
    train(prepare(load_config("tiny", overrides), 1))
    capsys.readouterr()
    again = {**overrides, **MUON, "train.steps": "4", "run.resume": "auto"}
    args = [token for key, value in again.items() for token in (f"--{key}", value)]
    assert cli.main(["train", *args]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("moe-train: error: train.optimizer='muon': ") and "adamw" in err, err


@pytest.mark.parametrize("master", [True, False])
def test_bf16_parameters_follow_an_fp32_master_copy(master: bool) -> None:
    # with a master copy, its trajectory is the fp32 run's on the same (bf16) gradients, bitwise, and the bf16 parameter
    # is it rounded; without one, the bf16 parameter is updated in fp32 and stored rounded each step
    gen = torch.Generator().manual_seed(4)
    shapes = [(48, 16), (4, 24, 40)]
    low = [torch.nn.Parameter(torch.randn(s, generator=gen).bfloat16()) for s in shapes]
    high = [torch.nn.Parameter(p.detach().float()) for p in low]
    ours = MuonWithAdamW([{"params": low, "rule": "muon"}], lr=0.02, master_weights=master)
    ref = MuonWithAdamW([{"params": high, "rule": "muon"}], lr=0.02)
    for _ in range(STEPS):
        for p, q in zip(low, high, strict=True):
            p.grad = torch.randn(p.shape, generator=gen).bfloat16()
            q.grad = p.grad.float()
        ours.step()
        ref.step()
        if not master:  # one step from the same fp32 start, rounded: then the runs part by bf16's rounding
            for p, q in zip(low, high, strict=True):
                assert torch.equal(p.detach(), q.detach().bfloat16())
                q.data.copy_(p.detach().float())
    for p, q in zip(low, high, strict=True):
        assert p.dtype == torch.bfloat16 and ("master" in ours.state[p]) == master
        if master:
            assert torch.equal(ours.state[p]["master"], q.detach())
            assert torch.equal(p.detach(), q.detach().bfloat16())


def test_same_shaped_matrices_are_orthogonalised_in_one_batch() -> None:
    # three [48, 16] matrices and two [4, 24, 40] expert weights: two batched iterations, each matrix as it would be
    # alone (the single-matrix path is torch.optim.Muon's, above); fp32, so the batch changes no rounding that matters
    gen = torch.Generator().manual_seed(6)
    shapes = [(48, 16)] * 3 + [(4, 24, 40)] * 2
    batched = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    alone = [torch.nn.Parameter(p.detach().clone()) for p in batched]
    hyper = {"lr": 0.02, "ns_dtype": torch.float32}
    ours = MuonWithAdamW([{"params": batched, "rule": "muon"}], **hyper)
    one_each = [MuonWithAdamW([{"params": [p], "rule": "muon"}], **hyper) for p in alone]
    calls = []
    original = moe_train.muon.newton_schulz
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(moe_train.muon, "newton_schulz", lambda x, *a: calls.append(x.shape) or original(x, *a))
        for _ in range(STEPS):
            for p, q in zip(batched, alone, strict=True):
                p.grad = torch.randn(p.shape, generator=gen)
                q.grad = p.grad.clone()
            ours.step()
            for optimizer in one_each:
                optimizer.step()
    assert calls[:2] == [(3, 48, 16), (8, 24, 40)]  # one call per shape, the experts' E matrices of both weights
    for p, q in zip(batched, alone, strict=True):
        assert _rel(p.detach(), q.detach()) < 1e-6
