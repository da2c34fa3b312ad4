"""Checkpoints in torch.distributed.checkpoint (DCP) format: sharding-aware, no pickled modules.

The optimizer's state goes in whole: for :class:`~moe_train.adamw.PrecisionAwareAdamW` ``exp_avg`` and
``exp_avg_sq`` in their own dtype (bf16 or fp32), ``step``, and the fp32 ``master`` copies of bf16 parameters, each
sharded like its parameter. ``get_optimizer_state_dict`` initialises an optimizer without state by a ``step()`` with
zero gradients and ``lr`` 0 (which counts a step); an optimizer that has ``init_state`` (ours) is initialised with it
instead, so loading never runs an update and the loaded values replace zeros of the right dtypes and shapes.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)


def save_checkpoint(directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> Path:
    """Write ``directory/step_<step>``; it appears only once complete (written aside, then renamed)."""
    final = directory / f"step_{step}"
    staging = directory / f".step_{step}.partial"
    is_main = not dist.is_initialized() or dist.get_rank() == 0
    if is_main:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    if dist.is_initialized():
        dist.barrier()
    _init_state(optimizer)  # an optimizer that never stepped: its zero state, not DCP's zero-gradient step
    model_state, optim_state = get_state_dict(model, optimizer)
    with warnings.catch_warnings():
        # single-process saves are intended; DCP warns that no process group is initialised
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": model_state, "optim": optim_state, "step": torch.tensor(step)}, checkpoint_id=staging)
    if dist.is_initialized():
        dist.barrier()
    if is_main:
        shutil.rmtree(final, ignore_errors=True)
        staging.rename(final)
    return final


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Load a checkpoint written by :func:`save_checkpoint` into ``model`` (and ``optimizer``); returns its step."""
    state: dict = {"model": get_model_state_dict(model), "step": torch.tensor(0)}
    if optimizer is not None:
        _init_state(optimizer)
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optim"])
    return int(state["step"])


def _init_state(optimizer: torch.optim.Optimizer) -> None:
    """Allocate the optimizer's state without an update where it can (module docstring)."""
    init_state = getattr(optimizer, "init_state", None)
    if not optimizer.state and callable(init_state):
        init_state()
