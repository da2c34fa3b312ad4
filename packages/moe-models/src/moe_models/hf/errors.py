"""The one error type of HF checkpoint import/export."""

from __future__ import annotations


class HFCheckpointError(ValueError):
    """A checkpoint or config that cannot be mapped; the message is one line naming the field/tensor and the fix."""


def name_list(names: list[str] | set[str], limit: int = 5) -> str:
    """The first ``limit`` names, sorted, plus how many more there are."""
    ordered = sorted(names)
    shown = ", ".join(ordered[:limit])
    return shown + (f" (+{len(ordered) - limit} more)" if len(ordered) > limit else "")
