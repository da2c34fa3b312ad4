"""Run loggers on the main rank: TensorBoard event files always, Weights & Biases when a project is set.

The trainer creates one :class:`RunLoggers`, calls :meth:`RunLoggers.log` with each step's record (and with
evaluation records such as ``{"val_loss": x}``) and :meth:`RunLoggers.close` at the end. wandb is optional:
it is imported only when ``run.wandb_project`` is set, and :func:`check_wandb_available` lets the trainer
report a missing install as a config error before any training starts.
"""

from __future__ import annotations

import importlib
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# keys the trainer writes, by the TensorBoard section they belong in; other keys go to "train/"
PERF_KEYS = frozenset({"tokens_per_s", "tflops_per_gpu", "mfu", "step_time_s"})
MOE_KEYS = frozenset({"expert_load_max_over_mean", "dropped_fraction"})
EVAL_PREFIXES = ("val_", "eval_")
FLUSH_SECS = 10  # SummaryWriter's default (120 s) leaves a live TensorBoard minutes behind
WANDB_ID_FILE = "wandb_id.txt"


class WandbUnavailableError(ValueError):
    """``run.wandb_project`` is set but wandb cannot be imported; the message is one line naming the fix."""


def check_wandb_available(project: str) -> None:
    """Raise :class:`WandbUnavailableError` when ``project`` is set and wandb is not installed (no-op otherwise)."""
    if project:
        _import_wandb(project)


def _import_wandb(project: str) -> Any:
    try:
        return importlib.import_module("wandb")
    except ImportError:
        raise WandbUnavailableError(
            f"run.wandb_project={project}: wandb is not installed; pip install wandb or unset run.wandb_project"
        ) from None


def tag_for(key: str) -> str:
    """The TensorBoard / W&B name of a record key: ``loss`` -> ``train/loss``, ``val_loss`` -> ``eval/val_loss``."""
    if "/" in key:  # already grouped by the caller
        return key
    if key.startswith(EVAL_PREFIXES):
        return f"eval/{key}"
    if key in PERF_KEYS:
        return f"perf/{key}"
    if key in MOE_KEYS:
        return f"moe/{key}"
    return f"train/{key}"


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The numeric entries of ``record`` under their tags; ``step`` and non-numbers (strings, None) are left out.

    NaN and inf are kept: both backends store them, and a loss turning NaN is what one wants to see.
    """
    out = {}
    for key, value in record.items():
        if key != "step" and isinstance(value, int | float) and not isinstance(value, bool):
            out[tag_for(key)] = float(value)
    return out


def stable_wandb_id(output_dir: Path) -> str:
    """The W&B run id kept in ``output_dir/wandb_id.txt``, created on first use, so a resumed run continues it."""
    path = output_dir / WANDB_ID_FILE
    if path.exists() and (run_id := path.read_text().strip()):
        return run_id
    run_id = uuid.uuid4().hex[:16]
    output_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(run_id + "\n")
    return run_id


class RunLoggers:
    """TensorBoard (``output_dir/tensorboard``) and, when ``wandb_project`` is set, W&B logging of step records.

    ``resume_step``: the checkpoint step a run resumes from. TensorBoard events of the earlier session with a
    step above it are hidden (``purge_step``), so steps the resumed run logs again appear once. A fresh run
    (``resume_step == 0``) hides every earlier event in the directory, as ``metrics.jsonl`` is rewritten then too.
    """

    def __init__(
        self,
        output_dir: Path,
        config: dict[str, Any],
        wandb_project: str = "",
        run_name: str = "",
        resume_step: int = 0,
    ) -> None:
        # imported here: it pulls in tensorboard, which the modules importing this one need not pay for
        from torch.utils.tensorboard import SummaryWriter

        self.output_dir = Path(output_dir)
        self._wandb_run: Any = None
        if wandb_project:  # first, so a missing wandb fails before an event file is created
            wandb = _import_wandb(wandb_project)
            self._wandb_run = wandb.init(
                project=wandb_project,
                name=run_name or None,
                config=config,
                dir=str(self.output_dir),
                resume="allow",
                id=stable_wandb_id(self.output_dir),
            )
        # the purge keeps events with step < purge_step; logging starts again at resume_step + 1
        self.tensorboard = SummaryWriter(
            log_dir=str(self.output_dir / "tensorboard"),
            purge_step=resume_step + 1 if resume_step > 0 else 0,
            flush_secs=FLUSH_SECS,
        )

    def log(self, step: int, record: Mapping[str, Any]) -> None:
        """Write the numeric entries of ``record`` at ``step`` (a ``step`` key in the record is ignored)."""
        values = scalars(record)
        for tag, value in values.items():
            self.tensorboard.add_scalar(tag, value, global_step=step)
        if self._wandb_run is not None and values:
            self._wandb_run.log(values, step=step)

    def flush(self) -> None:
        self.tensorboard.flush()

    def close(self) -> None:
        self.tensorboard.close()
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None

    def __enter__(self) -> RunLoggers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
