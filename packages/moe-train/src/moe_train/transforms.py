"""The run's model transforms (torchtitan's "model converters"): an explicit ordered list of named functions applied
to each module that will run (the whole model, or each pipeline stage), after expert and tensor parallelism have
built the rank's modules and before FSDP wraps them (moe_parallel's ``before_fsdp``).

Order: ``precision`` (the recipe swaps linears and expert projections: recompute must wrap the swapped modules),
``memory`` (recompute and offload wrappers), ``compile`` (last, as torchtitan: the wrappers end up inside the
compiled layers). What each did accumulates in :class:`ModelTransforms`.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from moe_memory import MemoryPolicy, apply_memory_policy
from moe_train.compile import compile_decoder_layers
from moe_train.config import ExperimentConfig, RunConfig
from moe_train.precision import apply_run_precision


def memory_settings(run: RunConfig) -> tuple[list[str], list[str], int]:
    """The run's recompute and offload settings, as moe_memory's policy functions take them."""
    return run.recompute_modules, run.offload_modules, run.offload_min_tensor_bytes


class ModelTransforms:
    """Callable on each module that runs: applies :attr:`steps` in order and keeps what they did (the modules the
    precision recipe took, the recompute / offload choices). ``part``: the modules are parts of a model checked whole
    (pipeline stages), so a stage may lack a kind the settings name."""

    def __init__(self, cfg: ExperimentConfig, native_precision: bool, part: bool) -> None:
        self.cfg, self.native_precision, self.part = cfg, native_precision, part
        self.precision_modules = 0
        self.memory = MemoryPolicy()
        self.steps: list[tuple[str, Callable[[nn.Module], None]]] = [
            ("precision", self.precision),
            ("memory", self.recompute_and_offload),
        ]
        if cfg.run.compile:
            self.steps.append(("compile", self.compile))

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.steps]

    def __call__(self, module: nn.Module) -> None:
        for _, transform in self.steps:
            transform(module)

    def precision(self, module: nn.Module) -> None:
        cfg, native = self.cfg, self.native_precision
        self.precision_modules += apply_run_precision(module, cfg.precision, cfg.model.num_layers, native)

    def recompute_and_offload(self, module: nn.Module) -> None:
        chosen = apply_memory_policy(module, module.module_kinds(), *memory_settings(self.cfg.run), part=self.part)
        self.memory = MemoryPolicy(
            saved=self.memory.saved or chosen.saved,
            recomputed={**self.memory.recomputed, **chosen.recomputed},
            offloaded={**self.memory.offloaded, **chosen.offloaded},
        )

    def compile(self, module: nn.Module) -> None:
        compile_decoder_layers(module)
