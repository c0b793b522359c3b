"""Virtual time: an asyncio event loop whose clock jumps to the next timer whenever every task is waiting.

Nothing in a simulation does real I/O (the store is in-process fakeredis), so "waiting for I/O" never happens:
when no callback is ready, the loop advances its clock straight to the earliest timer. A simulated day takes as
long as the Python work it contains. Loop time starts at 0 (float precision stays far below a microsecond for
years of simulated time); the wall clock is ``epoch_s`` plus loop time, and ``time.time`` is patched to it for
the duration of a run, which is the store's clock: fakeredis reads ``time.time`` for TIME, stream IDs and expiries.
"""

from __future__ import annotations

import asyncio
import random
import selectors
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, TypeVar
from unittest import mock

T = TypeVar("T")


class SimulationDeadlock(RuntimeError):
    """Every task waits and no timer is due: the simulation can never make progress."""


class _VirtualSelector(selectors.BaseSelector):
    """Keeps the loop's registrations (its self-pipe) and turns every wait into a jump of the virtual clock."""

    def __init__(self, loop: VirtualLoop) -> None:
        self._loop = loop
        self._keys: dict[Any, selectors.SelectorKey] = {}

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        fd = fileobj if isinstance(fileobj, int) else fileobj.fileno()
        key = selectors.SelectorKey(fileobj, fd, events, data)
        self._keys[fileobj] = key
        return key

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._keys.pop(fileobj)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:
            raise SimulationDeadlock("every task waits and no timer is due")
        self._loop.advance(timeout)
        return []

    def get_map(self) -> Mapping[Any, selectors.SelectorKey]:
        return self._keys

    def close(self) -> None:
        self._keys.clear()


class VirtualLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        self._now = 0.0
        super().__init__(_VirtualSelector(self))

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        if seconds > 0:
            self._now += seconds


class Sleepers:
    """Sleeps of a clock whose rate can change: a drift change ends them (:meth:`wake`), so that each works out
    again how long is left at the new rate. An OS timer fires when the clock it counts on reaches its moment,
    however that clock's rate changed meanwhile; a sleep left to end at the old rate would oversleep a clock
    made faster (a heartbeat sent late, a lease lost that was not). Woken in the order they began: the
    simulation stays deterministic."""

    def __init__(self) -> None:
        self._waiting: dict[asyncio.Future[None], None] = {}

    async def sleep(self, seconds: float) -> None:
        """Sleep ``seconds`` of the loop's time, or until :meth:`wake`."""
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        timer = loop.call_later(seconds, _end_sleep, waiter)
        self._waiting[waiter] = None
        try:
            await waiter
        finally:
            timer.cancel()
            del self._waiting[waiter]

    def wake(self) -> None:
        for waiter in self._waiting:
            _end_sleep(waiter)


def _end_sleep(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def run_virtual(
    main: Coroutine[Any, Any, T], *, epoch_s: float, seed: int, store_ahead_s: Callable[[], float] = lambda: 0.0
) -> T:
    """Run ``main`` to completion in virtual time; ``time.time()``, the store's clock, reads ``epoch_s`` + virtual
    seconds + ``store_ahead_s()`` meanwhile (a failover may promote a server whose clock differs).

    The module-level ``random`` is seeded too: fakeredis draws from it (SRANDMEMBER).
    """
    loop = VirtualLoop()
    state = random.getstate()
    random.seed(seed)

    def wall_clock() -> float:
        return epoch_s + loop.time() + store_ahead_s()

    try:
        with mock.patch("time.time", wall_clock):
            return loop.run_until_complete(main)
    finally:
        random.setstate(state)
        _cancel_remaining(loop)
        loop.close()


def _cancel_remaining(loop: VirtualLoop) -> None:
    pending = [task for task in asyncio.all_tasks(loop) if not task.done()]
    for task in pending:
        task.cancel()
    if pending:
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
