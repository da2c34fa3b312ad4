"""Training DeepSeek Sparse Attention's indexer (``dsa_indexer_loss_coeff``): in one process on tiny-deepseek-v32
(fp64, random weights, top-5 of 24 keys), for each stage (the dense KL under sparse attention, Megatron-Core's default;
the sparse KL; the dense warm-up under dense attention):
  * the forward's logits and every main-model gradient are exactly those of the model without the indexer loss (the
    warm-up's: of dense MLA on the same weights), the indexers' gradients are the loss's alone;
  * ``ModelOutput.indexer_loss`` is the sum over the layers (MTP depth included) of a KL written here in plain torch
    from each layer's own q and k (captured by hooks) and the indexer's dense scores: dense [S, S] softmaxes masked
    to the earlier keys, or to the selected ones;
  * packed documents: each document's queries get the KL they have alone;
and the config refuses inconsistent DSA training fields."""

from __future__ import annotations

import pytest
import torch
from _hf_reference import randomize_

from moe_models import build_model
from moe_models.attention import CoreAttention
from moe_models.config import ModelConfigError
from moe_models.loss import causal_lm_loss
from moe_models.mla import MultiLatentAttention
from moe_models.presets import preset
from moe_models.sparse_attention import SparseCoreAttention

F64 = torch.float64
DSA_FIELDS = {"dsa_indexer_topk": 5, "dsa_indexer_n_heads": 8, "dsa_indexer_head_dim": 16, "moe_expert_backend": "loop"}
NO_DSA = {"dsa_indexer_topk": None, "dsa_indexer_n_heads": None, "dsa_indexer_head_dim": None}
COEFF = 0.3
STAGES = {
    "dense_loss": {"dsa_indexer_loss_coeff": COEFF},
    "sparse_loss": {"dsa_indexer_loss_coeff": COEFF, "dsa_indexer_use_sparse_loss": True},
    "dense_warmup": {"dsa_indexer_loss_coeff": COEFF, "dsa_indexer_dense_warmup": True},
}


def _model(**fields) -> torch.nn.Module:
    """tiny-deepseek-v32 with a top-5 indexer, random O(1) weights, fp64, in training mode."""
    torch.manual_seed(0)
    model = build_model(preset("tiny-deepseek-v32", **DSA_FIELDS | fields)).to(F64)
    randomize_(model, seed=1)
    return model.train()


def _reference_of(model: torch.nn.Module, stage: str) -> torch.nn.Module:
    """The same weights without the indexer loss: the same DSA model, or for the warm-up dense MLA (no indexer)."""
    reference = _model(**(NO_DSA if stage == "dense_warmup" else {}))
    main = {n: t for n, t in model.state_dict().items() if ".indexer." not in n}
    missing, unexpected = reference.load_state_dict(main, strict=False)
    assert not unexpected and all(".indexer." in n for n in missing)
    return reference


def _ids(seed: int, b: int = 2, s: int = 24) -> torch.Tensor:
    return torch.randint(0, 256, (b, s), generator=torch.Generator().manual_seed(seed))


def _mla_modules(model: torch.nn.Module) -> list[MultiLatentAttention]:
    return [m for m in model.modules() if isinstance(m, MultiLatentAttention)]


@pytest.mark.parametrize("stage", list(STAGES))
def test_indexer_loss_trains_the_indexers_alone(stage: str) -> None:
    model = _model(**STAGES[stage])
    reference = _reference_of(model, stage)
    core = CoreAttention if stage == "dense_warmup" else SparseCoreAttention
    assert all(type(m.core_attention) is core for m in _mla_modules(model))
    ids = _ids(0)
    out, ref_out = model(ids), reference(ids)
    assert torch.equal(out.logits, ref_out.logits) and torch.equal(out.mtp_logits[0], ref_out.mtp_logits[0])
    assert ref_out.indexer_loss is None and out.indexer_loss.requires_grad and out.indexer_loss > 1e-3
    indexer_params = {n: p for n, p in model.named_parameters() if ".indexer." in n}
    assert len(indexer_params) == 5 * len(_mla_modules(model))  # wq_b, wk, k_norm (weight, bias), weights_proj
    alone = torch.autograd.grad(COEFF * out.indexer_loss, list(indexer_params.values()), retain_graph=True)
    labels = ids.roll(-1, dims=1)
    factor = model.config.mtp_loss_scaling_factor
    (causal_lm_loss(out, labels, factor).total + COEFF * out.indexer_loss).backward()
    causal_lm_loss(ref_out, labels, factor).total.backward()
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        if name in indexer_params:
            continue
        ref_grad = ref_params[name].grad
        assert (param.grad is None) == (ref_grad is None), name
        assert param.grad is None or torch.equal(param.grad, ref_grad), name
    # the LM loss gives the indexers nothing: their gradient is the indexer loss's, every tensor of it reached
    for (name, param), grad in zip(indexer_params.items(), alone, strict=True):
        assert torch.equal(param.grad, grad), name
        assert grad.abs().sum() > 0, name


def test_no_indexer_loss_outside_training() -> None:
    model = _model(**STAGES["sparse_loss"])
    ids = _ids(1)
    with torch.no_grad():
        assert model(ids).indexer_loss is None
    model.eval()
    assert model(ids).indexer_loss is None
    assert model.train()(ids).indexer_loss is not None


def _capture(model: torch.nn.Module) -> tuple[list[dict], list]:
    """Per MLA module, in call order: its input x, cos, sin, its q and k and (sparse) the selected indices."""
    records: dict[int, dict] = {}
    order: list[dict] = []
    handles = []
    for mla in _mla_modules(model):

        def before(module, args, mla=mla):
            records[id(mla)] = {"mla": mla, "x": args[0], "cos": args[1], "sin": args[2]}
            order.append(records[id(mla)])

        def projected(module, args, out, mla=mla):
            records[id(mla)]["q"], records[id(mla)]["k"] = out[0], out[1]

        def selected(module, args, out, mla=mla):
            records[id(mla)]["indices"] = out

        handles += [mla.register_forward_pre_hook(before), mla.up_proj.register_forward_hook(projected)]
        handles.append(mla.indexer.register_forward_hook(selected))
    return order, handles


def _plain_kl(layer: dict, sparse: bool, documents_BS: torch.Tensor | None = None) -> torch.Tensor:
    """The layer's indexer loss in plain torch: per query, the heads' softmax of scale q.k over its key set summed
    and L1-normalised, against the softmax of the indexer's dense scores over the same set; KL averaged over queries.
    The key set: earlier keys (of the query's document), or those of them selected."""
    mla, x, q, k = layer["mla"], layer["x"], layer["q"], layer["k"]
    b, _, s, _ = q.shape
    with torch.no_grad():
        scores_BSS = mla.indexer.scores(x, mla.q_a_norm(mla.q_a_proj(x)), layer["cos"], layer["sin"])
        keys_BSS = torch.ones(s, s, dtype=torch.bool).tril().expand(b, s, s)
        if documents_BS is not None:
            keys_BSS = keys_BSS & (documents_BS.unsqueeze(-1) == documents_BS.unsqueeze(1))
        if sparse:
            idx = layer["indices"]
            chosen = torch.zeros(b, s, s + 1, dtype=torch.bool).scatter(-1, torch.where(idx < 0, s, idx), True)
            keys_BSS = keys_BSS & chosen[..., :s]
        logits_BNSS = torch.einsum("bnsd,bntd->bnst", q, k) * mla.core_attention.scale
        p_BSS = logits_BNSS.masked_fill(~keys_BSS[:, None], float("-inf")).softmax(-1).sum(1)
        p_BSS = p_BSS / p_BSS.sum(-1, keepdim=True)
        log_q_BSS = scores_BSS.masked_fill(~keys_BSS, float("-inf")).log_softmax(-1)
        per_key = torch.where(keys_BSS, p_BSS * (p_BSS.log() - log_q_BSS), 0.0)
        return per_key.sum(-1).mean()


@pytest.mark.parametrize("stage", list(STAGES))
def test_indexer_loss_is_the_layers_kl_summed(stage: str) -> None:
    model = _model(**STAGES[stage])
    layers, handles = _capture(model)
    out = model(_ids(2))
    for h in handles:
        h.remove()
    assert len(layers) == model.config.num_layers + 1  # the MTP depth's layer too
    sparse = stage == "sparse_loss"
    if stage == "dense_warmup":
        assert all("indices" not in layer for layer in layers)  # dense attention: nothing selected
    else:  # a real selection: some query leaves out some earlier key
        assert all((layer["indices"] >= 0).sum() < 2 * 24 * 25 // 2 for layer in layers)
    expected = sum(_plain_kl(layer, sparse) for layer in layers)
    torch.testing.assert_close(out.indexer_loss, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("stage", ["dense_loss", "sparse_loss"])
def test_packed_documents_keep_the_kl_within_each_document(stage: str) -> None:
    """A row packing documents of 9 and 15 tokens: each layer's loss is the plain KL over keys of the query's own
    document (the packed rotary tables are the per-document ones)."""
    model = _model(**STAGES[stage])
    documents = torch.tensor([[0] * 9 + [1] * 15])
    layers, handles = _capture(model)
    out = model(_ids(3, b=1), document_ids_BS=documents)
    for h in handles:
        h.remove()
    expected = sum(_plain_kl(layer, stage == "sparse_loss", documents) for layer in layers)
    torch.testing.assert_close(out.indexer_loss, expected, rtol=1e-10, atol=1e-12)
    # and the other document matters: without the ids the loss differs
    assert not torch.allclose(model(_ids(3, b=1)).indexer_loss, out.indexer_loss)


def test_config_refuses_inconsistent_indexer_training_fields() -> None:
    with pytest.raises(ModelConfigError, match="dsa_indexer_loss_coeff"):
        preset("tiny-deepseek-v3", dsa_indexer_loss_coeff=0.1)  # no indexer to train
    with pytest.raises(ModelConfigError, match="dsa_indexer_loss_coeff"):
        preset("tiny-deepseek-v32", dsa_indexer_loss_coeff=-1.0)
    with pytest.raises(ModelConfigError, match="dsa_indexer_loss_coeff"):
        preset("tiny-deepseek-v32", dsa_indexer_use_sparse_loss=True)  # an option of a loss that is off
    with pytest.raises(ModelConfigError, match="dsa_indexer_loss_coeff"):
        preset("tiny-deepseek-v32", dsa_indexer_loss_coeff=0.0, dsa_indexer_dense_warmup=True)
    with pytest.raises(ModelConfigError, match="dsa_indexer_use_sparse_loss"):
        preset(
            "tiny-deepseek-v32",
            dsa_indexer_loss_coeff=0.1,
            dsa_indexer_use_sparse_loss=True,
            dsa_indexer_dense_warmup=True,
        )
    assert preset("tiny-deepseek-v32", dsa_indexer_loss_coeff=0.0).dsa_indexer_loss_coeff == 0.0  # off, as None


def test_pipeline_plan_refuses_the_indexer_loss() -> None:
    plan = build_model(preset("tiny-deepseek-v32", dsa_indexer_loss_coeff=0.1), seed=0).parallel_plan()
    assert "dsa_indexer_loss_coeff" in plan.pipeline.unsupported
    assert not build_model(preset("tiny-deepseek-v32"), seed=0).parallel_plan().pipeline.unsupported
