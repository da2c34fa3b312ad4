"""Router configuration. Field names follow Megatron-Core's ``--moe-router-*`` flags without the prefix.

Every invalid field, and every invalid combination of fields, is rejected in ``__post_init__`` with a
:class:`RouterConfigError` naming the one field to change (``.field``), its value and the reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moe_dispatch.permutation import BACKENDS as PERMUTE_BACKENDS

SCORE_FUNCTIONS = ("softmax", "sigmoid")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")
TOKEN_DROP_POLICIES = ("probs", "position")
ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


class RouterConfigError(ValueError):
    """An invalid :class:`RouterConfig`: ``field`` is the RouterConfig field to change, ``reason`` what is wrong
    and the fix (other fields appear in words, not by name, so that callers mapping ``field`` to their own
    config names, like moe-models, show a message that is right in their names too)."""

    def __init__(self, field: str, value: object, reason: str) -> None:
        super().__init__(f"{field}={value!r}: {reason}")
        self.field, self.value, self.reason = field, value, reason

    def __reduce__(self):  # type: ignore[no-untyped-def]
        # pickling (multiprocessing, torch.distributed) rebuilds from the constructor's arguments
        return type(self), (self.field, self.value, self.reason)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _bad_coeff(value: object) -> bool:
    """True unless ``value`` is a finite number >= 0."""
    return not _is_number(value) or not math.isfinite(value) or value < 0


@dataclass(frozen=True)
class RouterConfig:
    """Router settings, validated at construction (:class:`RouterConfigError` names the field to change).

    Defaults follow Megatron-Core: softmax top-k over the logits (``pre_softmax=False``), a Switch
    aux loss with coefficient 1e-2, no z-loss, no expert bias, dropless (``capacity_factor=None``).

    ``load_balancing_type`` is one name or a tuple/list of names (lists are stored as tuples);
    ``aux_loss_coeff`` is one float used for every type, or one float per type, in the same order.
    """

    num_experts: int
    topk: int = 2
    score_function: str = "softmax"
    pre_softmax: bool = False
    # sigmoid scores: renormalise the chosen experts' scores to sum to 1 (when topk > 1), as Megatron-Core
    # always does; False uses the raw sigmoid values (DeepSeek-V3 configs with norm_topk_prob=false)
    sigmoid_norm_topk: bool = True
    num_groups: int | None = None
    group_topk: int | None = None
    # a group's score: the sum of its top-n expert scores; None: n = topk // group_topk (Megatron-Core), 1: the
    # group's best expert (DeepSeek-V2), 2: transformers' DeepSeek-V3 whatever the top-k
    group_score_topk: int | None = None
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
    # not a router flag: how the MoE block built from this config permutes its tokens (Megatron's
    # --moe-permute-fusion picks fused kernels); a name of moe_dispatch.permutation.BACKENDS. "triton" on CPU runs the
    # custom ops' plain-torch stand-in: the permutation a GPU runs, traced the same way
    permute_backend: str = "auto"

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
        for name in ("enable_expert_bias", "force_load_balancing", "add_bias"):
            self._check_bool(name)
        if _bad_coeff(self.bias_update_rate):
            raise RouterConfigError("bias_update_rate", self.bias_update_rate, "must be a finite number >= 0")
        if self.router_dtype not in ROUTER_DTYPES:
            raise RouterConfigError("router_dtype", self.router_dtype, f"choose one of {tuple(ROUTER_DTYPES)}")
        if self.permute_backend not in PERMUTE_BACKENDS:
            raise RouterConfigError("permute_backend", self.permute_backend, f"choose one of {PERMUTE_BACKENDS}")

    def _check_bool(self, name: str) -> None:
        if not isinstance(getattr(self, name), bool):
            raise RouterConfigError(name, getattr(self, name), "must be a bool")

    def _check_experts(self) -> None:
        if not _is_int(self.num_experts) or self.num_experts < 1:
            raise RouterConfigError("num_experts", self.num_experts, "must be an int >= 1")
        if not _is_int(self.topk):
            raise RouterConfigError("topk", self.topk, "must be an int")
        if not 1 <= self.topk <= self.num_experts:
            raise RouterConfigError(
                "topk", self.topk, f"must be between 1 and the number of experts ({self.num_experts})"
            )

    def _check_scores(self) -> None:
        if self.score_function not in SCORE_FUNCTIONS:
            raise RouterConfigError("score_function", self.score_function, f"choose one of {SCORE_FUNCTIONS}")
        self._check_bool("pre_softmax")
        if self.pre_softmax and self.score_function != "softmax":
            raise RouterConfigError(
                "pre_softmax", True, f"needs softmax scores, not {self.score_function}; set it to False"
            )
        self._check_bool("sigmoid_norm_topk")
        if not self.sigmoid_norm_topk and self.score_function != "sigmoid":
            # softmax probabilities of the top-k without renormalisation already exist: pre_softmax
            raise RouterConfigError(
                "sigmoid_norm_topk",
                False,
                "applies to sigmoid scores only; for softmax scores not renormalised over the top-k, use the "
                "pre-softmax option instead",
            )
        factor = self.topk_scaling_factor
        if factor is not None and (not _is_number(factor) or not math.isfinite(factor) or factor <= 0):
            raise RouterConfigError("topk_scaling_factor", factor, "must be None or a finite number > 0")

    def _check_groups(self) -> None:
        groups, group_topk = self.num_groups, self.group_topk
        if groups is not None and (not _is_int(groups) or groups < 1):
            raise RouterConfigError("num_groups", groups, "must be None or an int >= 1")
        if group_topk is not None and (not _is_int(group_topk) or group_topk < 1):
            raise RouterConfigError("group_topk", group_topk, "must be None or an int >= 1")
        if group_topk is not None and groups is None:
            raise RouterConfigError("group_topk", group_topk, "needs the number of groups too: set both or neither")
        if groups is not None and group_topk is None:
            raise RouterConfigError("num_groups", groups, "needs the groups chosen per token too: set both or neither")
        score_topk = self.group_score_topk
        if score_topk is not None and (not _is_int(score_topk) or score_topk < 1):
            raise RouterConfigError("group_score_topk", score_topk, "must be None or an int >= 1")
        if score_topk is not None and groups is None:
            raise RouterConfigError("group_score_topk", score_topk, "scores groups: set num_groups and group_topk")
        if groups is None or group_topk is None:
            return
        if self.num_experts % groups:
            raise RouterConfigError("num_groups", groups, f"must divide the number of experts ({self.num_experts})")
        if group_topk > groups:
            raise RouterConfigError("group_topk", group_topk, f"must be at most the number of groups ({groups})")
        per_group = self.num_experts // groups
        if self.topk > group_topk * per_group:
            raise RouterConfigError(
                "topk",
                self.topk,
                f"more than the {group_topk * per_group} experts of the {group_topk} groups chosen per token "
                f"({per_group} experts per group)",
            )
        if self.topk < group_topk:
            raise RouterConfigError(
                "topk",
                self.topk,
                f"fewer than the {group_topk} groups chosen per token: each chosen group must provide an expert",
            )
        if score_topk is not None and score_topk > per_group:
            raise RouterConfigError(
                "group_score_topk", score_topk, f"more than the {per_group} experts of a group; at most {per_group}"
            )

    def _check_losses(self) -> None:
        kind = self.load_balancing_type
        types = (kind,) if isinstance(kind, str) else kind if isinstance(kind, tuple) else ()
        if not isinstance(kind, str | tuple) or not types or not all(isinstance(t, str) for t in types):
            raise RouterConfigError("load_balancing_type", kind, "must be a name or a non-empty tuple of names")
        for name in types:
            if name not in LOAD_BALANCING_TYPES:
                raise RouterConfigError(
                    "load_balancing_type", kind, f"unknown {name!r}, choose from {LOAD_BALANCING_TYPES}"
                )
        if len(set(types)) != len(types):
            raise RouterConfigError("load_balancing_type", kind, "a type is listed twice")
        if "none" in types and len(types) > 1:
            raise RouterConfigError("load_balancing_type", kind, "'none' cannot be combined with other types")
        coeff = self.aux_loss_coeff
        coeffs = coeff if isinstance(coeff, tuple) else (coeff,)
        if not coeffs or any(_bad_coeff(c) for c in coeffs):
            raise RouterConfigError("aux_loss_coeff", coeff, "every coefficient must be a finite number >= 0")
        if isinstance(coeff, tuple) and len(coeff) != len(types):
            raise RouterConfigError(
                "aux_loss_coeff",
                coeff,
                f"{len(coeff)} values for {len(types)} load-balancing types {types}: give one per type, or one for all",
            )
        if self.z_loss_coeff is not None and _bad_coeff(self.z_loss_coeff):
            raise RouterConfigError("z_loss_coeff", self.z_loss_coeff, "must be None or a finite number >= 0")

    def _check_capacity(self) -> None:
        factor = self.capacity_factor
        if factor is not None and (not _is_number(factor) or not math.isfinite(factor) or factor <= 0):
            raise RouterConfigError("capacity_factor", factor, "must be None (dropless) or a finite number > 0")
        if self.token_drop_policy not in TOKEN_DROP_POLICIES:
            raise RouterConfigError("token_drop_policy", self.token_drop_policy, f"choose one of {TOKEN_DROP_POLICIES}")
        self._check_bool("pad_to_capacity")
        if self.pad_to_capacity and factor is None:
            raise RouterConfigError(
                "pad_to_capacity", True, "padding needs a capacity factor: set one, or set this False"
            )

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
