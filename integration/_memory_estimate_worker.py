"""One rank of test_memory_estimate.py: ``python _memory_estimate_worker.py OUT_DIR``.

Reads ``OUT_DIR/cases.json`` (a list of {"name", "preset", "overrides"}) and, for each case in this one process group,
builds the model as ``moe-train train`` does (``moe_train.trainer.prepare``: meta build, parallelize, materialize),
runs one forward + loss under :class:`moe_memory.measure.SavedTensorBytes`, the backward and one optimizer step, and
records what this rank allocated (parameter, gradient and optimizer-state storages) next to the memory estimate for
its layout. Saves ``OUT_DIR/rank{r}.pt``: {case name: results}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from moe_memory.estimate import estimate_memory
from moe_memory.measure import SavedTensorBytes
from moe_models import causal_lm_loss
from moe_models.memory import estimate_module, local_parameters, model_shape, run_shape
from moe_train.config import load_config
from moe_train.optim import build_optimizer
from moe_train.trainer import prepare


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if hasattr(tensor, "_local_tensor") else tensor


def _storage_bytes(tensors) -> int:
    seen: dict[int, int] = {}
    for tensor in tensors:
        storage = _local(tensor).untyped_storage()
        seen.setdefault(storage.data_ptr(), storage.nbytes())
    return sum(seen.values())


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """The storages the optimizer's state holds (counted here, not by the optimizer)."""
    return _storage_bytes(t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t))


def run_case(case: dict, world: int) -> dict:
    overrides = {
        "run.dtype": "fp32",
        "run.save_checkpoint": "false",
        "run.device": "cpu",
        "run.output_dir": "unused",
        **case["overrides"],
    }
    cfg = load_config(case["preset"], overrides)
    setup = prepare(cfg, world)
    model, layout = setup.model, setup.layout
    torch.manual_seed(1000 + dist.get_rank())  # each data-parallel rank its own tokens (as it would read)
    ids = torch.randint(0, cfg.model.vocab_size, (setup.micro_batch, cfg.data.seq_len))
    if layout.tp * layout.cp > 1:  # the ranks of one tensor- or context-parallel group read the same sequences
        dist.broadcast(ids, src=0)
    positions = setup.parallel.positions(cfg.data.seq_len)  # under cp: this rank's share of every sequence
    dense = {n for n, m in model.named_modules() if n.endswith("mlp") and not hasattr(m, "router")}
    with setup.parallel.loss_context():  # vocabulary-parallel logits under tp
        with SavedTensorBytes(model=model) as saved:
            out = model(ids, positions)
            loss = causal_lm_loss(out, ids.roll(-1, dims=1), cfg.model.mtp_loss_scaling_factor, positions)
        loss.total.backward()
    setup.parallel.finalize_grads()  # as the trainer does before its step: gradients completed over the layout
    optimizer = build_optimizer(model, cfg.train)
    optimizer.step()
    params = [p for p in model.parameters() if p.requires_grad]
    sizes = {"fp32": 4, "bf16": 2, "none": 0}
    param_bytes = sizes[cfg.train.params_dtype]
    run = run_shape(
        cfg.model,
        local_parameters(model),
        micro_batch=setup.micro_batch,
        seq_len=cfg.data.seq_len,
        activation_bytes=param_bytes,  # fp32 runs: no autocast; bf16 parameters compute in bf16
        param_bytes=param_bytes,
        grad_bytes=param_bytes,
        optimizer_state_bytes=sizes[cfg.train.optimizer_states_dtype],
        master_weights_bytes=sizes[cfg.train.master_weights_dtype],
        layout=layout,
        dispatcher=cfg.parallel.moe_token_dispatcher_type,
        device="cpu",
    )
    estimate = estimate_memory(model_shape(cfg.model), run)
    measured_by_module: dict[str, int] = {}
    for storage in saved.storages:
        module = estimate_module(storage.module, storage.module in dense)
        measured_by_module[module] = measured_by_module.get(module, 0) + storage.nbytes
    return {
        "layout": {k: getattr(layout, k) for k in ("tp", "cp", "ep", "etp", "edp", "dp")},
        "measured_activations": saved.total,
        "measured_by_module": measured_by_module,
        "estimated_activations": estimate.activation_bytes,
        "estimated_by_module": estimate.activations_by_module(),
        "allocated_params": _storage_bytes(params),
        "allocated_grads": _storage_bytes(p.grad for p in params),
        "allocated_optimizer": _state_bytes(optimizer),
        "estimated_params": estimate.parameters,
        "estimated_grads": estimate.gradients,
        "estimated_optimizer": estimate.optimizer_states + estimate.master_weights,
    }


def main(out_dir: Path) -> None:
    cases = json.loads((out_dir / "cases.json").read_text())
    world = int(__import__("os").environ["WORLD_SIZE"])
    results = {case["name"]: run_case(case, world) for case in cases}
    rank = dist.get_rank()
    dist.barrier()
    dist.destroy_process_group()
    torch.save(results, out_dir / f"rank{rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
