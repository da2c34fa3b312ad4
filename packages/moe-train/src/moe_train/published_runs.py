"""Published MoE training runs whose layouts and throughput ``moe-train plan --search`` is checked against: NeMo
AutoModel's H100 BF16 pre-training table (its performance summary, with the recipes' micro-batch sizes and
activation checkpointing from ``examples/benchmark/configs``). Sequence length 4,096 in every row."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PublishedRun:
    preset: str  # moe_models preset
    gpus: int
    global_batch: int
    micro_batch: int
    tp: int
    pp: int
    cp: int
    ep: int
    vpp: int  # 1: no virtual stages
    fsdp: int
    recompute: str  # the recipe's activation checkpointing: layer (whole decoder layers) or none
    tflops: float  # per GPU, as published
    tokens_per_second: float  # per GPU, as published


SEQ_LEN = 4096
SOURCE = "NeMo AutoModel performance summary (DGX-H100, BF16) and examples/benchmark/configs"

# the GPT-OSS rows' EP is blank in the table; their recipes set ep 8 and 64, taken here: FSDP alone over 64 GPUs could
# not reach the published step (gathering GPT-OSS-120B's 117B parameters over InfiniBand for every micro-batch takes
# longer than the whole 4.3 s step)
PUBLISHED_RUNS: dict[str, PublishedRun] = {
    "DeepSeek-V3 on 256": PublishedRun("deepseek-v3-671b", 256, 512, 1, 1, 4, 1, 64, 8, 64, "layer", 250, 1002),
    "DeepSeek-V3 on 1024": PublishedRun("deepseek-v3-671b", 1024, 8192, 1, 1, 4, 1, 64, 8, 256, "layer", 216, 865),
    "Kimi-K2 on 256": PublishedRun("kimi-k2", 256, 512, 1, 1, 8, 1, 32, 4, 32, "layer", 189, 924),
    "Qwen3-30B-A3B on 8": PublishedRun("qwen3-30b-a3b", 8, 512, 4, 1, 1, 1, 8, 1, 8, "layer", 277, 12040),
    "GPT-OSS-20B on 8": PublishedRun("gpt-oss-20b", 8, 256, 2, 1, 1, 1, 8, 1, 8, "none", 279, 13058),
    "GPT-OSS-120B on 64": PublishedRun("gpt-oss-120b", 64, 512, 2, 1, 1, 1, 64, 1, 64, "none", 231, 7626),
}
