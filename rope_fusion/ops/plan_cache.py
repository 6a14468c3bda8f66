"""The one cache of the library's host work: what a call geometry costs once (its checks, its launch plan, its
runner), kept by the geometry's key for every later call of it, and every such cache cleared through one function.

A process that calls the ops with ever new shapes (every sequence length of a serving run) must not grow without
end, and must not lose its hot geometries when a cold one arrives: each cache is bounded and evicts its least
recently used entry, where a dict cleared wholesale at its bound dropped the geometry the next call needed with the
thousands it did not. A hit costs one dict lookup and one reordering (about 0.1 us on a 2-core CPU).

Every cache registers itself by name, so `clear_caches()` (exported as `rope_fusion.clear_caches`) drops all of
them at once: after a device kernel is swapped (a test's stand-in, a backend registered late), a planned runner
would otherwise keep launching the kernel that served its first call.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

DEFAULT_LIMIT = 4096  # geometries a cache keeps: far more than one model's layers and sequence-length buckets

_CACHES: dict[str, PlanCache] = {}
_CLEARERS: list[Callable[[], None]] = []  # caches of another kind (the host tables' device copies)


class PlanCache:
    """Values by a call geometry's key, least recently used evicted past `limit`. A key of None (a call that cannot
    be keyed: symbolic sizes, a tensor without storage) is never stored and never found; a stored value is never
    None, so `get` returning None means a miss."""

    __slots__ = ("name", "limit", "_entries")

    def __init__(self, name: str, limit: int = DEFAULT_LIMIT) -> None:
        if name in _CACHES:
            raise ValueError(f"a plan cache named {name!r} exists already")
        self.name, self.limit = name, limit
        self._entries: OrderedDict = OrderedDict()
        _CACHES[name] = self

    def get(self, key: Hashable | None) -> Any:
        if key is None:
            return None
        entries = self._entries
        value = entries.get(key)
        if value is not None:
            entries.move_to_end(key)
        return value

    def put(self, key: Hashable | None, value: Any) -> Any:
        """Keep value under key (nothing where key is None) and return it."""
        if key is not None and value is not None:
            entries = self._entries
            entries[key] = value
            entries.move_to_end(key)
            if len(entries) > self.limit:
                entries.popitem(last=False)
        return value

    def __contains__(self, key: Hashable | None) -> bool:
        return self.get(key) is not None

    def values(self) -> list:
        return list(self._entries.values())

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"PlanCache({self.name!r}, {len(self)}/{self.limit})"


def plan_cache(name: str) -> PlanCache:
    """The registered cache of that name (tests and benchmarks read what a family planned)."""
    return _CACHES[name]


def plan_caches() -> dict[str, PlanCache]:
    """Every registered cache by name."""
    return dict(_CACHES)


def on_clear(clear: Callable[[], None]) -> None:
    """Have `clear_caches` call `clear` too: a cache that is not keyed by geometry (the host tables' copies)."""
    _CLEARERS.append(clear)


def clear_caches() -> None:
    """Forget every planned geometry, checked call and cached copy of the library: each later call is checked and
    planned again, with the device kernels registered now."""
    for cache in _CACHES.values():
        cache.clear()
    for clear in _CLEARERS:
        clear()


__all__ = ["DEFAULT_LIMIT", "PlanCache", "clear_caches", "on_clear", "plan_cache", "plan_caches"]
