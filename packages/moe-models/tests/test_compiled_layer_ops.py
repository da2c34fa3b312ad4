"""A decoder layer whose permutation runs on the custom ops (``moe_permute_backend="triton"``: the Triton kernels on a
GPU, their plain-torch stand-in on CPU) compiles to ONE graph, forward and backward traced through the ops' fake and
autograd registrations, and computes eager's outputs and gradients. (The opaque autograd.Functions the ops replace
made Dynamo fail on this layer.)"""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from moe_models import ModelConfig, build_model
from moe_models.module_kinds import decoder_layers

TINY = {
    "vocab_size": 64,
    "hidden_size": 32,
    "num_layers": 1,
    "num_attention_heads": 4,
    "num_query_groups": 2,
    "kv_channels": 8,
    "num_moe_experts": 4,
    "moe_ffn_hidden_size": 16,
}
OPS = {"moe_dispatch.permute_rows.default", "moe_dispatch.unpermute_rows.default"}


def _model(topk: int, backend: str = "triton", shared: int | None = None):
    torch.manual_seed(0)
    cfg = ModelConfig(
        **TINY, moe_router_topk=topk, moe_permute_backend=backend, moe_shared_expert_intermediate_size=shared
    )
    return build_model(cfg)


def _loss_and_grads(model, ids):
    out = model(ids)
    out.logits.square().mean().backward()
    return out.logits, {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize(
    ("topk", "ops", "shared"),
    [
        (1, OPS, None),  # the experts take the permuted rows: permute_rows, then unpermute_rows to combine
        # the experts gather the rows themselves, combine is the op; with a shared expert (inline when compiling)
        (2, {"moe_dispatch.unpermute_rows.default"}, 16),
    ],
)
def test_decoder_layer_compiles_to_one_graph_through_the_ops(topk, ops, shared):
    eager = _model(topk, shared=shared)
    compiled = copy.deepcopy(eager)
    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    ((_, layer),) = decoder_layers(compiled)
    layer.compile(backend=counter)
    ids = torch.randint(0, TINY["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(1))

    got_logits, got_grads = _loss_and_grads(compiled, ids)
    want_logits, want_grads = _loss_and_grads(eager, ids)

    assert counter.frame_count == 1  # one graph for the layer: a graph break would make two or more
    targets = {str(node.target) for node in counter.graphs[0].graph.nodes}
    assert ops <= targets and not (OPS - ops) & targets  # the ops are in the graph, not called around it
    torch.testing.assert_close(got_logits, want_logits)
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, msg=name)


def test_layer_explains_without_a_graph_break():
    """The same through ``torch._dynamo.explain``: its count of graph breaks, with their reasons on failure."""
    model = _model(1)
    ((_, layer),) = decoder_layers(model)
    captured = {}
    hook = layer.register_forward_pre_hook(
        lambda _, args, kwargs: captured.setdefault("inputs", (args, kwargs)), with_kwargs=True
    )
    model(torch.randint(0, TINY["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(2)))
    hook.remove()
    args, kwargs = captured["inputs"]
    torch._dynamo.reset()
    explained = torch._dynamo.explain(layer)(*args, **kwargs)
    assert explained.graph_break_count == 0, [reason.reason for reason in explained.break_reasons]
    assert explained.graph_count == 1


def test_the_ops_equal_the_torch_permutation():
    """The custom-op model (stand-in on CPU) against the plain-torch permutation: same weights, same logits."""
    ids = torch.randint(0, TINY["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(3))
    got_logits, got_grads = _loss_and_grads(_model(1, "triton"), ids)
    want_logits, want_grads = _loss_and_grads(_model(1, "torch"), ids)
    torch.testing.assert_close(got_logits, want_logits)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the side stream is CUDA's")
def test_shared_expert_runs_inline_when_compiled_on_cuda():
    """Under torch.compile the shared expert skips its side stream (no record_stream in a graph): one graph, eager's
    values."""
    from moe_experts import SharedExperts

    shared = SharedExperts(32, 16).cuda()
    x = torch.randn(8, 32, device="cuda")
    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    got = torch.compile(lambda t: shared.start(t).wait(), backend=counter, fullgraph=True)(x)
    assert counter.frame_count == 1
    torch.testing.assert_close(got, shared(x))
