"""The error every rule a user's configuration breaks raises (:mod:`moe_train.config` and the checks beside it)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration the user wrote cannot be used; the message names the key and the fix."""
