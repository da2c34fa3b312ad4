"""Training data that exists on every machine: byte-level tokens of the Python standard library's
source files, cached once as a flat uint8 file and memory-mapped."""

from __future__ import annotations

import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

SEPARATOR = b"\n\n"


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "moe-train"


def stdlib_sources() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    # site-packages lives under the stdlib on some layouts; it is not the standard library
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts)


def stdlib_token_file(cache_dir: Path | None = None) -> Path:
    """The cached token file, built on first use (atomically, so concurrent ranks are safe)."""
    cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    path = cache_dir / f"stdlib-py{version}-bytes.u8"
    if path.exists():
        return path
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    with open(tmp, "wb") as out:
        for source in stdlib_sources():
            try:
                out.write(source.read_bytes())
            except OSError:  # unreadable files (permissions, broken links) are skipped
                continue
            out.write(SEPARATOR)
    os.replace(tmp, path)
    return path


@dataclass(frozen=True)
class Batch:
    input_ids_BS: torch.Tensor
    labels_BS: torch.Tensor


class TokenStream:
    """Random windows of a memory-mapped token file; batch ``step`` is the same on every machine,
    and each data-parallel rank takes its own contiguous slice of the global batch."""

    def __init__(self, path: Path, seq_len: int, seed: int) -> None:
        self.tokens = np.memmap(path, dtype=np.uint8, mode="r")
        if len(self.tokens) <= seq_len + 1:
            raise ValueError(f"data.seq_len={seq_len}: longer than the {len(self.tokens)}-token data set")
        self.seq_len, self.seed = seq_len, seed

    def global_offsets(self, step: int, global_batch: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, step])
        return rng.integers(0, len(self.tokens) - self.seq_len - 1, size=global_batch)

    def batch(self, step: int, global_batch: int, start: int, count: int) -> Batch:
        """Sequences ``start .. start+count-1`` of global batch ``step``."""
        offsets = self.global_offsets(step, global_batch)[start : start + count]
        windows = np.stack([self.tokens[o : o + self.seq_len + 1] for o in offsets]).astype(np.int64)
        windows_t = torch.from_numpy(windows)
        return Batch(windows_t[:, :-1], windows_t[:, 1:])
