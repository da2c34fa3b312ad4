"""One module per HuggingFace family added after the first four (which live in :mod:`moe_models.hf.config_map`):
each defines ``FAMILY``, an :class:`~moe_models.hf.family.HFFamily`."""

from __future__ import annotations

from moe_models.hf.families import deepseek_v2, dots1, glm4_moe, glm4_moe_lite, minimax_m2, olmoe, qwen2_moe

FAMILY_MODULES = (dots1, glm4_moe, glm4_moe_lite, qwen2_moe, olmoe, deepseek_v2, minimax_m2)
