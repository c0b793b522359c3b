"""Fixtures of the tests: `target` wraps the session's `server` fixture (fake or real)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.anarchon.support import StoreTarget


@pytest.fixture
async def target(server: Any) -> AsyncIterator[StoreTarget]:
    store_target = StoreTarget(server)
    try:
        yield store_target
    finally:
        await store_target.close()
