"""Fixtures for the reliability tests: the live targets they run on (redis-7 and valkey-9, when selected)."""

from __future__ import annotations

import pytest

from sim.servers.testing import resolve_selection

LIVE_TARGETS = ("redis-7", "valkey-9")


@pytest.fixture(params=LIVE_TARGETS)
def live_target(request: pytest.FixtureRequest) -> str:
    """A target the test starts its own throwaway servers of (it stops, pauses or restarts them)."""
    target: str = request.param
    if target not in resolve_selection(request.config.getoption("servers")):
        pytest.skip(f"{target} is not among the selected servers (--servers)")
    return target
