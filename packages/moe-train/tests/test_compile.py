"""``run.compile``: regional compile of each decoder layer. Over 10 training steps whose expert loads differ nothing
recompiles after the first step, and the losses equal eager's; combinations compile does not support are one-line
config errors, exit 2."""

from __future__ import annotations

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

from moe_models import build_model, causal_lm_loss
from moe_models.module_kinds import decoder_layers
from moe_models.presets import preset
from moe_train import cli
from moe_train.compile import compile_decoder_layers
from moe_train.config import load_config
from moe_train.data import prepare_data

STEPS = 10


class CountingBackend:
    """A dynamo backend that counts the graphs it is given (forward and backward) and runs them as traced."""

    def __init__(self) -> None:
        self.graphs = 0
        self.backend = aot_autograd(fw_compiler=self._count, bw_compiler=self._count)

    def _count(self, gm, example_inputs):
        self.graphs += 1
        return make_boxed_func(gm.forward)


def _train(compiled: CountingBackend | None) -> tuple[list[float], list[list[int]], list[int]]:
    """10 steps of the tiny preset on its data: losses, each step's tokens per expert of layer 0, and the graph count
    after each step."""
    cfg = load_config("tiny", {})
    model_cfg = cfg.model
    data = prepare_data(cfg.data, seed=cfg.train.seed, model_vocab_size=model_cfg.vocab_size, model_from_hf=False)
    model = build_model(model_cfg, seed=cfg.train.seed)
    if compiled is not None:
        assert compile_decoder_layers(model, backend=compiled.backend) == model_cfg.num_layers
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr)
    losses, loads, graphs = [], [], []
    for step in range(STEPS):
        batch = data.train.batch(step, 8, 0, 8)
        out = model(batch.input_ids_BS)
        loss = causal_lm_loss(out, batch.labels_BS, model_cfg.mtp_loss_scaling_factor).total
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        loads.append(out.tokens_per_expert_LE[0].tolist())
        graphs.append(compiled.graphs if compiled is not None else 0)
    return losses, loads, graphs


def test_compiled_layers_do_not_recompile_over_steps_whose_expert_loads_differ() -> None:
    torch._dynamo.reset()
    counting = CountingBackend()
    losses, loads, graphs = _train(counting)
    eager_losses, eager_loads, _ = _train(None)
    assert len({tuple(load) for load in loads}) == STEPS  # every step routes differently
    assert graphs[0] > 0
    assert graphs[-1] == graphs[1], graphs  # compiled in the first step (forward) and its backward: no more after
    assert graphs[-1] == 2, graphs  # one forward and one backward graph serve both layers: no graph break
    assert loads == eager_loads
    torch.testing.assert_close(losses, eager_losses, rtol=1e-6, atol=0)


@pytest.mark.parametrize("preset_name", ["tiny-qwen3-moe", "tiny-deepseek-v3", "tiny-gpt-oss", "tiny-mixtral"])
def test_every_family_decoder_layer_traces_without_a_graph_break(preset_name: str) -> None:
    """The dropless MoE block (router, balancing losses, permutation, experts, combine), dense layers, MLA, sinks and
    sliding windows (blockwise attention) all trace whole: each decoder layer is one graph, which the compiler can fuse
    across (a graph break runs the code between graphs eagerly)."""
    model = build_model(preset(preset_name), seed=0).train()
    inputs: dict[str, tuple] = {}
    hooks = [
        layer.register_forward_pre_hook(
            lambda _, args, kwargs, name=name: inputs.setdefault(name, (args, kwargs)), with_kwargs=True
        )
        for name, layer in decoder_layers(model)
    ]
    model(torch.randint(0, model.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0)))
    for hook in hooks:
        hook.remove()
    for name, layer in decoder_layers(model):
        torch._dynamo.reset()
        args, kwargs = inputs[name]
        explained = torch._dynamo.explain(layer)(*args, **kwargs)
        breaks = [b.reason.splitlines()[0] for b in explained.break_reasons]
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), (name, breaks)


def test_inductor_compiled_layers_match_eager_within_fp32_rounding() -> None:
    torch._dynamo.reset()
    cfg = load_config("tiny", {})
    data = prepare_data(cfg.data, seed=1, model_vocab_size=cfg.model.vocab_size, model_from_hf=False)
    batch = data.train.batch(0, 4, 0, 4)
    eager = build_model(cfg.model, seed=1)
    compiled = build_model(cfg.model, seed=1)
    compile_decoder_layers(compiled)  # inductor, the default

    def loss_and_grads(model):
        loss = causal_lm_loss(model(batch.input_ids_BS), batch.labels_BS, 0.0).total
        loss.backward()
        return loss.item(), torch.cat([p.grad.flatten() for p in model.parameters()])

    loss, grads = loss_and_grads(compiled)
    want_loss, want_grads = loss_and_grads(eager)
    assert loss == pytest.approx(want_loss, rel=1e-5)
    torch.testing.assert_close(grads, want_grads, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["--precision.recipe", "fp8_tensorwise", "--precision.emulate", "true"],
            "run.compile=true with precision.recipe='fp8_tensorwise': not supported",
        ),
        (
            ["--run.offload_modules", "expert_fc1"],
            "run.compile=true with run.offload_modules: activation offload's saved-tensor hooks are not supported",
        ),
    ],
)
def test_unsupported_combinations_are_one_line_config_errors(
    tmp_path, capsys: pytest.CaptureFixture[str], overrides: list[str], message: str
) -> None:
    args = ["train", "--train.steps", "1", "--run.output_dir", str(tmp_path / "out"), "--run.compile", "true"]
    assert cli.main([*args, *overrides]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "out").exists()  # nothing written
