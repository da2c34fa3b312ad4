"""DeepSeek-V3.2's dense warm-up through the trainer (tiny-deepseek-v32, ``model.dsa_indexer_loss_coeff`` and
``model.dsa_indexer_dense_warmup``): the metrics carry ``indexer_loss`` and it falls over 20 steps, only the indexers'
parameters change (the rest frozen: no gradient, not in the optimizer), and the parallel layouts whose indexer loss is
not exact yet are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe_train.config import ConfigError, load_config
from moe_train.optim import build_optimizer
from moe_train.trainer import prepare, train

WARMUP = {
    "model.preset": "tiny-deepseek-v32",
    "model.dsa_indexer_loss_coeff": "1.0",
    "model.dsa_indexer_dense_warmup": "true",
    "model.moe_expert_backend": "loop",
    "model.mtp_num_layers": "null",
    "data.seq_len": "64",
    "train.global_batch_size": "4",
    # at the default init (std 0.02) attention is near uniform, and so is the untrained indexer: the KL starts at 1e-3;
    # std 0.1 gives the frozen attention a shape to learn (KL 0.5 at the start, measured 0.23 after 20 steps)
    "model.init_method_std": "0.1",
    "train.lr": "3e-3",
    "train.warmup_steps": "2",
    "run.log_interval": "100",
    "run.save_checkpoint": "false",
}


def test_dense_warmup_trains_the_indexers_alone_and_their_loss_falls(data_cache: Path, tmp_path: Path) -> None:
    cfg = load_config(
        "tiny", {**WARMUP, "train.steps": "20", "data.cache_dir": str(data_cache), "run.output_dir": str(tmp_path)}
    )
    setup = prepare(cfg, 1)
    before = {name: p.detach().clone() for name, p in setup.model.named_parameters()}
    biases = {name: b.clone() for name, b in setup.model.named_buffers() if name.endswith("expert_bias")}
    assert biases and cfg.model.moe_router_enable_expert_bias
    train(setup)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    indexer = [r["indexer_loss"] for r in records]
    # the routers' expert biases are the frozen model's too: not updated
    assert all(b.equal(biases[name]) for name, b in setup.model.named_buffers() if name in biases)
    assert len(indexer) == 20 and all(v > 0 for v in indexer), indexer
    assert sum(indexer[-5:]) / 5 < 0.7 * sum(indexer[:3]) / 3, indexer
    params = dict(setup.model.named_parameters())
    is_indexer = {name: ".indexer." in f".{name}" for name in params}
    assert sum(is_indexer.values()) == 5 * cfg.model.num_layers  # wq_b, wk, k_norm (weight, bias), weights_proj
    for name, param in params.items():
        assert param.requires_grad == is_indexer[name], name
        assert param.grad is None or is_indexer[name], name  # the frozen ones never got a gradient
        changed = not param.detach().equal(before[name])
        assert changed == is_indexer[name], name
    # the optimizer is built over the parameters that require a gradient: the indexers' alone
    optimizer = build_optimizer(setup.model, cfg.train)
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert held == {id(p) for name, p in params.items() if is_indexer[name]}


@pytest.mark.parametrize("split", ["tp", "cp", "pp"])
def test_layouts_without_an_exact_indexer_loss_are_refused(split: str) -> None:
    with pytest.raises(ConfigError, match=f"parallel.{split}=2: the DSA indexer loss"):
        load_config("tiny", {**WARMUP, f"parallel.{split}": "2"})
    load_config("tiny", {**WARMUP, "model.dsa_indexer_loss_coeff": "null", "model.dsa_indexer_dense_warmup": "false"})


def test_sparse_stage_trains_the_whole_model_with_the_indexer_loss(data_cache: Path, tmp_path: Path) -> None:
    """model.dsa_indexer_use_sparse_loss: sparse attention, nothing frozen, the sparse KL logged."""
    sparse = {**WARMUP, "model.dsa_indexer_dense_warmup": "false", "model.dsa_indexer_use_sparse_loss": "true"}
    cfg = load_config(
        "tiny", {**sparse, "train.steps": "3", "data.cache_dir": str(data_cache), "run.output_dir": str(tmp_path)}
    )
    setup = prepare(cfg, 1)
    before = {name: p.detach().clone() for name, p in setup.model.named_parameters()}
    train(setup)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 3 and all(r["indexer_loss"] > 0 for r in records), records
    for name, param in setup.model.named_parameters():
        assert param.requires_grad and not param.detach().equal(before[name]), name
