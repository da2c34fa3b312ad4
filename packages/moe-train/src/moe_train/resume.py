"""Where a run starts from: a fresh output directory, a cleared one (``run.overwrite``) or a checkpoint
(``run.resume auto`` = the latest complete one in the output directory, or a path). Everything here is checked before
the model is built, so a mistake costs nothing and leaves nothing behind."""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from pathlib import Path
from typing import Any

from moe_train.checkpoint import CheckpointError, CheckpointInfo, latest_checkpoint, read_meta
from moe_train.config import ConfigError, ExperimentConfig

# model fields that choose how a step computes, not what the weights are: a checkpoint resumes under another value
_RUNTIME_MODEL_FIELDS = frozenset({"moe_expert_backend"})


@dataclasses.dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a run resumes from and what it recorded."""

    checkpoint: CheckpointInfo
    meta: dict[str, Any]


def checkpoint_dir(cfg: ExperimentConfig) -> Path:
    return Path(cfg.run.output_dir) / "checkpoints"


def check_output_dir(cfg: ExperimentConfig) -> None:
    """Refuse an output directory that holds another run (unless resuming or overwriting) or cannot be written."""
    run = cfg.run
    out = Path(run.output_dir)
    if run.overwrite and run.resume:
        raise ConfigError(
            f"run.overwrite=true with run.resume={run.resume!r}: overwriting deletes what resume reads; keep one"
        )
    if out.exists() and not out.is_dir():
        raise ConfigError(f"run.output_dir={run.output_dir!r} is a file; choose a directory")
    if out.is_dir() and any(out.iterdir()) and not (run.resume or run.overwrite):
        raise ConfigError(
            f"run.output_dir={run.output_dir!r} is not empty (an earlier run?): continue it with --run.resume auto, "
            "replace it with --run.overwrite true, or choose another run.output_dir"
        )
    ancestor = out
    while not ancestor.exists():
        ancestor = ancestor.parent
    try:
        if not ancestor.is_dir():
            raise NotADirectoryError(f"{ancestor} is not a directory")
        tempfile.TemporaryDirectory(dir=ancestor).cleanup()  # root passes every access() check; a real write does not
    except OSError as err:
        raise ConfigError(
            f"run.output_dir={run.output_dir!r} cannot be written ({err.strerror or err}); choose a writable directory"
        ) from None


def clear_output_dir(cfg: ExperimentConfig) -> None:
    """``run.overwrite``: remove what an earlier run left (on the main rank, once the run is known to be valid)."""
    out = Path(cfg.run.output_dir)
    if cfg.run.overwrite and out.is_dir():
        for child in out.iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()


def find_resume_point(cfg: ExperimentConfig) -> ResumePoint | None:
    """The checkpoint ``run.resume`` names, checked against this run's config; None to start fresh
    (``auto`` with no complete checkpoint yet starts fresh, so a launch script can always pass it)."""
    resume = cfg.run.resume
    if not resume:
        return None
    if resume == "auto":
        found = latest_checkpoint(checkpoint_dir(cfg))
        if found is None:
            return None
        path = found.path
    else:
        path = Path(resume)
        if not path.is_dir():
            raise ConfigError(f"run.resume={resume!r}: no such checkpoint directory; give a step_N directory or auto")
        if (run_latest := latest_checkpoint(path / "checkpoints")) is not None:
            path = run_latest.path  # a run's output directory: its latest checkpoint
    try:
        meta = read_meta(path)
    except CheckpointError as err:
        raise ConfigError(f"run.resume={resume!r}: {err}") from None
    found = CheckpointInfo(path, int(meta["step"]))
    check_compatible(cfg, meta, found)
    return ResumePoint(found, meta)


def check_compatible(cfg: ExperimentConfig, meta: dict[str, Any], found: CheckpointInfo) -> None:
    """A checkpoint resumes only into the same model, and only before the last step."""
    saved = meta.get("config", {}).get("model", {})
    current = dataclasses.asdict(cfg.model)
    differing = sorted(
        k for k in set(saved) | set(current) if k not in _RUNTIME_MODEL_FIELDS and saved.get(k) != current.get(k)
    )
    if differing:
        shown = ", ".join(
            f"model.{k} ({saved.get(k)!r} in the checkpoint, {current.get(k)!r} here)" for k in differing[:4]
        )
        more = f" and {len(differing) - 4} more" if len(differing) > 4 else ""
        raise ConfigError(
            f"run.resume={cfg.run.resume!r}: {found.path} holds another model: {shown}{more}; resume with the "
            "checkpoint's model settings (its meta.json) or start a new run"
        )
    if found.step >= cfg.train.steps:
        raise ConfigError(
            f"run.resume={cfg.run.resume!r}: {found.path} is at step {found.step} and train.steps={cfg.train.steps}: "
            "nothing left to train; raise train.steps"
        )
