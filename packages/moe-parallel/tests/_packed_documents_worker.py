"""One rank of test_packed_documents.py (2 gloo ranks): ``python _packed_documents_worker.py OUT_DIR``.

Packed rows of documents (a padding tail included) through moe_models' model split over the two ranks, against the
same model in this process alone on the whole rows: under context parallelism (cp=2: each rank computes its
load-balanced positions, its attention handed every rank's keys and values, the documents' ids those of the whole
rows) and under tensor + sequence parallelism (tp=2: attention split by heads over the whole sequence, MoE blocks
routing their sequence chunk with the ids of its tokens), and over two pipeline stages (pp=2: the documents' ids
a keyword every stage takes, cut into micro-batches by the schedule). Each (family, layout) is a scenario of its own
(``_rank_scenarios.py``) recording the largest relative errors; the test module asserts.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from _rank_scenarios import Scenarios
from moe_models import build_model, preset
from moe_parallel import ParallelConfig, build_meshes, full_value, init_distributed, parallelize

# + GLM-4.5's partial rotary, OLMoE's q/k norms across heads (whose mean square tp all-reduces) and clamps, and Llama
# 4's chunks (restarting at each document), NoPE layers and probabilities on the experts' input
FAMILIES = ("tiny-qwen3-moe", "tiny-gpt-oss", "tiny-deepseek-v3", "tiny-glm4-moe", "tiny-olmoe", "tiny-llama4")
LAYOUTS = {"cp=2": {"cp": 2}, "tp=2": {"tp": 2}, "pp=2": {"pp": 2}}
SEQ = 64
# documents cross the cp chunks (16 positions each) and the tp halves; GPT-OSS's first layer slides a 32-token window
# over the 40-token document
PACKING = [[40, 17], [12, 30, 22]]


def documents() -> torch.Tensor:
    rows = []
    for lengths in PACKING:
        row = [doc for doc, length in enumerate(lengths) for _ in range(length)]
        rows.append(row + [-1] * (SEQ - len(row)))
    return torch.tensor(rows)


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


def packed_forward(family: str, layout: str, world: int) -> dict:
    """The split model's logits (and MTP logits) at this rank's positions against one process's, and a backward
    through the split model (its gradients finite)."""
    config = preset(family)
    cfg = ParallelConfig(**LAYOUTS[layout])
    meshes = build_meshes(cfg.layout(world), "cpu")
    docs_BS = documents()
    ids_BS = torch.randint(0, config.vocab_size, docs_BS.shape, generator=torch.Generator().manual_seed(4))
    reference = build_model(config, seed=3)
    with torch.no_grad():
        want = reference(ids_BS, document_ids_BS=docs_BS)
        unmasked = reference(ids_BS)

    model = build_model(config, seed=3)
    parallel = parallelize(model, meshes, cfg)
    if layout == "pp=2":
        return _pipelined(parallel, reference, ids_BS, docs_BS, want, unmasked)
    positions = parallel.positions(SEQ)
    at = slice(None) if positions is None else positions
    out = model(ids_BS, positions, document_ids_BS=docs_BS)
    logits = full_value(out.logits)  # tp: the vocabulary-parallel logits gathered
    result = {
        "positions": None if positions is None else positions.tolist(),
        "logits": _relative(logits.detach(), want.logits[:, at]),
        "unmasked": _relative(unmasked.logits[:, at], want.logits[:, at]),
        "mtp": [
            _relative(full_value(m).detach(), w[:, at]) for m, w in zip(out.mtp_logits, want.mtp_logits, strict=True)
        ],
    }
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(5))
    (weights * logits).sum().backward()
    parallel.finalize_grads()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    result["grads_finite"] = all(bool(torch.isfinite(full_value(g)).all()) for g in grads) and len(grads) > 0
    return result


def _pipelined(parallel, reference, ids_BS: torch.Tensor, docs_BS: torch.Tensor, want, unmasked) -> dict:
    """The last stage's logits of one forward through both stages, and a training step's forward and backward in two
    micro-batches (the schedule cuts the documents' ids with the rows): every parameter's gradient against one
    process's accumulated over the same micro-batches."""
    out = parallel.forward(ids_BS, torch.float32, document_ids_BS=docs_BS)
    result: dict = {"positions": None, "last": out is not None}
    if out is not None:  # the last stage's rank
        logits, *mtp = out if isinstance(out, tuple) else (out,)
        result["logits"] = _relative(logits, want.logits)
        result["unmasked"] = _relative(unmasked.logits, want.logits)
        result["mtp"] = [_relative(m, w) for m, w in zip(mtp, want.mtp_logits, strict=True)]

    def loss_fn(output, labels_BS: torch.Tensor) -> torch.Tensor:  # the MTP depths' logits too: every weight learns
        outputs = output if isinstance(output, tuple) else (output,)
        return sum(torch.nn.functional.cross_entropy(o.flatten(0, 1), labels_BS.flatten()) for o in outputs)

    labels_BS = torch.roll(ids_BS, -1, 1)
    parallel.forward_backward(ids_BS, labels_BS, 2, loss_fn, torch.float32, document_ids_BS=docs_BS)
    parallel.finalize_grads()
    for row in range(ids_BS.shape[0]):  # one process, micro-batch by micro-batch
        out = reference(ids_BS[row : row + 1], document_ids_BS=docs_BS[row : row + 1])
        loss_fn((out.logits, *out.mtp_logits), labels_BS[row : row + 1]).backward()
    expected = dict(reference.named_parameters())
    errors = {}
    for name, param in parallel.model.named_parameters():
        want_grad = expected[parallel.global_name(name)].grad
        errors[parallel.global_name(name)] = _relative(full_value(param.grad), want_grad)
    result["grads"] = errors
    return result


def main(out_dir: Path) -> None:
    ctx = init_distributed("gloo", "cpu")
    scenarios = Scenarios(out_dir)
    for family in FAMILIES:
        for layout in LAYOUTS:
            scenarios.run(f"{family} {layout}", packed_forward, family, layout, ctx.world_size)
    scenarios.finish()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
