"""The published config.json values (moved to :mod:`moe_models.published_configs`), for the family tests."""

from moe_models.published_configs import PUBLISHED_HF_CONFIGS

__all__ = ["PUBLISHED_HF_CONFIGS"]
