"""Data layer: token streams that every trial of a sweep sees identically."""

from hptransfer.spec.data import DataSpec, cache_dir_default

from .bpe import BPETokenizer
from .dataset import TokenDataset
from .errors import DataError
from .loader import load_dataset
from .tokenizer import ByteTokenizer, decode_bytes, encode_bytes

__all__ = [
    "BPETokenizer",
    "ByteTokenizer",
    "DataError",
    "DataSpec",
    "TokenDataset",
    "cache_dir_default",
    "decode_bytes",
    "encode_bytes",
    "load_dataset",
]
