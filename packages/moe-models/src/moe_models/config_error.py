"""The error an invalid :class:`~moe_models.config.ModelConfig` raises (a leaf module: the config and its pattern
helpers both import it)."""

from __future__ import annotations


class ModelConfigError(ValueError):
    """An invalid :class:`ModelConfig`: ``field`` is the ModelConfig field to change, ``reason`` what is wrong and
    the fix (it may name other ModelConfig fields). ``str(err)`` is ``f"{field}={value!r}: {reason}"``."""

    def __init__(self, field: str, value: object, reason: str) -> None:
        super().__init__(f"{field}={value!r}: {reason}")
        self.field, self.value, self.reason = field, value, reason

    def __reduce__(self):  # type: ignore[no-untyped-def]
        # pickling (multiprocessing, torch.distributed) rebuilds from the constructor's arguments
        return type(self), (self.field, self.value, self.reason)
