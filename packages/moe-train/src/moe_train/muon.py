"""Muon for the matrices of a MoE model, AdamW for the rest, in one optimizer (one process or plain data parallelism).

:class:`MuonWithAdamW` is one ``torch.optim.Optimizer`` whose param groups carry a ``rule``:

- ``"muon"``: torch.optim.Muon's update (momentum as an EMA, optional Nesterov, Newton-Schulz orthogonalisation in
  bf16 with torch's quintic coefficients, decoupled weight decay ``p *= 1 - lr * wd``, the lr adjusted by the matrix
  shape: ``original`` = sqrt(max(1, A / B)), ``match_rms_adamw`` = 0.2 * sqrt(max(A, B)), Moonlight's RMS matching).
  A grouped-experts weight ``[E, K, M]`` is E matrices: each expert's ``[K, M]`` slice is orthogonalised on its own
  (the E slices in one batched matmul) and its lr adjusted by ``(K, M)``. For ``w_gate_up_EH2F`` an expert's whole
  ``[H, 2F]`` slice (gate and up columns together) is one matrix, as the fused parameter is, not gate and up apart.
- ``"adamw"``: torch.optim.AdamW's update (torch's own functional ``adam`` with decoupled weight decay), fp32 states.

Parameters may be DTensors (plain data parallelism, ``dp_replicate`` with ``dp_shard`` 1: dense matrices replicated,
routed experts split along the expert dimension over the expert-data-parallel ranks): the update runs on the local
tensors, which hold whole matrices (AdamW is elementwise, so any split suits it). A Muon matrix whose local piece is cut
(FSDP over dp_shard > 1, TP) is refused by :func:`moe_train.optim.build_muon`: each shard would be orthogonalised on
its own, which trains, just worse.

State per parameter: ``momentum_buffer`` (Muon, shaped like the parameter); ``step``, ``exp_avg``, ``exp_avg_sq``
(AdamW), so DCP checkpoints save and load them like the AdamW optimizer's. :func:`muon_param_groups` decides which
parameter takes which rule; :func:`grouping_message` is the line the trainer prints at start-up.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam as torch_adam

RULES = ("muon", "adamw")
ADJUST_LR = ("original", "match_rms_adamw")
# Keller Jordan's quintic coefficients, torch.optim.Muon's defaults
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7

# parameters that stay with AdamW although they are matrices, by name: the Muon papers and Megatron keep embeddings,
# the output head, the router and MTP's embedding/hidden projection out of Muon
ADAMW_NAME_PARTS = ("embed", "lm_head", "output_layer", "router", "eh_proj", "expert_bias")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``tensor`` (a DTensor's local tensor, which in-place updates write through), or itself."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def splits_matrices(param: torch.Tensor) -> bool:
    """Whether ``param`` is a DTensor whose local piece cuts its matrices (the last two dimensions): FSDP over
    dp_shard > 1, TP. Grouped experts split along the expert dimension only (plain data parallelism shards them over
    the expert-data-parallel ranks that way) keep each expert's matrix whole on one rank, so Muon on the local piece
    is Muon on the whole."""
    return isinstance(param, DTensor) and param._local_tensor.shape[-2:] != param.shape[-2:]


def uses_muon(name: str, param: torch.Tensor, module: nn.Module | None) -> bool:
    """Whether parameter ``name`` (of ``module``) is updated by Muon: a 2-D hidden weight (attention, dense MLP,
    shared experts) or a 3-D grouped-experts weight; not a vector (nor a ``[H, 1]`` gate), a bias, an embedding, the
    head, a router weight, the expert bias or an MTP projection."""
    leaf = name.rsplit(".", 1)[-1]
    if param.ndim not in (2, 3) or leaf.startswith("b_") or leaf == "bias":
        return False
    if min(param.shape[-2:]) == 1:  # a vector stored as a matrix (the shared-expert gate w_gate_H1)
        return False
    if isinstance(module, nn.Embedding):
        return False
    return not any(part in name for part in ADAMW_NAME_PARTS)


def muon_param_groups(model: nn.Module, muon: dict[str, Any], adamw: dict[str, Any]) -> list[dict[str, Any]]:
    """The trainable parameters of ``model`` as param groups: Muon's matrices with ``muon`` hyperparameters, then
    AdamW's decayed matrices and its undecayed vectors with ``adamw`` ones (weight decay 0 on norms, biases and other
    vectors, as :func:`moe_train.optim.build_optimizer` does). Empty groups are left out."""
    owner = {}
    for module_name, module in model.named_modules():
        for leaf, _ in module.named_parameters(recurse=False):
            owner[f"{module_name}.{leaf}" if module_name else leaf] = module
    muon_params, decay, no_decay = [], [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        leaf = name.rsplit(".", 1)[-1]
        if uses_muon(name, param, owner.get(name)):
            muon_params.append(param)
        elif param.ndim >= 2 and not (leaf.startswith("b_") or leaf == "bias"):
            decay.append(param)
        else:
            no_decay.append(param)
    groups = [
        {"params": muon_params, "rule": "muon", **muon},
        {"params": decay, "rule": "adamw", **adamw},
        {"params": no_decay, "rule": "adamw", **{**adamw, "weight_decay": 0.0}},
    ]
    return [g for g in groups if g["params"]]


def grouping_message(optimizer: torch.optim.Optimizer) -> str:
    """One line: how many tensors and parameters each rule updates (printed at start-up)."""
    tensors: dict[str, int] = {}
    numels: dict[str, int] = {}
    for group in optimizer.param_groups:
        rule = group.get("rule", "adamw")
        tensors[rule] = tensors.get(rule, 0) + len(group["params"])
        numels[rule] = numels.get(rule, 0) + sum(p.numel() for p in group["params"])
    return "optimizer " + ", ".join(f"{r} {tensors[r]} tensors / {numels[r] / 1e6:.3f}M params" for r in tensors)


def newton_schulz(
    update: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float
) -> torch.Tensor:
    """The orthogonalised ``update`` (``[K, M]`` or a batch ``[E, K, M]``, each matrix on its own), in bf16:
    torch.optim.Muon's iteration, the 2-D case with its very operations (so the result is bitwise torch's)."""
    a, b, c = coefficients
    x = update.to(dtype=torch.bfloat16, copy=True)
    tall = update.size(-2) > update.size(-1)
    if tall:
        x = x.mT
    if x.ndim == 2:
        x.div_(x.norm().clamp(min=eps))
        for _ in range(steps):
            gram = x @ x.T
            gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.addmm(x, gram_update, x, beta=a)
    else:
        x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
        for _ in range(steps):
            gram = x @ x.mT
            gram_update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.baddbmm(x, gram_update, x, beta=a)
    return x.mT if tall else x


def adjusted_lr(lr: float, adjust_lr: str, rows: int, cols: int) -> float:
    """torch.optim.Muon's lr adjustment for a ``[rows, cols]`` matrix."""
    if adjust_lr == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr * math.sqrt(max(1, rows / cols))


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon for the groups whose ``rule`` is ``"muon"`` and AdamW for those whose rule is ``"adamw"`` (module
    docstring). Defaults are torch.optim.Muon's and torch.optim.AdamW's; ``lr`` may be changed per group between
    steps (the schedule sets one lr for every group)."""

    def __init__(
        self,
        params: Iterable[dict[str, Any]],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        *,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        ns_steps: int = 5,
        ns_eps: float = NS_EPS,
        adjust_lr: str = "original",
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
    ) -> None:
        if adjust_lr not in ADJUST_LR:
            raise ValueError(f"adjust_lr={adjust_lr!r}: choose {' or '.join(ADJUST_LR)}")
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "rule": "muon",
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": tuple(ns_coefficients),
            "ns_steps": ns_steps,
            "ns_eps": ns_eps,
            "adjust_lr": adjust_lr,
            "betas": tuple(betas),
            "eps": eps,
        }
        super().__init__(params, defaults)
        for group in self.param_groups:
            if group["rule"] not in RULES:
                raise ValueError(f"param group rule={group['rule']!r}: choose {' or '.join(RULES)}")
            if group["rule"] == "muon" and any(p.ndim not in (2, 3) for p in group["params"]):
                raise ValueError("Muon updates matrices [K, M] and grouped experts [E, K, M] only")

    def _init_param_state(self, param: torch.Tensor, rule: str) -> dict[str, torch.Tensor]:
        state = self.state[param]
        if rule == "muon":
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            return state
        if "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32)
        for key in ("exp_avg", "exp_avg_sq"):
            if key not in state:
                state[key] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def init_state(self) -> None:
        """Every parameter's state as zeros (what a checkpoint is loaded into), without an update."""
        for group in self.param_groups:
            for param in group["params"]:
                self._init_param_state(param, group["rule"])

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if any(p.grad.is_sparse for p in params):
                raise RuntimeError("MuonWithAdamW does not support sparse gradients")
            if group["rule"] == "muon":
                for param in params:
                    self._muon_update(param, group)
            elif params:
                self._adamw_update(params, group)
        return loss

    def _muon_update(self, param: torch.Tensor, group: dict[str, Any]) -> None:
        """torch.optim.Muon's ``_single_tensor_muon`` for one matrix or one grouped-experts weight."""
        lr = group["lr"].item() if isinstance(group["lr"], torch.Tensor) else group["lr"]
        grad, momentum = _local(param.grad), group["momentum"]
        buf = _local(self._init_param_state(param, "muon")["momentum_buffer"])
        buf.lerp_(grad, 1 - momentum)
        update = grad.lerp(buf, momentum) if group["nesterov"] else buf
        update = newton_schulz(update, group["ns_coefficients"], group["ns_steps"], group["ns_eps"])
        rows, cols = param.shape[-2:]
        weight = _local(param)
        weight.mul_(1 - lr * group["weight_decay"])
        weight.add_(update, alpha=-adjusted_lr(lr, group["adjust_lr"], rows, cols))

    def _adamw_update(self, params: list[torch.Tensor], group: dict[str, Any]) -> None:
        """torch.optim.AdamW's update (torch's functional Adam with decoupled weight decay, its default kernel)."""
        states = [self._init_param_state(p, "adamw") for p in params]
        beta1, beta2 = group["betas"]
        torch_adam(
            [_local(p) for p in params],
            [_local(p.grad) for p in params],
            [_local(s["exp_avg"]) for s in states],
            [_local(s["exp_avg_sq"]) for s in states],
            [],
            [s["step"] for s in states],
            decoupled_weight_decay=True,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )
