"""Heartbeats: one keeper per scheduler extends the lease of every run the instance holds.

Runs are registered and removed in O(1) (no task, no cross-thread call per run); the keeper sleeps until the
earliest heartbeat or deadline, sends every heartbeat due (those sent together, the store pipelines), and reports
a lost lease through the callback the run registered with.

Each run's heartbeat is answered on its own: a beat that hangs (a stale connection, a cluster node that stopped
answering) holds up neither the beats of the other runs nor the next pass. Nor does it hold its own run until the
client gives up on it: a beat unanswered halfway to the run's deadline is given up on, and sent again, unless the
store took longer than that to answer the run's last claim or beat (a store slow to answer, not a connection that
hangs): then it is given 1.5 times that round trip, for its answer would come in time where a beat sent again
would not. It is
cancelled, with the other beats on their way to the same node (they wait on the same connection): redis-py and
valkey-py then drop it, and the retries go on another. GLIDE keeps its connection (its request timeout bounds the
wait), and a sync client's thread waits on until its socket timeout. Where the keeper shares the scheduler's
connection (no thread of its own), a claim or a finish stuck on it holds the beats queued behind it until the
client's timeout.

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
from collections.abc import Callable, Coroutine, Hashable
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
# short lease gets its retries too), and no sooner than RETRY_MIN_S. A heartbeat unanswered for half the time its
# run had left when it was sent (at least RETRY_MIN_S), and for SLOW_STORE_PATIENCE times the run's last round trip,
# has failed.
RETRY_S = 1.0
RETRY_MIN_S = 0.01
SLOW_STORE_PATIENCE = 1.5
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
    lane: Hashable  # the store node its beats go to (see Store.lane)
    beat: asyncio.Future[int] | None = None  # the heartbeat on its way
    sent: float = 0.0  # when it was sent
    give_up: float = 0.0  # when it has failed if still unanswered
    round_trip: float = 0.0  # how long the store took to answer the run's claim, then its last beat answered

    def next_moment(self) -> float:
        """When the keeper must next look at the run: its deadline, or before it its beat's give-up time or (with
        no beat on its way) its next beat."""
        return min(self.deadline, self.next_beat if self.beat is None else self.give_up)


class LeaseKeeper:
    """Keeps the leases of the runs registered with :meth:`hold` alive until :meth:`release`.

    A run's deadline counts from when its claim or last heartbeat was *sent* (never after the server stamped the
    lease) and stops short of the lease by ``margin_ms``: the job must be cancelled, and the cancellation
    delivered, before the store can hand the run to a backup.
    """

    def __init__(
        self, strategy: Strategy, store: Store, clock: Clock, *, heartbeat_ms: int, margin_ms: float,
        lane_of: Callable[[str], Hashable] = lambda job: None,
    ) -> None:  # fmt: skip
        """``lane_of(job)``: the node of ``store`` that the job's heartbeats go to (on a cluster)."""
        self.strategy = strategy
        self.lane_of = lane_of
        self.store = store
        self.clock = clock
        self.heartbeat_s = heartbeat_ms / 1000
        self.margin_s = margin_ms / 1000
        self._held: dict[str, _Held] = {}
        # Runs whose last heartbeat failed, and how many failed since none did: in an outage every run held tries
        # again several times before its deadline, so only the outage's first failure is a warning. The keeper's
        # own thread alone reads and writes them, and the beats on their way.
        self._failing: set[str] = set()
        self._failed_beats = 0
        # The beats on their way (given up on or not, until they end), and the node each went to.
        self._beats: dict[asyncio.Future[int], Hashable] = {}
        self._lock = threading.Lock()  # hold/release come from the scheduler's loop, serve may run elsewhere
        self._wake: Callable[[], object] = lambda: None
        self._sleeping_until = -float("inf")  # while awake, runs held meanwhile are seen on the next pass

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
        round_trip = max(0.0, self.clock.monotonic() - sent)  # the claim's, as far as the keeper can tell
        held = _Held(request, policy, deadline, first_beat, lose, self.lane_of(request.job), round_trip=round_trip)
        with self._lock:
            self._held[request.token] = held
            if held.next_moment() < self._sleeping_until:
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
        # A beat on its way goes on: its answer is not read.
        return self._held.pop(token, None) is not None

    async def serve(self) -> None:
        """Beat until cancelled. Beats on their way when it is end before it does."""
        try:
            while True:
                task = asyncio.current_task()
                if task is not None and task.cancelling():  # a cancellation a client call swallowed (3.11)
                    raise asyncio.CancelledError
                self._look(self.clock.monotonic())
                await self._wait_until(partial(self._next_moment, self.clock.monotonic() + IDLE_S))
        finally:
            beats = list(self._beats)
            for beat in beats:
                beat.cancel()
            await asyncio.gather(*beats, return_exceptions=True)

    def _look(self, now: float) -> None:
        """One pass over the runs held: read the answers in, tell the runs whose deadline passed, give up on the
        beats unanswered for too long, and send the beats due."""
        with self._lock:
            held = list(self._held.values())
        for run in held:  # first: an answer that came in time extends the deadline
            if run.beat is not None and run.beat.done():
                self._read(run, now)
        for run in held:
            if run.deadline <= now and self.release(run.request.token):
                if run.beat is not None:
                    run.beat.cancel()
                run.lose(LEASE_RAN_OUT)
        overdue = {run.lane for run in held if run.beat is not None and run.give_up <= now and self._holds(run)}
        if overdue:
            self._give_up(held, overdue, now)
        if self._failing:  # runs released, or lost, while failing: the next failure is an outage's first
            self._failing = {token for token in self._failing if token in self._held}
            if not self._failing:
                self._failed_beats = 0
        for run in held:
            if run.beat is None and run.next_beat <= now and self._holds(run):
                self._send(run, now)

    def _holds(self, run: _Held) -> bool:
        """Whether ``run`` is still held: neither released nor lost, nor held again as another."""
        return self._held.get(run.request.token) is run

    def _give_up(self, held: list[_Held], lanes: set[Hashable], now: float) -> None:
        """A beat sent to one of ``lanes`` has gone unanswered for too long: give up on every beat on its way to
        them. Each has failed, and is cancelled, which ends its wait for its connection (redis-py then drops that
        connection; the retry opens another). Beats to the same node wait on one connection, in one pipeline or
        queued behind it, those of runs released meanwhile too: one left waiting would hold that pipeline, and the
        retries queued behind it, until the client's own timeout. Beats to other nodes go on."""
        for beat, lane in list(self._beats.items()):
            if lane in lanes:
                beat.cancel()
        for run in held:
            if run.beat is not None and run.lane in lanes and self._holds(run):
                run.beat = None
                self._failed(run, TimeoutError(f"no answer in {now - run.sent:.3g} s"), now)

    def _send(self, run: _Held, now: float) -> None:
        beat = asyncio.ensure_future(self.strategy.heartbeat(self.store, run.request, run.policy))
        self._beats[beat] = run.lane
        beat.add_done_callback(self._beat_ended)
        run.beat, run.sent = beat, now
        run.give_up = now + max(RETRY_MIN_S, (run.deadline - now) / 2, SLOW_STORE_PATIENCE * run.round_trip)

    def _beat_ended(self, beat: asyncio.Future[int]) -> None:
        self._beats.pop(beat, None)
        if not beat.cancelled():
            beat.exception()  # read here too: the beat of a run released meanwhile is not read otherwise
        self._wake()

    def _next_moment(self, idle_until: float) -> float:
        """The earliest moment a run held needs the keeper; ``idle_until`` when none is held."""
        return min((run.next_moment() for run in list(self._held.values())), default=idle_until)

    async def _wait_until(self, moment: Callable[[], float]) -> None:
        """Wait until the keeper-clock ``moment()`` (worked out under the lock, from the runs held), until hold()
        wakes the wait for a run due sooner, or until a beat is answered."""
        loop = asyncio.get_running_loop()
        with self._lock:
            until = moment()
            sleeper = asyncio.ensure_future(self.clock.sleep(until - self.clock.monotonic()))
            self._wake = partial(loop.call_soon_threadsafe, sleeper.cancel)
            self._sleeping_until = until
        try:
            await asyncio.wait([sleeper])
        finally:
            sleeper.cancel()
            with self._lock:  # awake: the next pass sees every run held meanwhile
                self._sleeping_until = -float("inf")

    def _answered(self, token: str) -> None:
        """The store answered the run's heartbeat: the line that says so ends an outage's failures."""
        if token not in self._failing:
            return
        self._failing.discard(token)
        if not self._failing:
            log.info("heartbeats reach the store again; %d failed meanwhile", self._failed_beats)
            self._failed_beats = 0

    def _read(self, run: _Held, now: float) -> None:
        """Read the answer to the run's beat."""
        assert run.beat is not None
        beat, run.beat = run.beat, None
        # A CancelledError here is the call's alone: the keeper cancels only the beats it abandons or ends with.
        answer: int | BaseException = (
            asyncio.CancelledError() if beat.cancelled() else beat.exception() or beat.result()
        )
        if isinstance(answer, BaseException):
            if not isinstance(answer, Exception | asyncio.CancelledError):
                raise answer
            self._failed(run, answer, now)
        elif answer <= 0:
            if self.release(run.request.token):
                run.lose(HEARTBEAT_REFUSED)
        else:
            self._answered(run.request.token)
            run.round_trip = now - run.sent
            run.deadline = run.sent + answer / 1000 - self.margin_s
            run.next_beat = run.sent + self.heartbeat_s

    def _failed(self, run: _Held, error: BaseException, now: float) -> None:
        # Whatever went wrong, the run's lease may still be kept by the next try before its deadline: ending the
        # keeper instead would leave every run it holds unaware of losing its lease. A run's lease lost is said in
        # any case.
        unexpected = not isinstance(error, StoreError | TimeoutError)
        level = logging.WARNING if unexpected or not self._failing else logging.DEBUG
        self._failing.add(run.request.token)
        self._failed_beats += 1
        log.log(level, "job %s: heartbeat failed: %s", run.request.job, error, exc_info=error if unexpected else None)
        run.next_beat = now + max(RETRY_MIN_S, min(RETRY_S, (run.deadline - now) / 2))


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
