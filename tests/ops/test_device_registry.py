"""The device registry every op family keeps (ops/device_registry.py): what a registration stores, what it refuses,
and the plan caches it empties, on fresh registries and on the rotary family's own."""

from __future__ import annotations

import itertools

import pytest
import torch

import rope_fusion
from rope_fusion.ops.device_registry import DeviceKernel, DeviceRegistry
from rope_fusion.ops.device_runners import ROTARY_KERNELS
from rope_fusion.ops.plan_cache import plan_cache
from rope_fusion.ops.reference import rotary_reference

_NAMES = itertools.count()


def _cache_name() -> str:
    return f"test_device_registry.{next(_NAMES)}"  # plan caches are registered by a name used once


def test_register_stores_one_record_and_replaces_the_last():
    registry = DeviceRegistry("probe")

    def first(call):
        return None

    def second(call):
        return None

    def planner(call):
        return None

    registry.register("cuda", first, plan=planner)
    assert registry.get("cuda") == DeviceKernel(first, None, planner, False)
    registry.register("cuda", second, takes_packed=True)  # the planner of the first kernel goes with it
    assert registry.get("cuda") == DeviceKernel(second, None, None, True)
    assert registry.get("cpu") is None and list(registry.kernels) == ["cuda"]


def test_a_record_without_a_required_part_is_refused():
    with pytest.raises(ValueError, match="a probe kernel for cuda needs impl"):
        DeviceRegistry("probe").register("cuda", plan=lambda call: None)
    planners_only = DeviceRegistry("join probe", required=("plan",))
    with pytest.raises(ValueError, match="a join probe kernel for cuda needs plan"):
        planners_only.register("cuda", lambda call: None)
    assert not planners_only.kernels


def test_register_empties_the_registry_plan_caches_after_its_hook():
    seen = []

    def hook(device_type: str, kernel: DeviceKernel) -> None:
        seen.append((device_type, kernel, dict(registry.kernels), len(cache)))

    registry = DeviceRegistry("probe", on_register=hook)
    cache = registry.plan_cache(_cache_name())
    cache.put(("a geometry",), "its runner")
    kernel = registry.register("npu", lambda call: None)
    assert seen == [("npu", kernel, {}, 1)]  # the hook runs before the record is stored and the cache emptied
    assert registry.kernels == {"npu": kernel} and len(cache) == 0


def test_a_hook_that_refuses_leaves_the_registry_as_it_was():
    def refuse(device_type: str, kernel: DeviceKernel) -> None:
        raise RuntimeError(f"no {device_type} here")

    registry = DeviceRegistry("probe", on_register=refuse)
    cache = registry.plan_cache(_cache_name())
    cache.put(("a geometry",), "its runner")
    with pytest.raises(RuntimeError, match="no npu here"):
        registry.register("npu", lambda call: None)
    assert not registry.kernels and len(cache) == 1


def test_a_rotary_registration_drops_the_direct_path_plans():
    """The direct path's plans hold runners of the kernel that served a geometry first: a kernel registered for any
    device empties them, and the next call plans again and still computes the rotation."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, 3, 16, dtype=torch.float64)
    angles = torch.randn(5, 1, 8, dtype=torch.float64)
    cos, sin = angles.cos(), angles.sin()
    want = rotary_reference(x, cos, sin, interleaved=False, rotary_dim=16, full_tables=False)
    rope_fusion.clear_caches()
    torch.testing.assert_close(rope_fusion.apply_rotary(x, cos, sin), want, rtol=0, atol=0)
    direct = plan_cache("rotary.direct")
    assert len(direct) == 1
    try:  # a device type no test has tensors of: its dispatcher kernel is never reached
        ROTARY_KERNELS.register("xpu", lambda call: None)
        assert len(direct) == 0
    finally:
        ROTARY_KERNELS.kernels.pop("xpu", None)
    torch.testing.assert_close(rope_fusion.apply_rotary(x, cos, sin), want, rtol=0, atol=0)
    assert len(direct) == 1
