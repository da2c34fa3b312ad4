"""Initial weights as a function of ``(seed, parameter name)`` alone, so a rank can draw just the part it holds.

Megatron's init (normal(0, std) weights, std / sqrt(2 * layers) for the projections that add to the residual
stream, ones for norms (zeros for zero-centred ones), zeros for biases, sinks and the expert bias; the Gated
DeltaNet's and Mamba-2's A_log, dt_bias, D and short convolution as :func:`_rules` says), but each tensor comes from its
own generator seeded by the seed and its name, in blocks of rows with a generator each, and each routed expert from
:meth:`~moe_experts.GroupedExperts.initial_expert`. A slice therefore has the same values whichever way the model is
split and whichever device it is on: one process, a tensor-parallel shard or an FSDP shard of the same tensor agree,
and a rank never draws (or allocates) the rest of a tensor it does not hold.

:class:`InitialWeights` serves the values (the ``ParameterSource`` moe_parallel's ``materialize`` reads);
:meth:`InitialWeights.fill` fills a model whose tensors are all whole, as :func:`~moe_models.build_model` builds it.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
from torch import nn

from moe_dispatch import TopKRouter
from moe_experts import GroupedExperts, SharedExperts, expert_seed
from moe_models.kimi_delta import PerChannelForgetGate
from moe_models.mamba import Mamba2Mixer

ROWS_PER_DRAW = 1024  # rows of dim 0 drawn from one generator: a slice draws only the blocks it touches
# Linear layers whose output adds to the residual stream: initialised with std / sqrt(2 * layers), as Megatron
_OUTPUT_PROJECTIONS = ("o_proj", "down_proj", "out_proj")
# Gated DeltaNet and Mamba-2: A = exp(A_log) drawn uniformly in this range per value head (Mamba-2's, Megatron-Core's)
A_INIT_RANGE = (1.0, 16.0)
# Mamba-2 and Kimi Delta Attention: softplus(dt_bias) starts log-uniform in this range, at least MAMBA_DT_INIT_FLOOR
# (Mamba-2's, Megatron-Core's, transformers' Nemotron-H and Kimi Linear defaults)
MAMBA_DT_INIT_RANGE = (1e-3, 1e-1)
MAMBA_DT_INIT_FLOOR = 1e-4


@dataclass(frozen=True)
class Rule:
    """How one tensor starts: normal(0, std) when ``std`` is set, the log of a uniform draw in ``log_uniform`` when
    that is set, the inverse softplus of a log-uniform draw in ``softplus_log_uniform`` (at least
    :data:`MAMBA_DT_INIT_FLOOR`) when that is set, else filled with ``fill``."""

    std: float | None = None
    fill: float = 0.0
    log_uniform: tuple[float, float] | None = None
    softplus_log_uniform: tuple[float, float] | None = None

    @property
    def uniform(self) -> tuple[float, float] | None:
        return self.log_uniform or self.softplus_log_uniform


def name_seed(seed: int, name: str) -> int:
    """A 63-bit seed for tensor ``name``, mixed from ``seed`` and the name's CRC."""
    return expert_seed(seed, zlib.crc32(name.encode()))


def _rules(model: nn.Module, std: float, num_layers: int) -> tuple[dict[str, Rule], dict[str, GroupedExperts]]:
    """A rule per non-expert parameter and buffer of ``model``, and the grouped experts by module path."""
    out_std = std / math.sqrt(2.0 * num_layers)
    rules: dict[str, Rule] = {}
    experts: dict[str, GroupedExperts] = {}
    for path, module in model.named_modules():
        prefix = f"{path}." if path else ""
        if isinstance(module, GroupedExperts):
            experts[path] = module
            continue
        for name, _ in module.named_parameters(recurse=False):
            if isinstance(module, nn.Linear) and name == "weight":
                rule = Rule(out_std if path.endswith(_OUTPUT_PROJECTIONS) else std)
            elif isinstance(module, nn.Conv1d) and name == "weight":
                # the Gated DeltaNet's short convolution: the variance of torch's default U(-1/sqrt(W), 1/sqrt(W))
                rule = Rule(std=(3.0 * module.kernel_size[0]) ** -0.5)
            elif name == "A_log":  # Gated DeltaNet and Mamba-2: log of the per-head decay rate
                rule = Rule(log_uniform=A_INIT_RANGE)
            elif name == "dt_bias" and isinstance(module, Mamba2Mixer | PerChannelForgetGate):
                # Mamba-2 and Kimi Delta Attention: softplus(dt_bias) starts log-uniform (as transformers and FLA)
                rule = Rule(softplus_log_uniform=MAMBA_DT_INIT_RANGE)
            elif name in ("dt_bias", "D"):  # Gated DeltaNet: softplus(a + dt_bias); Mamba-2: the skip. Ones
                rule = Rule(fill=1.0)
            elif isinstance(module, nn.Embedding | TopKRouter) and name == "weight":
                rule = Rule(std)
            elif isinstance(module, SharedExperts):
                rule = Rule(out_std if name == "w_down_FH" else std)
            elif name == "weight":  # RMSNorm (scaled by 1 + weight when zero-centred), the gated norm
                rule = Rule(fill=0.0 if getattr(module, "zero_centered", False) else 1.0)
            else:  # biases, attention sinks
                rule = Rule()
            rules[prefix + name] = rule
        for name, _ in module.named_buffers(recurse=False):
            rules[prefix + name] = Rule()  # the router's expert bias
    return rules, experts


class InitialWeights:
    """The initial value of every tensor of a moe_models model (module docstring); ``seed`` picks the draw."""

    def __init__(self, model: nn.Module, seed: int) -> None:
        self.seed = seed
        self.std, self.num_layers = model.config.init_method_std, model.config.num_layers
        self.rules, self.experts = _rules(model, self.std, self.num_layers)

    def tensor(self, name: str, shape: tuple[int, ...], box: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The CPU fp32 value of non-expert tensor ``name`` of global ``shape``, or of its ``box`` (one slice per
        dimension) only."""
        rule = self.rules[name]
        box = box or tuple(slice(0, n) for n in shape)
        local = tuple(s.stop - s.start for s in box)
        if rule.std is None and rule.uniform is None:
            return torch.full(local, rule.fill, device="cpu")
        rows = box[0] if shape else slice(0, 1)
        first, last = rows.start // ROWS_PER_DRAW, max(rows.stop - 1, rows.start) // ROWS_PER_DRAW
        blocks = []
        for block in range(first, last + 1):
            # on the CPU whatever the default device (a model built under ``with torch.device("cuda")``): the
            # generator is a CPU one, and the values must not depend on the device
            gen = torch.Generator(device="cpu").manual_seed(expert_seed(name_seed(self.seed, name), block))
            n = min(ROWS_PER_DRAW, (shape[0] if shape else 1) - block * ROWS_PER_DRAW)
            draw = torch.randn if rule.uniform is None else torch.rand
            blocks.append(draw(n, *shape[1:], generator=gen, device="cpu"))
        start = rows.start - first * ROWS_PER_DRAW
        value = torch.cat(blocks)[start : start + (rows.stop - rows.start)]
        if rule.log_uniform is not None:
            low, high = rule.log_uniform
            value = value.mul_(high - low).add_(low).log_()
        elif rule.softplus_log_uniform is not None:
            low, high = (math.log(v) for v in rule.softplus_log_uniform)
            dt = value.mul_(high - low).add_(low).exp_().clamp_(min=MAMBA_DT_INIT_FLOOR)
            value = dt + torch.log(-torch.expm1(-dt))  # softplus(value) = dt
        else:
            value = value.mul_(rule.std)
        return value[(slice(None), *box[1:])] if shape else value.reshape(())

    def expert(self, path: str, index: int) -> dict[str, torch.Tensor]:
        """Global expert ``index`` of the grouped experts at ``path``: full-width values by parameter name."""
        return self.experts[path].initial_expert(index, name_seed(self.seed, path), self.std, self.num_layers)

    @torch.no_grad()
    def fill(self, model: nn.Module) -> None:
        """Write the initial values into ``model``, whose tensors are whole and allocated (no meta, no DTensor)."""
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name in self.rules:
                tensor.copy_(self.tensor(name, tuple(tensor.shape)))
        for path, experts in self.experts.items():
            for e in range(experts.num_experts):
                for name, value in self.expert(path, experts.first_expert + e).items():
                    getattr(experts, name)[e].copy_(experts.local_slice(name, value))
