"""AdamW with low-precision optimizer states and fp32 master weights (Megatron-Core's precision-aware optimizer).

:class:`PrecisionAwareAdamW` applies ``torch.optim.AdamW``'s update (decoupled weight decay, the foreach
implementation's exact sequence of operations) with per-parameter state:

- ``exp_avg``, ``exp_avg_sq``: shaped like the parameter (a DTensor with the parameter's placements when the
  parameter is one, so DCP checkpoints save them sharded), in ``states_dtype`` (fp32 or bf16);
- ``step``: a 0-d float32 tensor on the CPU, as torch's AdamW keeps it;
- ``master``: only for a parameter that is not fp32 (bf16) when ``master_weights=True``: an fp32 copy of it
  (DTensor like the parameter). The update is applied to the master copy, and the parameter is then overwritten
  with the master copy rounded to its dtype (round to nearest). Without it the low-precision parameter itself is
  read, updated in fp32 and written back rounded.

The arithmetic always runs in fp32 on the local shards (``DTensor._local_tensor``), with ``torch._foreach_*`` ops
over chunks of parameters of one device and dtype; bf16 states are read into fp32, updated and written back rounded
to nearest. With fp32 parameters and fp32 states nothing is copied and the results are bitwise those of
``torch.optim.AdamW(foreach=True)``.

The state it holds, per parameter tensor of ``n`` local elements, is exactly (:func:`optimizer_state_bytes` counts
it): 4 bytes (``step``) + 2 x n x (2 for bf16 states, 4 for fp32) + (4 x n with a master copy). The fp32 working
copies an update needs exist only inside :meth:`PrecisionAwareAdamW.step`, one chunk of parameters
(:data:`CHUNK_ELEMENTS`) at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from itertools import chain
from typing import Any

import torch
from torch.distributed.tensor import DTensor

STATE_DTYPES = (torch.float32, torch.bfloat16)
STATE_KEYS = ("exp_avg", "exp_avg_sq", "step", "master", "momentum_buffer")  # the last: moe_train.muon's
# the most elements whose fp32 working copies (gradient, both moments, the weight, the denominator) one foreach
# launch in step() holds at once: bounds the transient memory of low-precision states and parameters (a larger
# tensor is updated alone)
CHUNK_ELEMENTS = 1 << 24


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``tensor``: a DTensor's local shard (which in-place updates write through), or itself."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _fp32(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """fp32 versions of ``tensors``: the same tensor where it is fp32 already (updated in place), a copy otherwise."""
    return [t if t.dtype == torch.float32 else t.float() for t in tensors]


class PrecisionAwareAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) with optimizer states in ``states_dtype`` and, for parameters that are not
    fp32, an fp32 master copy when ``master_weights`` (module docstring). Hyperparameters are torch.optim.AdamW's;
    ``lr`` may be changed per group between steps."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        states_dtype: torch.dtype = torch.float32,
        master_weights: bool = True,
    ) -> None:
        if states_dtype not in STATE_DTYPES:
            raise ValueError(f"states_dtype={states_dtype}: choose torch.float32 or torch.bfloat16")
        if not lr >= 0.0 or not eps >= 0.0 or not weight_decay >= 0.0:
            raise ValueError(f"lr={lr}, eps={eps}, weight_decay={weight_decay}: must be >= 0")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas={betas}: each must be in [0, 1)")
        # attributes, not param-group entries: a checkpoint's param groups must not override the current setting
        self.states_dtype = states_dtype
        self.master_weights = master_weights
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})

    def keeps_master(self, param: torch.Tensor) -> bool:
        """Whether ``param`` gets an fp32 master copy: it is not fp32 and master weights are on."""
        return self.master_weights and param.dtype != torch.float32

    def _init_param_state(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        """``param``'s state, creating any entry it lacks (all of them on first use; ``master`` also after loading a
        checkpoint written without one)."""
        state = self.state[param]
        if "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32)
        for key in ("exp_avg", "exp_avg_sq"):
            if key not in state:
                # zeros_like of a DTensor is a DTensor with the same mesh and placements: saved sharded by DCP
                state[key] = torch.zeros_like(param, dtype=self.states_dtype, memory_format=torch.preserve_format)
        if self.keeps_master(param) and "master" not in state:
            master = torch.empty_like(param, dtype=torch.float32, memory_format=torch.preserve_format)
            _local(master).copy_(_local(param.detach()))
            state["master"] = master
        return state

    @torch.no_grad()
    def init_state(self) -> None:
        """Allocate every parameter's state now (zeros, ``step`` 0, masters copied from the parameters) instead of
        at the first :meth:`step`: what a checkpoint is loaded into. Unlike
        ``torch.distributed.checkpoint.state_dict``'s own initialisation (a ``step()`` with zero gradients and
        ``lr`` 0, which counts a step), this leaves ``step`` at 0 and the parameters untouched."""
        for group in self.param_groups:
            for param in group["params"]:
                self._init_param_state(param)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._step_group(group)
        return loss

    def _step_group(self, group: dict[str, Any]) -> None:
        """One param group's update, chunk by chunk."""
        params = [p for p in group["params"] if p.grad is not None]
        if any(p.grad.is_sparse for p in params):
            raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
        # torch's foreach kernels take one device and dtype per list; the parameter's dtype decides the rest
        buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for p in params:
            buckets.setdefault((_local(p).device, p.dtype), []).append(p)
        for bucket in buckets.values():
            for chunk in _chunks(bucket):
                self._update(chunk, group)

    def _update(self, params: list[torch.Tensor], group: dict[str, Any]) -> None:
        """torch.optim.adam._multi_tensor_adam (decoupled weight decay, not capturable), in fp32 on local shards."""
        lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
        beta1, beta2 = group["betas"]
        lr = lr.item() if isinstance(lr, torch.Tensor) else lr
        states = [self._init_param_state(p) for p in params]
        steps = [s["step"] for s in states]
        # the tensors that keep the result: the master copies, else the parameters; the moments
        weights = [_local(s["master"]) if "master" in s else _local(p) for p, s in zip(params, states, strict=True)]
        exp_avgs = [_local(s["exp_avg"]) for s in states]
        exp_avg_sqs = [_local(s["exp_avg_sq"]) for s in states]
        # fp32 working copies of whichever are stored in another dtype (the same tensors where they are fp32)
        grads = _fp32([_local(p.grad) for p in params])
        weights32, exp_avgs32, exp_avg_sqs32 = _fp32(weights), _fp32(exp_avgs), _fp32(exp_avg_sqs)

        torch._foreach_add_(steps, torch.tensor(1.0), alpha=1.0)
        if weight_decay != 0:
            torch._foreach_mul_(weights32, 1 - lr * weight_decay)
        torch._foreach_lerp_(exp_avgs32, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs32, beta2)
        torch._foreach_addcmul_(exp_avg_sqs32, grads, grads, 1 - beta2)
        del grads
        bias_correction1 = [1 - beta1 ** step.item() for step in steps]
        bias_correction2 = [1 - beta2 ** step.item() for step in steps]
        step_size = [(lr / bc) * -1 for bc in bias_correction1]
        bias_correction2_sqrt = [bc**0.5 for bc in bias_correction2]
        denom = torch._foreach_sqrt(exp_avg_sqs32)
        torch._foreach_div_(denom, bias_correction2_sqrt)
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(weights32, exp_avgs32, denom, step_size)
        del denom

        # write back what was updated in a copy, rounded to nearest; then the parameters from their masters
        for stored, updated in chain(
            zip(weights, weights32, strict=True),
            zip(exp_avgs, exp_avgs32, strict=True),
            zip(exp_avg_sqs, exp_avg_sqs32, strict=True),
        ):
            if stored is not updated:
                stored.copy_(updated)
        for p, s in zip(params, states, strict=True):
            if "master" in s:
                _local(p).copy_(_local(s["master"]))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """``torch.optim.Optimizer.load_state_dict``, keeping this optimizer's state dtypes: the base class casts
        every floating-point state to its parameter's dtype, which would round an fp32 master copy to bf16 and turn
        bf16 moments of fp32 parameters into fp32. The loaded values are put back in ``states_dtype`` (moments)
        and fp32 (master copies); a master copy the checkpoint lacks is made from the loaded parameter."""
        saved_state = state_dict["state"]
        super().load_state_dict(state_dict)
        saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        for saved_id, param in zip(saved_ids, params, strict=True):
            if saved_id not in saved_state:
                continue
            state, saved = self.state[param], saved_state[saved_id]
            device = _local(param).device
            for key in ("exp_avg", "exp_avg_sq"):
                if key in saved:
                    state[key] = saved[key].to(device=device, dtype=self.states_dtype)
            if "step" in saved:
                state["step"] = torch.as_tensor(saved["step"], dtype=torch.float32).cpu()
            if "master" in saved and self.keeps_master(param):
                state["master"] = saved["master"].to(device=device, dtype=torch.float32)
            else:
                state.pop("master", None)
        with torch.no_grad():
            for group in self.param_groups:
                for param in group["params"]:
                    if self.state.get(param):
                        self._init_param_state(param)


def _chunks(params: list[torch.Tensor]) -> Iterable[list[torch.Tensor]]:
    """``params`` in consecutive runs of at most :data:`CHUNK_ELEMENTS` local elements (a larger one alone)."""
    chunk: list[torch.Tensor] = []
    size = 0
    for p in params:
        n = _local(p).numel()
        if chunk and size + n > CHUNK_ELEMENTS:
            yield chunk
            chunk, size = [], 0
        chunk.append(p)
        size += n
    if chunk:
        yield chunk


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of optimizer state this rank holds, by kind (``exp_avg``, ``exp_avg_sq``, ``step``, ``master``): the
    storage of each state tensor's local shard, every storage counted once. For :class:`PrecisionAwareAdamW`, per
    parameter tensor of ``n`` local elements: ``step`` 4, ``exp_avg`` and ``exp_avg_sq`` n x 2 (bf16) or n x 4
    (fp32) each, ``master`` n x 4 where a master copy is kept (module docstring)."""
    totals = dict.fromkeys(STATE_KEYS, 0)
    seen: set[int] = set()
    for state in optimizer.state.values():
        for key in STATE_KEYS:
            value = state.get(key)
            if not isinstance(value, torch.Tensor):
                continue
            storage = _local(value).untyped_storage()
            if storage.nbytes() and storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            totals[key] += storage.nbytes()
    return totals
