"""Checkpoints in torch.distributed.checkpoint (DCP) format: sharding-aware, no pickled modules, and read without
unpickling anything but DCP's own metadata types (:mod:`moe_train.safe_dcp`: a checkpoint from elsewhere runs no code).

A checkpoint is a directory ``step_<N>`` holding the DCP files (model and optimizer state as global tensors, so any
layout loads any other), one ``rng_rank<r>.pt`` per rank (tensors only, read with ``weights_only``) and
``meta.json`` (step, the resolved config, package versions, layout, data position). It is written aside as
``.step_<N>.partial`` and renamed only once every file is in place, so a directory named ``step_<N>`` with a
``meta.json`` is complete whatever happened to the process that wrote it; an older complete one is deleted only after
a newer one is in place (``keep_last``).

The optimizer's state goes in whole: for :class:`~moe_train.adamw.PrecisionAwareAdamW` ``exp_avg`` and
``exp_avg_sq`` in their own dtype (bf16 or fp32), ``step``, and the fp32 ``master`` copies of bf16 parameters, each
sharded like its parameter. ``get_optimizer_state_dict`` initialises an optimizer without state by a ``step()`` with
zero gradients and ``lr`` 0 (which counts a step); an optimizer that has ``init_state`` (ours) is initialised with it
instead, so loading never runs an update and the loaded values replace zeros of the right dtypes and shapes.

Frozen parameters (the base of a LoRA run, :mod:`moe_train.peft`) are not stored: they never change, and the run
that resumes reads them from where the first run did (``model.from_hf``, whose identity ``meta.json`` records). Such
a checkpoint holds the adapters, their optimizer state and the buffers.

Routed experts are stored in moe_parallel's canonical form (:func:`moe_parallel.expert_checkpoint_pieces`: gate and
up apart, each a global tensor), the same for every layout, expert-tensor-parallel ones included; the other tensors
are the global tensors DCP sees (DTensors under FSDP, tensor and expert parallelism).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import re
import shutil
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from moe_parallel import (
    ParallelModel,
    StagedModel,
    expert_checkpoint_pieces,
    local_box,
    restore_expert_checkpoint_pieces,
)
from moe_train.faults import agree_on_failure
from moe_train.peft import base_reference
from moe_train.safe_dcp import DamagedCheckpointError, SafeFileSystemReader, UnsafeCheckpointError
from moe_train.safe_dcp import read_metadata as read_dcp_metadata
from moe_train.write_errors import OutputWriteError, interrupted, is_write_failure, write_failure

META_FILE = "meta.json"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"step_(\d+)")
_PARTIAL_DIR = re.compile(r"\.step_(\d+)\.partial")

# (fqn, tensor) -> tensors to save instead (None: save as is); then copy loaded pieces back into the tensor
PiecesFn = Callable[[str, torch.Tensor], "dict[str, torch.Tensor] | None"]
RestoreFn = Callable[[str, torch.Tensor, "dict[str, torch.Tensor]"], None]


# what moe_parallel made of the model: split in place, or the rank's stages (what the trainer holds)
Parallelised = ParallelModel | StagedModel


class CheckpointError(ValueError):
    """A checkpoint cannot be used as asked; the message says which and why, in one line."""


class CheckpointWriteError(OutputWriteError):
    """A checkpoint could not be written (a full disk, permissions); its partial files are removed."""


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    step: int


@dataclass(frozen=True)
class ExpertForm:
    """How routed-expert tensors are written and read: moe_parallel's canonical pieces."""

    pieces: PiecesFn
    restore: RestoreFn


def expert_form(model: nn.Module, parallel: Parallelised | None = None) -> ExpertForm | None:
    """The canonical form of ``model``'s routed experts under ``parallel`` (one process when None); None for a
    model without a parallel plan (nothing is an expert)."""
    if parallel is None:
        plan = getattr(model, "parallel_plan", None)
        if plan is None:
            return None
        if any(isinstance(p, DTensor) for p in model.parameters()):
            raise ValueError("the model is split over a layout: pass its ParallelModel (parallelize's result)")
        parallel = ParallelModel(model, plan=plan())
    return ExpertForm(
        pieces=lambda fqn, tensor: expert_checkpoint_pieces(parallel, fqn, tensor),
        restore=lambda fqn, tensor, pieces: restore_expert_checkpoint_pieces(parallel, fqn, tensor, pieces),
    )


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        # single-process saves and loads are intended; DCP warns that no process group is initialised
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def package_versions() -> dict[str, str]:
    """Versions of torch and of this stack's packages, recorded in each checkpoint."""
    versions = {}
    for name in (
        "torch",
        *(f"moe-{p}" for p in ("dispatch", "experts", "memory", "models", "parallel", "precision", "train")),
    ):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def list_checkpoints(directory: Path) -> list[CheckpointInfo]:
    """The complete checkpoints under ``directory``, oldest first (partial ones and strays are not listed)."""
    found = []
    if directory.is_dir():
        for child in directory.iterdir():
            match = _STEP_DIR.fullmatch(child.name)
            if match and (child / META_FILE).is_file():
                found.append(CheckpointInfo(child, int(match.group(1))))
    return sorted(found, key=lambda c: c.step)


def incomplete_checkpoints(directory: Path) -> list[tuple[Path, int]]:
    """Saves under ``directory`` that did not finish (``.step_N.partial``, or ``step_N`` without ``meta.json``) and
    their steps, oldest first."""
    found = []
    if directory.is_dir():
        for child in directory.iterdir():
            partial = _PARTIAL_DIR.fullmatch(child.name)
            complete_name = _STEP_DIR.fullmatch(child.name)
            if partial:
                found.append((child, int(partial.group(1))))
            elif complete_name and child.is_dir() and not (child / META_FILE).is_file():
                found.append((child, int(complete_name.group(1))))
    return sorted(found, key=lambda pair: pair[1])


def latest_checkpoint(directory: Path) -> CheckpointInfo | None:
    found = list_checkpoints(directory)
    return found[-1] if found else None


def read_meta(path: Path) -> dict[str, Any]:
    """``meta.json`` of the checkpoint at ``path``; a one-line :class:`CheckpointError` if it is not one."""
    meta_file = Path(path) / META_FILE
    if not meta_file.is_file():
        raise CheckpointError(f"{path}: not a complete moe-train checkpoint (no {META_FILE})")
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{meta_file}: unreadable ({err})") from None
    if meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: checkpoint format {meta.get('format')!r}, this moe-train reads {FORMAT_VERSION}"
        )
    return meta


Pieces = dict[tuple[str, str], dict[str, torch.Tensor]]  # (parameter fqn, state key) -> suffix -> piece


def _split(
    entries: dict[str, Any], fqn_of: Callable[[str], str], form: ExpertForm | None, found: Pieces
) -> dict[str, Any]:
    """``entries`` with each routed-expert tensor replaced by its canonical pieces under ``<key><suffix>``; the pieces
    are recorded in ``found`` so that, once DCP has loaded into them, :func:`_join` copies them back."""
    if form is None:
        return entries
    out: dict[str, Any] = {}
    for key, value in entries.items():
        fqn = fqn_of(key)
        pieces = form.pieces(fqn, value) if isinstance(value, torch.Tensor) and value.ndim > 0 else None
        if pieces is None:
            out[key] = value
        else:
            found[(fqn, key)] = pieces
            out.update({key + suffix: piece for suffix, piece in pieces.items()})
    return out


def _canonical(
    model_state: dict[str, Any], optim_state: dict[str, Any] | None, form: ExpertForm | None, found: Pieces
) -> dict[str, Any]:
    """What DCP saves or loads into: model and optimizer state, routed experts in canonical pieces. The other tensors
    are the state dicts' own, so DCP loads into them in place."""
    state: dict[str, Any] = {"model": _split(model_state, lambda key: key, form, found)}
    if optim_state is not None:
        per_param = {
            fqn: _split(param_state, lambda _key, fqn=fqn: fqn, form, found)
            for fqn, param_state in optim_state["state"].items()
        }
        # per-parameter state only: the param groups' hyperparameters come from the config, and how parameters are
        # grouped depends on the layout (plain and DTensor parameters apart), so a stored grouping would not fit another
        state["optim"] = {"state": per_param}
    return state


def _join(model_state: dict[str, Any], optim_state: dict[str, Any] | None, form: ExpertForm, found: Pieces) -> None:
    """Copy the loaded pieces back into the tensors they were cut from."""
    for (fqn, key), pieces in found.items():
        tensor = model_state[key] if fqn == key and key in model_state else optim_state["state"][fqn][key]
        form.restore(fqn, tensor, pieces)


Aliases = list[tuple[Any, Any]]  # (state left out, the state of the same name that stands for it)


def _without_frozen(model: nn.Module, model_state: dict[str, Any]) -> dict[str, Any]:
    """``model_state`` without the frozen parameters (module docstring)."""
    frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {key: value for key, value in model_state.items() if key not in frozen} if frozen else model_state


def _whole_model_names(state: dict[str, Any], parallel: Parallelised | None) -> tuple[dict[str, Any], Aliases]:
    """``state`` (DCP's state) under the whole model's names (``parallel.global_name``: a staged model's stages sit
    under ``<k>.`` in the rank's ``ModuleList``). A name two stages of one rank both hold (a copied embedding) is
    stored once; the aliases say what to copy the loaded value into."""
    if parallel is None:
        return state, []
    aliases: Aliases = []

    def rename(entries: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in entries.items():
            name = parallel.global_name(key)
            if name in out:
                aliases.append((value, out[name]))
            else:
                out[name] = value
        return out

    renamed = {**state, "model": rename(state["model"])}
    if "optim" in state:
        renamed["optim"] = {"state": rename(state["optim"]["state"])}
    return renamed, aliases


@torch.no_grad()
def _copy_aliases(aliases: Aliases) -> None:
    for left_out, loaded in aliases:
        if isinstance(loaded, dict):
            _copy_aliases([(left_out[k], v) for k, v in loaded.items()])
        elif isinstance(loaded, torch.Tensor):
            local_box(left_out)[0].copy_(local_box(loaded)[0])


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: Path, value: dict[str, Any]) -> None:
    with open(path, "w") as out:
        json.dump(value, out, indent=2)
        out.flush()
        os.fsync(out.fileno())


class CheckpointWriter:
    """Writes checkpoints during a run: synchronously, or with DCP's asynchronous save (the state is copied to host
    memory at once, written in the background while training goes on, and made visible at the next save or
    :meth:`wait`). Keeps the ``keep_last`` newest (0: all). ``process_group``: the group async saves talk over, one
    of their own so that the background write never interleaves with the training step's collectives."""

    def __init__(
        self,
        directory: Path,
        *,
        keep_last: int = 0,
        async_save: bool = False,
        parallel: Parallelised | None = None,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.directory, self.keep_last, self.async_save = Path(directory), keep_last, async_save
        self.parallel, self.process_group = parallel, process_group
        self._pending: tuple[Future, Path, Path, dict[str, Any]] | None = None
        self.last: Path | None = None

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, meta: dict[str, Any]) -> None:
        """Write ``step_<step>`` (in the background with ``async_save``). A write that fails removes what it wrote and
        raises :class:`CheckpointWriteError` (one line: the file, why, the last complete checkpoint); an interrupt
        (a second Ctrl-C) removes it too and raises KeyboardInterrupt."""
        self.wait()
        final = self.directory / f"step_{step}"
        staging = self.directory / f".step_{step}.partial"
        try:
            if _rank() == 0:
                shutil.rmtree(staging, ignore_errors=True)
                staging.mkdir(parents=True)
            _barrier()
            torch.save(_rng_state(), staging / f"rng_rank{_rank()}.pt")
            _init_state(optimizer)  # an optimizer that never stepped: its zero state, not DCP's zero-gradient step
            model_state, optim_state = get_state_dict(model, optimizer)
            model_state = _without_frozen(model, model_state)
            form = expert_form(model, self.parallel)
            state, _ = _whole_model_names(_canonical(model_state, optim_state, form, {}), self.parallel)
            state["step"] = torch.tensor(step)
            meta = {"format": FORMAT_VERSION, "step": step, **meta}
            if "config" in meta and "peft_base" not in meta:  # adapters only: the base they adapt, for resuming
                meta["peft_base"] = base_reference(meta["config"])
            with _quiet():
                if self.async_save:
                    future = dcp.async_save(state, checkpoint_id=staging, process_group=self.process_group)
                    self._pending = (future, staging, final, meta)
                    return
                dcp.save(state, checkpoint_id=staging)
            self._publish(staging, final, meta)
        except BaseException as err:
            raise self._failed(err, staging, step) from None

    def wait(self) -> Path | None:
        """Finish an asynchronous save in flight (every rank calls it); returns the newest checkpoint written."""
        if self._pending is not None:
            future, staging, final, meta = self._pending
            self._pending = None
            try:
                future.result()
                self._publish(staging, final, meta)
            except BaseException as err:
                raise self._failed(err, staging, meta["step"]) from None
        return self.last

    def _failed(self, err: BaseException, staging: Path, step: int) -> BaseException:
        """Remove the save's partial directory (if it was not published already); the error to raise:
        KeyboardInterrupt for an interrupt, a one-line :class:`CheckpointWriteError` for a write the file system
        refused, else ``err`` itself (a bug, an out-of-memory, a collective that failed: its traceback matters)."""
        where = write_failure(err, staging)  # before the removal frees the space
        if _rank() == 0:
            shutil.rmtree(staging, ignore_errors=True)
        latest = latest_checkpoint(self.directory)
        saved = latest is not None and latest.step == step  # it failed after the rename: the checkpoint is complete
        what = f"checkpoint of step {step} saved ({latest.path}), then" if saved else f"checkpoint of step {step}"
        kept = f"the last complete checkpoint is {latest.path}" if latest else "no complete checkpoint was written"
        if interrupted(err):
            removed = "" if saved else " (removed)"
            return KeyboardInterrupt(f"interrupted during the checkpoint save of step {step}{removed}; {kept}")
        if not is_write_failure(err, staging):
            return err
        return CheckpointWriteError(
            f"{what if saved else what + ' not saved'}: cannot write {where[0]}: {where[1]}; its partial files were "
            f"removed and {kept}; free space (or fix the directory) and continue with --run.resume auto"
        )

    def _publish(self, staging: Path, final: Path, meta: dict[str, Any]) -> None:
        _barrier()  # every rank's files are written
        failure = None
        if _rank() == 0:
            try:
                self._publish_files(staging, final, meta)
            except OSError as err:
                failure = err
        agree_on_failure(failure)  # every rank stops if the main rank could not publish
        self.last = final

    def _publish_files(self, staging: Path, final: Path, meta: dict[str, Any]) -> None:
        """The main rank's part: ``meta.json``, the rename into place, the checkpoints ``keep_last`` lets go."""
        _write_json(staging / META_FILE, meta)
        _fsync_dir(staging)
        old = final.with_name(f".{final.name}.old")
        if final.exists():  # the same step saved again: the old one goes only once the new one is in place
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
        staging.rename(final)
        _fsync_dir(final.parent)
        shutil.rmtree(old, ignore_errors=True)
        if self.keep_last > 0:  # never the one just written: only older ones count against keep_last
            older = [c for c in list_checkpoints(self.directory) if c.step < int(meta["step"])]
            for stale in older[: max(len(older) - (self.keep_last - 1), 0)]:
                shutil.rmtree(stale.path, ignore_errors=True)


def save_checkpoint(
    directory: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    meta: dict[str, Any] | None = None,
    parallel: Parallelised | None = None,
) -> Path:
    """Write ``directory/step_<step>`` synchronously; it appears only once complete (written aside, then renamed)."""
    writer = CheckpointWriter(directory, parallel=parallel)
    writer.save(step, model, optimizer, meta or {})
    return writer.wait()


def read_checked_metadata(path: Path) -> Metadata:
    """The checkpoint's DCP metadata, read without unpickling anything but DCP's own types
    (:mod:`moe_train.safe_dcp`), its data files checked present and whole; a one-line :class:`CheckpointError`
    naming the file otherwise."""
    try:
        return read_dcp_metadata(path)
    except (UnsafeCheckpointError, DamagedCheckpointError) as err:  # one line naming the file already
        raise CheckpointError(str(err)) from None


def _checked_keys(path: Path, expected: set[str], whole: bool = True) -> Metadata:
    """:func:`read_checked_metadata`, refusing a checkpoint whose model tensors are not exactly the model's (DCP alone
    loads a subset silently); with ``whole=False`` (a pipeline stage) the checkpoint may hold more."""
    metadata = read_checked_metadata(path)
    stored = {k.removeprefix("model.") for k in metadata.state_dict_metadata if k.startswith("model.")}
    missing, extra = sorted(expected - stored), sorted(stored - expected) if whole else []
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"{len(missing)} model tensors missing from it (e.g. {missing[0]})")
        if extra:
            parts.append(f"{len(extra)} it holds that the model lacks (e.g. {extra[0]})")
        raise CheckpointError(f"{path}: checkpoint does not match the model: {'; '.join(parts)}")
    return metadata


def load_checkpoint(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    parallel: Parallelised | None = None,
    *,
    restore_rng: bool = False,
) -> int:
    """Load a checkpoint written by :func:`save_checkpoint` into ``model`` (and ``optimizer``); returns its step.

    Every model tensor must be in the checkpoint and every model tensor there must be in the model
    (:class:`CheckpointError` otherwise). ``parallel``: the layout ``model`` is split over (None: one process).
    ``restore_rng``: also this rank's random generators (same world size)."""
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise CheckpointError(f"{path}: not a DCP checkpoint (no .metadata)")
    whole_state = get_model_state_dict(model)
    model_state = _without_frozen(model, whole_state)
    form = expert_form(model, parallel)
    optim_state = None
    if optimizer is not None:
        _init_state(optimizer)
        optim_state = get_optimizer_state_dict(model, optimizer)
    found: Pieces = {}
    state, aliases = _whole_model_names(_canonical(model_state, optim_state, form, found), parallel)
    state["step"] = torch.tensor(0)
    # a pipeline rank holds only its stages of the model: the other stages' ranks check theirs
    metadata = _checked_keys(path, set(state["model"]), whole=parallel is None or parallel.holds_whole_model)
    try:
        with _quiet():
            dcp.load(state, storage_reader=SafeFileSystemReader(path, metadata))
    except (Exception, CheckpointException) as err:  # DCP's own (missing or truncated files): one line all the same
        raise CheckpointError(f"{path}: cannot be read ({_cause(err)})") from None
    _copy_aliases(aliases)
    if form is not None:
        _join(model_state, optim_state, form, found)
    # DCP loaded into the state dicts' tensors in place; set_* also writes them into FSDP's and the optimizer's own
    set_model_state_dict(model, model_state, options=StateDictOptions(strict=model_state is whole_state))
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, optim_state)
    if restore_rng:
        rng_file = path / f"rng_rank{_rank()}.pt"
        if rng_file.is_file():
            rng = torch.load(rng_file, weights_only=True)
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"])
    return int(state["step"])


def _cause(err: BaseException) -> str:
    """``Type: first line`` of an error, or of the first rank's failure DCP wrapped in a CheckpointException (a
    BaseException whose message is the whole traceback)."""
    if isinstance(err, CheckpointException) and err.failures:
        failure = next(iter(err.failures.values()))
        err = failure[0] if isinstance(failure, tuple) else failure
    first_line = (str(err).strip().splitlines() or [""])[0]
    return f"{type(err).__name__}: {first_line}"


def _init_state(optimizer: torch.optim.Optimizer) -> None:
    """Allocate the optimizer's state without an update where it can (module docstring)."""
    init_state = getattr(optimizer, "init_state", None)
    if not optimizer.state and callable(init_state):
        init_state()
