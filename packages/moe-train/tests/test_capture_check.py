"""The capture-safety check of CUDA graphs' regions (moe_train.capture_check), on the CPU: the regions of every scope
(a token mixer, a router, a router with its dispatch, a whole dropless decoder layer) read nothing back on the host
with the model configured as a GPU runs it, and a planted read-back, or a configuration that reads back, is named by
op and site."""

from __future__ import annotations

import pytest
import torch

import moe_dispatch.router
from moe_models import build_model
from moe_models.presets import preset
from moe_train.capture_check import CUDA_GRAPH_SCOPES, capture_problems, first_regions, host_reads_of

# as a GPU runs the model (test_host_syncs.GPU_MODEL): grouped_mm experts, the fused permutation's custom ops, and
# the balancing losses, z-loss and expert bias
GPU_MODEL = {
    "moe_expert_backend": "torch",
    "moe_permute_backend": "triton",
    "moe_z_loss_coeff": 0.001,
    "moe_router_enable_expert_bias": True,
}


def _model(name: str, **changes):
    config = preset(name, **{**GPU_MODEL, **changes})
    model = build_model(config, seed=0)
    tokens = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    return model, lambda: model(tokens)


@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-deepseek-v3"])
def test_every_scope_is_capturable_as_a_gpu_runs_it(name: str) -> None:
    model, forward = _model(name)
    regions = first_regions(model, CUDA_GRAPH_SCOPES, forward)
    # DeepSeek-V3's first layer is dense: its MoE scopes are the second layer's
    assert [r.scope for r in regions] == list(CUDA_GRAPH_SCOPES)
    for region in regions:
        assert host_reads_of(region) == [], region.path
    before = {n: b.clone() for n, b in model.named_buffers()}
    assert capture_problems(model, CUDA_GRAPH_SCOPES, forward) == {}
    assert all(torch.equal(before[n], b) for n, b in model.named_buffers())  # router statistics put back
    assert all(p.grad is None for p in model.parameters())


def test_a_planted_read_back_is_named_by_op_and_site(monkeypatch: pytest.MonkeyPatch) -> None:
    original = moe_dispatch.router.probs_for_selection

    def reading_back(*args, **kwargs):
        probs = original(*args, **kwargs)
        probs.max().item()  # the planted host sync
        return probs

    monkeypatch.setattr(moe_dispatch.router, "probs_for_selection", reading_back)
    model, forward = _model("tiny-qwen3-moe")
    problems = capture_problems(model, CUDA_GRAPH_SCOPES, forward)
    assert set(problems) == {"moe_router", "moe_preprocess", "layer"}  # every scope holding a router
    assert problems["moe_router"].startswith("layers.0.mlp.router reads back on the host: item at router.py:")
    assert "\n" not in problems["layer"]


@pytest.mark.parametrize(
    ("changes", "scopes", "site"),
    [
        # capacity without padding: the buffer holds the kept pairs only, a count the host needs
        ({"moe_expert_capacity_factor": 1.0}, {"moe_preprocess", "layer"}, "permutation.py"),
        # one matmul per expert, the rows split on the host
        ({"moe_expert_backend": "loop"}, {"layer"}, "grouped.py"),
    ],
)
def test_configurations_that_read_back_are_refused_where_they_do(changes: dict, scopes: set, site: str) -> None:
    model, forward = _model("tiny-qwen3-moe", **changes)
    problems = capture_problems(model, CUDA_GRAPH_SCOPES, forward)
    assert set(problems) == scopes, problems
    assert all(f" at {site}:" in problems[s] for s in scopes), problems
