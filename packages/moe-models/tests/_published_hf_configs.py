"""The published config.json values (moved to :mod:`moe_models.published_configs`, the hybrid models' to
:mod:`moe_models.published_hybrid_configs` and merged back in), for the family tests."""

from moe_models.published_configs import PUBLISHED_HF_CONFIGS

__all__ = ["PUBLISHED_HF_CONFIGS"]
