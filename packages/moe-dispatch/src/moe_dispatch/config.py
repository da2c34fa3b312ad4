"""Router configuration. Field names follow Megatron-Core's ``--moe-router-*`` flags without the prefix."""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCORE_FUNCTIONS = ("softmax",)
LOAD_BALANCING_TYPES = ("aux_loss", "none")
ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


@dataclass(frozen=True)
class RouterConfig:
    """Router settings, validated at construction (invalid combinations name both fields)."""

    num_experts: int
    topk: int = 2
    score_function: str = "softmax"
    load_balancing_type: str = "aux_loss"
    aux_loss_coeff: float = 1e-2
    router_dtype: str = "fp32"

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise ValueError(f"num_experts={self.num_experts}: must be at least 1")
        if not 1 <= self.topk <= self.num_experts:
            raise ValueError(f"topk={self.topk} with num_experts={self.num_experts}: topk must be in [1, num_experts]")
        if self.score_function not in SCORE_FUNCTIONS:
            raise ValueError(f"score_function={self.score_function!r}: choose one of {SCORE_FUNCTIONS}")
        if self.load_balancing_type not in LOAD_BALANCING_TYPES:
            raise ValueError(f"load_balancing_type={self.load_balancing_type!r}: choose one of {LOAD_BALANCING_TYPES}")
        if self.aux_loss_coeff < 0:
            raise ValueError(f"aux_loss_coeff={self.aux_loss_coeff}: must be >= 0")
        if self.router_dtype not in ROUTER_DTYPES:
            raise ValueError(f"router_dtype={self.router_dtype!r}: choose one of {tuple(ROUTER_DTYPES)}")

    @property
    def torch_router_dtype(self) -> torch.dtype:
        return ROUTER_DTYPES[self.router_dtype]
