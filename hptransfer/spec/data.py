"""DataSpec: what data a sweep trains on, validated when constructed (no I/O).

The one definition of a sweep's `data` section: the sweep spec and the trial spec embed this
model, so its field errors carry their full path there (``data.val_tokens``). A bad value
raises pydantic's ValidationError (a ValueError) naming the field.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator

from hptransfer.config import home_dir

STDLIB_SOURCE = "stdlib"
Tokenizer = Literal["byte", "bpe"]
ShardFormat = Literal["auto", "nanogpt", "modded"]
TOKENIZER_NAMES: tuple[str, ...] = get_args(Tokenizer)
SHARD_FORMATS: tuple[str, ...] = get_args(ShardFormat)
# Tokens are stored as uint16 everywhere, so no vocabulary can exceed this.
MAX_VOCAB = 1 << 16
MAX_SOURCE_CHARS = 4096
MAX_VAL_TOKENS = 1 << 30
MAX_CORPUS_BYTES = 1 << 32


def val_window_problem(val_tokens: int, seq_len: int) -> str | None:
    """Why `val_tokens` cannot hold one validation window of `seq_len` (its inputs and their
    targets, one token further), or None. Checked when a spec is given, not after training."""
    if val_tokens - 1 >= seq_len:
        return None
    return (f"val_tokens={val_tokens} is too small for one window of seq_len+1={seq_len + 1}; "
            "raise val_tokens or lower seq_len")


class DataSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    source: Annotated[str, Field(min_length=1, max_length=MAX_SOURCE_CHARS)] = STDLIB_SOURCE
    tokenizer: Tokenizer = "byte"
    # 256 byte symbols plus at least one merge, stored as uint16.
    bpe_vocab_size: Annotated[int, Field(gt=256, le=MAX_VOCAB)] = 4096
    shard_format: ShardFormat = "auto"
    vocab_size: Annotated[int, Field(ge=1, le=MAX_VOCAB)] | None = None
    val_fraction: Annotated[float, Field(gt=0, lt=0.5)] = 0.05
    val_tokens: Annotated[int, Field(ge=2, le=MAX_VAL_TOKENS)] = 16384  # input + target
    max_corpus_bytes: Annotated[int, Field(ge=1, le=MAX_CORPUS_BYTES)] | None = 8_000_000

    @field_validator("source", mode="before")
    @classmethod
    def _path_as_text(cls, value: Any) -> Any:
        # Accept Path objects but store a str so the spec stays hashable and serialisable.
        return os.fspath(value) if isinstance(value, os.PathLike) else value

    @property
    def is_stdlib(self) -> bool:
        return self.source == STDLIB_SOURCE


def cache_dir_default() -> Path:
    """`$HPT_HOME/cache` if HPT_HOME is set, else `./.hpt/cache` (made absolute now, since Ray
    workers may later run with a different working directory)."""
    return home_dir() / "cache"
