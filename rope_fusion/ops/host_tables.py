"""`rope_fusion::host_table_to_device`: a host-to-device copy of a RoPE table that is made once, not per call.

Models keep their frequency tables on the host as plain attributes (diffusers Qwen-Image keeps complex
`pos_freqs`/`neg_freqs` off the module's buffers on purpose) and move them with `.to(device)` inside
forward, behind an lru_cache that torch.compile does not honour: the compiled forward then copies them from
pageable memory on every call, and each such copy synchronises the stream (CUDA waits for all queued work
before a pageable host-to-device copy), which leaves the GPU idle while the host catches up.

This op keeps one device copy per host tensor and reuses it only while the host tensor provably holds the
values it held when the copy was made. The version counter is not proof: writes through `.data`
(`t.data.copy_(new)`, `t.data.mul_(2)`), through the storage (`t.untyped_storage().fill_(0)`, another tensor
`set_` on it), through a numpy array sharing the memory (`t.numpy()`, `torch.from_numpy`) all leave `_version`
as it was. So the cache keeps a host snapshot of the table beside the device copy and compares their bits on
every call (`torch.equal` of integer views, so a NaN is equal to itself and a signed zero is not): any write by
any path is seen, and the table is copied again. The cheap checks come first (the same tensor object, held
weakly; its data pointer, version counter and geometry): a change there re-copies without comparing.

What it costs: one read of the table and of its snapshot on the host per call, and a host copy of each cached
table. Measured on a shared 2-core CPU, one thread, a call that finds its copy: 6 us for a 32 KiB table, 160 us
for 2 MiB (Qwen-Image's `pos_freqs`, 4096 positions of 64 complex64 pairs), 670 us for 8 MiB. The per-call
pageable copy it replaces moves the same bytes over PCIe and stalls the GPU's queue. Each call returns a fresh
device-to-device clone of the cached copy, so the graph owns its output as it owned device_put's (Inductor may
reuse that buffer), and the clone is asynchronous. RopeFusionPass(cache_host_tables=False) turns the cache off.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .plan_cache import on_clear

# integer dtypes of each element width: a table's bits, compared as integers
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _state(src: torch.Tensor, device: torch.device) -> tuple:
    return (src.data_ptr(), src._version, tuple(src.shape), src.stride(), src.storage_offset(), src.dtype,
            str(device))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """t's bits as integers, equal exactly when the bits are: 8 bytes a word where the lanes allow it (fewer
    words compare faster: 150 against 280 us for 2 MiB of complex64 as int64 and as int32), else one integer per
    entry (complex128 as its real pairs)."""
    if t.element_size() > 8:
        t = torch.view_as_real(t)
    if t.element_size() < 8 and t.dim() > 0:
        try:  # whole words of lanes: contiguous lanes, a row of whole words, an aligned start
            return t.view(torch.int64)
        except RuntimeError:
            pass
    return t.view(_BITS[t.element_size()])


@dataclasses.dataclass
class _Entry:
    state: tuple  # the cheap checks: data pointer, version counter, geometry, target device
    snapshot: torch.Tensor  # the host table's values when `copy` was made
    copy: torch.Tensor  # on the target device


class HostTableCache:
    """Device copies of host tables, one per host tensor object, each reused while its host tensor is unchanged
    (same object, data pointer, version counter and geometry, and the same bits as the snapshot taken with it)."""

    def __init__(self) -> None:
        self._entries: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def get(self, src: torch.Tensor, device: torch.device) -> torch.Tensor:
        """The cached copy of src on device (not a clone: the caller must not write it), made again where src
        changed since it was made."""
        state = _state(src, device)
        hit = self._entries.get(src)
        if hit is not None and hit.state == state and torch.equal(_bits(src), _bits(hit.snapshot)):
            return hit.copy
        hit = _Entry(state, src.clone(), src.to(device, copy=True))
        self._entries[src] = hit
        return hit.copy

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()


_CACHE = HostTableCache()


@torch.library.custom_op("rope_fusion::host_table_to_device", mutates_args=())
def host_table_to_device(src: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`src.to(device)`, served from a cached device copy while `src` is unchanged."""
    if src.device == torch.device(device):
        return src.clone()
    return _CACHE.get(src, device).clone()


@host_table_to_device.register_fake
def _host_table_to_device_fake(src: torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.empty_like(src, device=device)


def cached_tables() -> int:
    """How many host tables have a device copy now (for tests and the report)."""
    return len(_CACHE)


def clear_cache() -> None:
    _CACHE.clear()


on_clear(clear_cache)


__all__ = ["HostTableCache", "cached_tables", "clear_cache", "host_table_to_device"]
