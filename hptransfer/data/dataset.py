"""TokenDataset: deterministic train batches and a fixed validation set over a TokenStream.

The data layer is numpy: torch is imported only where a batch becomes a tensor (in the trainer's
process, which has it loaded already), so the coordinator loads a sweep's data at submit to
check it and hash it without importing torch (~1-2 CPU-s of its start-up)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

from hptransfer.spec.data import val_window_problem

from .checks import first_out_of_range, out_of_range_message
from .errors import DataError
from .stream import TokenStream
from .tokenizer import Tokenizer

if TYPE_CHECKING:
    import torch

Batch = tuple["torch.Tensor", "torch.Tensor"]


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if int(value) < 1:
            raise DataError(f"{name}={value} must be a positive integer")


class TokenDataset:
    """Split: the last `val_fraction` of the stream is validation (int(n * val_fraction) tokens),
    the rest is training. The fixed validation set is the first `val_tokens` of that split."""

    def __init__(
        self,
        stream: TokenStream,
        *,
        vocab_size: int,
        content_hash: str,
        val_fraction: float,
        val_tokens: int,
        source: str,
        tokenizer_name: str | None,
        tokenizer: Tokenizer | None = None,
        shard_format: str | None = None,
    ) -> None:
        n = len(stream)
        n_val_split = int(n * val_fraction)
        if n_val_split < val_tokens:
            raise DataError(
                f"validation split has {n_val_split} tokens ({val_fraction=} of {n}) but "
                f"val_tokens={val_tokens}; lower val_tokens, raise val_fraction, or use more data"
            )
        self._stream = stream
        self.vocab_size = vocab_size
        self.content_hash = content_hash
        self.n_train_tokens = n - n_val_split
        self.n_val_tokens = val_tokens
        self.source = source
        self.tokenizer_name = tokenizer_name
        self.tokenizer = tokenizer  # encode/decode helpers; None for pre-tokenized shards
        self.shard_format = shard_format
        self._val: np.ndarray | None = None

    @property
    def n_tokens(self) -> int:
        return len(self._stream)

    def read_tokens(self, start: int, stop: int) -> np.ndarray:
        """Raw uint16 tokens [start, stop) of the whole stream (train split, then val split)."""
        return self._stream.read(start, stop)

    def train_batch(self, step: int, batch_size: int, seq_len: int, seed: int,
                    rows: slice | None = None) -> Batch:
        """(x, y) int64 tensors (batch_size, seq_len), y = x shifted by one. Window offsets come
        from default_rng([seed, step]), so a batch depends only on its arguments. `rows`: only
        those rows of the batch are read (a data-parallel rank's part)."""
        _check_positive(batch_size=batch_size, seq_len=seq_len)
        if step < 0 or seed < 0:
            raise DataError(f"step={step} and seed={seed} must be non-negative")
        span = seq_len + 1
        if self.n_train_tokens < span:
            raise DataError(
                f"train split has {self.n_train_tokens} tokens, fewer than seq_len+1={span} "
                "needed for one window; use more data (max_corpus_bytes, more shards) or a "
                "smaller seq_len"
            )
        rng = np.random.default_rng([int(seed), int(step)])
        starts = rng.integers(0, self.n_train_tokens - span + 1, size=batch_size)
        if rows is not None:
            starts = starts[rows]
        windows = self._stream.windows(starts, span)
        self._check_ids(windows, "training batch")
        return _as_tensor(windows[:, :-1]), _as_tensor(windows[:, 1:])

    def val_batches(self, batch_size: int, seq_len: int) -> Iterator[Batch]:
        """Contiguous non-overlapping windows over the first val_tokens of the val split: window
        i is x = v[i*L:(i+1)*L], y = v[i*L+1:(i+1)*L+1], with (val_tokens-1)//L windows. The
        last batch holds the remainder and may be smaller than batch_size."""
        # Validate now, not on first next(): this is not itself a generator function.
        _check_positive(batch_size=batch_size, seq_len=seq_len)
        problem = val_window_problem(self.n_val_tokens, seq_len)
        if problem:
            raise DataError(problem)
        n_windows = (self.n_val_tokens - 1) // seq_len
        tokens = self._val_set()
        x_all = tokens[: n_windows * seq_len].reshape(n_windows, seq_len)
        y_all = tokens[1 : n_windows * seq_len + 1].reshape(n_windows, seq_len)
        return (
            (_as_tensor(x_all[i : i + batch_size]), _as_tensor(y_all[i : i + batch_size]))
            for i in range(0, n_windows, batch_size)
        )

    def verify_tokens(self) -> None:
        """Full scan: raise DataError if any token id >= vocab_size (reads all the data)."""
        for part, name in zip(self._stream.parts, self._stream.names, strict=True):
            bad = first_out_of_range(part, self.vocab_size, sample=False)
            if bad is not None:
                raise DataError(out_of_range_message(name, bad, self.vocab_size))

    def describe(self) -> dict:
        return {
            "source": self.source,
            "tokenizer": self.tokenizer_name,
            "shard_format": self.shard_format,
            "vocab_size": self.vocab_size,
            "content_hash": self.content_hash,
            "n_train_tokens": self.n_train_tokens,
            "n_val_tokens": self.n_val_tokens,
        }

    def _val_set(self) -> np.ndarray:
        if self._val is None:
            start = self.n_train_tokens
            val = self._stream.read(start, start + self.n_val_tokens)
            self._check_ids(val, "validation set")
            self._val = val
        return self._val

    def _check_ids(self, tokens: np.ndarray, what: str) -> None:
        # Cheap on a batch and guarantees no out-of-range id ever reaches an embedding table.
        if tokens.size and int(tokens.max()) >= self.vocab_size:
            raise DataError(
                f"{what} contains token id {int(tokens.max())} >= vocab_size={self.vocab_size}; "
                "set data.vocab_size to the tokenizer's vocabulary size or check data.shard_format"
            )


def _as_tensor(tokens: np.ndarray) -> torch.Tensor:
    import torch  # here, not at the top: see the module's docstring

    # astype copies into a fresh contiguous int64 array that torch can own.
    return torch.from_numpy(tokens.astype(np.int64))
