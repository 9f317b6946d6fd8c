"""DataSpec: what data a sweep trains on, validated when constructed (no I/O)."""

import os
from dataclasses import dataclass
from pathlib import Path

from .errors import DataError

STDLIB_SOURCE = "stdlib"
TOKENIZER_NAMES = ("byte", "bpe")
SHARD_FORMATS = ("auto", "nanogpt", "modded")
# Tokens are stored as uint16 everywhere, so no vocabulary can exceed this.
MAX_VOCAB = 1 << 16


@dataclass(frozen=True)
class DataSpec:
    source: str = STDLIB_SOURCE
    tokenizer: str = "byte"
    bpe_vocab_size: int = 4096
    shard_format: str = "auto"
    vocab_size: int | None = None
    val_fraction: float = 0.05
    val_tokens: int = 65536
    max_corpus_bytes: int | None = 8_000_000

    def __post_init__(self) -> None:
        if isinstance(self.source, os.PathLike):
            # Accept Path objects but store a str so the spec stays hashable and serialisable.
            object.__setattr__(self, "source", os.fspath(self.source))
        if not isinstance(self.source, str) or not self.source:
            raise DataError(
                "DataSpec.source must be 'stdlib' or a path to a .bin file, a directory of .bin "
                "shards, or a glob"
            )
        if self.tokenizer not in TOKENIZER_NAMES:
            raise DataError(
                f"unknown tokenizer {self.tokenizer!r}; use one of {', '.join(TOKENIZER_NAMES)}"
            )
        if self.shard_format not in SHARD_FORMATS:
            raise DataError(
                f"unknown shard_format {self.shard_format!r}; use one of {', '.join(SHARD_FORMATS)}"
            )
        if self.tokenizer == "bpe" and not 256 < self.bpe_vocab_size <= MAX_VOCAB:
            raise DataError(
                f"bpe_vocab_size={self.bpe_vocab_size} must be in (256, {MAX_VOCAB}] "
                "(256 byte symbols plus merges, stored as uint16)"
            )
        if self.vocab_size is not None and not 1 <= self.vocab_size <= MAX_VOCAB:
            raise DataError(
                f"vocab_size={self.vocab_size} must be in [1, {MAX_VOCAB}] (tokens are uint16)"
            )
        if not 0.0 < self.val_fraction < 1.0:
            raise DataError(f"val_fraction={self.val_fraction} must be strictly between 0 and 1")
        if self.val_tokens < 2:
            raise DataError(f"val_tokens={self.val_tokens} must be at least 2 (input + target)")
        if self.max_corpus_bytes is not None and self.max_corpus_bytes < 1:
            raise DataError(f"max_corpus_bytes={self.max_corpus_bytes} must be positive or None")

    @property
    def is_stdlib(self) -> bool:
        return self.source == STDLIB_SOURCE


def cache_dir_default() -> Path:
    """`$HPT_HOME/cache` if HPT_HOME is set, else `./.hpt/cache` (made absolute now, since Ray
    workers may later run with a different working directory)."""
    home = os.environ.get("HPT_HOME")
    if home:
        return Path(home).expanduser() / "cache"
    return Path.cwd() / ".hpt" / "cache"
