"""``Registry``: objects that traced ops name by an integer, held weakly.

A custom op takes tensors, numbers and strings, not Python objects, so an op that must reach a
per-program object (a ``local_map`` region, an expert exchange's records) takes its id. The
registry holds only weak references: an object lives as long as the program (or step) that owns
it, and the registry never grows with the number of calls.

    regions = Registry("local_map region")
    rid = regions.add(region)          # the op's argument
    regions[rid] is region             # while its owner keeps it alive
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any


class Registry:
    """Integer ids for live objects of one kind (``what`` names them in errors)."""

    def __init__(self, what: str):
        self.what = what
        self._items: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._ids: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._next = itertools.count()

    def add(self, obj: Any) -> int:
        """``obj``'s id (the same id every time for the same object)."""
        if obj in self._ids:
            return self._ids[obj]
        i = next(self._next)
        self._items[i] = obj
        self._ids[obj] = i
        return i

    def __getitem__(self, i: int) -> Any:
        try:
            return self._items[i]
        except KeyError:
            raise KeyError(f"no live {self.what} with id {i}: the program that used it was freed") from None

    def __len__(self) -> int:
        return len(self._items)
