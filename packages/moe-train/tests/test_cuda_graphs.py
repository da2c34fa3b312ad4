"""``run.cuda_graphs`` (moe_train.cuda_graphs): the one-line refusals, on the CPU through ``moe-train train``; what a
region's outputs are flattened to and rebuilt from; the refusal of a region that reads back; and, on a GPU, captured
replay against eager execution."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from moe_dispatch import RoutingResult
from moe_models import build_model
from moe_models.presets import preset
from moe_parallel import ParallelLayout
from moe_train import cli
from moe_train.capture_check import flatten_tensors
from moe_train.config import ConfigError, load_config
from moe_train.cuda_graphs import apply_cuda_graphs, cuda_graphs_problem, graph_run_regions, regions
from moe_train.trainer import prepare


def test_off_cuda_the_run_is_refused_in_one_line(
    micro_overrides: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    overrides = {**micro_overrides, "run.cuda_graphs": "attn,layer", "run.device": "cpu"}
    args = [token for key, value in overrides.items() for token in (f"--{key}", value)]
    assert cli.main(["train", *args]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "run.cuda_graphs=attn,layer: CUDA graphs capture CUDA work and this run is on cpu" in err
    assert not Path(overrides["run.output_dir"]).exists()


@pytest.mark.parametrize(
    ("overrides", "world", "expected"),
    [
        ({"run.cuda_graphs": "attn,mlp"}, 1, "run.cuda_graphs=attn,mlp: unknown scope 'mlp'"),
        ({"run.cuda_graphs": "moe_preprocess"}, 1, "moe_preprocess is checked capturable but not captured on its own"),
        ({"run.cuda_graphs": "layer"}, 2, "run.cuda_graphs=layer with 2 processes: captured in one process only"),
        ({"run.cuda_graphs": "attn", "run.recompute_modules": "moe"}, 1, "with run.recompute_modules set"),
        ({"run.cuda_graphs": "attn", "run.compile": "true"}, 1, "with run.compile set"),
        ({"run.cuda_graphs": "attn", "precision.recipe": "fp8_delayed"}, 1, "with precision.recipe set"),
    ],
)
def test_what_graphs_cannot_capture_is_refused_on_cuda_too(overrides: dict, world: int, expected: str) -> None:
    cfg = load_config("tiny", overrides)
    problem = cuda_graphs_problem(cfg, ParallelLayout(world), "cuda")
    assert problem is not None and expected in problem and "\n" not in problem, problem
    assert (
        cuda_graphs_problem(load_config("tiny", {"run.cuda_graphs": "attn,layer"}), ParallelLayout(1), "cuda") is None
    )


def test_outputs_are_flattened_and_rebuilt() -> None:
    probs, idx = torch.rand(3, 2), torch.zeros(3, 2, dtype=torch.long)
    routing = RoutingResult(probs, idx, torch.ones(4), torch.zeros(()), losses={"aux": torch.ones(())})
    value = (torch.ones(2), routing, None, [torch.zeros(1), 3])
    tensors, rebuild = flatten_tensors(value)
    assert len(tensors) == 7  # x, the routing's probs, idx, counts, aux loss and its one loss, the list's tensor
    doubled = rebuild([t * 2 for t in tensors])
    assert torch.equal(doubled[0], 2 * value[0]) and doubled[2] is None and doubled[3][1] == 3
    assert isinstance(doubled[1], RoutingResult) and torch.equal(doubled[1].probs_TK, 2 * probs)
    assert torch.equal(doubled[1].losses["aux"], 2 * torch.ones(()))
    assert dataclasses.replace(routing) is not routing  # rebuilt from a copy, the original untouched
    assert torch.equal(routing.probs_TK, probs)


def test_a_region_that_reads_back_is_refused_naming_the_op() -> None:
    """The loop experts split their rows on the host: a whole layer cannot be captured (checked before any graph)."""
    config = preset("tiny-qwen3-moe", moe_expert_backend="loop")
    model = build_model(config, seed=0)
    tokens = torch.randint(0, config.vocab_size, (2, 8))
    with pytest.raises(ConfigError) as err:
        apply_cuda_graphs(model, ("attn", "layer"), lambda: model(tokens))
    message = str(err.value)
    assert message.startswith("run.cuda_graphs=layer: layers.0 reads back on the host: ") and "grouped.py:" in message
    assert message.endswith("it cannot be captured, leave layer out"), message


def test_a_run_checks_its_one_stage_before_capturing(micro_overrides: dict[str, str]) -> None:
    """The trainer's path (moe_train.setup): the run's stage, a forward on a random batch under the run's autocast,
    the check; here it refuses the loop experts before asking CUDA for anything."""
    cfg = load_config("tiny", {**micro_overrides, "model.moe_expert_backend": "loop", "run.save_checkpoint": "false"})
    setup = prepare(cfg, 1)
    with pytest.raises(
        ConfigError, match=r"^run.cuda_graphs=layer: layers.0 reads back on the host: .* at grouped.py:"
    ):
        graph_run_regions(setup.parallel, ("attn", "layer"), (2, cfg.data.seq_len), cfg.model.vocab_size, setup.dtype)
    assert not Path(micro_overrides["run.output_dir"]).exists()


def test_the_scopes_name_their_modules() -> None:
    model = build_model(preset("tiny-deepseek-v3"), seed=0)  # a dense first layer, then a MoE layer, then MTP
    layers = [m for m in model.modules() if type(m).__name__ == "DecoderLayer"]
    attn = regions(model, ("attn",))
    assert attn and all(type(m).__name__ in ("MultiLatentAttention", "Attention") for m in attn)
    routers = regions(model, ("moe_router",))
    assert routers and all(type(m).__name__ == "TopKRouter" for m in routers)
    whole = regions(model, ("layer", "attn"))  # a captured layer holds its token mixer: not captured again
    assert layers[0].attention in whole and layers[1] in whole and layers[1].attention not in whole


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("scopes", [("attn", "moe_router"), ("layer",)])
def test_captured_replay_equals_eager(scopes: tuple[str, ...]) -> None:
    """Three training steps (two micro-batches' forward and backward accumulated, then SGD) with the scopes replayed
    from graphs equal the eager ones: the same kernels in the same order, so the logits and gradients agree to fp32
    rounding of atomics (index_add). Accumulation is where a graph's static weight-gradient buffer could alias."""
    config = preset("tiny-qwen3-moe", moe_expert_backend="torch", moe_permute_backend="triton")
    device = torch.device("cuda")
    eager, graphed = (build_model(config, seed=0).to(device) for _ in range(2))
    tokens = torch.randint(0, config.vocab_size, (3, 2, 2, 33), device=device)
    apply_cuda_graphs(graphed, scopes, lambda: graphed(tokens[0, 0, :, :-1]))
    for step in range(3):
        for micro in range(2):
            logits = []
            for model in (eager, graphed):
                batch = tokens[step, micro]
                out = model(batch[:, :-1]).logits
                loss = torch.nn.functional.cross_entropy(out.flatten(0, 1).float(), batch[:, 1:].flatten())
                loss.backward()
                logits.append(out.detach())
            torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)
        for (name, a), b in zip(eager.named_parameters(), graphed.parameters(), strict=True):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)
        with torch.no_grad():
            for model in (eager, graphed):
                for p in model.parameters():
                    p -= 0.1 * p.grad
                model.zero_grad(set_to_none=True)
