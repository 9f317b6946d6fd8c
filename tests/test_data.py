"""Tests for hptransfer.data: determinism, shard formats, caching and every DataError path."""

import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from hptransfer.data import (
    BPETokenizer,
    ByteTokenizer,
    DataError,
    DataSpec,
    TokenDataset,
    cache_dir_default,
    decode_bytes,
    encode_bytes,
    load_dataset,
)
from hptransfer.data import bpe as bpe_module
from hptransfer.data.cache import write_atomic
from hptransfer.data.corpus import (
    EXCLUDED_DIRS,
    FILE_SEPARATOR,
    load_stdlib_corpus,
    stdlib_files,
)
from hptransfer.data.shards import MODDED_MAGIC

SMALL_STDLIB = {"max_corpus_bytes": 200_000, "val_tokens": 2_000}


def write_raw(path: Path, tokens: np.ndarray) -> Path:
    np.asarray(tokens, dtype="<u2").tofile(path)
    return path


def write_modded(
    path: Path, tokens: np.ndarray, *, version: int = 1, ntok: int | None = None
) -> Path:
    header = np.zeros(256, dtype="<i4")
    header[0] = MODDED_MAGIC
    header[1] = version
    header[2] = len(tokens) if ntok is None else ntok
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(tokens, dtype="<u2").tobytes())
    return path


def shard_spec(source: Path | str, **kw: object) -> DataSpec:
    kw.setdefault("vocab_size", 50_000)
    kw.setdefault("val_tokens", 1_000)
    return DataSpec(source=str(source), **kw)


@pytest.fixture
def arange_shard(tmp_path: Path) -> Path:
    # Token value == stream position, so every window shows exactly where it was read from.
    return write_raw(tmp_path / "positions.bin", np.arange(50_000))


# ---------------------------------------------------------------- spec and defaults


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"tokenizer": "wordpiece"}, "tokenizer"),
        ({"shard_format": "hdf5"}, "shard_format"),
        ({"val_fraction": 0.0}, "val_fraction"),
        ({"val_fraction": 0.5}, "val_fraction"),
        ({"val_fraction": float("nan")}, "val_fraction"),
        ({"val_tokens": 1}, "val_tokens"),
        ({"val_tokens": True}, "val_tokens"),
        ({"val_tokens": 2048.0}, "val_tokens"),
        ({"vocab_size": 70_000}, "vocab_size"),
        ({"vocab_size": "300"}, "vocab_size"),
        ({"tokenizer": "bpe", "bpe_vocab_size": 256}, "bpe_vocab_size"),
        ({"max_corpus_bytes": 0}, "max_corpus_bytes"),
        ({"source": ""}, "source"),
    ],
)
def test_spec_rejects_bad_values(kwargs: dict, field: str) -> None:
    with pytest.raises(ValidationError) as info:
        DataSpec(**kwargs)
    assert [e["loc"] for e in info.value.errors()] == [(field,)]


def test_spec_bounds_match_the_uint16_token_store() -> None:
    # 256 byte symbols + >= 1 merge, at most 2**16 ids; vocab_size up to 2**16 too.
    assert DataSpec(tokenizer="bpe", bpe_vocab_size=257).bpe_vocab_size == 257
    assert DataSpec(tokenizer="bpe", bpe_vocab_size=65536).bpe_vocab_size == 65536
    assert DataSpec(vocab_size=65536).vocab_size == 65536


def test_spec_accepts_path_objects_and_is_hashable(tmp_path: Path) -> None:
    spec = DataSpec(source=tmp_path)  # type: ignore[arg-type]
    assert spec.source == str(tmp_path)
    assert hash(spec) == hash(DataSpec(source=str(tmp_path)))


def test_data_error_is_value_error() -> None:
    assert issubclass(DataError, ValueError)


def test_cache_dir_default(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HPT_HOME", str(tmp_path / "home"))
    assert cache_dir_default() == tmp_path / "home" / "cache"
    monkeypatch.delenv("HPT_HOME")
    monkeypatch.chdir(tmp_path)
    assert cache_dir_default() == tmp_path / ".hpt" / "cache"


def test_load_without_cache_dir_uses_hpt_home(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("HPT_HOME", str(tmp_path))
    load_dataset(DataSpec(**SMALL_STDLIB))
    assert list((tmp_path / "cache").glob("tokens-byte-*.npy"))


# ---------------------------------------------------------------- byte tokenizer and corpus


def test_byte_round_trip() -> None:
    text = "def f(x):\n    return 'héllo ✓ 🐍'\n"
    ids = encode_bytes(text)
    assert ids.dtype == np.uint16
    assert ids.tolist() == list(text.encode("utf-8"))
    assert decode_bytes(ids) == text
    tok = ByteTokenizer()
    assert tok.vocab_size == 256
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode(torch.tensor(tok.encode(text))) == text
    with pytest.raises(DataError, match=r"must be in \[0, 256\)"):
        decode_bytes([65, 300])


def test_stdlib_file_selection() -> None:
    files = stdlib_files()
    assert files == sorted(files)
    assert "os.py" in files
    assert all(f.endswith(".py") for f in files)
    assert not any(set(f.split("/")[:-1]) & EXCLUDED_DIRS for f in files)


def test_corpus_takes_whole_files_in_order_and_excludes_dirs(tmp_path: Path) -> None:
    root = tmp_path / "lib"
    for rel, text in {
        "b.py": "b" * 10,
        "a.py": "a" * 10,
        "pkg/c.py": "c" * 10,
        "tests/t.py": "t",
        "test/t.py": "t",
        "idlelib/i.py": "i",
        "lib2to3/l.py": "l",
        "site-packages/s.py": "s",
        "notes.txt": "n",
    }.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    full = load_stdlib_corpus(None, root=root)
    assert full.files == ("a.py", "b.py", "pkg/c.py")
    assert full.data == FILE_SEPARATOR.join([b"a" * 10, b"b" * 10, b"c" * 10])
    # The third file would cross the cap, so only two whole files are taken.
    capped = load_stdlib_corpus(2 * 10 + len(FILE_SEPARATOR) + 5, root=root)
    assert capped.files == ("a.py", "b.py")
    assert capped.sha256 != full.sha256
    # A file too large for the remaining budget is skipped, later ones still fill the cap.
    (root / "b.py").write_text("b" * 50)
    assert load_stdlib_corpus(30, root=root).files == ("a.py", "pkg/c.py")
    with pytest.raises(DataError, match="smaller than every stdlib file"):
        load_stdlib_corpus(5, root=root)
    (root / "b.py").write_text("b" * 10)
    assert load_stdlib_corpus(None, root=root).sha256 == full.sha256
    (root / "a.py").write_text("A" * 10)
    assert load_stdlib_corpus(None, root=root).sha256 != full.sha256


def test_stdlib_tokens_are_the_corpus_bytes(tmp_path: Path) -> None:
    ds = load_dataset(DataSpec(**SMALL_STDLIB), cache_dir=tmp_path)
    corpus = load_stdlib_corpus(SMALL_STDLIB["max_corpus_bytes"])
    assert ds.vocab_size == 256
    # Whole files skipped only when they would overflow: the cap is nearly filled.
    assert 0.9 * 200_000 < ds.n_tokens == len(corpus.data) <= 200_000
    assert ds.read_tokens(0, ds.n_tokens).astype(np.uint8).tobytes() == corpus.data
    assert ds.n_train_tokens == ds.n_tokens - int(ds.n_tokens * 0.05)
    assert ds.n_val_tokens == SMALL_STDLIB["val_tokens"]


# ---------------------------------------------------------------- train batches


def test_train_batch_is_deterministic_and_shifted(tmp_path: Path) -> None:
    ds = load_dataset(DataSpec(**SMALL_STDLIB), cache_dir=tmp_path)
    x, y = ds.train_batch(step=3, batch_size=4, seq_len=32, seed=7)
    assert x.shape == y.shape == (4, 32)
    assert x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    x2, y2 = ds.train_batch(step=3, batch_size=4, seq_len=32, seed=7)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(x, ds.train_batch(step=4, batch_size=4, seq_len=32, seed=7)[0])
    assert not torch.equal(x, ds.train_batch(step=3, batch_size=4, seq_len=32, seed=8)[0])
    # A fresh load (another trial) reproduces it too.
    other = load_dataset(DataSpec(**SMALL_STDLIB), cache_dir=tmp_path)
    assert torch.equal(x, other.train_batch(step=3, batch_size=4, seq_len=32, seed=7)[0])


def test_train_batch_independent_of_call_order(arange_shard: Path) -> None:
    ds = load_dataset(shard_spec(arange_shard))
    forward = [ds.train_batch(s, 8, 16, seed=1)[0] for s in range(5)]
    backward = [ds.train_batch(s, 8, 16, seed=1)[0] for s in reversed(range(5))][::-1]
    for a, b in zip(forward, backward, strict=True):
        assert torch.equal(a, b)


def test_train_windows_are_contiguous_and_inside_train_split(arange_shard: Path) -> None:
    ds = load_dataset(shard_spec(arange_shard))
    seq_len = 64
    for step in range(20):
        x, y = ds.train_batch(step, batch_size=16, seq_len=seq_len, seed=0)
        starts = x[:, :1]
        assert torch.equal(x, starts + torch.arange(seq_len))
        assert torch.equal(y, x + 1)
        # The target of the last position must still be a training token.
        assert int(y.max()) < ds.n_train_tokens


def test_train_batch_errors(tmp_path: Path) -> None:
    tiny = write_raw(tmp_path / "tiny.bin", np.arange(100))
    ds = load_dataset(shard_spec(tiny, val_tokens=5, val_fraction=0.1))
    assert ds.n_train_tokens == 90
    x, y = ds.train_batch(0, 16, seq_len=89, seed=0)  # exactly one window fits: offset 0
    assert torch.equal(x, torch.arange(89).expand(16, 89))
    assert torch.equal(y, x + 1)
    with pytest.raises(DataError, match=r"fewer than seq_len\+1=91"):
        ds.train_batch(0, 2, seq_len=90, seed=0)
    with pytest.raises(DataError, match="batch_size=0"):
        ds.train_batch(0, 0, seq_len=8, seed=0)
    with pytest.raises(DataError, match="must be non-negative"):
        ds.train_batch(0, 2, seq_len=8, seed=-1)


# ---------------------------------------------------------------- validation set


def test_val_batches_cover_first_val_tokens_of_val_split(arange_shard: Path) -> None:
    ds = load_dataset(shard_spec(arange_shard, val_tokens=1_000))
    seq_len, batch_size = 64, 4
    batches = list(ds.val_batches(batch_size, seq_len))
    n_windows = (1_000 - 1) // seq_len
    assert [len(x) for x, _ in batches] == [4, 4, 4, 3]
    assert sum(len(x) for x, _ in batches) == n_windows
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    start = ds.n_train_tokens
    assert start == 50_000 - int(50_000 * 0.05)
    expected = torch.arange(start, start + n_windows * seq_len).reshape(n_windows, seq_len)
    assert torch.equal(x, expected)
    assert torch.equal(y, expected + 1)
    assert int(y.max()) < start + 1_000


def test_val_set_identical_across_calls_and_loads(tmp_path: Path) -> None:
    spec = DataSpec(**SMALL_STDLIB)
    first = list(load_dataset(spec, cache_dir=tmp_path).val_batches(8, 32))
    again = load_dataset(spec, cache_dir=tmp_path)
    for batches in (list(again.val_batches(8, 32)), list(again.val_batches(8, 32))):
        assert len(batches) == len(first)
        for (x1, y1), (x2, y2) in zip(first, batches, strict=True):
            assert torch.equal(x1, x2) and torch.equal(y1, y2)


def test_val_errors(tmp_path: Path, arange_shard: Path) -> None:
    with pytest.raises(DataError, match="validation split has 2500 tokens"):
        load_dataset(shard_spec(arange_shard, val_tokens=2_501))
    ds = load_dataset(shard_spec(arange_shard, val_tokens=10))
    with pytest.raises(DataError, match="val_tokens=10 is too small"):
        ds.val_batches(2, seq_len=10)  # raised at call time, before iteration
    with pytest.raises(DataError, match="validation split has"):
        load_dataset(DataSpec(max_corpus_bytes=20_000, val_tokens=5_000), cache_dir=tmp_path)


# ---------------------------------------------------------------- content hash


def test_stdlib_hash_stable_and_content_sensitive(tmp_path: Path) -> None:
    a = load_dataset(DataSpec(**SMALL_STDLIB), cache_dir=tmp_path)
    b = load_dataset(DataSpec(**SMALL_STDLIB), cache_dir=tmp_path / "other")
    assert a.content_hash == b.content_hash
    assert len(a.content_hash) == 64 and int(a.content_hash, 16) >= 0
    smaller = load_dataset(DataSpec(max_corpus_bytes=100_000, val_tokens=1_000), cache_dir=tmp_path)
    assert smaller.content_hash != a.content_hash
    described = a.describe()
    assert described == {
        "source": "stdlib",
        "tokenizer": "byte",
        "shard_format": None,
        "vocab_size": 256,
        "content_hash": a.content_hash,
        "n_train_tokens": a.n_train_tokens,
        "n_val_tokens": 2_000,
    }


def test_shard_hash_stable_and_content_sensitive(tmp_path: Path) -> None:
    tokens = np.arange(20_000) % 1000
    d1 = tmp_path / "d1"
    d1.mkdir()
    write_raw(d1 / "s.bin", tokens)
    h = load_dataset(shard_spec(d1)).content_hash
    assert load_dataset(shard_spec(d1)).content_hash == h
    # Same files elsewhere: same data, same hash (only file names enter it, not directories).
    shutil.copytree(d1, tmp_path / "d2")
    assert load_dataset(shard_spec(tmp_path / "d2")).content_hash == h
    assert load_dataset(shard_spec(d1, vocab_size=1000)).content_hash != h
    changed = tokens.copy()
    changed[123] += 1
    write_raw(d1 / "s.bin", changed)
    assert load_dataset(shard_spec(d1)).content_hash != h


def test_shard_hash_covers_the_file_name_and_the_last_mib(tmp_path: Path) -> None:
    """The hash covers each shard's file name and its first and last HASH_EDGE_BYTES (1 MiB):
    a renamed shard, or one whose last token changed in a 3 MiB file, hashes differently."""
    from hptransfer.data.shards import HASH_EDGE_BYTES

    tokens = np.arange(1_500_000) % 1000  # 3 MB: the last token is 2 MB past the first MiB
    path = write_raw(tmp_path / "a.bin", tokens)
    assert path.stat().st_size > 2 * HASH_EDGE_BYTES == 2 * 2**20
    h = load_dataset(shard_spec(path)).content_hash
    renamed = path.rename(tmp_path / "b.bin")
    assert load_dataset(shard_spec(renamed)).content_hash != h
    renamed.rename(path)
    assert load_dataset(shard_spec(path)).content_hash == h
    changed = tokens.copy()
    changed[-1] += 1
    write_raw(path, changed)
    assert load_dataset(shard_spec(path)).content_hash != h


def test_stdlib_hash_tells_tokenizers_of_equal_vocab_size_apart() -> None:
    """Two tokenizers with the same vocabulary size but different identities (BPE merges
    learnt differently) tokenize differently, so their token caches must not be shared."""
    from types import SimpleNamespace

    from hptransfer.data.loader import stdlib_content_hash

    corpus = SimpleNamespace(sha256="c" * 64)
    a, b = (SimpleNamespace(identity=i, vocab_size=512) for i in ("bpe-merges-1", "bpe-merges-2"))
    assert stdlib_content_hash(corpus, a) != stdlib_content_hash(corpus, b)
    assert stdlib_content_hash(corpus, a) == stdlib_content_hash(
        corpus, SimpleNamespace(identity="bpe-merges-1", vocab_size=512))


# ---------------------------------------------------------------- shard formats


@pytest.mark.parametrize("fmt", ["auto", "nanogpt"])
def test_nanogpt_shard_read_exactly(tmp_path: Path, fmt: str) -> None:
    tokens = np.random.default_rng(0).integers(0, 50_000, size=30_000)
    path = write_raw(tmp_path / "raw.bin", tokens)
    ds = load_dataset(shard_spec(path, shard_format=fmt))
    assert ds.n_tokens == 30_000
    assert np.array_equal(ds.read_tokens(0, 30_000), tokens)
    assert ds.describe()["shard_format"] == "nanogpt"
    assert ds.describe()["tokenizer"] is None


@pytest.mark.parametrize("fmt", ["auto", "modded"])
def test_modded_shard_read_exactly(tmp_path: Path, fmt: str) -> None:
    tokens = np.random.default_rng(1).integers(0, 50_000, size=30_000)
    path = write_modded(tmp_path / "m.bin", tokens)
    ds = load_dataset(shard_spec(path, shard_format=fmt))
    assert ds.n_tokens == 30_000  # the header is not read as tokens
    assert np.array_equal(ds.read_tokens(0, 30_000), tokens)
    assert ds.describe()["shard_format"] == "modded"


def test_directory_and_glob_concatenate_in_sorted_order(tmp_path: Path) -> None:
    positions = np.arange(45_000)
    d = tmp_path / "shards"
    d.mkdir()
    # Written out of order and in mixed formats; names decide the order.
    write_modded(d / "part_02.bin", positions[30_000:])
    write_raw(d / "part_00.bin", positions[:12_345])
    write_modded(d / "part_01.bin", positions[12_345:30_000])
    (d / "README.txt").write_text("not a shard")
    for source in (d, d / "part_*.bin"):
        ds = load_dataset(shard_spec(source))
        assert np.array_equal(ds.read_tokens(0, ds.n_tokens), positions)
        assert ds.describe()["shard_format"] == "modded+nanogpt"
        # Windows that straddle shard boundaries are still contiguous.
        x, y = ds.train_batch(0, batch_size=64, seq_len=2_000, seed=3)
        assert torch.equal(x, x[:, :1] + torch.arange(2_000))
        assert torch.equal(y, x + 1)
    assert np.array_equal(ds.read_tokens(12_340, 12_350), positions[12_340:12_350])


# ---------------------------------------------------------------- shard errors


def test_missing_sources(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        load_dataset(shard_spec(tmp_path / "nope.bin"))
    with pytest.raises(DataError, match="matched no files"):
        load_dataset(shard_spec(tmp_path / "nothing_*.bin"))
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(DataError, match="contains no .bin shards"):
        load_dataset(shard_spec(tmp_path / "empty_dir"))


def test_shard_layout_errors(tmp_path: Path) -> None:
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    with pytest.raises(DataError, match=r"empty.bin is empty \(0 bytes\)"):
        load_dataset(shard_spec(empty))
    zero = write_modded(tmp_path / "zero.bin", np.zeros(0))
    with pytest.raises(DataError, match="header says 0 tokens"):
        load_dataset(shard_spec(zero))
    v2 = write_modded(tmp_path / "v2.bin", np.arange(10), version=2)
    with pytest.raises(DataError, match="header version 2; only version 1"):
        load_dataset(shard_spec(v2))
    lying = write_modded(tmp_path / "lying.bin", np.arange(10), ntok=11)
    with pytest.raises(DataError, match="header says 11 tokens .* file has 1044 bytes"):
        load_dataset(shard_spec(lying))
    stub = tmp_path / "stub.bin"
    stub.write_bytes(np.array([MODDED_MAGIC, 1], dtype="<i4").tobytes())
    with pytest.raises(DataError, match="shorter than the 1024-byte header"):
        load_dataset(shard_spec(stub))
    # the magic alone (4 bytes), and a header one int32 short (1020 bytes), are truncated too
    for n_ints in (1, 255):
        short = np.zeros(n_ints, dtype="<i4")
        short[0] = MODDED_MAGIC
        stub.write_bytes(short.tobytes())
        size = 4 * n_ints
        with pytest.raises(DataError, match=f"only {size} bytes, shorter than the 1024-byte"):
            load_dataset(shard_spec(stub))
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x00\x02")
    with pytest.raises(DataError, match=r"odd byte count \(3\)"):
        load_dataset(shard_spec(odd))
    raw = write_raw(tmp_path / "raw.bin", np.arange(10))
    with pytest.raises(DataError, match="no modded-nanogpt header"):
        load_dataset(shard_spec(raw, shard_format="modded"))


def test_shard_spec_errors(arange_shard: Path, tmp_path: Path) -> None:
    with pytest.raises(DataError, match="vocab_size is required .*: set data.vocab_size "):
        load_dataset(DataSpec(source=str(arange_shard), val_tokens=100))
    # outside the data roots: said first, not "set vocab_size" and then that
    with pytest.raises(DataError, match="not inside the server's data roots"):
        load_dataset(DataSpec(source=str(arange_shard), val_tokens=100),
                     roots=[tmp_path / "elsewhere"])
    with pytest.raises(DataError, match="applies only to source='stdlib'"):
        load_dataset(shard_spec(arange_shard, tokenizer="bpe"))


def test_token_id_above_vocab_caught_by_sample(tmp_path: Path) -> None:
    path = write_raw(tmp_path / "s.bin", np.arange(50_000) % 80)
    with pytest.raises(DataError, match="token id 64 >= vocab_size=64 .*at token 64.*set "
                                        "data.vocab_size .* or check data.shard_format"):
        load_dataset(shard_spec(path, vocab_size=64))
    assert load_dataset(shard_spec(path, vocab_size=80)).vocab_size == 80


def test_stray_token_id_caught_by_full_check_and_batches(tmp_path: Path) -> None:
    # 400k tokens: the sample reads 10 windows of 16k; positions 30_000 (train split) and
    # 381_000 (start of the val set) lie between sampled windows.
    tokens = np.zeros(400_000, dtype=np.uint16)
    tokens[30_000] = 999
    tokens[381_000] = 998
    path = write_raw(tmp_path / "s.bin", tokens)
    spec = shard_spec(path, vocab_size=100, val_tokens=2_000)
    ds = load_dataset(spec)  # the sampled check misses the stray ids
    with pytest.raises(DataError, match="token id 999 >= vocab_size=100 .*at token 30000"):
        ds.verify_tokens()
    with pytest.raises(DataError, match="token id 999"):
        load_dataset(spec, full_check=True)
    with pytest.raises(DataError, match="validation set contains token id 998 .*set "
                                        "data.vocab_size"):
        list(ds.val_batches(4, 32))


# ---------------------------------------------------------------- stdlib errors


def test_stdlib_vocab_size_must_match(tmp_path: Path) -> None:
    assert load_dataset(DataSpec(vocab_size=256, **SMALL_STDLIB), tmp_path).vocab_size == 256
    with pytest.raises(DataError, match="vocab_size=300 disagrees"):
        load_dataset(DataSpec(vocab_size=300, **SMALL_STDLIB), cache_dir=tmp_path)


# ---------------------------------------------------------------- caching


def test_token_cache_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = load_dataset(DataSpec(**SMALL_STDLIB), cache_dir=tmp_path)
    (cache_file,) = tmp_path.glob("tokens-byte-*.npy")
    assert first.content_hash in cache_file.name
    inode = cache_file.stat().st_ino

    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("retokenized despite a cache hit")

    monkeypatch.setattr(ByteTokenizer, "encode_corpus", fail)
    second = load_dataset(DataSpec(**SMALL_STDLIB), cache_dir=tmp_path)
    assert cache_file.stat().st_ino == inode  # not written again (a hit only marks its use)
    assert np.array_equal(second.read_tokens(0, 5_000), first.read_tokens(0, 5_000))
    # Atomic writes leave no temp files behind.
    assert sorted(p.name for p in tmp_path.iterdir()) == [cache_file.name]


def test_corrupt_token_cache_is_rebuilt(tmp_path: Path) -> None:
    first = load_dataset(DataSpec(**SMALL_STDLIB), cache_dir=tmp_path)
    expected = first.read_tokens(0, first.n_tokens)  # a copy, not the memmap we corrupt next
    del first
    (cache_file,) = tmp_path.glob("tokens-byte-*.npy")
    cache_file.write_bytes(b"garbage")
    again = load_dataset(DataSpec(**SMALL_STDLIB), cache_dir=tmp_path)
    assert np.array_equal(again.read_tokens(0, again.n_tokens), expected)
    assert np.array_equal(np.load(cache_file), expected)


def test_an_empty_token_cache_entry_is_rebuilt(tmp_path: Path) -> None:
    """A cache entry that holds a valid but empty uint16 array is no hit: the corpus is
    tokenized again and the entry rewritten (an empty token stream trains on nothing)."""
    first = load_dataset(DataSpec(**SMALL_STDLIB), cache_dir=tmp_path)
    expected = first.read_tokens(0, first.n_tokens)
    del first
    (cache_file,) = tmp_path.glob("tokens-byte-*.npy")
    np.save(cache_file, np.zeros(0, dtype=np.uint16))
    again = load_dataset(DataSpec(**SMALL_STDLIB), cache_dir=tmp_path)
    assert np.array_equal(again.read_tokens(0, again.n_tokens), expected)
    assert np.array_equal(np.load(cache_file), expected)


def test_write_atomic_first_wins(tmp_path: Path) -> None:
    target = tmp_path / "entry.json"
    write_atomic(target, lambda p: p.write_text("first"), first_wins=True)
    write_atomic(target, lambda p: p.write_text("second"), first_wins=True)
    assert target.read_text() == "first"
    write_atomic(target, lambda p: p.write_text("third"))
    assert target.read_text() == "third"

    def boom(p: Path) -> None:
        p.write_text("partial")
        raise RuntimeError("writer crashed")

    with pytest.raises(RuntimeError):
        write_atomic(target, boom)
    assert target.read_text() == "third"
    assert os.listdir(tmp_path) == ["entry.json"]


# ---------------------------------------------------------------- BPE


BPE_SPEC = DataSpec(tokenizer="bpe", bpe_vocab_size=512, max_corpus_bytes=300_000, val_tokens=1_000)


def test_bpe_trains_and_round_trips(tmp_path: Path) -> None:
    ds = load_dataset(BPE_SPEC, cache_dir=tmp_path)
    assert isinstance(ds.tokenizer, BPETokenizer)
    assert 256 < ds.vocab_size <= 512
    assert ds.describe()["tokenizer"] == "bpe"
    corpus = load_stdlib_corpus(300_000)
    assert ds.n_tokens < len(corpus.data) / 2  # merges actually compress the text
    tokens = ds.read_tokens(0, ds.n_tokens)
    assert int(tokens.max()) < ds.vocab_size
    assert ds.tokenizer.decode(tokens.tolist()) == corpus.data.decode("utf-8")
    text = "import os\n\ndef main() -> None:\n    print('héllo ✓')\n"
    assert ds.tokenizer.decode(ds.tokenizer.encode(text)) == text
    byte_hash = load_dataset(
        DataSpec(max_corpus_bytes=300_000, val_tokens=1_000), cache_dir=tmp_path
    ).content_hash
    assert ds.content_hash != byte_hash
    # Training is deterministic: a fresh cache (another machine) yields the same tokenizer.
    assert load_dataset(BPE_SPEC, cache_dir=tmp_path / "fresh").content_hash == ds.content_hash


def test_bpe_cache_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = load_dataset(BPE_SPEC, cache_dir=tmp_path)
    (tok_file,) = tmp_path.glob("bpe-*-v512.json")
    inodes = {p: p.stat().st_ino for p in tmp_path.iterdir()}

    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("retrained or retokenized despite a cache hit")

    monkeypatch.setattr(bpe_module, "train_bpe", fail)
    monkeypatch.setattr(BPETokenizer, "encode_corpus", fail)
    second = load_dataset(BPE_SPEC, cache_dir=tmp_path)
    assert {p: p.stat().st_ino for p in tmp_path.iterdir()} == inodes  # none written again
    assert second.content_hash == first.content_hash
    assert second.vocab_size == first.vocab_size
    assert torch.equal(second.train_batch(0, 2, 16, 0)[0], first.train_batch(0, 2, 16, 0)[0])
    assert tok_file.exists()


def test_dataset_type_exported() -> None:
    assert TokenDataset.__name__ == "TokenDataset"


def test_the_cache_keeps_to_its_cap_least_recently_used_first(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each corpus size a request names writes a tokenized corpus (and a tokenizer) to the
    cache, which grew without bound. Past HPT_CACHE_MAX_GB the least recently used entries
    go; the one just written and any used in the last minutes stay, and an entry that went
    is rebuilt the same when asked for again."""
    sizes = [60_000, 70_000, 80_000, 90_000]
    day = 86_400.0
    for i, size in enumerate(sizes):  # four entries, used 4, 3, 2 and 1 days ago
        load_dataset(DataSpec(max_corpus_bytes=size, val_tokens=2_000), cache_dir=tmp_path)
        (path,) = sorted(tmp_path.glob("tokens-*.npy"), key=lambda p: p.stat().st_mtime)[-1:]
        os.utime(path, (time.time() - (4 - i) * day,) * 2)
    entries = {p.name: p.stat().st_size for p in tmp_path.glob("tokens-*.npy")}
    assert len(entries) == 4
    oldest = min(tmp_path.glob("tokens-*.npy"), key=lambda p: p.stat().st_mtime)
    first = load_dataset(DataSpec(max_corpus_bytes=sizes[0], val_tokens=2_000),
                         cache_dir=tmp_path)  # a hit: the oldest is now the latest used
    assert oldest.stat().st_mtime > time.time() - 60
    # room for about three entries of this size: the new one and the two most recently used
    # stay (the one hit just now among them); the two least recently used go
    cap = 3.5 * max(entries.values())
    monkeypatch.setenv("HPT_CACHE_MAX_GB", str(cap / 1e9))
    load_dataset(DataSpec(max_corpus_bytes=100_000, val_tokens=2_000), cache_dir=tmp_path)
    left = sorted(tmp_path.glob("tokens-*.npy"), key=lambda p: p.stat().st_mtime)
    assert len(left) == 3 and oldest in left
    assert sum(p.stat().st_size for p in left) <= cap
    # the evicted corpus comes back the same (content-addressed, deterministic)
    again = load_dataset(DataSpec(max_corpus_bytes=sizes[1], val_tokens=2_000),
                         cache_dir=tmp_path)
    assert again.content_hash == load_dataset(
        DataSpec(max_corpus_bytes=sizes[1], val_tokens=2_000),
        cache_dir=tmp_path / "fresh").content_hash
    assert first.content_hash != again.content_hash


def test_a_killed_writers_temp_file_is_evicted_once_stale(tmp_path: Path) -> None:
    """A writer killed mid-write (Ray cancel, OOM killer) never runs its `finally`: its temp
    file was skipped by eviction and held its space for good."""
    from hptransfer.data.cache import STALE_TMP_S, evict_least_used

    stale = tmp_path / ".tokens-byte-a.npy.k1l2.tmp"
    fresh = tmp_path / ".tokens-byte-b.npy.x9y8.tmp"  # a write in progress right now
    for path in (stale, fresh):
        path.write_bytes(b"\0" * 100_000)
    old = time.time() - STALE_TMP_S - 60
    os.utime(stale, (old, old))
    kept = tmp_path / "tokens-byte-c.npy"
    kept.write_bytes(b"\0" * 10)
    assert evict_least_used(tmp_path, keep=kept, max_bytes=1e12) == 1
    assert not stale.exists() and fresh.exists() and kept.exists()


def _unwritable(directory: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`directory` refuses new files: immutable where chattr works (root on ext4/xfs), else
    its temp-file creation fails as a read-only mount's does."""
    import errno
    import subprocess

    directory.mkdir(parents=True, exist_ok=True)
    if shutil.which("chattr") and subprocess.run(["chattr", "+i", str(directory)],
                                                 capture_output=True).returncode == 0:
        try:
            (directory / "probe").write_text("x")
        except OSError:
            return
        subprocess.run(["chattr", "-i", str(directory)], check=True)
        (directory / "probe").unlink()
    from hptransfer.data import cache as cache_module

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(cache_module.tempfile, "mkstemp", read_only)


@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_an_unwritable_cache_serves_from_memory(tmp_path: Path, tokenizer: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess

    spec = DataSpec(max_corpus_bytes=60_000, val_tokens=2_000, tokenizer=tokenizer,
                    **({"bpe_vocab_size": 300} if tokenizer == "bpe" else {}))
    expected = load_dataset(spec, cache_dir=tmp_path / "writable")
    cache = tmp_path / "read-only"
    _unwritable(cache, monkeypatch)
    try:
        got = load_dataset(spec, cache_dir=cache)  # raised the OSError (a 500 at submit)
    finally:
        subprocess.run(["chattr", "-i", str(cache)], capture_output=True)
    assert got.content_hash == expected.content_hash and got.n_tokens == expected.n_tokens
    assert not any(cache.iterdir())


def test_a_corpus_bound_below_every_file_says_so() -> None:
    # empty stdlib files (package __init__.py) fit any bound: the corpus was empty instead
    with pytest.raises(DataError, match="max_corpus_bytes=1 is smaller than every stdlib file"):
        load_stdlib_corpus(1)
