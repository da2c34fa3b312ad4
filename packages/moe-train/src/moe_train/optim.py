"""The optimizer ``train.optimizer`` names: AdamW with decoupled weight decay on matrices only, low-precision states
and master weights as the config says (:class:`moe_train.adamw.PrecisionAwareAdamW`), or Muon with AdamW for the rest
(:class:`moe_train.muon.MuonWithAdamW`); and a linear-warmup + cosine schedule."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from moe_parallel import HiddenSplit
from moe_train.adamw import PrecisionAwareAdamW
from moe_train.config import TrainConfig
from moe_train.dtypes import torch_dtype
from moe_train.muon import MuonWithAdamW, muon_param_groups


def build_optimizer(
    model: nn.Module, cfg: TrainConfig, hidden_splits: dict[int, HiddenSplit] | None = None
) -> PrecisionAwareAdamW | MuonWithAdamW:
    """The optimizer ``train.optimizer`` names over ``model``'s trainable parameters: AdamW (below) or Muon with
    AdamW for the parameters Muon does not take (:func:`build_muon`; ``hidden_splits``: the layout's
    :func:`moe_parallel.hidden_matrix_splits`)."""
    if cfg.optimizer == "muon":
        return build_muon(model, cfg, hidden_splits)
    return build_adamw(model, cfg)


def build_muon(
    model: nn.Module, cfg: TrainConfig, hidden_splits: dict[int, HiddenSplit] | None = None
) -> MuonWithAdamW:
    """:class:`moe_train.muon.MuonWithAdamW` with ``cfg``'s Muon and AdamW hyperparameters, one lr for both; each
    matrix orthogonalised whole however the layout splits it (DTensor placements, and ``hidden_splits``)."""
    muon = {
        "momentum": cfg.muon_momentum,
        "nesterov": cfg.muon_use_nesterov,
        "ns_steps": cfg.muon_num_ns_steps,
        "ns_coefficients": tuple(cfg.muon_ns_coefficients),
        "adjust_lr": cfg.muon_adjust_lr_fn,
        "ns_dtype": None if cfg.muon_ns_dtype == "auto" else torch_dtype(cfg.muon_ns_dtype),
        "weight_decay": cfg.weight_decay,
    }
    adamw = {"betas": (cfg.adam_beta1, cfg.adam_beta2), "eps": cfg.adam_eps, "weight_decay": cfg.weight_decay}
    return MuonWithAdamW(
        muon_param_groups(model, muon, adamw),
        lr=cfg.lr,
        states_dtype=torch_dtype(cfg.optimizer_states_dtype),
        master_weights=cfg.master_weights_dtype == "fp32",
        hidden_splits=hidden_splits,
    )


def build_adamw(model: nn.Module, cfg: TrainConfig) -> PrecisionAwareAdamW:
    """AdamW over ``model``'s trainable parameters with ``cfg``'s hyperparameters, its states in
    ``train.optimizer_states_dtype`` and fp32 master copies of parameters that are not fp32 unless
    ``train.master_weights_dtype`` is none. With all-fp32 settings its updates are torch.optim.AdamW's, bitwise."""
    groups: dict[tuple[bool, bool], list[nn.Parameter]] = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            # norms, biases and other vectors are not decayed, as in Megatron and torchtitan (grouped experts' biases
            # are 2-D only because they stack one vector per expert). Sharded (DTensor) and plain parameters go to
            # separate groups: the foreach kernels refuse a list that mixes them
            leaf = name.rsplit(".", 1)[-1]
            decay = param.ndim >= 2 and not (leaf.startswith("b_") or leaf == "bias")
            groups.setdefault((decay, isinstance(param, DTensor)), []).append(param)
    groups = [
        {"params": params, "weight_decay": cfg.weight_decay if decay else 0.0}
        for (decay, _), params in sorted(groups.items(), key=lambda item: (not item[0][0], item[0][1]))
    ]
    return PrecisionAwareAdamW(
        groups,
        lr=cfg.lr,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_eps,
        states_dtype=torch_dtype(cfg.optimizer_states_dtype),
        master_weights=cfg.master_weights_dtype == "fp32",
    )


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup to ``lr`` over
    ``warmup_steps`` (at most ``steps``), then cosine decay to ``min_lr`` at the last step."""
    warmup = min(cfg.warmup_steps, cfg.steps)
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    decay_steps = max(cfg.steps - warmup - 1, 1)
    progress = min((step - warmup) / decay_steps, 1.0)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
