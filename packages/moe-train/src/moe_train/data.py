"""Training data as memory-mapped token files, and the random windows the trainer reads from them.

``prepare_data`` turns the ``data`` config section into token files (sources: moe_train.sources; tokenizers:
moe_train.tokenization; packing and the cache: moe_train.packing). The default, byte-level tokens of the Python
standard library's source files, exists on every machine and is cached once as a flat uint8 file. Conversations
(``data.format`` chat / prompt_completion) take their own path (moe_train.conversation_data) to windows of whole
conversations with labels on the answers only (moe_train.conversation_stream.ConversationStream).
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from moe_train.batch import Batch
from moe_train.config import ConfigError, DataConfig
from moe_train.conversation_data import prepare_conversations
from moe_train.conversation_stream import ConversationStream
from moe_train.packing import log_to_stderr, token_files
from moe_train.sources import STDLIB, resolve_source, stdlib_sources
from moe_train.tokenization import BYTE_SEPARATOR, default_tokenizer, load_tokenizer

SEPARATOR = BYTE_SEPARATOR
DTYPES = {".u8": np.uint8, ".u16": np.uint16, ".u32": np.uint32}

__all__ = [
    "SEPARATOR",
    "Batch",
    "ConversationStream",
    "PreparedData",
    "TokenStream",
    "default_cache_dir",
    "default_tokenizer",
    "prepare_data",
    "stdlib_sources",
    "stdlib_token_file",
]


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "moe-train"


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


class TokenStream:
    """Random windows of a memory-mapped token file; batch ``step`` is the same on every machine,
    and each data-parallel rank takes its own contiguous slice of the global batch.

    The token dtype follows the file's suffix (.u8, .u16, .u32; anything else is uint8) unless given. ``what``
    names the data in the error for a file shorter than one window.
    """

    def __init__(
        self, path: Path, seq_len: int, seed: int, dtype: np.dtype | None = None, what: str = "data set"
    ) -> None:
        self.path = Path(path)
        dtype = dtype if dtype is not None else DTYPES.get(self.path.suffix, np.uint8)
        self.tokens = np.memmap(self.path, dtype=dtype, mode="r")
        if len(self.tokens) <= seq_len + 1:
            raise ConfigError(
                f"data.seq_len={seq_len}: longer than the {len(self.tokens)}-token {what}; lower data.seq_len "
                "or use more data"
            )
        self.seq_len, self.seed = seq_len, seed

    def global_offsets(self, step: int, global_batch: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, step])
        return rng.integers(0, len(self.tokens) - self.seq_len - 1, size=global_batch)

    def _windows(self, offsets: np.ndarray) -> Batch:
        windows = np.stack([self.tokens[o : o + self.seq_len + 1] for o in offsets]).astype(np.int64)
        windows_t = torch.from_numpy(windows)
        return Batch(windows_t[:, :-1], windows_t[:, 1:])

    def batch(self, step: int, global_batch: int, start: int, count: int) -> Batch:
        """Sequences ``start .. start+count-1`` of global batch ``step``."""
        return self._windows(self.global_offsets(step, global_batch)[start : start + count])

    def labelled_tokens(self, step: int, global_batch: int) -> int:
        """The labels of global batch ``step``: every position of every window has one."""
        return global_batch * self.seq_len

    def eval_offsets(self, num_windows: int | None = None) -> np.ndarray:
        """Starts of fixed evaluation windows: non-overlapping (each token is a label at most once), spread evenly
        over the file; all that fit when ``num_windows`` is None or more than fit."""
        available = (len(self.tokens) - 1) // self.seq_len
        count = available if num_windows is None else min(num_windows, available)
        return (np.arange(count, dtype=np.int64) * available // max(count, 1)) * self.seq_len

    def eval_batches(
        self, num_batches: int | None, batch_size: int, start: int = 0, count: int | None = None
    ) -> Iterator[Batch]:
        """``num_batches`` fixed batches of ``batch_size`` windows (as many whole batches as fit when None or more
        than fit): the same whatever the step, the seed or the machine. As in :meth:`batch`, each data-parallel rank
        takes sequences ``start .. start+count-1`` of every batch."""
        available = len(self.eval_offsets())
        wanted = available if num_batches is None else min(num_batches * batch_size, available)
        whole = wanted // batch_size
        if whole == 0:
            raise ConfigError(
                f"data.seq_len={self.seq_len}: the {len(self.tokens)}-token evaluation data holds {available} "
                f"windows, fewer than one batch of {batch_size}; lower data.seq_len or add validation data"
            )
        offsets = self.eval_offsets(whole * batch_size).reshape(whole, batch_size)
        stop = batch_size if count is None else start + count
        return (self._windows(row[start:stop]) for row in offsets)

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class PreparedData:
    """What the trainer reads: training windows, validation windows (None without validation data) and what
    identifies them."""

    train: TokenStream | ConversationStream
    valid: TokenStream | ConversationStream | None
    vocab_size_needed: int  # model.vocab_size must be at least this: every id the tokenizer can produce
    eos_id: int | None  # the id after every document; None for byte level, whose documents end with a blank line
    separator: tuple[int, ...]  # the ids after every document
    tokenizer: str  # the tokenizer file or directory; "" = byte level
    # hash of the token files' content (and dtype): equal for equal data, wherever it is cached; checkpoints record
    # it so that a resume on other data can be refused
    fingerprint: str
    # conversations (data.format chat / prompt_completion): the share of the training windows' tokens that are
    # conversations' (the rest is padding); None for text
    packing_efficiency: float | None = None
    # records and conversations left out by data.bad_records=skip / data.truncation=skip: reason -> count
    skipped: dict[str, int] = field(default_factory=dict)


def _stdlib_bytes(data: DataConfig, cache_dir: Path, seed: int) -> PreparedData:
    """The default data, read from the same file (and so the same windows) as before there were other sources."""
    path = stdlib_token_file(cache_dir)
    with open(path, "rb") as file:
        digest = hashlib.file_digest(file, "sha256").hexdigest()
    stream = TokenStream(path, data.seq_len, seed, what="training data (data.source='stdlib')")
    return PreparedData(stream, None, 256, None, tuple(SEPARATOR), "", f"stdlib-bytes-{digest}")


def prepare_data(
    data: DataConfig,
    *,
    seed: int,
    model_vocab_size: int | None = None,
    model_from_hf: str = "",
    log: Callable[[str], None] | None = log_to_stderr,
) -> PreparedData:
    """Resolve the sources, load the tokenizer, tokenise into the cache unless an entry for exactly these
    inputs is there, and open the token files. Every mistake a user can make is a one-line :class:`ConfigError`,
    raised before the trainer builds anything: missing or unreadable sources, a missing ``data.text_field``, an
    empty corpus, a tokenizer that is not one, a vocabulary larger than ``model_vocab_size``, data shorter than a
    window. ``log`` hears about a build (which can take a while); cache hits are silent. For data.format chat /
    prompt_completion, bad records and conversations longer than a window too (or, with data.bad_records /
    data.truncation skip, their counts in ``skipped``)."""
    cache_dir = Path(data.cache_dir).expanduser() if data.cache_dir else default_cache_dir()
    tokenizer = load_tokenizer(default_tokenizer(data, model_from_hf), data.eos_token)
    if model_vocab_size is not None and model_vocab_size < tokenizer.vocab_size:
        what = f"data.tokenizer={tokenizer.name!r}" if tokenizer.name else "byte-level data"
        raise ConfigError(
            f"model.vocab_size={model_vocab_size}: {what} needs at least {tokenizer.vocab_size}; "
            f"set model.vocab_size={tokenizer.vocab_size} or more"
        )
    if data.format != "text":
        found = prepare_conversations(data, tokenizer, cache_dir, seed, log)
        return PreparedData(
            train=found.train,
            valid=found.valid,
            vocab_size_needed=tokenizer.vocab_size,
            eos_id=tokenizer.eos_id,
            separator=(),  # nothing follows a conversation: its template ends it, and windows keep them apart
            tokenizer=tokenizer.name,
            fingerprint=found.fingerprint,
            packing_efficiency=found.train.packing_efficiency,
            skipped=found.skipped,
        )
    valid_spec = data.valid_source
    if data.source == STDLIB and not tokenizer.name and not valid_spec and not data.valid_fraction:
        return _stdlib_bytes(data, cache_dir, seed)
    train = resolve_source(data.source, data.text_field, "data.source", data.decode_errors)
    valid = resolve_source(valid_spec, data.text_field, "data.valid_source", data.decode_errors) if valid_spec else None
    files = token_files(cache_dir, train, valid, data.valid_fraction, tokenizer, log)
    rest = f" less data.valid_fraction={data.valid_fraction}" if data.valid_fraction else ""
    stream = TokenStream(files.train, data.seq_len, seed, what=f"training data ({train.describe()}{rest})")
    valid_stream = None
    if files.valid is not None:
        held_out = f"data.valid_source={valid_spec!r}" if valid else f"data.valid_fraction={data.valid_fraction}"
        valid_tokens = files.meta["valid"]["tokens"]
        if valid_tokens <= data.seq_len + 1:
            more = "add validation data" if valid else "raise data.valid_fraction"
            raise ConfigError(
                f"{held_out}: {valid_tokens} validation tokens, too few for a window (it needs more than "
                f"data.seq_len+1={data.seq_len + 1}); {more} or lower data.seq_len"
            )
        valid_stream = TokenStream(files.valid, data.seq_len, seed, what=f"validation data ({held_out})")
    return PreparedData(
        train=stream,
        valid=valid_stream,
        vocab_size_needed=tokenizer.vocab_size,
        eos_id=tokenizer.eos_id,
        separator=tokenizer.separator,
        tokenizer=tokenizer.name,
        fingerprint=files.fingerprint,
    )
