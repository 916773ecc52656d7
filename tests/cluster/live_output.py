"""Capture off for a tier whose printed progress and figures are its report (the real-engine and kind
tiers: minutes per step). Their conftests import these hooks; pytest applies a conftest's hooks to its
own directory only. Innermost wrappers of each phase: pytest turns capture back on around each one."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


def _capture_off(item: pytest.Item) -> Iterator[None]:
    capman = item.config.pluginmanager.getplugin("capturemanager")
    if capman is None:
        yield
        return
    with capman.global_and_fixture_disabled():
        yield


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    yield from _capture_off(item)


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    yield from _capture_off(item)


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    yield from _capture_off(item)
