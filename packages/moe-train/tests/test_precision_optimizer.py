"""The precision-aware AdamW (moe_train.adamw): fp32 states against torch.optim.AdamW, bf16 states and bf16 parameters
(with and without fp32 master weights) against torch.optim.AdamW with the same roundings applied by hand, the exact
state bytes, checkpoint resume (one process, and FSDP on 2 gloo ranks), and the config keys.

Run as a script (``python test_precision_optimizer.py OUT_DIR``) this file is one rank of the 2-rank resume test."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch

from moe_models import StageRouting, build_model, causal_lm_loss
from moe_train.adamw import PrecisionAwareAdamW, optimizer_state_bytes
from moe_train.checkpoint import load_checkpoint, save_checkpoint
from moe_train.config import ExperimentConfig, TrainConfig, load_config
from moe_train.loop import NextTokenLoss
from moe_train.optim import build_optimizer, lr_at, set_lr

# sigmoid scores with the aux-loss-free expert bias: an fp32 buffer that must survive the bf16 cast and the resume
EXPERT_BIAS = {
    "model.moe_router_score_function": "sigmoid",
    "model.moe_router_enable_expert_bias": "true",
    "model.moe_router_bias_update_rate": "0.01",
}
BF16_ALL = {"train.optimizer_states_dtype": "bf16", "train.params_dtype": "bf16", "train.master_weights_dtype": "fp32"}


def _micro_model(overrides: dict[str, str], seed: int = 0) -> torch.nn.Module:
    return build_model(load_config("tiny", overrides).model, seed=seed)


def _backward(model: torch.nn.Module, step: int) -> None:
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(100 + step))
    out = model(ids)
    causal_lm_loss(out, ids.roll(-1, dims=1), 0.0).total.backward()


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def _torch_adamw(
    model: torch.nn.Module, reference: torch.nn.Module, cfg: TrainConfig, ours: torch.optim.Optimizer
) -> torch.optim.AdamW:
    """torch's AdamW over ``reference`` (a copy of ``model``) with the param groups ``ours`` has over ``model``."""
    by_position = dict(zip(map(id, model.parameters()), reference.parameters(), strict=True))
    groups = [
        {"params": [by_position[id(p)] for p in g["params"]], "weight_decay": g["weight_decay"]}
        for g in ours.param_groups
    ]
    betas = (cfg.adam_beta1, cfg.adam_beta2)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, eps=cfg.adam_eps, foreach=True)


def _pairs(ours: torch.optim.Optimizer, ref: torch.optim.Optimizer):
    return zip(_params(ours), _params(ref), strict=True)


# ----------------------------------------------------------------------------------------------- the update


def test_fp32_states_match_torch_adamw(micro_overrides: dict[str, str]) -> None:
    model = _micro_model(micro_overrides)
    reference = copy.deepcopy(model)
    cfg = TrainConfig(steps=6, warmup_steps=2, weight_decay=0.1)
    ours = build_optimizer(model, cfg)
    assert isinstance(ours, PrecisionAwareAdamW) and ours.states_dtype == torch.float32
    ref = _torch_adamw(model, reference, cfg, ours)
    for step in range(cfg.steps):
        for m, opt in ((model, ours), (reference, ref)):
            set_lr(opt, lr_at(step, cfg))  # the schedule changes lr every step
            opt.zero_grad(set_to_none=True)
            _backward(m, step)
            opt.step()
        for p, q in _pairs(ours, ref):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=0)
            for key in ("exp_avg", "exp_avg_sq", "step"):
                torch.testing.assert_close(ours.state[p][key], ref.state[q][key], rtol=1e-6, atol=0)
    # the parameters moved: the equality above is not between two untouched copies
    assert not torch.equal(next(model.parameters()), next(_micro_model(micro_overrides).parameters()))


def _reference_run(
    micro_overrides: dict[str, str], train: dict[str, str], steps: int
) -> tuple[PrecisionAwareAdamW, torch.optim.AdamW]:
    """Ours with ``train`` settings, and torch's AdamW on an fp32 copy with the same roundings applied by hand after
    each step: bf16 moments rounded, parameters stored in bf16 rounded (without master weights), and the gradients
    ours sees (of the bf16 model, when params are bf16) copied in."""
    cfg = load_config("tiny", {**micro_overrides, **train})
    model = build_model(cfg.model, seed=0)
    if cfg.train.params_dtype == "bf16":
        model.to(torch.bfloat16)
    reference = build_model(cfg.model, seed=0)
    with torch.no_grad():
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            q.copy_(p)  # the bf16 values, exactly, in fp32
    ours = build_optimizer(model, cfg.train)
    ref = _torch_adamw(model, reference, cfg.train, ours)
    bf16_states = cfg.train.optimizer_states_dtype == "bf16"
    rounded_params = cfg.train.params_dtype == "bf16" and cfg.train.master_weights_dtype == "none"
    for step in range(steps):
        lr = lr_at(step, cfg.train)
        set_lr(ours, lr)
        set_lr(ref, lr)
        ours.zero_grad(set_to_none=True)
        _backward(model, step)
        for p, q in _pairs(ours, ref):
            q.grad = p.grad.float()
        ours.step()
        ref.step()
        with torch.no_grad():
            for _, q in _pairs(ours, ref):
                if bf16_states:
                    for key in ("exp_avg", "exp_avg_sq"):
                        ref.state[q][key].copy_(ref.state[q][key].bfloat16())
                if rounded_params:
                    q.copy_(q.bfloat16())
    return ours, ref


def test_bf16_states_are_torch_adamw_with_rounded_moments(micro_overrides: dict[str, str]) -> None:
    ours, ref = _reference_run(micro_overrides, {"train.optimizer_states_dtype": "bf16"}, steps=5)
    for p, q in _pairs(ours, ref):
        assert p.dtype == torch.float32 and "master" not in ours.state[p]
        torch.testing.assert_close(p, q, rtol=1e-6, atol=0)
        for key in ("exp_avg", "exp_avg_sq"):
            state = ours.state[p][key]
            assert state.dtype == torch.bfloat16
            assert state.untyped_storage().nbytes() == 2 * p.numel()
            torch.testing.assert_close(state.float(), ref.state[q][key], rtol=0, atol=0)
    # rounding the moments changes the trajectory: fp32 states give other parameters
    fp32_ours, _ = _reference_run(micro_overrides, {}, steps=5)
    assert any(not torch.equal(p, q) for p, q in _pairs(ours, fp32_ours))


def test_bf16_params_with_fp32_master_weights(micro_overrides: dict[str, str]) -> None:
    ours, ref = _reference_run(micro_overrides, BF16_ALL, steps=5)
    coarser = 0
    for p, q in _pairs(ours, ref):
        master = ours.state[p]["master"]
        assert p.dtype == torch.bfloat16 and master.dtype == torch.float32
        # the master copy carries the fp32 update (torch's AdamW on fp32 weights with the same gradients) ...
        torch.testing.assert_close(master, q, rtol=1e-6, atol=0)
        # ... and the parameter is that copy rounded to nearest bf16
        assert torch.equal(p, master.bfloat16())
        coarser += int(not torch.equal(p.float(), master))
    assert coarser > 0  # the master copy holds more than the parameter does


def test_bf16_params_without_master_weights_are_updated_in_place(micro_overrides: dict[str, str]) -> None:
    train = {**BF16_ALL, "train.master_weights_dtype": "none"}
    ours, ref = _reference_run(micro_overrides, train, steps=4)
    for p, q in _pairs(ours, ref):
        assert p.dtype == torch.bfloat16 and "master" not in ours.state[p]
        torch.testing.assert_close(p.float(), q, rtol=0, atol=0)


def test_the_parameter_is_the_rounded_master_after_every_step(micro_overrides: dict[str, str]) -> None:
    model = _micro_model({**micro_overrides, **EXPERT_BIAS}).to(torch.bfloat16)
    # the routers' expert bias stays fp32 under the cast (the routers rely on it)
    assert {r.expert_bias.dtype for r in model.routers()} == {torch.float32}
    opt = build_optimizer(model, TrainConfig(optimizer_states_dtype="bf16", params_dtype="bf16"))
    for step in range(3):
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad(set_to_none=True)
        _backward(model, step)
        opt.step()
        for p in model.parameters():
            assert torch.equal(p, opt.state[p]["master"].bfloat16())
        assert any(not torch.equal(p, was) for p, was in zip(model.parameters(), before, strict=True))


@pytest.mark.parametrize(
    ("params_dtype", "master", "kept"),
    [("fp32", "fp32", False), ("fp32", "none", False), ("bf16", "fp32", True), ("bf16", "none", False)],
)
def test_master_weights_only_for_bf16_params_with_fp32_masters(
    micro_overrides: dict[str, str], params_dtype: str, master: str, kept: bool
) -> None:
    model = _micro_model(micro_overrides).to(torch.bfloat16 if params_dtype == "bf16" else torch.float32)
    opt = build_optimizer(model, TrainConfig(params_dtype=params_dtype, master_weights_dtype=master))
    _backward(model, 0)
    opt.step()
    assert {("master" in opt.state[p]) for p in model.parameters()} == {kept}


def test_prepare_makes_bf16_params_the_rounded_fp32_initial_values(micro_overrides: dict[str, str]) -> None:
    from moe_train.setup import prepare

    cfg = load_config("tiny", {**micro_overrides, **EXPERT_BIAS, **BF16_ALL})
    on_meta = prepare(cfg, world_size=1).model
    fp32 = build_model(cfg.model, seed=cfg.train.seed)
    assert {p.dtype for p in on_meta.parameters()} == {torch.bfloat16}
    for (name, a), c in zip(on_meta.state_dict().items(), fp32.state_dict().values(), strict=True):
        # the fp32 initial values rounded to nearest (materialised from the meta device); the expert bias stays fp32
        assert torch.equal(a, c.to(a.dtype)) and (a.dtype == torch.float32) == name.endswith("expert_bias"), name


# ----------------------------------------------------------------------------------------------- memory


@pytest.mark.parametrize(
    ("states", "params", "master"),
    [("fp32", "fp32", "fp32"), ("bf16", "fp32", "fp32"), ("bf16", "bf16", "fp32"), ("fp32", "bf16", "none")],
)
def test_state_bytes_are_the_formula(micro_overrides: dict[str, str], states: str, params: str, master: str) -> None:
    model = _micro_model(micro_overrides).to(torch.bfloat16 if params == "bf16" else torch.float32)
    opt = build_optimizer(
        model, TrainConfig(optimizer_states_dtype=states, params_dtype=params, master_weights_dtype=master)
    )
    assert optimizer_state_bytes(opt) == {"exp_avg": 0, "exp_avg_sq": 0, "step": 0, "master": 0, "momentum_buffer": 0}
    _backward(model, 0)
    opt.step()
    tensors = list(model.parameters())
    numel = sum(p.numel() for p in tensors)
    state_bytes = {"fp32": 4, "bf16": 2}[states]
    has_master = params == "bf16" and master == "fp32"
    expected = {
        "exp_avg": numel * state_bytes,
        "exp_avg_sq": numel * state_bytes,
        "step": 4 * len(tensors),
        "master": 4 * numel if has_master else 0,
        "momentum_buffer": 0,  # Muon's
    }
    assert optimizer_state_bytes(opt) == expected
    # what the optimizer allocated, counted independently of optimizer_state_bytes: every state tensor's storage
    held = sum(t.untyped_storage().nbytes() for s in opt.state.values() for t in s.values())
    assert held == sum(expected.values())
    # init_state allocates the same, without a step
    fresh = build_optimizer(model, opt_cfg := TrainConfig(optimizer_states_dtype=states, master_weights_dtype=master))
    fresh.init_state()
    assert optimizer_state_bytes(fresh) == expected and opt_cfg.params_dtype == "fp32"
    assert {s["step"].item() for s in fresh.state.values()} == {0.0}


# ----------------------------------------------------------------------------------------------- checkpoints


def _train_steps(setup, optimizer: torch.optim.Optimizer, steps: range) -> list[float]:
    """The trainer's step (without metrics), one micro-batch per rank: batch, forward, backward, gradient
    completion, clipping, AdamW, expert-bias update."""
    cfg: ExperimentConfig = setup.cfg
    stream = setup.data.train
    params = [p for p in setup.model.parameters() if p.requires_grad]
    routing, loss_fn = StageRouting(), NextTokenLoss(cfg.model.mtp_loss_scaling_factor)
    losses = []
    for step in steps:
        set_lr(optimizer, lr_at(step, cfg.train))
        optimizer.zero_grad(set_to_none=True)
        batch = stream.batch(
            step, cfg.train.global_batch_size, setup.parallel.dp_index * setup.micro_batch, setup.micro_batch
        )
        routing.clear()
        loss_fn.reset(torch.device("cpu"))
        setup.parallel.forward_backward(batch.input_ids_BS, batch.labels_BS, 1, loss_fn, torch.float32, routing=routing)
        setup.parallel.finalize_grads()
        setup.parallel.clip_grad_norm_(cfg.train.clip_grad, params)
        optimizer.step()
        load_LE = torch.cat([routing.tokens_per_expert_LE[i] for i in setup.parallel.stage_indices])
        for router, counts_E in zip(setup.parallel.routers(), load_LE, strict=True):
            router.update_expert_bias(counts_E)
        losses.append(loss_fn.lm_sum.item())
    return losses


def _local_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every local tensor of the model (parameters and buffers) and of the optimizer's state, by name."""
    from torch.distributed.tensor import DTensor

    def local(t: torch.Tensor) -> torch.Tensor:
        return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()

    out = {name: local(t) for name, t in model.state_dict().items()}
    names = {id(p): name for name, p in model.named_parameters()}
    for p, state in optimizer.state.items():
        out.update({f"{names[id(p)]}:{key}": local(t) for key, t in state.items()})
    return out


def resume_equals_uninterrupted(
    overrides: dict[str, str], checkpoints: Path, first: int, then: int, world_size: int = 1
) -> dict:
    """``first`` steps, a checkpoint, a fresh model and optimizer loading it, ``then`` more steps; and the same
    ``first + then`` steps uninterrupted. Returns both runs' final local states and losses (also run on each rank of
    the 2-rank test)."""
    from moe_train.trainer import prepare

    cfg = load_config("tiny", {**overrides, "train.steps": str(first + then)})
    whole = prepare(cfg, world_size=world_size)
    whole_opt = build_optimizer(whole.model, cfg.train)
    whole_losses = _train_steps(whole, whole_opt, range(first + then))

    part = prepare(cfg, world_size=world_size)
    part_opt = build_optimizer(part.model, cfg.train)
    part_losses = _train_steps(part, part_opt, range(first))
    path = save_checkpoint(checkpoints, part.model, part_opt, first, parallel=part.parallel)
    fresh = prepare(cfg, world_size=world_size)
    fresh_opt = build_optimizer(fresh.model, cfg.train)
    untrained = _local_state(fresh.model, fresh_opt)
    assert load_checkpoint(path, fresh.model, fresh_opt, fresh.parallel) == first
    part_losses += _train_steps(fresh, fresh_opt, range(first, first + then))
    return {
        "whole": _local_state(whole.model, whole_opt),
        "resumed": _local_state(fresh.model, fresh_opt),
        "untrained": untrained,
        "whole_losses": whole_losses,
        "resumed_losses": part_losses,
        "dtypes": {name: str(p.dtype) for name, p in fresh.model.named_parameters()},
        "placements": {name: str(getattr(p, "placements", None)) for name, p in fresh.model.named_parameters()},
        "state_placements": {
            f"{name}:{key}": str(getattr(fresh_opt.state[p][key], "placements", None))
            for name, p in fresh.model.named_parameters()
            for key in ("exp_avg", "exp_avg_sq", "master")
        },
    }


def _assert_resume(result: dict, steps: int) -> None:
    whole, resumed = result["whole"], result["resumed"]
    assert whole.keys() == resumed.keys()
    assert {k.rsplit(":", 1)[1] for k in whole if ":" in k} == {"exp_avg", "exp_avg_sq", "step", "master"}
    for name, tensor in whole.items():
        assert resumed[name].dtype == tensor.dtype, name
        torch.testing.assert_close(resumed[name], tensor, rtol=1e-6, atol=0, msg=name)
        if name.endswith(":step"):
            assert tensor.item() == steps
        elif name.endswith((":exp_avg", ":exp_avg_sq")):
            assert tensor.dtype == torch.bfloat16
        elif name.endswith(":master"):
            assert tensor.dtype == torch.float32
    assert result["resumed_losses"] == pytest.approx(result["whole_losses"], rel=1e-6)
    assert set(result["dtypes"].values()) == {"torch.bfloat16"}
    # a resume that loaded nothing would have the fresh model's state and the state a fresh optimizer makes: the
    # comparison above is not between two untouched copies
    assert any(not torch.equal(result["untrained"][n], t) for n, t in whole.items() if n in result["untrained"])


def test_resume_with_bf16_states_and_master_weights_equals_an_uninterrupted_run(
    micro_overrides: dict[str, str], tmp_path: Path
) -> None:
    result = resume_equals_uninterrupted({**micro_overrides, **EXPERT_BIAS, **BF16_ALL}, tmp_path / "ckpt", 3, 3)
    _assert_resume(result, 6)
    assert any(k.startswith("0.layers.0.mlp.router.expert_bias") for k in result["whole"])  # stage 0 holds it


WORLD = 2


@pytest.mark.dist
def test_resume_under_fsdp_on_two_ranks(launch_gloo_workers, micro_overrides: dict[str, str], tmp_path: Path) -> None:
    overrides = {**micro_overrides, **EXPERT_BIAS, **BF16_ALL, "parallel.dp_shard": "2", "train.micro_batch_size": "2"}
    (tmp_path / "overrides.json").write_text(json.dumps(overrides))
    for result in launch_gloo_workers(Path(__file__), WORLD, tmp_path, timeout=120):
        # the parameters and every optimizer state are sharded by FSDP: saved and loaded per shard
        assert "Shard(dim=0)" in result["placements"]["0.layers.0.attention.q_proj.weight"]
        for key, placements in result["state_placements"].items():
            assert placements == result["placements"][key.split(":")[0]], key
        _assert_resume(result, 4)


# ----------------------------------------------------------------------------------------------- config and CLI


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("train.optimizer_states_dtype", "fp16", "train.optimizer_states_dtype='fp16': choose fp32 or bf16"),
        ("train.params_dtype", "fp8", "train.params_dtype='fp8': choose fp32 or bf16"),
        ("train.master_weights_dtype", "bf16", "train.master_weights_dtype='bf16': choose fp32 or none"),
    ],
)
def test_bad_dtypes_are_one_line_exit_2(
    micro_overrides: dict[str, str], capsys: pytest.CaptureFixture[str], key: str, value: str, expected: str
) -> None:
    from moe_train import cli

    args = [token for k, v in {**micro_overrides, key: value}.items() for token in (f"--{k}", v)]
    assert cli.main(["train", *args]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and expected in err, err
    assert not Path(micro_overrides["run.output_dir"]).exists()


def test_trainer_runs_bf16_params_states_and_master_weights(
    micro_overrides: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    from moe_train import cli

    args = [t for k, v in {**micro_overrides, **BF16_ALL, "train.steps": "30"}.items() for t in (f"--{k}", v)]
    assert cli.main(["train", *args, "--train.lr", "0.01"]) == 0
    out = capsys.readouterr().out
    assert "bf16 params, AdamW states bf16, master weights fp32" in out
    lines = Path(micro_overrides["run.output_dir"], "metrics.jsonl").read_text().splitlines()
    losses = [json.loads(line)["loss"] for line in lines]
    assert len(losses) == 30 and losses[-1] < 0.8 * losses[0]


# ----------------------------------------------------------------------------------------------- 2-rank worker


def _worker(out: Path) -> None:
    overrides = json.loads((out / "overrides.json").read_text())
    torch.set_num_threads(1)
    result = resume_equals_uninterrupted(overrides, out / "ckpt", 2, 2, world_size=WORLD)
    rank = torch.distributed.get_rank()
    torch.save(result, out / f"rank{rank}.pt")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
