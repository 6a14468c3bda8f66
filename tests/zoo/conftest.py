"""Zoo options: entries marked slow (bf16 of some models) run with `-m slow` or ROPE_ZOO_ALL=1."""

import os

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: zoo cases outside the default selection")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("ROPE_ZOO_ALL") == "1" or "slow" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="slow zoo case (ROPE_ZOO_ALL=1 or -m slow)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
