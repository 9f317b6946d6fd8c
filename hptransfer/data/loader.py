"""load_dataset: turn a DataSpec into a TokenDataset (stdlib corpus or pre-tokenized shards)."""

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from hptransfer.spec.data import DataSpec, cache_dir_default

from .bpe import load_or_train_bpe
from .cache import ensure_dir, evict_least_used, mark_used, publish
from .checks import first_out_of_range, out_of_range_message
from .corpus import FILE_SEPARATOR, Corpus, load_stdlib_corpus
from .dataset import TokenDataset
from .errors import DataError
from .shards import open_shards, shards_hash
from .stream import TokenStream
from .tokenizer import ByteTokenizer, Tokenizer


def load_dataset(
    spec: DataSpec,
    cache_dir: str | os.PathLike | None = None,
    *,
    full_check: bool = False,
    roots: Sequence[Path] | None = None,
) -> TokenDataset:
    """Load the data `spec` describes. Shards get a sampled token-range check here (and every
    served batch is checked); `full_check=True` also scans every token up front. With
    `roots` (the server's data roots), a shard source outside them is refused."""
    if spec.is_stdlib:
        cache = Path(cache_dir) if cache_dir is not None else cache_dir_default()
        dataset = _load_stdlib(spec, ensure_dir(cache))
    else:
        dataset = _load_shards(spec, roots)
    if full_check:
        dataset.verify_tokens()
    return dataset


def stdlib_content_hash(corpus: Corpus, tokenizer: Tokenizer) -> str:
    text = f"stdlib\0{corpus.sha256}\0{tokenizer.identity}\0vocab_size={tokenizer.vocab_size}"
    return hashlib.sha256(text.encode()).hexdigest()


def _load_stdlib(spec: DataSpec, cache: Path) -> TokenDataset:
    corpus = load_stdlib_corpus(spec.max_corpus_bytes)
    tokenizer: Tokenizer
    if spec.tokenizer == "byte":
        tokenizer = ByteTokenizer()
    else:
        tokenizer = load_or_train_bpe(corpus, spec.bpe_vocab_size, cache)
    if spec.vocab_size is not None and spec.vocab_size != tokenizer.vocab_size:
        raise DataError(
            f"vocab_size={spec.vocab_size} disagrees with the {spec.tokenizer} tokenizer's "
            f"{tokenizer.vocab_size}; leave vocab_size=None for the stdlib corpus (it is derived)"
        )
    content_hash = stdlib_content_hash(corpus, tokenizer)
    token_path = cache / f"tokens-{tokenizer.name}-{content_hash}.npy"
    tokens = _cached_tokens(token_path, corpus, tokenizer)
    return TokenDataset(
        TokenStream([tokens], [f"stdlib corpus ({spec.tokenizer})"]),
        vocab_size=tokenizer.vocab_size,
        content_hash=content_hash,
        val_fraction=spec.val_fraction,
        val_tokens=spec.val_tokens,
        source=spec.source,
        tokenizer_name=spec.tokenizer,
        tokenizer=tokenizer,
    )


def _cached_tokens(path: Path, corpus: Corpus, tokenizer: Tokenizer) -> np.ndarray:
    """Memory-mapped token cache keyed by the content hash; tokenize only on a miss."""
    if path.exists():
        try:
            cached = np.load(path, mmap_mode="r")
            if cached.dtype == np.uint16 and cached.ndim == 1 and len(cached) > 0:
                mark_used(path)
                return cached
        except (OSError, ValueError):
            pass  # unreadable entry: rebuild it below
    tokens = tokenizer.encode_corpus(corpus.pieces, FILE_SEPARATOR).astype(np.uint16, copy=False)

    def save(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            np.save(f, tokens)

    # Content-addressed, so any concurrent writer produces the same bytes: last one may win.
    if publish(path, save):
        evict_least_used(path.parent, keep=path)
    return tokens


def _load_shards(spec: DataSpec, roots: Sequence[Path] | None) -> TokenDataset:
    # where the shards are first: a source outside the data roots is refused as such, not
    # sent to fix its vocab_size
    shards = open_shards(spec.source, spec.shard_format, roots)
    if spec.vocab_size is None:
        raise DataError(
            f"vocab_size is required for shard source {spec.source!r}: set data.vocab_size "
            "to the vocabulary the shards were tokenized with (e.g. 50257 for GPT-2)"
        )
    if spec.tokenizer != "byte":
        raise DataError(
            f"tokenizer={spec.tokenizer!r} applies only to source='stdlib'; shards are already "
            "tokenized, so leave tokenizer at its default"
        )
    parts = [s.tokens() for s in shards]
    for shard, tokens in zip(shards, parts, strict=True):
        bad = first_out_of_range(tokens, spec.vocab_size, sample=True)
        if bad is not None:
            raise DataError(out_of_range_message(f"shard {shard.path}", bad, spec.vocab_size))
    formats = sorted({s.format for s in shards})
    return TokenDataset(
        TokenStream(parts, [f"shard {s.path}" for s in shards]),
        vocab_size=spec.vocab_size,
        content_hash=shards_hash(shards, spec.vocab_size),
        val_fraction=spec.val_fraction,
        val_tokens=spec.val_tokens,
        source=spec.source,
        tokenizer_name=None,
        shard_format="+".join(formats),
    )
