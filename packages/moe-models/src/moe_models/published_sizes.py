"""The parameter counts model authors published for the published presets (:mod:`moe_models.presets`), with their
rounding and where each was read: what the presets' exact counts are checked against."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PublishedSize:
    """Parameter counts as the model authors published them (model cards / reports)."""

    total: float
    active: float
    # one unit of the last digit published: a count within it of the figure agrees with it, whether the
    # authors rounded or truncated
    total_unit: float
    active_unit: float
    # whether the published active count includes the input embedding (a lookup, not a GEMM): GPT-OSS's
    # model card tabulates it without; DeepSeek-V3 and Kimi-K2 say only "37B" / "32B", which the count
    # without it rounds to (with it, 37.6B and 32.9B); Qwen3's 3.3B and Mixtral's 12.9B include it
    active_includes_input_embedding: bool
    source: str


PUBLISHED_SIZES: dict[str, PublishedSize] = {
    # the V3 report: 671B total (main model; the MTP module is 14B more in the HF checkpoint), 37B activated
    "deepseek-v3-671b": PublishedSize(671e9, 37e9, 1e9, 1e9, False, "DeepSeek-V3 technical report, model card"),
    # "1T total, 32B activated": published to one digit, held here to 5% (the exact count is 1.026T)
    "kimi-k2": PublishedSize(1.0e12, 32e9, 0.05e12, 1e9, False, "Kimi-K2 model card"),
    "qwen3-30b-a3b": PublishedSize(30.5e9, 3.3e9, 0.1e9, 0.1e9, True, "Qwen3-30B-A3B model card"),
    "qwen3-235b-a22b": PublishedSize(235e9, 22e9, 1e9, 1e9, True, "Qwen3-235B-A22B model card"),
    "gpt-oss-20b": PublishedSize(20.91e9, 3.61e9, 0.01e9, 0.01e9, False, "gpt-oss model card, table 1"),
    "gpt-oss-120b": PublishedSize(116.83e9, 5.13e9, 0.01e9, 0.01e9, False, "gpt-oss model card, table 1"),
    "mixtral-8x7b": PublishedSize(46.7e9, 12.9e9, 0.1e9, 0.1e9, True, "Mixtral of Experts paper"),
    # "355B total, 32B active": the card's total is neither the 352.8B counted without the MTP layer nor 356.8B with
    # it, so it is held to 3B; the active count without the input embedding is 32.9B
    "glm-4.5-355b-a32b": PublishedSize(355e9, 32e9, 3e9, 1e9, False, "GLM-4.5 model card"),
    "glm-4.6": PublishedSize(355e9, 32e9, 3e9, 1e9, False, "GLM-4.6 model card (GLM-4.5's architecture)"),
    "glm-4.7": PublishedSize(355e9, 32e9, 3e9, 1e9, False, "GLM-4.7 model card (GLM-4.5's architecture)"),
    "glm-4.5-air": PublishedSize(106e9, 12e9, 1e9, 1e9, False, "GLM-4.5 model card (Air)"),
    "glm-4.7-flash": PublishedSize(30e9, 3e9, 1e9, 1e9, False, "GLM-4.7-Flash model card (30B-A3B)"),
    "dots.llm1": PublishedSize(142e9, 14e9, 1e9, 1e9, True, "dots.llm1 technical report"),
    # "230B total, 10B active": 228.7B counted (the card rounds up), held to 2B
    "minimax-m2": PublishedSize(230e9, 10e9, 2e9, 1e9, False, "MiniMax-M2 model card"),
    "qwen1.5-moe-a2.7b": PublishedSize(14.3e9, 2.7e9, 0.1e9, 0.1e9, True, "Qwen1.5-MoE-A2.7B model card"),
    "qwen2-57b-a14b": PublishedSize(57e9, 14e9, 1e9, 1e9, True, "Qwen2 technical report (57B-A14B)"),
    "olmoe-1b-7b": PublishedSize(6.9e9, 1.3e9, 0.1e9, 0.1e9, True, "OLMoE paper (6.9B total, 1.3B active)"),
    "deepseek-v2": PublishedSize(236e9, 21e9, 1e9, 1e9, False, "DeepSeek-V2 technical report"),
    "deepseek-v2-lite": PublishedSize(15.7e9, 2.4e9, 0.1e9, 0.1e9, False, "DeepSeek-V2-Lite model card"),
    # "21B total, 3B active": 21.8B counted (the card rounds down)
    "ernie-4.5-21b-a3b": PublishedSize(21e9, 3e9, 1e9, 1e9, False, "ERNIE 4.5 model card (21B-A3B)"),
    "ernie-4.5-300b-a47b": PublishedSize(300e9, 47e9, 1e9, 1e9, False, "ERNIE 4.5 model card (300B-A47B)"),
    "hunyuan-a13b": PublishedSize(80e9, 13e9, 1e9, 1e9, True, "Hunyuan-A13B model card"),
    # "109B total": the text model counted here is 107.8B, the card's figure includes the vision encoder; held to 2B
    "llama-4-scout-17b-16e": PublishedSize(109e9, 17e9, 2e9, 1e9, True, "Llama 4 model card (Scout)"),
    "llama-4-maverick-17b-128e": PublishedSize(400e9, 17e9, 1e9, 1e9, True, "Llama 4 model card (Maverick)"),
    # "80B in total and 3B activated": 79.7B and 3.6B counted (without the input embedding; the card rounds down)
    "qwen3-next-80b-a3b": PublishedSize(80e9, 3e9, 1e9, 1e9, False, "Qwen3-Next-80B-A3B model card"),
    # "35B / 122B / 397B in total, 3B / 10B / 17B activated": the text model counts 34.66B / 122.11B / 396.35B (the
    # cards' totals include the vision encoder) and 3.45B / 9.77B / 17.35B active with the input embedding, which round
    # to the cards' figures (2.95B / 9.01B / 16.33B without it)
    "qwen3.5-35b-a3b": PublishedSize(35e9, 3e9, 1e9, 1e9, True, "Qwen3.5-35B-A3B model card"),
    "qwen3.5-122b-a10b": PublishedSize(122e9, 10e9, 1e9, 1e9, True, "Qwen3.5-122B-A10B model card"),
    "qwen3.5-397b-a17b": PublishedSize(397e9, 17e9, 1e9, 1e9, True, "Qwen3.5-397B-A17B model card"),
    # 671B (xorbitsai/inference's stored model page of DeepSeek-V3.2-Exp); 37B active is DeepSeek-V3's figure, whose
    # weights V3.2 continues: the indexers add 0.85B (671.9B and 37.5B counted, without the input embedding)
    "deepseek-v3.2": PublishedSize(671e9, 37e9, 1e9, 1e9, False, "DeepSeek-V3.2-Exp model page; V3's active size"),
    # "744B total, 40B active": 743.91B counted (without the MTP layer, 9.95B more), 40.83B active without the input
    # embedding
    "glm-5": PublishedSize(744e9, 40e9, 1e9, 1e9, False, "GLM-5 model card and report (arXiv 2602.15763)"),
    # "8B / 47B / 56B" (Nemotron-H paper and model cards): 8.10B / 46.79B / 56.32B counted; dense, all of it active
    "nemotron-h-8b": PublishedSize(8e9, 8e9, 1e9, 1e9, True, "Nemotron-H paper (arXiv 2504.03624), 8B model card"),
    "nemotron-h-47b": PublishedSize(47e9, 47e9, 1e9, 1e9, True, "Nemotron-H paper (arXiv 2504.03624), 47B model card"),
    "nemotron-h-56b": PublishedSize(56e9, 56e9, 1e9, 1e9, True, "Nemotron-H paper (arXiv 2504.03624), 56B model card"),
    # "31.6B total, 3.2B active (3.6B including embeddings)": 31.58B counted, 3.23B active without the input embedding
    # (3.58B with it)
    "nemotron-3-nano-30b-a3b": PublishedSize(31.6e9, 3.2e9, 0.1e9, 0.1e9, False, "Nemotron 3 Nano report (2512.20848)"),
    # "48B total, 3B activated": 49.12B counted (48.37B without the input embedding and the output head, each 0.38B),
    # so the total is held to 2B; 3.11B active without the input embedding
    "kimi-linear-48b-a3b": PublishedSize(48e9, 3e9, 2e9, 1e9, False, "Kimi-Linear README model table"),
}
