"""One module per HuggingFace family added after the first four (which live in :mod:`moe_models.hf.config_map`):
each defines ``FAMILY``, an :class:`~moe_models.hf.family.HFFamily`."""

from __future__ import annotations

from moe_models.hf.families import (
    deepseek_v2,
    deepseek_v32,
    dots1,
    ernie4_5_moe,
    exaone_moe,
    flint,
    glm4_moe,
    glm4_moe_lite,
    glm_moe_dsa,
    hunyuan_v1_moe,
    hy_v3,
    kimi_linear,
    llama4,
    mellum,
    minimax_m2,
    nemotron_h,
    olmoe,
    qwen2_moe,
    qwen3_5_moe,
    qwen3_next,
    solar_open,
)

FAMILY_MODULES = (
    deepseek_v2,
    dots1,
    glm4_moe,
    glm4_moe_lite,
    minimax_m2,
    olmoe,
    qwen2_moe,
    ernie4_5_moe,
    hunyuan_v1_moe,
    llama4,
    solar_open,
    hy_v3,
    exaone_moe,
    flint,
    mellum,
    qwen3_next,
    deepseek_v32,
    qwen3_5_moe,
    nemotron_h,
    glm_moe_dsa,
    kimi_linear,
)
