"""The ``parallel`` config section. Sizes follow torchtitan / Megatron names."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from moe_dispatch import OVERLAP_MODES
from moe_parallel.layout import ParallelLayout
from moe_parallel.plan import LayoutError
from moe_parallel.schedules import check_schedule_name

MAX_TIMEOUT_MINUTES = 7 * 24 * 60

TOKEN_DISPATCHERS = ("alltoall", "allgather", "flex")
# the stack's dtype names (moe-train's config sections take the same): short, as Megatron-Core's flags; torch's
# names accepted as aliases
PRECISIONS = ("fp32", "bf16")
DTYPE_ALIASES = {"float32": "fp32", "bfloat16": "bf16"}
BACKENDS = ("auto", "gloo", "nccl")


@dataclass
class ParallelConfig:
    """The ``parallel`` config section: sizes of each parallel dimension, the token dispatcher expert parallelism
    uses, FSDP's mixed precision and the process-group backend."""

    tp: int = 1
    cp: int = 1
    dp_replicate: int = 1
    dp_shard: int = -1
    pp: int = 1
    ep: int = 1
    etp: int | None = None
    # Megatron-Core's --moe-token-dispatcher-type: how tokens reach experts on other ranks (ep or etp > 1)
    moe_token_dispatcher_type: str = "alltoall"
    # FSDP2 MixedPrecisionPolicy, as torchtitan's: the dtype parameters are gathered in, and gradients reduced in
    mixed_precision_param: str = "fp32"
    mixed_precision_reduce: str = "fp32"
    backend: str = "auto"  # process-group backend: auto (nccl on CUDA, gloo on CPU), gloo or nccl
    # pipeline parallelism (pp > 1): torch.distributed.pipelining's schedule, the stages each rank holds (None: 1 for
    # 1F1B / GPipe, 2 for the interleaved and V-shaped schedules), and Megatron-Core's
    # --decoder-first/last-pipeline-num-layers (None: split by cost)
    pp_schedule: str = "1F1B"
    vpp: int | None = None
    pp_first_stage_layers: int | None = None
    pp_last_stage_layers: int | None = None
    # expert-parallel communication hidden behind computation: none; chunked (moe_dispatch.overlap: each MoE
    # layer's tokens in ep_overlap_chunks chunks whose all-to-alls run while other chunks' experts compute); or
    # microbatch (moe_dispatch.lanes: one micro-batch's backward and the next one's forward take turns at their
    # all-to-alls, without pp or in DualPipeV's paired actions; each exchange also in ep_overlap_chunks chunks, 1:
    # whole)
    ep_overlap: str = "none"
    ep_overlap_chunks: int = 4
    # with ep_overlap microbatch, without pp: the experts' weight-gradient GEMMs run while the backward's all-to-alls
    # travel rather than before them (Megatron-Core's --delay-wgrad-compute; moe_experts.delayed_wgrad)
    delay_wgrad_compute: bool = False
    # every collective's timeout, on every process group the stack creates (Megatron-Core's
    # --distributed-timeout-minutes, and its default)
    timeout_minutes: float = 10.0

    def __post_init__(self) -> None:
        if self.moe_token_dispatcher_type not in TOKEN_DISPATCHERS:
            raise LayoutError(
                "moe_token_dispatcher_type",
                self.moe_token_dispatcher_type,
                f"choose one of {', '.join(TOKEN_DISPATCHERS)}",
            )
        check_schedule_name(self.pp_schedule)
        if self.ep_overlap not in OVERLAP_MODES:
            raise LayoutError("ep_overlap", self.ep_overlap, f"choose one of {', '.join(OVERLAP_MODES)}")
        if self.ep_overlap_chunks < 1:
            raise LayoutError("ep_overlap_chunks", self.ep_overlap_chunks, "must be at least 1")
        if self.ep_overlap == "chunked" and self.ep_overlap_chunks < 2:
            raise LayoutError(
                "ep_overlap_chunks",
                self.ep_overlap_chunks,
                "must be at least 2 with ep_overlap chunked (1 overlaps nothing)",
            )
        if self.delay_wgrad_compute and self.ep_overlap != "microbatch":
            raise LayoutError(
                "delay_wgrad_compute",
                True,
                "moves the experts' weight gradients into the waits of ep_overlap microbatch's backward, and "
                f"ep_overlap is {self.ep_overlap}: set ep_overlap microbatch, or delay_wgrad_compute false",
            )
        if not 0 < self.timeout_minutes <= MAX_TIMEOUT_MINUTES:
            raise LayoutError(
                "timeout_minutes", self.timeout_minutes, f"must be positive and at most {MAX_TIMEOUT_MINUTES} (a week)"
            )
        for name in ("vpp", "pp_first_stage_layers", "pp_last_stage_layers"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise LayoutError(name, value, "must be at least 1 (or unset)")
        if self.backend not in BACKENDS:
            raise LayoutError("backend", self.backend, f"choose one of {', '.join(BACKENDS)}")
        for name in ("mixed_precision_param", "mixed_precision_reduce"):
            setattr(self, name, DTYPE_ALIASES.get(getattr(self, name), getattr(self, name)))
            if getattr(self, name) not in PRECISIONS:
                raise LayoutError(name, getattr(self, name), f"choose one of {', '.join(PRECISIONS)}")

    def layout(self, world_size: int) -> ParallelLayout:
        return ParallelLayout(
            world_size,
            tp=self.tp,
            cp=self.cp,
            dp_replicate=self.dp_replicate,
            dp_shard=self.dp_shard,
            pp=self.pp,
            ep=self.ep,
            etp=self.etp,
        )

    @property
    def timeout(self) -> timedelta:
        """:attr:`timeout_minutes` as torch takes it."""
        return timedelta(minutes=self.timeout_minutes)
