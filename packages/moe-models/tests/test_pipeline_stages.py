"""Pipeline stages of MoETransformer, chained by hand in one process, compute exactly what the whole model does:
logits, MTP logits, routing side results and every parameter's gradient (the embedding's as the sum of its two
copies when MTP puts one on the last stage), also on packed rows of documents. The reference is the model's own
forward."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from moe_models import ModelConfig, StageRouting, build_model, causal_lm_loss, next_token_loss, preset
from moe_models.module_kinds import module_kinds
from moe_models.pipeline import DEFAULT_SEQ_LEN

FAMILIES = ("tiny-qwen3-moe", "tiny-deepseek-v3", "tiny-gpt-oss", "tiny-mixtral")
SPLITS = ([(0,), (1, 2), (3,)], [(0, 1, 2), (3,)], [(0,), (1,), (2,), (3,)])


def _config(name: str) -> ModelConfig:
    extra = {"moe_layer_freq": [0, 1, 1, 1]} if name == "tiny-deepseek-v3" else {}
    return preset(name, num_layers=4, **extra)


def _stages(model, split):
    plan = model.parallel_plan().pipeline
    last = len(split) - 1
    return [plan.build_stage(i, layers, i == 0, i == last) for i, layers in enumerate(split)]


def _run(stages, ids, **kwargs):
    routing = StageRouting()
    x = ids
    for stage in stages:
        x = stage(x, input_ids_BS=ids, routing=routing, **kwargs)
    logits, *mtp = x if isinstance(x, tuple) else (x,)
    return logits, mtp, routing


# packed rows: three documents and a padding tail, two documents
DOCUMENTS = torch.tensor([[0] * 5 + [1] * 6 + [2] * 3 + [-1] * 2, [7] * 9 + [8] * 7])


@pytest.mark.parametrize("split", SPLITS, ids=lambda s: "/".join(str(len(g)) for g in s))
@pytest.mark.parametrize("family", FAMILIES)
def test_chained_stages_equal_the_whole_model(family: str, split) -> None:
    _check_stages(family, split)


@pytest.mark.parametrize("family", FAMILIES)
def test_chained_stages_on_packed_documents_equal_the_whole_model(family: str) -> None:
    _check_stages(family, SPLITS[0], document_ids_BS=DOCUMENTS)


def _check_stages(family: str, split, **kwargs) -> None:
    config = _config(family)
    model = build_model(config, seed=5)
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    labels = torch.roll(ids, -1, 1)
    whole = model(ids, **kwargs)
    causal_lm_loss(whole, labels).total.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    stages = _stages(model, split)
    logits, mtp, routing = _run(stages, ids, **kwargs)
    torch.testing.assert_close(logits, whole.logits, rtol=0, atol=0)
    assert len(mtp) == len(whole.mtp_logits)
    for ours, theirs in zip(mtp, whole.mtp_logits, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    loads = torch.cat([routing.tokens_per_expert_LE[i] for i in range(len(stages))])
    assert torch.equal(loads, whole.tokens_per_expert_LE)
    aux = sum(routing.aux_loss.values())
    torch.testing.assert_close(aux, whole.aux_loss, rtol=1e-6, atol=0)
    assert [r for s in stages for r in s.routers()] == model.routers()
    assert [row for s in stages for row in s.router_rows()] == list(range(len(model.routers())))

    next_token_loss(logits, mtp, labels).total.backward()
    got: dict[str, torch.Tensor] = {}
    for stage in stages:
        for name, param in stage.named_parameters():
            got[name] = got[name] + param.grad if name in got else param.grad.clone()
    assert set(got) == set(expected)
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-6, atol=1e-7, msg=name)


def test_stages_keep_the_whole_models_names_and_kinds() -> None:
    model = build_model(_config("tiny-deepseek-v3"), seed=5)
    stages = _stages(model, SPLITS[0])
    names = [set(s.state_dict()) for s in stages]
    assert set.union(*names) == set(model.state_dict())
    # only the MTP's embedding copy is held twice
    assert set.intersection(names[0], names[-1]) == {"embed_tokens.weight"}
    assert not set.intersection(names[0], names[1]) and not set.intersection(names[1], names[2])
    whole_kinds = module_kinds(model)
    for kind in whole_kinds:
        assert sorted(n for s in stages for n in s.module_kinds().get(kind, [])) == sorted(whole_kinds[kind])
    # the first stage runs the model's own embedding, the last a copy of it with the same values
    assert stages[0].embed_tokens is model.embed_tokens
    assert stages[-1].embed_tokens is not model.embed_tokens
    torch.testing.assert_close(stages[-1].embed_tokens.weight, model.embed_tokens.weight, rtol=0, atol=0)


def test_stage_io_matches_what_stages_return() -> None:
    config = _config("tiny-deepseek-v3")
    model = build_model(config, seed=5)
    plan = model.parallel_plan().pipeline
    stages = _stages(model, SPLITS[0])
    ids = torch.randint(0, config.vocab_size, (3, 8))
    x = ids
    for stage in stages:
        inputs, outputs = plan.stage_io(stage, 3, 8, 1, torch.float32)
        assert [(t.shape, t.dtype) for t in inputs] == [(x.shape, x.dtype)]
        x = stage(x, input_ids_BS=ids)
        out = x if isinstance(x, tuple) else (x,)
        assert [(t.shape, t.dtype) for t in outputs] == [(t.shape, t.dtype) for t in out]


def test_costs_weigh_moe_layers_above_dense_ones_and_the_head() -> None:
    plan = build_model(_config("tiny-deepseek-v3"), seed=5).parallel_plan().pipeline
    dense, *moe = plan.layer_costs
    assert all(cost > dense for cost in moe)
    assert plan.last_cost > 0 and plan.first_cost < min(plan.layer_costs)
    assert plan.last_stage_copies == ("embed_tokens.weight",)
    tied = build_model(replace(_config("tiny-qwen3-moe"), share_embeddings_and_output_weights=True))
    assert "share_embeddings_and_output_weights" in tied.parallel_plan().pipeline.unsupported


def test_costs_are_at_the_sequence_length_given() -> None:
    model = build_model(_config("tiny-qwen3-moe"), seed=5)
    default, short, long = (model.parallel_plan(seq_len).pipeline for seq_len in (None, 256, 65536))
    assert default.layer_costs == model.parallel_plan(DEFAULT_SEQ_LEN).pipeline.layer_costs
    assert short.layer_costs != default.layer_costs != long.layer_costs
    # core attention grows with the sequence, the rest of a layer, the embedding and the head do not
    assert all(s < d < lo for s, d, lo in zip(short.layer_costs, default.layer_costs, long.layer_costs, strict=True))
    assert short.first_cost == default.first_cost == long.first_cost
    assert short.last_cost == default.last_cost == long.last_cost
    assert long.layer_costs[0] / long.last_cost > short.layer_costs[0] / short.last_cost
