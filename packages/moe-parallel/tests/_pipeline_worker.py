"""One rank of test_pipeline_dist.py (4 gloo ranks): ``python _pipeline_worker.py OUT_DIR``.

A training step's forward and backward through :meth:`StagedModel.forward_backward` against the same model (same
seed) whole in this process alone, run micro-batch by micro-batch with the gradients summed (what
``forward_backward`` documents: accumulated, not divided by the micro-batch count; the trainer divides afterwards):

- 1F1B over pp=4 ranks (one decoder layer a stage, middle stages that neither embed nor compute the loss);
- 1F1B over pp=2 x tp=2;
- ZBVZeroBubble over pp=2 x tp=2: two stages a rank, V-shaped (rank 0 holds the first and the last), backwards split
  into input and weight parts;
- ZBVZeroBubble and DualPipeV over pp=2 x dp_shard=2: the same split backwards of stages that are FSDP units (each
  layer and each layer's experts a unit inside), two FSDP roots a rank;
- ZBVZeroBubble over pp=2 x tp=2 with etp=1: no attention data parallelism, the experts FSDP units on edp=2 inside
  stages that are not.

After the step (the gradients reduced) and after an evaluation forward every FSDP unit holds its sharded parameters
again, the ones an optimizer updates: the rank records whether the stages' parameters are the objects they held
before the step.

Under tp the last stage's logits are vocabulary-parallel: the loss runs under ``staged.loss_context()``, as the
trainer runs it. The stages are built as moe-train builds them (the model on the meta device, ``parallelize_stages``,
then ``materialize`` from ``initial_weights(seed)``); the reference is ``build_model(config, seed=seed)``. Each
scenario records each micro-batch's loss on the last stage's ranks and every gradient the rank holds, gathered
whole (a routed expert under etp: the rank's slice), beside the reference's; the test module asserts.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from _rank_scenarios import Scenarios
from moe_experts import GroupedExperts
from moe_models import build_model
from moe_models.presets import preset
from moe_parallel import (
    ParallelConfig,
    build_meshes,
    check_plan,
    full_value,
    init_distributed,
    parallelize_stages,
)

# 4 decoder layers (every one MoE, 4 experts, top-2), hidden 64: one a stage at pp=4 and under ZBV at pp=2
CONFIG = preset(
    "tiny-qwen3-moe",
    num_layers=4,
    hidden_size=64,
    kv_channels=16,
    ffn_hidden_size=128,
    moe_ffn_hidden_size=32,
    num_moe_experts=4,
)
SEED = 3
SEQ = 16
ROWS_PER_MICRO = 2
SCENARIOS: dict[str, tuple[dict, int]] = {  # name -> (ParallelConfig fields, micro-batches)
    "1F1B pp=4": ({"pp": 4}, 4),
    "1F1B pp=2 x tp=2": ({"pp": 2, "tp": 2}, 2),
    "ZBVZeroBubble pp=2 x tp=2": ({"pp": 2, "tp": 2, "pp_schedule": "ZBVZeroBubble"}, 4),
    "ZBVZeroBubble pp=2 x dp_shard=2": ({"pp": 2, "pp_schedule": "ZBVZeroBubble"}, 4),
    "DualPipeV pp=2 x dp_shard=2": ({"pp": 2, "pp_schedule": "DualPipeV"}, 4),
    "ZBVZeroBubble pp=2 x tp=2 x etp=1": ({"pp": 2, "tp": 2, "etp": 1, "pp_schedule": "ZBVZeroBubble"}, 4),
}


class RecordingLoss:
    """Next-token cross-entropy of the last stage's logits (vocabulary-parallel under tp: a DTensor, which
    ``F.cross_entropy`` takes only under ``loss_parallel``), each call's value kept whole."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def __call__(self, logits_BSV: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(logits_BSV.float().flatten(0, 1), labels_BS.flatten())
        self.values.append(full_value(loss).item())
        return loss


def batch(microbatches: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's rows (the same on every rank) and their next-token labels."""
    ids_BS = torch.randint(
        0, CONFIG.vocab_size, (microbatches * ROWS_PER_MICRO, SEQ + 1), generator=torch.Generator().manual_seed(5)
    )
    return ids_BS[:, :-1].contiguous(), ids_BS[:, 1:].contiguous()


def reference_step(microbatches: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process: the whole model on each micro-batch (the same row slices the schedule cuts), the gradients
    summed over them; each parameter's gradient and each micro-batch's loss."""
    model = build_model(CONFIG, seed=SEED)
    loss_fn = RecordingLoss()
    ids_BS, labels_BS = batch(microbatches)
    for ids_micro_BS, labels_micro_BS in zip(ids_BS.chunk(microbatches), labels_BS.chunk(microbatches), strict=True):
        loss_fn(model(ids_micro_BS).logits, labels_micro_BS).backward()
    return {n: p.grad for n, p in model.named_parameters()}, loss_fn.values


def _same_part(model: nn.Module, name: str, whole: torch.Tensor, got: torch.Tensor | None) -> torch.Tensor:
    """The part of the reference's ``whole`` gradient that parameter ``name`` of ``model`` holds gathered (``got``):
    all of it (expert-parallel experts are DTensors over ep), except for routed experts split over etp (plain
    per-rank tensors), whose slice of each expert this rank holds."""
    path, _, attr = name.rpartition(".")
    module = model.get_submodule(path)
    if not isinstance(module, GroupedExperts) or (got is not None and got.shape == whole.shape):
        return whole
    first = module.first_expert
    return torch.stack([module.local_slice(attr, whole[first + e]) for e in range(module.num_experts)])


def pipelined_step(sizes: dict, microbatches: int, world: int) -> dict:
    """``forward_backward`` of the step's micro-batches under ``sizes``' layout, then ``finalize_grads`` (tp's
    partial gradients summed); every gradient this rank holds, gathered whole, beside the reference's."""
    cfg = ParallelConfig(**sizes)
    meshes = build_meshes(cfg.layout(world), "cpu")
    with torch.device("meta"):
        model = build_model(CONFIG)
    plan = model.parallel_plan(SEQ)
    check_plan(model, plan, cfg, meshes.layout)
    staged = parallelize_stages(model, meshes, cfg, plan)
    staged.materialize(model.initial_weights(SEED), "cpu")
    loss_fn = RecordingLoss()
    ids_BS, labels_BS = batch(microbatches)
    registered = [id(p) for p in staged.model.parameters()]  # the sharded parameters an optimizer would hold
    with staged.loss_context():  # as moe-train's step runs it: the last stage's loss and its backward
        staged.forward_backward(ids_BS, labels_BS, microbatches, loss_fn, torch.float32)
    staged.finalize_grads()
    resharded_after_step = [id(p) for p in staged.model.parameters()] == registered
    want, want_losses = reference_step(microbatches)
    grads = {}
    # the same order on every rank of a stage: the gathers of its sharded gradients line up
    for name, param in staged.model.named_parameters():
        got = None if param.grad is None else full_value(param.grad).detach().clone()
        grads[staged.global_name(name)] = (got, _same_part(staged.model, name, want[staged.global_name(name)], got))
    staged.forward(ids_BS[:ROWS_PER_MICRO], torch.float32)
    resharded_after_forward = [id(p) for p in staged.model.parameters()] == registered
    return {
        "resharded": (resharded_after_step, resharded_after_forward),
        "stages": staged.stage_indices,
        "is_last": staged.is_last,
        "losses": loss_fn.values,
        "ref_losses": want_losses,
        "grads": grads,
        "all_params": sorted(want),
    }


def main(out_dir: Path) -> None:
    ctx = init_distributed("gloo", "cpu")
    scenarios = Scenarios(out_dir)
    for name, (sizes, microbatches) in SCENARIOS.items():
        scenarios.run(name, pipelined_step, sizes, microbatches, ctx.world_size)
    scenarios.finish()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
