"""Router configuration. Field names follow Megatron-Core's ``--moe-router-*`` flags without the prefix.

Every invalid field, and every invalid combination of fields, is rejected in ``__post_init__`` with a
one-line ``ValueError`` of the form ``field=value ...`` that names each field involved.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SCORE_FUNCTIONS = ("softmax", "sigmoid")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")
TOKEN_DROP_POLICIES = ("probs", "position")
ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _bad_coeff(value: object) -> bool:
    """True unless ``value`` is a finite number >= 0."""
    return not _is_number(value) or not math.isfinite(value) or value < 0


@dataclass(frozen=True)
class RouterConfig:
    """Router settings, validated at construction (invalid combinations name both fields).

    Defaults follow Megatron-Core: softmax top-k over the logits (``pre_softmax=False``), a Switch
    aux loss with coefficient 1e-2, no z-loss, no expert bias, dropless (``capacity_factor=None``).

    ``load_balancing_type`` is one name or a tuple/list of names (lists are stored as tuples);
    ``aux_loss_coeff`` is one float used for every type, or one float per type, in the same order.
    """

    num_experts: int
    topk: int = 2
    score_function: str = "softmax"
    pre_softmax: bool = False
    num_groups: int | None = None
    group_topk: int | None = None
    topk_scaling_factor: float | None = None
    load_balancing_type: str | tuple[str, ...] = "aux_loss"
    aux_loss_coeff: float | tuple[float, ...] = 1e-2
    z_loss_coeff: float | None = None
    enable_expert_bias: bool = False
    bias_update_rate: float = 1e-3
    capacity_factor: float | None = None
    token_drop_policy: str = "probs"
    pad_to_capacity: bool = False
    force_load_balancing: bool = False
    router_dtype: str = "fp32"
    add_bias: bool = False  # a learned bias on the router logits (GPT-OSS)

    def __post_init__(self) -> None:
        # lists are accepted but stored as tuples so the frozen config stays hashable and comparable
        if isinstance(self.load_balancing_type, list):
            object.__setattr__(self, "load_balancing_type", tuple(self.load_balancing_type))
        if isinstance(self.aux_loss_coeff, list):
            object.__setattr__(self, "aux_loss_coeff", tuple(self.aux_loss_coeff))
        self._check_experts()
        self._check_scores()
        self._check_groups()
        self._check_losses()
        self._check_capacity()
        if not isinstance(self.enable_expert_bias, bool):
            raise ValueError(f"enable_expert_bias={self.enable_expert_bias!r}: must be a bool")
        if _bad_coeff(self.bias_update_rate):
            raise ValueError(f"bias_update_rate={self.bias_update_rate!r}: must be a finite number >= 0")
        if not isinstance(self.force_load_balancing, bool):
            raise ValueError(f"force_load_balancing={self.force_load_balancing!r}: must be a bool")
        if not isinstance(self.add_bias, bool):
            raise ValueError(f"add_bias={self.add_bias!r}: must be a bool")
        if self.router_dtype not in ROUTER_DTYPES:
            raise ValueError(f"router_dtype={self.router_dtype!r}: choose one of {tuple(ROUTER_DTYPES)}")

    def _check_experts(self) -> None:
        if not _is_int(self.num_experts) or self.num_experts < 1:
            raise ValueError(f"num_experts={self.num_experts!r}: must be an int >= 1")
        if not _is_int(self.topk):
            raise ValueError(f"topk={self.topk!r}: must be an int")
        if not 1 <= self.topk <= self.num_experts:
            raise ValueError(f"topk={self.topk} with num_experts={self.num_experts}: topk must be in [1, num_experts]")

    def _check_scores(self) -> None:
        if self.score_function not in SCORE_FUNCTIONS:
            raise ValueError(f"score_function={self.score_function!r}: choose one of {SCORE_FUNCTIONS}")
        if not isinstance(self.pre_softmax, bool):
            raise ValueError(f"pre_softmax={self.pre_softmax!r}: must be a bool")
        if self.pre_softmax and self.score_function != "softmax":
            raise ValueError(
                f"pre_softmax=True with score_function={self.score_function!r}: pre_softmax needs softmax scores"
            )
        factor = self.topk_scaling_factor
        if factor is not None and (not _is_number(factor) or not math.isfinite(factor) or factor <= 0):
            raise ValueError(f"topk_scaling_factor={factor!r}: must be None or a finite number > 0")

    def _check_groups(self) -> None:
        groups, group_topk = self.num_groups, self.group_topk
        if groups is not None and (not _is_int(groups) or groups < 1):
            raise ValueError(f"num_groups={groups!r}: must be None or an int >= 1")
        if group_topk is not None and (not _is_int(group_topk) or group_topk < 1):
            raise ValueError(f"group_topk={group_topk!r}: must be None or an int >= 1")
        if group_topk is not None and groups is None:
            raise ValueError(f"group_topk={group_topk} without num_groups: set both or neither")
        if groups is not None and group_topk is None:
            raise ValueError(f"num_groups={groups} without group_topk: set both or neither")
        if groups is None or group_topk is None:
            return
        if self.num_experts % groups:
            raise ValueError(f"num_experts={self.num_experts} is not divisible by num_groups={groups}")
        if group_topk > groups:
            raise ValueError(f"group_topk={group_topk} is larger than num_groups={groups}")
        per_group = self.num_experts // groups
        if self.topk > group_topk * per_group:
            raise ValueError(
                f"topk={self.topk} is larger than group_topk={group_topk} times the {per_group} experts per group"
            )
        if self.topk < group_topk:
            raise ValueError(
                f"topk={self.topk} is smaller than group_topk={group_topk}: each chosen group scores its "
                "top-(topk // group_topk) experts"
            )

    def _check_losses(self) -> None:
        kind = self.load_balancing_type
        types = (kind,) if isinstance(kind, str) else kind if isinstance(kind, tuple) else ()
        if not isinstance(kind, str | tuple) or not types or not all(isinstance(t, str) for t in types):
            raise ValueError(f"load_balancing_type={kind!r}: must be a name or a non-empty tuple of names")
        for name in types:
            if name not in LOAD_BALANCING_TYPES:
                raise ValueError(f"load_balancing_type={kind!r}: unknown {name!r}, choose from {LOAD_BALANCING_TYPES}")
        if len(set(types)) != len(types):
            raise ValueError(f"load_balancing_type={kind!r}: a type is listed twice")
        if "none" in types and len(types) > 1:
            raise ValueError(f"load_balancing_type={kind!r}: 'none' cannot be combined with other types")
        coeff = self.aux_loss_coeff
        coeffs = coeff if isinstance(coeff, tuple) else (coeff,)
        if not coeffs or any(_bad_coeff(c) for c in coeffs):
            raise ValueError(f"aux_loss_coeff={coeff!r}: every coefficient must be a finite number >= 0")
        if isinstance(coeff, tuple) and len(coeff) != len(types):
            raise ValueError(
                f"aux_loss_coeff={coeff!r} has {len(coeff)} values for load_balancing_type={kind!r} "
                f"with {len(types)} types"
            )
        if self.z_loss_coeff is not None and _bad_coeff(self.z_loss_coeff):
            raise ValueError(f"z_loss_coeff={self.z_loss_coeff!r}: must be None or a finite number >= 0")

    def _check_capacity(self) -> None:
        factor = self.capacity_factor
        if factor is not None and (not _is_number(factor) or not math.isfinite(factor) or factor <= 0):
            raise ValueError(f"capacity_factor={factor!r}: must be None (dropless) or a finite number > 0")
        if self.token_drop_policy not in TOKEN_DROP_POLICIES:
            raise ValueError(f"token_drop_policy={self.token_drop_policy!r}: choose one of {TOKEN_DROP_POLICIES}")
        if not isinstance(self.pad_to_capacity, bool):
            raise ValueError(f"pad_to_capacity={self.pad_to_capacity!r}: must be a bool")
        if self.pad_to_capacity and factor is None:
            raise ValueError("pad_to_capacity=True without capacity_factor: padding needs a capacity")

    @property
    def torch_router_dtype(self) -> torch.dtype:
        return ROUTER_DTYPES[self.router_dtype]

    @property
    def load_balancing_types(self) -> tuple[str, ...]:
        """The load-balancing types as a tuple (``()`` for ``"none"``)."""
        kind = self.load_balancing_type
        types = (kind,) if isinstance(kind, str) else tuple(kind) if isinstance(kind, tuple) else ()
        return () if types == ("none",) else types

    @property
    def aux_loss_coeffs(self) -> dict[str, float]:
        """Coefficient of each active load-balancing type."""
        types = self.load_balancing_types
        coeff = self.aux_loss_coeff
        if isinstance(coeff, tuple):
            return dict(zip(types, (float(c) for c in coeff), strict=False))
        return {t: float(coeff) for t in types}
