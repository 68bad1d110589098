"""A bounded map for what the runtime learns per call structure (design.md §4.7).

The pipeline runtime remembers, per (module, argument structure, grad mode), the structure of
the outputs an earlier call returned (to return futures at once, §4.3), whether the caller
used them (to leave them on the owner, §4.8) and which of its arguments the owner read (to keep
the others, §4.6). A model whose calls carry changing Python values
(a sequence length, a step counter) makes a new key per value: unbounded, those tables grew
with every step. :class:`LRU` keeps the most recently used ``limit`` keys; a key dropped is
only relearned (its next call waits for its outputs once).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

__all__ = ["CALL_CACHE_SIZE", "LRU"]

CALL_CACHE_SIZE = 4096  # keys per table: far more than the distinct calls of one step


class LRU:
    """A dict holding at most ``limit`` keys; reads and writes make a key the most recent."""

    def __init__(self, limit: int | None = None):
        limit = CALL_CACHE_SIZE if limit is None else limit
        if limit < 1:
            raise ValueError(f"smp: an LRU table holds at least 1 key, got limit={limit}")
        self.limit = limit
        self.evicted = 0  # keys dropped to stay within the limit, since creation
        self._items: OrderedDict[Any, Any] = OrderedDict()

    def get(self, key: Any, default: Any = None) -> Any:
        if key not in self._items:
            return default
        self._items.move_to_end(key)
        return self._items[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        self._items[key] = value
        self._items.move_to_end(key)
        while len(self._items) > self.limit:
            self._items.popitem(last=False)
            self.evicted += 1

    def update(self, items: dict) -> None:
        for key, value in items.items():
            self[key] = value

    def add(self, key: Any) -> None:
        """As a set: ``key`` is in the table."""
        self[key] = True

    def pop(self, key: Any, default: Any = None) -> Any:
        return self._items.pop(key, default)

    def __contains__(self, key: Any) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)
