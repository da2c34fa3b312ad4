"""The per-rank memory estimate (``moe_memory.estimate``) against what a training step really holds: one harness for
benchmarks/memory_estimate.py and integration/test_memory_estimate.py (its worker, which puts this folder on its path).

:func:`measured_step` runs a forward + loss under :class:`moe_memory.measure.SavedTensorBytes`, then the backward;
:func:`compare` puts an estimate beside it: the activations in total and by the estimate's modules (the dispatcher's
dispatch and combine as one, as they are measured), and the parameter, gradient and optimizer-state storages the
step allocated. :func:`training_step` does both for one rank built as ``moe-train train`` builds it (``prepare``:
meta build, parallelize, materialize) under its layout, with moe-train's AdamW.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from moe_memory.estimate import MemoryEstimate, estimate_memory
from moe_memory.measure import SavedTensorBytes
from moe_models import MoETransformer, next_token_loss
from moe_models.linear_attention import GatedDeltaNet
from moe_models.memory import estimate_module, local_parameters, model_shape, run_shape
from moe_parallel import hidden_matrix_splits
from moe_train.config import load_config
from moe_train.muon import muon_parameters
from moe_train.optim import build_optimizer
from moe_train.trainer import prepare

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "none": 0}


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages of ``tensors`` (a DTensor's: its local shard's)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        local = tensor._local_tensor if hasattr(tensor, "_local_tensor") else tensor
        seen.setdefault(local.untyped_storage().data_ptr(), local.untyped_storage().nbytes())
    return sum(seen.values())


def forward_logits(
    model: torch.nn.Module, ids: torch.Tensor, positions: torch.Tensor | None = None
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The logits and the MTP depths' logits of ``ids`` through ``model``: a whole model (``model(ids, positions)``
    gives a ``ModelOutput``) or the one stage a run without pipeline parallelism trains (``setup.model[0]``)."""
    if isinstance(model, MoETransformer):
        out = model(ids, positions)
        return out.logits, list(out.mtp_logits)
    local = ids if positions is None else ids[:, positions]
    kwargs = {} if positions is None else {"positions_BS": positions.expand(ids.shape[0], -1)}
    out = model(local, input_ids_BS=ids, **kwargs)
    logits, *mtp = out if isinstance(out, tuple) else (out,)
    return logits, mtp


def measured_step(
    model: torch.nn.Module,
    ids: torch.Tensor,
    mtp_loss_scaling_factor: float,
    positions: torch.Tensor | None = None,
    loss_context: contextlib.AbstractContextManager | None = None,
) -> SavedTensorBytes:
    """Forward + LM loss of ``ids`` (next tokens: ``ids`` rolled) under ``SavedTensorBytes``, then the backward, both
    inside ``loss_context`` (vocabulary-parallel logits under tp). ``model``: as :func:`forward_logits` takes it."""
    with loss_context or contextlib.nullcontext():
        with SavedTensorBytes(model=model) as saved:
            logits, mtp = forward_logits(model, ids, positions)
            loss = next_token_loss(logits, mtp, ids.roll(-1, dims=1), mtp_loss_scaling_factor, positions)
        loss.total.backward()
    return saved


def compare(
    estimate: MemoryEstimate,
    saved: SavedTensorBytes,
    model: torch.nn.Module,
    params: list[torch.Tensor],
    optimizer: torch.optim.Optimizer,
) -> dict:
    """The estimate against the measurement (``saved``) and what the step allocated (``params``, their ``.grad``,
    the optimizer's state)."""
    by_estimate = dict(estimate.activations_by_module())
    by_estimate["dispatch"] = by_estimate.get("dispatch", 0) + by_estimate.pop("combine", 0)  # one module measured
    dense = {n for n, m in model.named_modules() if n.endswith("mlp") and not hasattr(m, "router")}
    linear = {n for n, m in model.named_modules() if isinstance(m, GatedDeltaNet)}
    by_measured: dict[str, int] = {}
    for storage in saved.storages:
        module = estimate_module(storage.module, storage.module in dense, storage.module in linear)
        by_measured[module] = by_measured.get(module, 0) + storage.nbytes
    states = storage_bytes(t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t))
    return {
        "estimated_activation_bytes": estimate.activation_bytes,
        "measured_activation_bytes": saved.total,
        "activation_rel_error": (estimate.activation_bytes - saved.total) / saved.total,
        "estimated_by_module": by_estimate,
        "measured_by_module": by_measured,
        "params": {"estimated": estimate.parameters, "allocated": storage_bytes(params)},
        "grads": {"estimated": estimate.gradients, "allocated": storage_bytes(p.grad for p in params)},
        "optimizer": {"estimated": estimate.optimizer_states + estimate.master_weights, "allocated": states},
    }


def training_step(preset: str, overrides: dict[str, str], world: int) -> dict:
    """One rank of ``world`` (its process group started by ``prepare``): the model of ``preset`` with moe-train's
    ``overrides``, fp32 on the CPU unless they say otherwise, one forward + loss + backward and an optimizer step;
    :func:`compare`'s record and the layout's sizes. Each data-parallel rank reads its own tokens, the ranks of a
    tensor- or context-parallel group the same."""
    settings = {"run.dtype": "fp32", "run.save_checkpoint": "false", "run.device": "cpu", **overrides}
    cfg = load_config(preset, settings)
    setup = prepare(cfg, world)
    (model,), layout = setup.model, setup.layout  # without pipeline parallelism: one stage, the whole model
    torch.manual_seed(1000 + dist.get_rank())
    ids = torch.randint(0, cfg.model.vocab_size, (setup.micro_batch, cfg.data.seq_len))
    if layout.tp * layout.cp > 1:
        dist.broadcast(ids, src=0)
    positions = setup.parallel.positions(cfg.data.seq_len)  # under cp: this rank's share of every sequence
    saved = measured_step(model, ids, cfg.model.mtp_loss_scaling_factor, positions, setup.parallel.loss_context())
    setup.parallel.finalize_grads()  # as the trainer does before its step: gradients completed over the layout
    optimizer = build_optimizer(model, cfg.train, hidden_matrix_splits(setup.parallel))
    optimizer.step()
    param_bytes = DTYPE_BYTES[cfg.train.params_dtype]  # fp32 runs: no autocast; bf16 parameters compute in bf16
    params = local_parameters(model)
    if cfg.train.optimizer == "muon":  # Muon's matrices keep one momentum buffer each, no AdamW moments or step
        muon = [p for p in model.parameters() if id(p) in muon_parameters(model)]
        momentum = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in muon)
        params = dataclasses.replace(params, momentum_only_numel=momentum, momentum_only_tensors=len(muon))
    run = run_shape(
        cfg.model,
        params,
        micro_batch=setup.micro_batch,
        seq_len=cfg.data.seq_len,
        activation_bytes=param_bytes,
        param_bytes=param_bytes,
        grad_bytes=param_bytes,
        optimizer_state_bytes=DTYPE_BYTES[cfg.train.optimizer_states_dtype],
        master_weights_bytes=DTYPE_BYTES[cfg.train.master_weights_dtype],
        layout=layout,
        dispatcher=cfg.parallel.moe_token_dispatcher_type,
        device="cpu",
    )
    estimate = estimate_memory(
        model_shape(cfg.model),
        run,
        recompute=frozenset(cfg.run.recompute_modules),
        offload=frozenset(cfg.run.offload_modules),
        offload_min_tensor_bytes=cfg.run.offload_min_tensor_bytes,
    )
    params = [p for p in model.parameters() if p.requires_grad]
    layout_sizes = {k: getattr(layout, k) for k in ("tp", "cp", "ep", "etp", "edp", "dp")}
    return {"layout": layout_sizes, **compare(estimate, saved, model, params, optimizer)}
