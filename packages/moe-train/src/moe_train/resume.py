"""Where a run starts from: a fresh output directory, a cleared one (``run.overwrite``) or a checkpoint
(``run.resume auto`` = the latest complete one in the output directory, or a path). Everything here is checked before
the model is built, so a mistake costs nothing and leaves nothing behind.

An output directory holds one history. Resuming from a checkpoint other than its latest (or from another run's)
abandons what came after: :func:`start_history` moves those checkpoints, with the abandoned history's
``metrics.jsonl`` and ``summary.json``, into ``checkpoints/abandoned-<time>/`` before the run writes anything, and the
metrics log and TensorBoard events are cut back to the resume point, so ``run.resume auto`` always continues the
history the last run wrote."""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from moe_train.checkpoint import (
    CheckpointError,
    CheckpointInfo,
    incomplete_checkpoints,
    latest_checkpoint,
    list_checkpoints,
    read_meta,
)
from moe_train.config import ConfigError, ExperimentConfig
from moe_train.output_lock import LOCK_FILE, check_unlocked
from moe_train.peft import check_base

# model fields that choose how a step computes, not what the weights are: a checkpoint resumes under another value
_RUNTIME_MODEL_FIELDS = frozenset(
    {"moe_expert_backend", "moe_permute_backend", "linear_attention_backend", "mamba_backend"}
)


@dataclasses.dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a run resumes from and what it recorded."""

    checkpoint: CheckpointInfo
    meta: dict[str, Any]
    # complete checkpoints of the output directory that do not lead to ``checkpoint``: the later ones, or all of them
    # when it is another directory's (``foreign``); set aside by start_history
    abandoned: tuple[CheckpointInfo, ...] = ()
    foreign: bool = False
    incomplete: tuple[Path, ...] = ()  # saves newer than ``checkpoint`` that did not finish (passed over)


def checkpoint_dir(cfg: ExperimentConfig) -> Path:
    return Path(cfg.run.output_dir) / "checkpoints"


# the writable check's folder: each rank of a run checks before the group forms, and one rank's probe inside the output
# directory (which the main rank's lock may have made) must not read as an earlier run's files to another
WRITE_PROBE_PREFIX = ".moe-train-write-probe-"


def _run_own(name: str) -> bool:
    """An entry of the output directory this run itself puts there while checking it: the lock, a write probe."""
    return name == LOCK_FILE or name.startswith(WRITE_PROBE_PREFIX)


def check_output_dir(cfg: ExperimentConfig, *, locked: bool = False) -> None:
    """Refuse an output directory that another live run holds, that holds another run (unless resuming or
    overwriting) or that cannot be written. ``locked``: this process holds its lock."""
    run = cfg.run
    out = Path(run.output_dir)
    if run.overwrite and run.resume:
        raise ConfigError(
            f"run.overwrite=true with run.resume={run.resume!r}: overwriting deletes what resume reads; keep one"
        )
    if out.exists() and not out.is_dir():
        raise ConfigError(f"run.output_dir={run.output_dir!r} is a file; choose a directory")
    # the main rank (RANK 0 under torchrun) holds the lock for every rank of a run: the others do not look
    if out.is_dir() and not locked and int(os.environ.get("RANK", "0")) == 0:
        check_unlocked(run.output_dir)
    if out.is_dir() and any(not _run_own(p.name) for p in out.iterdir()) and not (run.resume or run.overwrite):
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
        # root passes every access() check; a real write does not
        tempfile.TemporaryDirectory(prefix=WRITE_PROBE_PREFIX, dir=ancestor).cleanup()
    except OSError as err:
        raise ConfigError(
            f"run.output_dir={run.output_dir!r} cannot be written ({err.strerror or err}); choose a writable directory"
        ) from None


def clear_output_dir(cfg: ExperimentConfig) -> None:
    """``run.overwrite``: remove what an earlier run left (on the main rank, once the run is known to be valid)."""
    out = Path(cfg.run.output_dir)
    if cfg.run.overwrite and out.is_dir():
        for child in out.iterdir():
            if child.name == LOCK_FILE:  # this run's own lock
                continue
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
    own_dir = checkpoint_dir(cfg)
    foreign = not (own_dir.is_dir() and path.parent.resolve() == own_dir.resolve())
    existing = list_checkpoints(own_dir)
    abandoned = tuple(existing if foreign else (c for c in existing if c.step > found.step))
    incomplete = tuple(p for p, step in incomplete_checkpoints(own_dir) if step > found.step and not foreign)
    return ResumePoint(found, meta, abandoned, foreign, incomplete)


# files of a run's output directory that describe its history up to where it stopped
HISTORY_FILES = ("metrics.jsonl", "summary.json", "loss.svg", "expert_load.svg")


def _aside_dir(checkpoints: Path) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    aside, n = checkpoints / f"abandoned-{stamp}", 1
    while aside.exists():
        n += 1
        aside = checkpoints / f"abandoned-{stamp}-{n}"
    return aside


def start_history(cfg: ExperimentConfig, resume: ResumePoint | None) -> list[str]:
    """Make the output directory hold the one history this run continues (on the main rank, once the run is known to
    be valid, before anything is written): ``run.overwrite`` clears it; saves that never finished (``.step_N.partial``)
    and files a killed rewrite left (``*.tmp``) go; a resume sets aside the checkpoints and files of the history it
    abandons (module docstring). Returns notes for the user."""
    out, checkpoints = Path(cfg.run.output_dir), checkpoint_dir(cfg)
    notes: list[str] = []
    if resume is None:
        clear_output_dir(cfg)
    # a .step_N.old whose step_N is missing is the complete checkpoint a re-save of step N was replacing when it was
    # killed: it is left for the user (rename it to step_N to use it)
    olds = [p for p in checkpoints.glob(".step_*.old") if (checkpoints / p.name[1:].removesuffix(".old")).exists()]
    stale = [*checkpoints.glob(".step_*.partial"), *olds, *out.glob("*.tmp")]
    for path in stale:
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    passed_over = resume.incomplete if resume is not None else ()
    if removed := [p.name for p in stale if p not in passed_over]:
        notes.append(f"removed what interrupted writes left: {', '.join(removed)}")
    if resume is None:
        return notes
    step = resume.checkpoint.step
    if passed_over:
        notes.append(
            f"passed over {', '.join(p.name for p in passed_over)} (newer than step {step} but incomplete: a save that "
            f"did not finish; partial ones removed); resuming from {resume.checkpoint.path}"
        )
    history = [out / name for name in HISTORY_FILES if (out / name).is_file()]
    if resume.foreign and (out / "tensorboard").is_dir():
        history.append(out / "tensorboard")
    if resume.abandoned or (resume.foreign and history):
        aside = _aside_dir(checkpoints)
        aside.mkdir(parents=True)
        for checkpoint in resume.abandoned:
            checkpoint.path.rename(aside / checkpoint.path.name)
        for path in history:
            if path.name == "metrics.jsonl" and not resume.foreign:
                shutil.copy2(path, aside / path.name)  # cut back to the resume point by the run's MetricsLog
            else:
                path.rename(aside / path.name)
        what = f"checkpoints {', '.join(c.path.name for c in resume.abandoned)}" if resume.abandoned else "its files"
        origin = f"{resume.checkpoint.path} (another directory's)" if resume.foreign else f"step {step}"
        notes.append(
            f"resuming from {origin} abandons the history this output directory went on to: {what} moved to {aside}"
        )
    else:
        (out / "summary.json").unlink(missing_ok=True)  # where the last session ended; this one writes its own
    return notes


def print_notes(notes: list[str]) -> None:
    for note in notes:
        print(f"moe-train: note: {note}", file=sys.stderr)


def check_compatible(cfg: ExperimentConfig, meta: dict[str, Any], found: CheckpointInfo) -> None:
    """A checkpoint resumes only into the same model, with the optimizer that wrote it, and only before the last
    step."""
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
    check_base(cfg, meta, found.path)  # adapters resume onto the base they were trained on
    # Muon's matrices hold a momentum buffer where AdamW's hold two moments and a step: neither loads the other's
    optimizer = meta.get("config", {}).get("train", {}).get("optimizer", "adamw")
    if optimizer != cfg.train.optimizer:
        raise ConfigError(
            f"train.optimizer={cfg.train.optimizer!r}: {found.path} was written by train.optimizer {optimizer}, whose "
            f"states this one cannot load; resume with train.optimizer {optimizer} or start a new run"
        )
    if found.step >= cfg.train.steps:
        raise ConfigError(
            f"run.resume={cfg.run.resume!r}: {found.path} is at step {found.step} and train.steps={cfg.train.steps}: "
            "nothing left to train; raise train.steps"
        )
