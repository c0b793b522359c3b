"""The only way anarchon reads time or sleeps.

Wall time (epoch milliseconds) places cron slots; monotonic time drives timers; ``sleep`` waits. The simulator
injects virtual and skewed clocks through the same protocol, so the scheduler never calls ``time`` directly.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol, runtime_checkable


@runtime_checkable
class Clock(Protocol):
    def wall_ms(self) -> int:
        """Milliseconds since the Unix epoch, as this instance's wall clock says (may be skewed)."""
        ...

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back, for measuring intervals."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` of this clock's time."""
        ...


class SystemClock:
    """The machine's clocks and asyncio's sleep."""

    def wall_ms(self) -> int:
        return time.time_ns() // 1_000_000

    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))

    def __repr__(self) -> str:
        return "SystemClock()"
