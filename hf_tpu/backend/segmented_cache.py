"""A bounded cache that a run of one-off entries does not empty of what loops find again and again."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, MutableMapping
from typing import Any, Callable


class SegmentedCache(MutableMapping):
    """A map of at most ``capacity()`` entries in two parts: entries put and not found since, evicted first, the
    oldest first; and entries found since they were put, at most three quarters of the capacity, the one found
    longest ago going back among the others past that (where it is the newest: found again, it comes back). A run
    of one-off entries (a generate loop whose growing token tensors give every step new shapes) then evicts one-off
    entries, not the programs of a loop body found at each of its runs. ``find`` is the lookup that counts as a
    use, at the cost of one dict lookup for an entry found before (it is called for every op fused eager records);
    item access neither reorders nor promotes."""

    def __init__(self, capacity: Callable[[], int]) -> None:
        self._capacity = capacity
        self._new: OrderedDict = OrderedDict()
        self._found: OrderedDict = OrderedDict()

    def find(self, key: Any) -> Any:
        """The value kept for ``key`` (``None`` if none is kept); a value not found before joins the found part."""
        value = self._found.get(key)
        if value is not None:
            return value
        value = self._new.pop(key, None)
        if value is not None:
            self._found[key] = value
            if len(self._found) > self._capacity() * 3 // 4:
                demoted, kept = self._found.popitem(last=False)
                self._new[demoted] = kept
        return value

    def __setitem__(self, key: Any, value: Any) -> None:
        if key in self._found:
            self._found[key] = value
            return
        self._new[key] = value
        while len(self) > self._capacity():
            (self._new or self._found).popitem(last=False)

    def __getitem__(self, key: Any) -> Any:
        return self._found[key] if key in self._found else self._new[key]

    def __delitem__(self, key: Any) -> None:
        if key in self._found:
            del self._found[key]
        else:
            del self._new[key]

    def __iter__(self) -> Iterator:
        yield from self._new
        yield from self._found

    def __len__(self) -> int:
        return len(self._new) + len(self._found)
