"""Writes that fail (a full disk, a quota, a read-only or vanished directory) as one line naming the file and why.

DCP wraps a rank's failure in a ``CheckpointException`` whose message is the whole traceback, and torch's zip writer
reports a short write as ``unexpected pos`` with no errno: :func:`write_failure` digs the ``OSError`` out of the chain
and, where there is none, asks the file system whether it is out of space.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from torch.distributed.checkpoint import CheckpointException

# below this many free bytes a write that failed without an errno is taken to have failed for lack of space
LOW_SPACE_BYTES = 1 << 20


class OutputWriteError(RuntimeError):
    """A file of the run (or of an export) could not be written; the message is one line: which file, why, what was
    kept and what to do."""


def _chain(err: BaseException) -> Iterator[BaseException]:
    """``err``, the exceptions it wraps (DCP's per-rank failures) and their causes and contexts, each once."""
    seen: set[int] = set()
    pending = [err]
    while pending:
        current = pending.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        if isinstance(current, CheckpointException):
            for failure in current.failures.values():
                pending.append(failure[0] if isinstance(failure, tuple) else failure)
        pending.extend(e for e in (current.__cause__, current.__context__) if e is not None)


def interrupted(err: BaseException) -> bool:
    """Whether ``err`` is, or wraps, a KeyboardInterrupt (DCP turns one raised inside its writes into its own
    exception)."""
    return any(isinstance(e, KeyboardInterrupt) for e in _chain(err))


def _free_bytes(path: Path) -> int | None:
    for candidate in (path, *path.parents):
        if candidate.exists():
            return shutil.disk_usage(candidate).free
    return None


def write_failure(err: BaseException, where: Path) -> tuple[Path, str]:
    """(the file that failed, why) for a write under ``where`` that raised ``err``."""
    for cause in _chain(err):
        if isinstance(cause, OSError) and cause.errno is not None:
            name = cause.filename if isinstance(cause.filename, str) and cause.filename else where
            return Path(name), cause.strerror or errno.errorcode.get(cause.errno, str(cause.errno))
    free = _free_bytes(where)
    if free is not None and free < LOW_SPACE_BYTES:
        return where, f"{os.strerror(errno.ENOSPC)} ({free} bytes free)"
    last = list(_chain(err))[-1]
    first_line = (str(last).strip().splitlines() or [""])[0]
    return where, f"{type(last).__name__}: {first_line}" if first_line else type(last).__name__


def is_write_failure(err: BaseException, where: Path) -> bool:
    """Whether ``err`` is (or wraps) an ``OSError`` with an errno, or happened with the disk under ``where`` full: a
    failure the user fixes on the file system, not a bug."""
    if any(isinstance(cause, OSError) and cause.errno is not None for cause in _chain(err)):
        return True
    free = _free_bytes(where)
    return free is not None and free < LOW_SPACE_BYTES


def describe(err: BaseException, where: Path) -> str:
    """``cannot write <file>: <why>`` for ``err``."""
    path, why = write_failure(err, where)
    return f"cannot write {path}: {why}"


@contextlib.contextmanager
def writing(path: Path, consequence: str) -> Iterator[None]:
    """Turn an ``OSError`` of the writes inside into :class:`OutputWriteError`: ``cannot write <path>: <why>;
    <consequence>`` (``path``: the file written, when the error does not name one)."""
    try:
        yield
    except OSError as err:
        raise OutputWriteError(f"{describe(err, path)}; {consequence}") from None


def write_whole(path: Path, text: str, *, fsync: bool = False) -> None:
    """``path`` holding ``text``, or, when the write fails (a full disk), as it was: written aside as ``<name>.tmp``
    (removed on failure) and renamed over it; ``fsync``: on disk before the rename."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w") as out:
            out.write(text)
            if fsync:
                out.flush()
                os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
