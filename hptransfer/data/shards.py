"""Pre-tokenized .bin shards: nanoGPT raw uint16 and modded-nanogpt (1 KiB int32 header).

Shards are memory-mapped, never read whole. Their content hash covers, for each shard in order,
its file name (not directory, so moving the data keeps the hash), size, detected format and the
first and last HASH_EDGE_BYTES bytes, plus the vocab size: cheap for 100s of GiB, and it changes
on any re-tokenization, truncation or header edit. A change confined to the middle of a shard
larger than 2 MiB is not detected by it.
"""

import hashlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np

from .errors import DataError
from .paths import (
    absolute,
    bounded_glob,
    bounded_listing,
    check_inside,
    control_character,
    has_glob,
)

MODDED_MAGIC = 20240520
MODDED_VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
HASH_EDGE_BYTES = 1 << 20
TOKEN_DTYPE = np.dtype("<u2")
T = TypeVar("T")


@dataclass(frozen=True)
class Shard:
    path: Path
    format: str  # "nanogpt" | "modded"
    offset: int  # byte offset of the first token
    n_tokens: int

    def tokens(self) -> np.memmap:
        return np.memmap(
            self.path, dtype=TOKEN_DTYPE, mode="r", offset=self.offset, shape=(self.n_tokens,)
        )


def resolve_shard_paths(source: str, roots: Sequence[Path] | None = None) -> list[Path]:
    """A .bin file, every .bin file in a directory, or every file a glob matches; sorted.

    With `roots`, every path must resolve inside one of them (see `paths`); `~` is never
    expanded. A source with a control character, or one the filesystem cannot look up (a
    name too long, say), raises DataError like a missing one."""
    bad = control_character(source)
    if bad is not None:
        raise DataError(
            f"data source {source!r} contains the control character {bad!r}; give a path to a "
            ".bin file, a directory of .bin shards, or a glob, as plain text"
        )
    path = absolute(source)  # `..` resolved, which may take a glob part (`d/*/..`) with it
    if has_glob(str(path)) and not os.path.exists(source):
        matches = _probing(source, lambda: bounded_glob(source, roots))
        if not matches:
            raise DataError(f"glob {source!r} matched no files; check the pattern and directory")
        return matches
    check_inside(source, [path], roots)  # before anything that tells whether it exists
    if not _probing(source, path.exists):
        raise DataError(
            f"data source {source!r} does not exist; use 'stdlib' for the embedded corpus or a "
            "path to a .bin file, a directory of .bin shards, or a glob"
        )
    if _probing(source, path.is_dir):
        files = _probing(source, lambda: bounded_listing(path, source))
        if not files:
            raise DataError(f"directory {path} contains no .bin shards")
        check_inside(source, files, roots)  # a symlinked shard must not lead out
        return files
    return [path]


def _probing(source: str, probe: Callable[[], T], what: str | None = None) -> T:
    """`probe()`, with an OSError or ValueError from the filesystem as a DataError (only for
    paths already found inside the roots, so the reason tells nothing about other files)."""
    try:
        return probe()
    except DataError:
        raise
    except (OSError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise DataError(
            f"{what or f'data source {source!r}'} cannot be read ({reason}); give a readable "
            "path (each name at most 255 bytes) to a .bin file, a directory of .bin shards, "
            "or a glob"
        ) from None


def inspect_shard(path: Path, shard_format: str) -> Shard:
    """Validate one shard's layout (header, size) without reading its tokens."""
    size = path.stat().st_size
    if size == 0:
        raise DataError(f"shard {path} is empty (0 bytes)")
    with open(path, "rb") as f:
        head = f.read(HEADER_BYTES)
    first = int.from_bytes(head[:4], "little", signed=True) if len(head) >= 4 else None
    has_magic = first == MODDED_MAGIC
    fmt = shard_format if shard_format != "auto" else ("modded" if has_magic else "nanogpt")
    if fmt == "modded":
        return _modded_shard(path, size, head, first)
    if size % 2:
        raise DataError(
            f"raw nanoGPT shard {path} has an odd byte count ({size}); uint16 tokens need an even "
            "size, so it is truncated or not a token file"
        )
    return Shard(path=path, format="nanogpt", offset=0, n_tokens=size // 2)


def _modded_shard(path: Path, size: int, head: bytes, first: int | None) -> Shard:
    if first != MODDED_MAGIC:
        raise DataError(
            f"shard {path} has no modded-nanogpt header (first int32 is {first}, expected "
            f"{MODDED_MAGIC}); use shard_format='nanogpt' or 'auto' for raw uint16 shards"
        )
    if len(head) < HEADER_BYTES:
        raise DataError(
            f"shard {path} has the modded-nanogpt magic but is only {size} bytes, shorter than "
            f"the {HEADER_BYTES}-byte header; the file is truncated"
        )
    header = np.frombuffer(head, dtype="<i4")
    version, n_tokens = int(header[1]), int(header[2])
    if version != MODDED_VERSION:
        raise DataError(
            f"shard {path} has modded-nanogpt header version {version}; only version "
            f"{MODDED_VERSION} is supported"
        )
    expected = HEADER_BYTES + 2 * n_tokens
    if n_tokens < 0 or size != expected:
        raise DataError(
            f"shard {path}: header says {n_tokens} tokens ({expected} bytes with header) but the "
            f"file has {size} bytes; the shard is truncated or corrupt"
        )
    if n_tokens == 0:
        raise DataError(f"shard {path} is empty (header says 0 tokens)")
    return Shard(path=path, format="modded", offset=HEADER_BYTES, n_tokens=n_tokens)


def open_shards(
    source: str, shard_format: str, roots: Sequence[Path] | None = None
) -> list[Shard]:
    return [_probing(source, lambda p=p: inspect_shard(p, shard_format), f"shard {p}")
            for p in resolve_shard_paths(source, roots)]


def shards_hash(shards: list[Shard], vocab_size: int) -> str:
    """See the module docstring for what is (and is not) covered."""
    h = hashlib.sha256(b"hptransfer-shards-v1\0")
    for shard in shards:
        size = shard.path.stat().st_size
        h.update(f"{shard.path.name}\0{size}\0{shard.format}\0".encode())
        with open(shard.path, "rb") as f:
            h.update(f.read(HASH_EDGE_BYTES))
            f.seek(max(0, size - HASH_EDGE_BYTES))
            h.update(f.read(HASH_EDGE_BYTES))
    h.update(f"vocab_size={vocab_size}".encode())
    return h.hexdigest()
