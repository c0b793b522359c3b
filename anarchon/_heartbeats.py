"""Heartbeats on a thread of their own.

A job that hogs the event loop (CPU-bound code in an ``async def``, a blocking call) would otherwise stop the
heartbeats of every run on that loop, and a backup would take over a run that is still going. The thread has
its own event loop and its own connection to the store, so leases stay alive whatever the app's loop does. If
the lease is lost all the same (a backup took over, the store is gone), the job is told on its own loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from ._store import Store

T = TypeVar("T")


class HeartbeatThread:
    def __init__(self, store: Store) -> None:
        self.store = store
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="anarchon-heartbeats", daemon=True)
        self._thread.start()

    def submit(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    def close(self) -> None:
        """Close the thread's connection and stop it (blocking: call it in a worker thread from async code)."""
        try:
            self.submit(self.store.close()).result(timeout=10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._loop.close()
