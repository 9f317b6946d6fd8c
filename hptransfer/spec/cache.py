"""Validated specs by sweep id, so a stored spec is validated once, not on every use.

A stored spec never changes, so an entry never goes stale; the cache keeps the most recently
used `size` specs so a long-lived coordinator's memory does not grow with every sweep ever
submitted.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from .sweep import SweepSpec

# the most sweeps one listing page shows (GET /sweeps?limit=): a page of studies re-listed
# after every commit must find all its specs here, or LRU eviction validates them all again
MAX_PAGE = 1000


class SpecCache:
    def __init__(self, size: int = MAX_PAGE + 24) -> None:
        if size < 1:
            raise ValueError(f"SpecCache size must be >= 1, got {size}")
        self.size = size
        self._specs: OrderedDict[str, SweepSpec] = OrderedDict()
        self._lock = threading.Lock()  # the API's threads and the dispatcher share one

    def get(self, sweep_id: str, raw: dict[str, Any]) -> SweepSpec:
        """The validated spec of `sweep_id`; raises pydantic's ValidationError if `raw` is
        invalid (nothing is cached then)."""
        with self._lock:
            spec = self._specs.get(sweep_id)
            if spec is not None:
                self._specs.move_to_end(sweep_id)
                return spec
        spec = SweepSpec.model_validate(raw)  # outside the lock: validation is the slow part
        self.put(sweep_id, spec)
        return spec

    def put(self, sweep_id: str, spec: SweepSpec) -> None:
        """Keep `spec` as the validated spec of `sweep_id`: one validated at submit, whose
        stored JSON `storable` checked to read back as this spec, need not be read again."""
        with self._lock:
            self._specs[sweep_id] = spec
            self._specs.move_to_end(sweep_id)
            while len(self._specs) > self.size:
                self._specs.popitem(last=False)

    def __len__(self) -> int:
        return len(self._specs)
