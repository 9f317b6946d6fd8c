"""Byte-level BPE trained locally on the corpus with the `tokenizers` package, cached as JSON."""

import hashlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .cache import evict_least_used, mark_used, publish
from .corpus import FILE_SEPARATOR, Corpus

if TYPE_CHECKING:
    from tokenizers import Tokenizer as HFTokenizer


def _piece_texts(pieces: Sequence[bytes], separator: bytes) -> list[str]:
    # One text per file (separator attached) so the corpus is processed in parallel batches while
    # the concatenated ids still decode to exactly the joined corpus.
    last = len(pieces) - 1
    return [
        (p if i == last else p + separator).decode("utf-8", errors="replace")
        for i, p in enumerate(pieces)
    ]


class BPETokenizer:
    name = "bpe"

    def __init__(self, hf: "HFTokenizer", json_text: str) -> None:
        self._hf = hf
        self.vocab_size: int = hf.get_vocab_size()
        # Hash of the saved merges/vocab: identical JSON means identical tokenization.
        self.identity = "bpe:" + hashlib.sha256(json_text.encode("utf-8")).hexdigest()

    @classmethod
    def from_file(cls, path: Path) -> "BPETokenizer":
        return cls.from_str(path.read_text(encoding="utf-8"))

    @classmethod
    def from_str(cls, text: str) -> "BPETokenizer":
        from tokenizers import Tokenizer as HFTokenizer

        return cls(HFTokenizer.from_str(text), text)

    def encode(self, text: str) -> list[int]:
        return list(self._hf.encode(text).ids)

    def decode(self, ids: Iterable[int]) -> str:
        return self._hf.decode([int(i) for i in ids])

    def encode_corpus(self, pieces: Sequence[bytes], separator: bytes) -> np.ndarray:
        encodings = self._hf.encode_batch(_piece_texts(pieces, separator))
        if not encodings:
            return np.zeros(0, dtype=np.uint16)
        return np.concatenate([np.asarray(e.ids, dtype=np.uint16) for e in encodings])


def train_bpe(pieces: Sequence[bytes], vocab_size: int) -> "HFTokenizer":
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        show_progress=False,
        # All 256 byte symbols up front, so any input encodes without an unknown token.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    texts = _piece_texts(pieces, FILE_SEPARATOR)
    hf.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return hf


def bpe_cache_path(cache_dir: Path, corpus: Corpus, vocab_size: int) -> Path:
    return cache_dir / f"bpe-{corpus.sha256}-v{vocab_size}.json"


def load_or_train_bpe(corpus: Corpus, vocab_size: int, cache_dir: Path) -> BPETokenizer:
    """Reuse the cached tokenizer for this corpus + vocab size, else train and cache it."""
    path = bpe_cache_path(cache_dir, corpus, vocab_size)
    if path.exists():
        try:
            tokenizer = BPETokenizer.from_file(path)
            mark_used(path)
            return tokenizer
        except Exception:  # a corrupt or unreadable cache entry is rebuilt, not fatal
            path.unlink(missing_ok=True)
    json_text = train_bpe(corpus.pieces, vocab_size).to_str()
    # First writer wins so concurrent workers all tokenize with one and the same tokenizer.
    if not publish(path, lambda tmp: tmp.write_text(json_text, encoding="utf-8"),
                   first_wins=True):
        return BPETokenizer.from_str(json_text)  # an unwritable cache: this one, unshared
    evict_least_used(path.parent, keep=path)
    return BPETokenizer.from_file(path)
