"""Byte tokenizer (utf-8 bytes -> ids 0..255) and the interface shared with BPE."""

from collections.abc import Iterable, Sequence
from typing import Protocol

import numpy as np

from .errors import DataError

BYTE_VOCAB = 256


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    identity: str  # enters the content hash: two tokenizers with equal identity tokenize alike

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def encode_corpus(self, pieces: Sequence[bytes], separator: bytes) -> np.ndarray: ...


def encode_bytes(text: str) -> np.ndarray:
    """utf-8 bytes of `text` as a uint16 id array."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)


def decode_bytes(ids: Iterable[int]) -> str:
    """Inverse of `encode_bytes`; invalid utf-8 (e.g. a cut multi-byte char) becomes U+FFFD."""
    # Arrays and tensors convert directly; other iterables (generators too) via a list.
    arr = np.asarray(ids if hasattr(ids, "__array__") else list(ids), dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() >= BYTE_VOCAB):
        lo, hi = int(arr.min()), int(arr.max())
        raise DataError(f"byte token ids must be in [0, {BYTE_VOCAB}); got {lo}..{hi}")
    return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


class ByteTokenizer:
    name = "byte"
    vocab_size = BYTE_VOCAB
    identity = "byte"

    def encode(self, text: str) -> list[int]:
        return encode_bytes(text).tolist()

    def decode(self, ids: Iterable[int]) -> str:
        return decode_bytes(ids)

    def encode_corpus(self, pieces: Sequence[bytes], separator: bytes) -> np.ndarray:
        return np.frombuffer(separator.join(pieces), dtype=np.uint8).astype(np.uint16)
