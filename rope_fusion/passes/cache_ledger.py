"""The cache ledger: how a report learns of the graphs a compile cache served without running the pass.

Its own module because it is the one piece of the pass that outlives an instance and a process: one ledger per
process (`LEDGER`), shared by every `RopeFusionPass`, reading and writing Inductor's counters.
"""

from __future__ import annotations

import collections
import logging
import threading
import weakref
from typing import Any, Protocol

log = logging.getLogger("rope_fusion")


class ReplayTaker(Protocol):
    """What the ledger needs of a pass (RopeFusionPass): the tag its records carry, and where a replay goes. Named
    so, the ledger does not import the pass, which imports the ledger."""

    tag: str

    def take_replay(self, payload: str) -> None: ...

# Counter keys that carry one graph's records: the prefix, the options' tag, the records as JSON.
PAYLOAD_PREFIX = "rope_fusion_graph:"


class CacheLedger:
    """Carries each graph's report records through Inductor's compile caches, to the pass instance that asked.

    On a cache hit (FX graph cache, AOTAutograd cache, a bundled artifact) Inductor runs no post-grad pass, but
    it adds the counter deltas stored with the compile to `counters["inductor"]`. So the pass, when it runs,
    adds one counter whose key holds the graph's records (`Report.graph_payload`, tagged with the options);
    it survives a new process with the cached artifact. The key names no pass instance (that would change
    nothing in the cache key, but no other process could know the instance): a replay is given to the latest
    pass that Inductor asked for its `uuid()` with that tag. Inductor asks for it to build the cache key of every
    compile the pass takes part in, before the lookup that may replay; so two instances with the same options
    each get the graphs of their own compiles.

    Counts of each key that have been handed out (or recorded live) are `seen`; a key counted past that was
    replayed. The counters object's identity says nothing: Inductor's lazy pattern init swaps
    `counters["inductor"]` for a copy taken before it ran (pattern_matcher's `lazy_init`, once per pattern set
    in a process), so a new object is no clear, and forgetting `seen` on it handed every live graph of the
    process to the next pass as a replay. A clear shows as a count below `seen`, which is lowered to match;
    `asked` settles before each compile's cache lookup, so a clear before a compile is seen before its replay.
    Replays are taken in when a compile ends (a Dynamo end-of-compile callback: one log line per graph on a warm
    run too), when the pass runs or is asked for its uuid, and before a report is read."""

    RECENT = 16  # passes remembered as askers (latest last)

    def __init__(self) -> None:
        self.seen: collections.Counter = collections.Counter()
        self.recent: list = []  # weak references to the passes asked for their uuid, latest last
        self.lock = threading.RLock()

    @staticmethod
    def _counters() -> collections.Counter:
        from torch._dynamo.utils import counters

        return counters["inductor"]

    def _current(self) -> collections.Counter:
        c = self._counters()
        for k in [k for k, n in self.seen.items() if c.get(k, 0) < n]:  # cleared (`counters.clear()`, in place)
            self.seen[k] = c.get(k, 0)
        return c

    def recorded(self, tag: str, payload: str) -> None:
        """A graph the pass just ran on: its records go into the compile's counter deltas."""
        with self.lock:
            c = self._current()
            key = f"{PAYLOAD_PREFIX}{tag}:{payload}"
            c[key] += 1
            self.seen[key] += 1

    def asked(self, p: ReplayTaker) -> None:
        """Inductor (or vLLM, or a chain) asked `p` for its uuid: a compile with `p` may follow."""
        with self.lock:
            self.settle()
            self.recent = [r for r in self.recent if r() is not None and r() is not p][-self.RECENT + 1:]
            self.recent.append(weakref.ref(p))
        _on_compile_end(take_in_cache_replays)

    def settle(self, *_: Any) -> None:
        """Give each graph replayed since the last call to the pass that asked for it."""
        with self.lock:
            c = self._current()
            fresh = [(k, n - self.seen[k]) for k, n in list(c.items())
                     if n > self.seen[k] and isinstance(k, str) and k.startswith(PAYLOAD_PREFIX)]
            for key, times in fresh:
                self.seen[key] += times
                tag, _, payload = key[len(PAYLOAD_PREFIX):].partition(":")
                p = next((p for p in map(lambda r: r(), reversed(self.recent)) if p is not None and p.tag == tag),
                         None)
                for _ in range(times if p is not None else 0):
                    p.take_replay(payload)


def _on_compile_end(fn: Any) -> None:
    """Run fn at the end of every Dynamo compile (`torch._dynamo.reset()` drops such callbacks: re-added here
    each time a compile asks for the uuid). Without the callback API, reports still take replays in when read."""
    try:
        from torch._dynamo.callback import callback_handler
    except ImportError:
        return
    registered = getattr(callback_handler, "end_callbacks", None)
    if isinstance(registered, list) and fn not in registered:
        callback_handler.register_end_callback(fn)


LEDGER = CacheLedger()


def take_in_cache_replays(*_: Any) -> None:
    """Hand the graphs that a compile cache replayed to the passes that compiled them (`Report.refresh`, and
    the end of every compile); never raises."""
    try:
        LEDGER.settle()
    except Exception as e:  # a report must stay readable
        log.debug("rope_fusion: compile-cache records not read: %s: %s", type(e).__name__, e)
