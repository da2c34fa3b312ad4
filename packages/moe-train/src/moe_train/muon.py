"""Muon for the matrices of a MoE model, AdamW for the rest, in one optimizer, under every parallel layout.

:class:`MuonWithAdamW` is one :class:`~moe_train.adamw.PrecisionAwareAdamW` whose param groups carry a ``rule``:

- ``"muon"``: torch.optim.Muon's update (momentum as an EMA, optional Nesterov, Newton-Schulz orthogonalisation with
  torch's quintic coefficients, decoupled weight decay ``p *= 1 - lr * wd``, the lr adjusted by the matrix shape:
  ``original`` = sqrt(max(1, A / B)), ``match_rms_adamw`` = 0.2 * sqrt(max(A, B)), Moonlight's RMS matching).
  Newton-Schulz runs in bf16 on GPUs (as torch and Megatron-Core) and in fp32 on CPU unless ``ns_dtype`` says.
  A grouped-experts weight ``[E, K, M]`` is E matrices: each expert's ``[K, M]`` slice is orthogonalised on its own
  (the E slices in one batched matmul) and its lr adjusted by ``(K, M)``. For ``w_gate_up_EH2F`` an expert's whole
  ``[H, 2F]`` slice (gate and up columns together) is one matrix, as the fused parameter is, not gate and up apart.
- ``"adamw"``: PrecisionAwareAdamW's update (torch.optim.AdamW's, foreach), its states in ``states_dtype``.

Muon's update of a matrix is a function of the whole matrix, so a matrix a layout splits is orthogonalised as the
matrix it stands for (:class:`WholeMatrices`), never shard by shard (which trains, just worse): the momentum and the
Nesterov blend are elementwise on the rank's piece; that piece is gathered into whole matrices (the DTensor
placements that cut a matrix dimension: FSDP2's shards, tensor parallelism's; then an expert-tensor-parallel slice,
which :func:`moe_parallel.hidden_matrix_splits` names); the ranks that then hold the same matrices take turns, one
orthogonalising each parameter and handing the result to the others (a sum in which theirs are zeros); each keeps
its piece. A grouped-experts weight keeps its split along the experts: under expert parallelism a rank
orthogonalises its own experts, with no communication. The update then equals one process's (the gathered matrices
are the same numbers; an etp-gathered gate/up projection has its columns in another order, which orthogonalisation
commutes with).

State per parameter: ``momentum_buffer`` (Muon, shaped like the parameter, in ``states_dtype``: fp32, or bf16 updated
in fp32 and stored rounded); ``step``, ``exp_avg``, ``exp_avg_sq`` (AdamW); ``master``, an fp32 copy of a bf16
parameter (either rule) that the update is applied to, when ``master_weights``; DTensors like their parameters, so DCP
checkpoints save and load them like the AdamW optimizer's, onto any layout. :func:`muon_param_groups` decides which
parameter takes which rule; :func:`grouping_message` is the line the trainer prints at start-up.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from moe_parallel import HiddenSplit
from moe_train.adamw import STATE_DTYPES, PrecisionAwareAdamW

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


def _splits_dim(placement: Placement, dim: int) -> bool:
    return isinstance(placement, (Shard, _StridedShard)) and placement.dim == dim


class WholeMatrices:
    """How one parameter's local update becomes whole matrices and back (module docstring): the DTensor placements
    that cut a matrix dimension are gathered (a grouped-experts weight keeps its split along the experts, so a rank
    orthogonalises its own experts), then a :class:`~moe_parallel.HiddenSplit` (an etp slice) is gathered. The ranks
    that then hold the same matrices (``spread``: the groups along which they were gathered or replicated) share the
    work: one of them orthogonalises, the others receive its result."""

    def __init__(self, param: torch.Tensor, split: HiddenSplit | None) -> None:
        self.param, self.split = param, split
        self.spread: list[tuple[dist.ProcessGroup, int, int]] = []  # (group, this rank's index in it, its size)
        if isinstance(param, DTensor):
            mesh = param.device_mesh
            keep_experts = param.ndim == 3
            self.whole = [p if keep_experts and _splits_dim(p, 0) else Replicate() for p in param.placements]
            for dim, placement in enumerate(self.whole):
                if isinstance(placement, Replicate) and mesh.size(dim) > 1:
                    self.spread.append((mesh.get_group(dim), mesh.get_local_rank(dim), mesh.size(dim)))
        if split is not None:
            self.spread.append((split.group, dist.get_rank(split.group), dist.get_world_size(split.group)))
        self.ranks, self.index = 1, 0  # how many ranks share the work, and this rank's place among them
        for _, index, size in self.spread:
            self.ranks, self.index = self.ranks * size, self.index * size + index

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """The whole matrices of which ``local`` (shaped like the parameter's local tensor) holds this rank's piece."""
        param, whole = self.param, local
        if isinstance(param, DTensor):
            spec = (param.device_mesh, param.placements)
            whole = DTensor.from_local(local, *spec, run_check=False, shape=param.shape, stride=param.stride())
            whole = whole.redistribute(param.device_mesh, self.whole).to_local()
        if self.split is not None:
            pieces = [torch.empty_like(whole) for _ in range(dist.get_world_size(self.split.group))]
            dist.all_gather(pieces, whole.contiguous(), group=self.split.group)
            whole = torch.cat(pieces, dim=self.split.dim)
        return whole

    def scatter(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's piece of ``whole`` (as :meth:`gather` returned it): local slicing, no communication."""
        param, piece = self.param, whole
        if self.split is not None:
            size, rank = dist.get_world_size(self.split.group), dist.get_rank(self.split.group)
            piece = piece.chunk(size, dim=self.split.dim)[rank]
        if isinstance(param, DTensor):
            mesh, shape = param.device_mesh, {"shape": param.shape, "stride": param.stride()}
            piece = DTensor.from_local(piece, mesh, self.whole, run_check=False, **shape)
            piece = piece.redistribute(mesh, param.placements).to_local()
        return piece

    def share(self, result: torch.Tensor) -> torch.Tensor:
        """``result`` (the orthogonalised matrices on the rank that computed them, zeros on the others) on every rank
        of :attr:`spread`: one sum per group (exact: the other terms are zeros)."""
        for group, _, size in self.spread:
            if size > 1:
                dist.all_reduce(result, group=group)
        return result


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


def muon_parameters(model: nn.Module) -> set[int]:
    """``id`` of each trainable parameter of ``model`` that Muon updates (:func:`muon_param_groups`' rule)."""
    groups = muon_param_groups(model, {}, {})
    return {id(p) for g in groups if g["rule"] == "muon" for p in g["params"]}


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
    update: torch.Tensor,
    coefficients: tuple[float, float, float],
    steps: int,
    eps: float,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """The orthogonalised ``update`` (``[K, M]`` or a batch ``[E, K, M]``, each matrix on its own), computed in
    ``dtype``: torch.optim.Muon's iteration, the 2-D case with its very operations (so that in bf16 the result is
    bitwise torch's)."""
    a, b, c = coefficients
    x = update.to(dtype=dtype, copy=True)
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


def ns_dtype(group: dict[str, Any], update: torch.Tensor) -> torch.dtype:
    """The dtype Newton-Schulz runs in: the group's ``ns_dtype``, or by default bf16 on an accelerator (as torch and
    Megatron-Core do) and fp32 on CPU (whose bf16 matrix products are slow, and where runs are compared exactly)."""
    if group["ns_dtype"] is not None:
        return group["ns_dtype"]
    return torch.float32 if update.device.type == "cpu" else torch.bfloat16


def adjusted_lr(lr: float, adjust_lr: str, rows: int, cols: int) -> float:
    """torch.optim.Muon's lr adjustment for a ``[rows, cols]`` matrix."""
    if adjust_lr == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr * math.sqrt(max(1, rows / cols))


class MuonWithAdamW(PrecisionAwareAdamW):
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
        ns_dtype: torch.dtype | None = None,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        states_dtype: torch.dtype = torch.float32,
        master_weights: bool = True,
        hidden_splits: dict[int, HiddenSplit] | None = None,
        whole_matrices: bool = True,
    ) -> None:
        if states_dtype not in STATE_DTYPES:
            raise ValueError(f"states_dtype={states_dtype}: choose torch.float32 or torch.bfloat16")
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
            "ns_dtype": ns_dtype,
            "betas": tuple(betas),
            "eps": eps,
        }
        # PrecisionAwareAdamW's attributes (its __init__ would set AdamW's defaults only)
        self.states_dtype, self.master_weights = states_dtype, master_weights
        torch.optim.Optimizer.__init__(self, params, defaults)
        # id(param) -> its etp split (moe_parallel.hidden_matrix_splits); whole_matrices False: each rank
        # orthogonalises the pieces it holds, as a sharding-unaware Muon would (a control for tests, never right)
        self.hidden_splits, self.whole_matrices = hidden_splits or {}, whole_matrices
        self._whole: dict[int, WholeMatrices | None] = {}
        for group in self.param_groups:
            if group["rule"] not in RULES:
                raise ValueError(f"param group rule={group['rule']!r}: choose {' or '.join(RULES)}")
            if group["rule"] == "muon" and any(p.ndim not in (2, 3) for p in group["params"]):
                raise ValueError("Muon updates matrices [K, M] and grouped experts [E, K, M] only")
        self._muon = {id(p) for g in self.param_groups if g["rule"] == "muon" for p in g["params"]}

    def _init_param_state(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        """A Muon matrix's momentum buffer, or the AdamW state of the others (PrecisionAwareAdamW's), in
        ``states_dtype``."""
        if id(param) not in self._muon:
            return super()._init_param_state(param)
        state = self.state[param]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(param, dtype=self.states_dtype)
        if self.keeps_master(param) and "master" not in state:
            state["master"] = torch.empty_like(param, dtype=torch.float32)
            _local(state["master"]).copy_(_local(param.detach()))
        return state

    def _step_group(self, group: dict[str, Any]) -> None:
        """One param group's update (PrecisionAwareAdamW.step calls it per group): AdamW's for an ``"adamw"`` group;
        for a ``"muon"`` one, the split parameters one by one (every rank of a layout holds the same, in order), then
        whole matrices of one shape (a layer's projections, each layer's experts) in one batched iteration."""
        if group["rule"] == "adamw":
            super()._step_group(group)
            return
        params = [p for p in group["params"] if p.grad is not None]
        split = [p for p in params if self._whole_matrices(p) is not None]
        for turn, param in enumerate(split):
            self._muon_update(param, group, turn)
        same_shape: dict[tuple, list[torch.Tensor]] = {}
        for param in params:
            if self._whole_matrices(param) is None:
                local = _local(param)
                same_shape.setdefault((tuple(local.shape), local.device), []).append(param)
        for batch in same_shape.values():
            self._batched_update(batch, group)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """PrecisionAwareAdamW's (AdamW states kept in ``states_dtype``), and the momentum buffers put back in it."""
        super().load_state_dict(state_dict)
        for state in self.state.values():
            if "momentum_buffer" in state:
                state["momentum_buffer"] = state["momentum_buffer"].to(self.states_dtype)

    def _whole_matrices(self, param: torch.Tensor) -> WholeMatrices | None:
        """How ``param``'s update is gathered into whole matrices; None where it is whole already (a plain tensor)."""
        if id(param) not in self._whole:
            split = self.hidden_splits.get(id(param))
            distributed = self.whole_matrices and (isinstance(param, DTensor) or split is not None)
            self._whole[id(param)] = WholeMatrices(param, split) if distributed else None
        return self._whole[id(param)]

    def _momentum(self, param: torch.Tensor, group: dict[str, Any]) -> tuple[dict[str, Any], torch.Tensor]:
        """``param``'s state and the update to orthogonalise (its local piece, fp32): torch.optim.Muon's momentum EMA,
        and the Nesterov blend with the gradient."""
        grad, momentum = _local(param.grad).float(), group["momentum"]  # bf16 parameters: fp32 arithmetic
        state = self._init_param_state(param)
        stored = _local(state["momentum_buffer"])
        buf = stored if stored.dtype == grad.dtype else stored.to(grad.dtype)  # bf16 momentum: updated in fp32
        buf.lerp_(grad, 1 - momentum)
        if buf is not stored:
            stored.copy_(buf)
        return state, grad.lerp(buf, momentum) if group["nesterov"] else buf

    def _apply(self, param: torch.Tensor, state: dict[str, Any], group: dict[str, Any], ortho: torch.Tensor) -> None:
        """Decoupled weight decay and the orthogonalised update ``ortho`` (the rank's piece; its lr adjusted by the
        whole matrices' shape, ``state["matrix"]``) on the fp32 master copy where one is kept, else on the parameter
        (a bf16 one updated in fp32 and stored rounded)."""
        lr = group["lr"].item() if isinstance(group["lr"], torch.Tensor) else group["lr"]
        rows, cols = state.pop("matrix")
        stored_weight = _local(state.get("master", param))
        weight = stored_weight.float()
        weight.mul_(1 - lr * group["weight_decay"])
        weight.add_(ortho, alpha=-adjusted_lr(lr, group["adjust_lr"], rows, cols))
        if weight is not stored_weight:
            stored_weight.copy_(weight)
        if "master" in state:
            _local(param).copy_(stored_weight)

    def _muon_update(self, param: torch.Tensor, group: dict[str, Any], turn: int) -> None:
        """One split parameter's update, its matrices orthogonalised whole (:class:`WholeMatrices`); ``turn`` picks
        which of the ranks sharing them computes."""
        state, update = self._momentum(param, group)
        layout = self._whole_matrices(param)
        whole = layout.gather(update)
        dtype = ns_dtype(group, whole)
        if turn % layout.ranks == layout.index:
            ortho = newton_schulz(whole, group["ns_coefficients"], group["ns_steps"], group["ns_eps"], dtype)
            ortho = ortho.contiguous()  # a collective reads storage in order: a tall result is a transposed view
        else:
            ortho = torch.zeros_like(whole, dtype=dtype)
        state["matrix"] = whole.shape[-2:]
        self._apply(param, state, group, layout.scatter(layout.share(ortho)))

    def _batched_update(self, params: list[torch.Tensor], group: dict[str, Any]) -> None:
        """Whole parameters of one shape: their updates orthogonalised in one batched Newton-Schulz (one parameter
        alone: the 2-D case torch.optim.Muon runs, bitwise in bf16)."""
        states, updates = zip(*(self._momentum(p, group) for p in params), strict=True)
        stacked = updates[0] if len(updates) == 1 else torch.stack(updates).flatten(0, -3)
        dtype = ns_dtype(group, stacked)
        ortho = newton_schulz(stacked, group["ns_coefficients"], group["ns_steps"], group["ns_eps"], dtype)
        shape = _local(params[0]).shape  # whole_matrices False: a DTensor's local piece, as if whole
        ortho = ortho.reshape(len(params), *shape)
        for param, state, piece in zip(params, states, ortho, strict=True):
            state["matrix"] = shape[-2:]
            self._apply(param, state, group, piece)
