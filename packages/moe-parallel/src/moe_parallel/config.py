"""The ``parallel`` config section. Sizes follow torchtitan / Megatron names."""

from __future__ import annotations

from dataclasses import dataclass

from moe_parallel.layout import ParallelLayout


@dataclass
class ParallelConfig:
    """The ``parallel`` config section: sizes of each parallel dimension and the process-group backend."""

    tp: int = 1
    cp: int = 1
    dp_replicate: int = 1
    dp_shard: int = -1
    pp: int = 1
    ep: int = 1
    etp: int | None = None
    backend: str = "auto"  # process-group backend: auto (nccl on CUDA, gloo on CPU), gloo or nccl

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
