"""Token-range checks: ids >= vocab_size crash embeddings with cryptic (CUDA) errors later.

`sample` reads the first and last SAMPLE_WINDOW tokens plus SAMPLE_COUNT evenly spaced windows,
so it costs a few hundred KiB per shard whatever the shard size; it catches a wrong vocab_size or
a wrongly detected format, not a single stray token. The full check streams every token in
FULL_CHUNK pieces. Batches are also checked as they are served, so a bad id never reaches a model.
"""

import numpy as np

SAMPLE_WINDOW = 1 << 14
SAMPLE_COUNT = 8
FULL_CHUNK = 1 << 23


def _windows(n: int, sample: bool) -> list[tuple[int, int]]:
    if not sample:
        return [(s, min(s + FULL_CHUNK, n)) for s in range(0, n, FULL_CHUNK)]
    if n <= SAMPLE_WINDOW * (SAMPLE_COUNT + 2):
        return [(0, n)]
    starts = np.linspace(0, n - SAMPLE_WINDOW, SAMPLE_COUNT + 2).astype(np.int64)
    return [(int(s), int(s) + SAMPLE_WINDOW) for s in starts]


def first_out_of_range(tokens: np.ndarray, vocab_size: int, sample: bool) -> tuple[int, int] | None:
    """(position, id) of the first checked token >= vocab_size, or None if all are in range."""
    for start, stop in _windows(len(tokens), sample):
        chunk = np.asarray(tokens[start:stop])
        if chunk.size and int(chunk.max()) >= vocab_size:
            pos = int(np.argmax(chunk >= vocab_size))
            return start + pos, int(chunk[pos])
    return None


def out_of_range_message(name: str, bad: tuple[int, int], vocab_size: int) -> str:
    pos, token = bad
    return (
        f"{name} contains token id {token} >= vocab_size={vocab_size} (at token {pos}); set "
        "data.vocab_size to the tokenizer's vocabulary size or check data.shard_format"
    )
