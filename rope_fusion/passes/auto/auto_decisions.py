"""`auto`'s persistent decisions: what measuring chose per site signature, and a device's calibrated factor table.

Both live in `rope_fusion/` under Inductor's cache dir (`torch._inductor.runtime.cache_dir_utils.cache_dir()`, which
follows `TORCHINDUCTOR_CACHE_DIR`), so that clearing Inductor's caches clears them too:

- `auto_decisions.json`: one entry per key, the key naming the device (its name and compute capability), the
  torch, triton and rope_fusion versions (the package's source hash: any code change measures again) and the site
  signature (passes/auto/auto_timing.py). A warm compile reads its decisions here and times nothing.
- `factors-<device>.json`: the factor table `rope-fusion calibrate` measured on that device (ops/cost_model.py
  `Factors`); the table fallback uses it instead of the H200's when it is present.

The pass's `uuid()` (Inductor's FX graph cache key) covers `fingerprint()`, the calibrated tables' content hash: a
table that `rope-fusion calibrate` rewrote compiles anew. It does not cover the decisions file. A compile that
measures writes every decision it compiled by, so the graph it caches is the one a later compile reading the file
would build; with the file in the key, the decision written by a process's first compile changed the key, and its
second start compiled everything again where plain compile's was a cache hit. What a hit can then serve that a fresh
compile would not: a site the first compile left unmeasured (beyond its allowance for measuring) stays as plain
compile writes it, and a decision edited by hand is not read, until Inductor's cache dir is removed or another
`TORCHINDUCTOR_CACHE_DIR` is used. A compile that does not measure reads no decisions.

Writes merge with what is on disk and replace the file atomically, so concurrent compiles (several ranks, several
processes) lose no decision and never read half a file. A file that does not parse is treated as empty (and
rewritten on the next decision): a damaged cache costs a measurement, never a compile.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import tempfile
import threading
from typing import Any

import torch

from ...ops.cost_model import Factors
from ..pass_identity import source_hash

log = logging.getLogger("rope_fusion")

DECISIONS_FILE = "auto_decisions.json"
FORMAT = 1  # the decisions file's layout; another value is not read


def cache_dir() -> str:
    """`rope_fusion/` under Inductor's cache dir (created when written). Read as Inductor's `cache_dir()` reads it,
    without its side effects (it creates the directory and sets the environment variable)."""
    root = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if root is None:
        try:
            from torch._inductor.runtime.cache_dir_utils import default_cache_dir
        except ImportError:  # older torch
            from torch._inductor.utils import default_cache_dir
        root = default_cache_dir()
    return os.path.join(os.path.abspath(root), "rope_fusion")


def decisions_path() -> str:
    return os.path.join(cache_dir(), DECISIONS_FILE)


def device_name(device: torch.device | str) -> str:
    """The device as decisions are keyed: a GPU's name and compute capability, else the device type."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        return f"{torch.cuda.get_device_name(index)} sm{major}{minor}"
    return device.type


def factors_path(device: torch.device | str) -> str:
    """Where `rope-fusion calibrate` writes the factor table of this device."""
    slug = re.sub(r"[^A-Za-z0-9]+", "-", device_name(device)).strip("-").lower()
    return os.path.join(cache_dir(), f"factors-{slug}.json")


def versions() -> str:
    """torch, triton and rope_fusion (its source hash) versions: a decision holds for these only."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    return f"torch {torch.__version__}, triton {triton_version}, rope_fusion {source_hash()[:16]}"


def decision_key(device: torch.device | str, signature: str) -> str:
    return f"{device_name(device)} | {versions()} | {signature}"


@dataclasses.dataclass(frozen=True)
class Decision:
    """What measuring chose for one site signature, and the timings it chose by (microseconds)."""

    choice: str  # "triton", "inductor" or "left"
    timings_us: dict
    margin: float
    # candidates not timed since their outputs broke the numbers contract (passes/fusion_check.py): never cached
    refused: dict = dataclasses.field(default_factory=dict, compare=False)

    def describe(self) -> str:
        """"left 12.3 us, triton 13.1 us, inductor 14.0 us", fastest first."""
        return ", ".join(f"{k} {v:.1f} us" for k, v in sorted(self.timings_us.items(), key=lambda kv: kv[1]))


class DecisionCache:
    """The decisions file, read once per change on disk (by its modification time and size)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: tuple | None = None  # (path, mtime_ns, size) of what `_entries` holds
        self._entries: dict = {}
        self._digest = ""

    def _stat(self, path: str) -> tuple | None:
        try:
            st = os.stat(path)
        except OSError:
            return None
        return (path, st.st_mtime_ns, st.st_size)

    def _load(self) -> None:
        path = decisions_path()
        stat = self._stat(path)
        if stat is not None and stat == self._seen:
            return
        entries, digest = {}, ""
        if stat is not None:
            try:
                with open(path, "rb") as f:
                    raw = f.read()
                digest = hashlib.sha256(raw).hexdigest()
                data = json.loads(raw)
                if isinstance(data, dict) and data.get("format") == FORMAT and isinstance(data.get("decisions"), dict):
                    entries = data["decisions"]
            except (OSError, ValueError) as e:
                log.debug("rope_fusion: decisions file %s not read: %s", path, e)
        self._seen, self._entries, self._digest = stat, entries, digest

    def digest(self) -> str:
        """The file's content hash ("" when there is none)."""
        with self._lock:
            self._load()
            return self._digest

    def get(self, key: str) -> Decision | None:
        with self._lock:
            self._load()
            entry = self._entries.get(key)
        if not isinstance(entry, dict):
            return None
        try:
            return Decision(str(entry["choice"]), {str(k): float(v) for k, v in entry["timings_us"].items()},
                            float(entry["margin"]))
        except (KeyError, TypeError, ValueError, AttributeError):
            return None

    def put(self, key: str, decision: Decision) -> None:
        """Add one decision to the file (merged with what another process wrote since), atomically."""
        path = decisions_path()
        with self._lock:
            self._seen = None
            self._load()
            entries = dict(self._entries)
            entries[key] = {k: v for k, v in dataclasses.asdict(decision).items() if k != "refused"}
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".auto_decisions.", suffix=".tmp")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump({"format": FORMAT, "decisions": entries}, f, indent=1, sort_keys=True)
                os.replace(tmp, path)
            except BaseException:
                if os.path.exists(tmp):
                    os.unlink(tmp)
                raise
            self._seen = None


DECISIONS = DecisionCache()


def file_digest(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return ""


_FACTORS_SEEN: dict = {}  # path -> ((mtime_ns, size), Factors | None)


def calibrated_factors(device: torch.device | str) -> Factors | None:
    """The factor table calibrated on this device, None where there is none (or it does not parse: logged)."""
    path = factors_path(device)
    try:
        st = os.stat(path)
    except OSError:
        return None
    stamp = (st.st_mtime_ns, st.st_size)
    seen = _FACTORS_SEEN.get(path)
    if seen is not None and seen[0] == stamp:
        return seen[1]
    factors = None
    try:
        with open(path) as f:
            data = json.load(f)
        factors = Factors.from_json(data["factors"], source=f"calibrated on {data.get('device', '?')}")
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("rope_fusion: the calibrated factor table %s is not read (%s); the H200 table decides", path, e)
    _FACTORS_SEEN[path] = (stamp, factors)
    return factors


def write_factors(device: torch.device | str, factors: Factors, measured: dict) -> str:
    """Write a calibrated table (and the rows it came from) for this device; returns the path."""
    path = factors_path(device)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    data: dict[str, Any] = {"device": device_name(device), "versions": versions(),
                            "factors": {k: v for k, v in factors.to_json().items() if k != "source"},
                            "measured": measured}
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".factors.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
    return path


def fingerprint(device_types: tuple = ("cuda",)) -> str:
    """What `auto` could read from disk that a compiled graph does not itself settle: the calibrated tables of the
    visible devices (their content hash). The decisions file is not in it: see the module's docstring."""
    parts = []
    if "cuda" in device_types and torch.cuda.is_available():
        parts += [file_digest(factors_path(f"cuda:{i}")) for i in range(torch.cuda.device_count())]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


__all__ = ["DECISIONS", "Decision", "DecisionCache", "cache_dir", "calibrated_factors", "decision_key",
           "decisions_path", "device_name", "factors_path", "fingerprint", "versions", "write_factors"]
