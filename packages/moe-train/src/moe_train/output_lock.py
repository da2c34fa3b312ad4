"""One run per output directory at a time: an exclusive ``flock`` on ``<output_dir>/.moe-train.lock``, held by the
main rank for the whole run.

The kernel drops the lock when its holder exits, however it exits (kill -9 included), so a lock file left by a dead
run is simply taken by the next one: there are no stale locks to clean up. The file holds the holder's PID and host,
for the message another run gets. ``flock`` is advisory and local to one machine's kernel (a network file system may
not honour it across machines).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
from pathlib import Path

from moe_train.config import ConfigError

LOCK_FILE = ".moe-train.lock"


def _in_use(output_dir: str, holder: str) -> ConfigError:
    return ConfigError(
        f"run.output_dir={output_dir!r} is in use by another moe-train run ({holder}); wait for it to end, or choose "
        "another run.output_dir"
    )


def _holder_text(path: Path) -> str:
    try:
        fields = path.read_text().split()
    except OSError:
        fields = []
    if len(fields) >= 2:
        return f"PID {fields[0]} on {fields[1]}"
    return "PID unknown"


def check_unlocked(output_dir: str) -> None:
    """Refuse an output directory another live run holds (a :class:`ConfigError` naming its PID); writes nothing."""
    path = Path(output_dir) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # no lock file (or none readable): nobody holds it
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # refused while a run holds it exclusively
    except BlockingIOError:
        raise _in_use(output_dir, _holder_text(path)) from None
    finally:
        os.close(fd)  # closing drops a lock taken just to look


class OutputDirLock:
    """The lock of ``output_dir``, taken by :meth:`acquire` (creating the directory when missing) and dropped by
    :meth:`release`, which also removes a directory this lock created if nothing but the lock file is in it (a run
    that stopped before writing anything leaves nothing behind)."""

    def __init__(self, output_dir: str) -> None:
        self.output_dir = output_dir
        self.path = Path(output_dir) / LOCK_FILE
        self._fd: int | None = None
        self._created_dir = False

    def acquire(self) -> OutputDirLock:
        directory = self.path.parent
        self._created_dir = not directory.exists()
        try:
            directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:  # another user's lock file, a read-only directory
            raise ConfigError(
                f"run.output_dir={self.output_dir!r}: cannot take its lock file {self.path} ({err.strerror or err}); "
                "choose a directory this user can write"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise _in_use(self.output_dir, _holder_text(self.path)) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {socket.gethostname()} {int(time.time())}\n".encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        directory = self.path.parent
        if self._created_dir and [p.name for p in directory.iterdir()] == [LOCK_FILE]:
            # removed while still held: a run that opened the file meanwhile fails to lock it (its attempt does not
            # wait), rather than locking a file no longer in the directory
            self.path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # another run created something in it meanwhile
                directory.rmdir()
        os.close(self._fd)  # drops the lock
        self._fd = None

    def __del__(self) -> None:  # a Setup dropped without a run (tests, benchmarks) must not keep the directory locked
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
