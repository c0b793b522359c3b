"""Heartbeats: one keeper per scheduler extends the lease of every run the instance holds.

Runs are registered and removed in O(1) (no task, no cross-thread call per run); the keeper sleeps until the
earliest heartbeat or deadline, sends every heartbeat due together (the store pipelines them), and reports a lost
lease through the callback the run registered with.

The keeper runs on a thread of its own when it can (:class:`HeartbeatThread`): a job that hogs the event loop
(CPU-bound code in an ``async def``, a blocking call) would otherwise stop the heartbeats of every run on that
loop, and a backup would take over runs that are still going. The thread has its own event loop and its own
connection to the store. With an injected clock (the simulator's virtual time) it runs as a task on the
scheduler's loop instead.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from ._clock import Clock
from ._errors import StoreError
from ._store import Store
from ._strategies import JobPolicy, RunRequest, Strategy

log = logging.getLogger("anarchon")
T = TypeVar("T")
IDLE_S = 60.0
# After a failed heartbeat the next try comes RETRY_S later, or halfway to the deadline if that is sooner (so a
# short lease gets its retries too), and no sooner than RETRY_MIN_S.
RETRY_S = 1.0
RETRY_MIN_S = 0.01
# Why a run's lease is lost.
LEASE_RAN_OUT = "the lease ran out before a heartbeat reached the store"
HEARTBEAT_REFUSED = (
    "the heartbeat was refused: the run is not this attempt's (taken over, or lost by the store), or its lease had "
    "ended by the store's clock"
)


@dataclass(slots=True)
class _Held:
    request: RunRequest
    policy: JobPolicy
    deadline: float  # keeper clock seconds: past it, the lease may be gone
    next_beat: float
    lose: Callable[[str], object]


class LeaseKeeper:
    """Keeps the leases of the runs registered with :meth:`hold` alive until :meth:`release`.

    A run's deadline counts from when its claim or last heartbeat was *sent* (never after the server stamped the
    lease) and stops short of the lease by ``margin_ms``: the job must be cancelled, and the cancellation
    delivered, before the store can hand the run to a backup.
    """

    def __init__(self, strategy: Strategy, store: Store, clock: Clock, *, heartbeat_ms: int, margin_ms: float) -> None:
        self.strategy = strategy
        self.store = store
        self.clock = clock
        self.heartbeat_s = heartbeat_ms / 1000
        self.margin_s = margin_ms / 1000
        self._held: dict[str, _Held] = {}
        # Runs whose last heartbeat failed, and how many failed since none did: in an outage every run held tries
        # again several times before its deadline, so only the outage's first failure is a warning. The keeper's
        # own thread alone reads and writes them.
        self._failing: set[str] = set()
        self._failed_beats = 0
        self._lock = threading.Lock()  # hold/release come from the scheduler's loop, serve may run elsewhere
        self._wake: Callable[[], object] = lambda: None
        self._sleeping_until = -float("inf")  # while awake, runs held meanwhile are seen on the next pass
        self._awaiting_beats = False  # the wait is for a round's answers: only a sooner deadline matters to it

    def hold(
        self, request: RunRequest, policy: JobPolicy, sent: float, lease_ms_left: int, lose: Callable[[str], object]
    ) -> None:
        """Keep ``request``'s lease, won by a claim sent at ``sent`` (this keeper's clock)."""
        deadline = sent + lease_ms_left / 1000 - self.margin_s
        first_beat = sent + self.heartbeat_s
        if first_beat >= deadline:
            # A claim retried with its own token may win with less of the lease left than a heartbeat period:
            # its first beat comes halfway to the deadline, or none would be sent before the lease runs out.
            first_beat = sent + (deadline - sent) / 2
        held = _Held(request, policy, deadline, first_beat, lose)
        with self._lock:
            self._held[request.token] = held
            soonest = held.deadline if self._awaiting_beats else min(held.next_beat, held.deadline)
            if soonest < self._sleeping_until:
                self._wake()
                # Woken once is enough: its next pass sees every run held until then. Without this, a burst of
                # runs held before the keeper's thread gets to run would each send it another wake-up.
                self._sleeping_until = -float("inf")

    def holds(self, token: str) -> bool:
        """Whether the run's lease is still kept: not released, and not lost."""
        return token in self._held

    def release(self, token: str) -> bool:
        """Stop keeping a run; False if it was no longer kept (released meanwhile: its job ended, and a heartbeat
        refused meanwhile means nothing was lost)."""
        # No lock: a dict's pop is atomic, and serve() reads the runs only through atomic copies. A burst of
        # runs ending together must not queue behind the keeper's thread for the lock (and the GIL) each time.
        return self._held.pop(token, None) is not None

    async def serve(self) -> None:
        """Beat until cancelled."""
        while True:
            task = asyncio.current_task()
            if task is not None and task.cancelling():  # a cancellation a client call swallowed (3.11)
                raise asyncio.CancelledError
            now = self.clock.monotonic()
            with self._lock:
                held = list(self._held.values())
            for run in held:
                if run.deadline <= now and self.release(run.request.token):
                    run.lose(LEASE_RAN_OUT)
            if self._failing:  # runs released, or lost, while failing: the next failure is an outage's first
                self._failing = {token for token in self._failing if token in self._held}
                if not self._failing:
                    self._failed_beats = 0
            due = [run for run in held if run.deadline > now and run.next_beat <= now]
            if due:
                await self._beat(due)
                continue
            await self._wait_until(partial(self._next_due, now + IDLE_S))

    def _next_due(self, idle_until: float) -> float:
        """The earliest beat or deadline of the runs held; ``idle_until`` when none is held."""
        return min((min(run.next_beat, run.deadline) for run in list(self._held.values())), default=idle_until)

    async def _wait_until(
        self, moment: Callable[[], float], answering: asyncio.Future[list[int | BaseException]] | None = None
    ) -> bool:
        """Wait until the keeper-clock ``moment()`` (worked out under the lock, from the runs held), until hold()
        wakes the wait for a run due sooner, or until ``answering`` (a round's beats) is done; True if the moment
        came. While a round is answered, only a sooner deadline wakes the wait: beats go out after the round."""
        loop = asyncio.get_running_loop()
        with self._lock:
            until = moment()
            sleeper = asyncio.ensure_future(self.clock.sleep(until - self.clock.monotonic()))
            self._wake = partial(loop.call_soon_threadsafe, sleeper.cancel)
            self._sleeping_until, self._awaiting_beats = until, answering is not None
        waits: list[asyncio.Future[Any]] = [sleeper] if answering is None else [sleeper, answering]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            sleeper.cancel()
            with self._lock:  # awake: the next pass sees every run held meanwhile
                self._sleeping_until, self._awaiting_beats = -float("inf"), False
        return sleeper.done() and not sleeper.cancelled()

    def _answered(self, token: str) -> None:
        """The store answered the run's heartbeat: the line that says so ends an outage's failures."""
        if token not in self._failing:
            return
        self._failing.discard(token)
        if not self._failing:
            log.info("heartbeats reach the store again; %d failed meanwhile", self._failed_beats)
            self._failed_beats = 0

    async def _beat(self, due: list[_Held]) -> None:
        sent = self.clock.monotonic()
        beats = [self.strategy.heartbeat(self.store, run.request, run.policy) for run in due]
        answering = asyncio.ensure_future(asyncio.gather(*beats, return_exceptions=True))

        # Waited for no longer than the first deadline of every run held, not only of these: another run whose
        # beat failed earlier, or one held meanwhile, must learn it lost its lease at its deadline, not when these
        # beats end.
        def first_deadline() -> float:
            return min(run.deadline for run in (*due, *self._held.values()))

        try:
            deadline_came = False
            while not (answering.done() or deadline_came):
                deadline_came = await self._wait_until(first_deadline, answering)
        except asyncio.CancelledError:  # the keeper is stopping: the beats in flight end before it does
            await _cancelled(answering)
            raise
        if answering.done():
            answers = answering.result()
        else:
            await _cancelled(answering)
            answers = [TimeoutError("no answer before the lease deadline")] * len(due)
        for run, answer in zip(due, answers, strict=True):
            if isinstance(answer, BaseException):
                # A CancelledError here is the call's alone: one of the keeper would have been raised above.
                if not isinstance(answer, Exception | asyncio.CancelledError):
                    raise answer
                # Whatever went wrong, the run's lease may still be kept by the next try before its deadline:
                # ending the keeper instead would leave every run it holds unaware of losing its lease.
                # A run's lease lost is said in any case.
                unexpected = not isinstance(answer, StoreError | TimeoutError)
                level = logging.WARNING if unexpected or not self._failing else logging.DEBUG
                self._failing.add(run.request.token)
                self._failed_beats += 1
                log.log(level, "job %s: heartbeat failed: %s", run.request.job, answer, exc_info=unexpected)
                failed = self.clock.monotonic()
                run.next_beat = failed + max(RETRY_MIN_S, min(RETRY_S, (run.deadline - failed) / 2))
            elif answer <= 0:
                if self.release(run.request.token):
                    run.lose(HEARTBEAT_REFUSED)
            else:
                self._answered(run.request.token)
                run.deadline = sent + answer / 1000 - self.margin_s
                run.next_beat = sent + self.heartbeat_s


async def _cancelled(answering: asyncio.Future[list[int | BaseException]]) -> None:
    """Cancel a round's beats and wait for them to end. Their gathered outcome (a CancelledError) is read, or
    asyncio would log it as an exception never retrieved."""
    answering.cancel()
    await asyncio.wait([answering])
    if not answering.cancelled():
        answering.exception()


class HeartbeatThread:
    """Runs a keeper on a thread of its own, with its own event loop and store connection."""

    def __init__(self, keeper: LeaseKeeper) -> None:
        self.keeper = keeper
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="anarchon-heartbeats", daemon=True)
        self._thread.start()
        self.submit(keeper.serve())

    def _run(self) -> None:
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    def submit(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    async def _shut_down(self, timeout: float) -> None:
        # Every task of this loop (the keeper, its sleeper, beats in flight) ends before the loop closes: a task
        # still pending then would be destroyed unfinished.
        try:
            others = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in others:
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)
            await asyncio.wait_for(self.keeper.store.close(), timeout)
        except TimeoutError:
            log.warning("heartbeats: the heartbeat thread's connection did not close within %.1f s; dropped", timeout)
        except Exception as error:  # the thread ends all the same
            log.warning("heartbeats: closing the heartbeat thread's connection failed: %r", error)
        finally:
            asyncio.get_running_loop().stop()

    def close(self, timeout: float) -> None:
        """Stop beating, close the thread's connection and end the thread, within ``timeout`` seconds, half of
        them for the connection to close (blocking: call it from a worker thread in async code). A thread that
        does not end by then (its event loop blocked) is left behind, logged: a daemon thread, it does not hold
        the process up, and it ends once its loop runs again."""
        self.end(timeout)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.error("heartbeats: the heartbeat thread did not end within %.1f s (its event loop is blocked); left "
                      "behind", timeout)  # fmt: skip

    def end(self, timeout: float) -> None:
        """Stop beating, close the thread's connection (within half of ``timeout`` seconds) and end the thread,
        without waiting for any of it."""
        self.submit(self._shut_down(timeout / 2))
