"""A read-only logical concatenation of 1-D uint16 token arrays (memmaps or in-memory)."""

from collections.abc import Sequence

import numpy as np


class TokenStream:
    def __init__(self, parts: Sequence[np.ndarray], names: Sequence[str]) -> None:
        if len(parts) != len(names):
            raise ValueError("one name per part is required")
        self.parts = list(parts)
        self.names = list(names)
        # starts[i] = stream position of parts[i][0]; starts[-1] = total length.
        self._starts = np.cumsum([0, *(len(p) for p in parts)], dtype=np.int64)

    def __len__(self) -> int:
        return int(self._starts[-1])

    def read(self, start: int, stop: int) -> np.ndarray:
        """Copy of tokens [start, stop), crossing part boundaries as needed."""
        if not 0 <= start <= stop <= len(self):
            raise IndexError(f"range [{start}, {stop}) outside stream of length {len(self)}")
        if len(self.parts) == 1:
            return np.array(self.parts[0][start:stop], dtype=np.uint16)
        out = np.empty(stop - start, dtype=np.uint16)
        i = int(np.searchsorted(self._starts, start, side="right")) - 1
        pos = start
        while pos < stop:
            lo = pos - int(self._starts[i])
            hi = min(stop, int(self._starts[i + 1])) - int(self._starts[i])
            out[pos - start : pos - start + hi - lo] = self.parts[i][lo:hi]
            pos += hi - lo
            i += 1
        return out

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """(len(starts), length) array; row r = tokens [starts[r], starts[r] + length)."""
        out = np.empty((len(starts), length), dtype=np.uint16)
        for row, s in enumerate(starts):
            out[row] = self.read(int(s), int(s) + length)
        return out
