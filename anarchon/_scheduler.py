"""The scheduler: computes each job's slots, claims them through the backend, runs what it wins.

One dispatcher task per scheduler sleeps until the earliest due claim, then claims everything due in one round
trip (a burst of jobs due in the same second costs one pipeline, not one round trip each). Under the lease
strategy the winner keeps its lease alive with heartbeats, instances that got ``running`` stand by as backups
and claim again when the lease ends, and missed slots are caught up at start.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import concurrent.futures.thread  # registers its exit hook before any SchedulerThread does
import contextlib
import contextvars
import dataclasses
import functools
import hashlib
import heapq
import inspect
import logging
import math
import os
import random
import re
import signal
import socket
import threading
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Hashable, Iterable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Generic, Literal, TypeAlias, TypeVar, cast, overload
from zoneinfo import ZoneInfo

from ._backend import ClaimOnly, Leased, M, RedisBackend
from ._clock import Clock, SystemClock
from ._config import check_int, is_finite, shown
from ._context import RunContext
from ._errors import (
    ConfigError,
    ConfigTypeError,
    JobNotFoundError,
    SchedulerStateError,
    StoreError,
    StoreUnavailableError,
    UnknownOptionError,
)
from ._heartbeats import HEARTBEAT_REFUSED, HeartbeatThread, LeaseKeeper
from ._job import (
    DAY_MS,
    LEASE_OPTIONS,
    Job,
    JobFunction,
    JobOptions,
    check_callable,
    check_claim_order,
    check_idmp_size,
    check_memory,
)
from ._keys import check_job_name
from ._records import RunRecord, Status
from ._store import Connection, Store
from ._strategies import Claim, JobPolicy, Outcome, RunRequest, run_id
from ._strategies._base import CLAIM_MARGIN_MS

log = logging.getLogger("anarchon")
# In a run's task: its scheduler, the run, and that task. Tasks its job or hooks start copy the context, and see
# it too (see stop()).
_RUN_OF: contextvars.ContextVar[tuple[object, _Running, asyncio.Task[Any]] | None] = contextvars.ContextVar(
    "anarchon_run_of", default=None
)

F = TypeVar("F", bound=JobFunction)
S = TypeVar("S")
RunStartHook = Callable[[RunContext], object]
RunEndHook = Callable[[RunContext, RunRecord], object]

DEFAULT_LEASE_MS = 30_000
DEFAULT_HISTORY_SIZE = 1000
RETRY_MIN_S = 0.5
RETRY_MAX_S = 30.0
# A wall clock that moved this much less than the monotonic one was set back (below it: the two clocks' reading
# moments and rounding).
STEP_BACK_MIN_MS = 2
MAX_SLEEP_S = 60.0  # wake at least this often, so a wall clock that jumps is noticed
LEASE_MARGIN = 0.05  # share of the lease a winner gives up, so that it stops before the store's lease end
# After stop()'s timeout, how long the runs it cut short (and claims in flight) may still wait for the store to
# take their hand-back or result: a store that does not answer then is given up on, as after a crash.
STOP_GRACE_S = 1.0
# How long a sync job cut short is waited for: one that checks run.lease_is_lost between steps returns a step
# later. Within STOP_GRACE_S, so that its hand-back or result still reaches the store.
THREAD_GIVE_UP_S = 0.5
# Why a lease claim answered that the store has forgotten the run (Claim.forgotten) does not run it.
FORGOTTEN = (
    "the store's history no longer reaches back to this run (it ended more than keep_ms ago, or this clock is far "
    "behind the store's)"
)
# A result the store could not take is sent again after FINISH_RETRY_MIN_S, then after twice as long each time, up
# to FINISH_RETRY_S, while the lease lasts. The first try again comes soon: until the store has the result, the run
# holds the job's lease, and the job's next slot (a second away, for some jobs) would be skipped for overlap.
FINISH_RETRY_MIN_S = 0.1
FINISH_RETRY_S = 1.0
# Runs due together are claimed in pipelines of CLAIM_BATCH, CLAIM_LANES of them in flight at a time: the runs
# of the first pipelines start while the store answers the next ones (instead of every run waiting for the
# last answer), and the store has the next pipeline at hand when it has answered one.
CLAIM_BATCH = 1_000
CLAIM_LANES = 2
# Claims that fail are said in the log at once, then at most once per FAILING_SAID_S (an outage fails every job's
# claim, again at each retry: a line each would flood the log), naming up to SAID_RUNS of them.
FAILING_SAID_S = 5.0
SAID_RUNS = 10
# Sync jobs run on threads of the scheduler's own, up to this many at once. asyncio's default pool (min(32,
# CPUs + 4) threads) also serves DNS lookups, sync store clients and the heartbeat thread's shutdown: jobs there
# would wait behind each other with their leases kept, and stop() behind them.
JOB_THREADS = 128
STOPPED = "the scheduler stopped"  # why stop() interrupts the runs still going at its timeout
LEASE_LOST = "lease lost"  # why the keeper interrupts a run whose lease it could not keep

# Tokens need draws that differ between processes, not the OS's randomness on every draw: a system call each,
# which took a tenth of an instance's client time in a burst of claims. One generator seeded by the OS,
# seeded again in a forked process: one seeded before a fork (gunicorn's preload) would draw the same tokens in
# every worker, and each would take every run for its own.
_SEEDED_BY_THE_OS = random.Random()
os.register_at_fork(after_in_child=_SEEDED_BY_THE_OS.seed)


# "early": a claim the store put off to its slot (this clock runs ahead of the store's, another run is live)
Kind: TypeAlias = Literal["scheduled", "backup", "retry", "early"]
# A claim to make: at ``at_ms`` (this instance's wall clock), for ``job``'s ``slot``. ``seq`` orders the claims
# due at the same ms. ``failures`` counts the tries that failed so far; a claim retried after an unknown outcome
# keeps its ``token``, so that the store recognises it if the first try won.
# A plain tuple of numbers and strings: the heap compares them in C, and the garbage collector stops tracking
# them, however many thousand backups wait in the queue.
_Due: TypeAlias = tuple[int, int, str, int, Kind, int, str | None]  # at_ms, seq, job, slot, kind, failures, token
_Failed: TypeAlias = tuple[str, int, StoreError, int, float]  # a claim that failed: job, slot, error, failures, delay


class _Failing:
    """Claims failing: since when (monotonic), how many in all, those not said yet (the first SAID_RUNS of them
    kept to name), the jobs whose last claim could not reach the store, those whose last claim the store refused
    (a key of another type, an ACL: retried as well, and said as seldom), and those whose last claim, retried past
    its lateness, ended as a skip that could not reach the store either (with their node: no claim of theirs may
    come for a day, and an answer from their node says they would reach it)."""

    __slots__ = (
        "given_up", "out_of_reach", "refused", "said_at", "since", "total", "unreachable", "unsaid", "unsaid_count"
    )  # fmt: skip

    def __init__(self, since: float) -> None:
        self.since = since
        self.said_at = -math.inf
        self.total = self.unsaid_count = 0
        self.unsaid: list[_Failed] = []
        self.out_of_reach: set[str] = set()
        self.refused: set[str] = set()
        self.given_up: dict[str, Hashable] = {}
        self.unreachable = False  # some claim could not reach the store (others were refused: an answer)

    def add(self, failed: list[_Failed]) -> None:
        self.total += len(failed)
        self.unsaid_count += len(failed)
        self.unsaid.extend(failed[: SAID_RUNS - len(self.unsaid)])
        for name, _, error, _, _ in failed:
            if isinstance(error, StoreUnavailableError):
                self.out_of_reach.add(name)
                self.unreachable = True
            else:
                self.refused.add(name)

    @property
    def over(self) -> bool:
        """Whether every job's last claim (or late skip) was answered."""
        return not self.out_of_reach and not self.refused and not self.given_up

    def say(self, now: float) -> None:
        if self.unsaid_count == 1:
            [(name, slot, error, _, delay_s)] = self.unsaid
            log.warning("job %s: claim of slot %d failed (%s); retrying in %.1f s", name, slot, error, delay_s,
                        extra={"job": name, "slot": slot})  # fmt: skip
        elif self.unsaid:
            named = ", ".join(f"job {name} slot {slot} (try {failures} failed; next in {delay_s:.1f} s)"
                              for name, slot, _, failures, delay_s in self.unsaid)  # fmt: skip
            more = f", and {self.unsaid_count - len(self.unsaid)} more" if self.unsaid_count > len(self.unsaid) else ""
            within = f" in the last {now - self.said_at:.1f} s" if self.said_at > -math.inf else ""
            log.warning("claims of %d runs failed%s (%s); retrying: %s%s", self.unsaid_count, within,
                        self.unsaid[-1][2], named, more)  # fmt: skip
        self.said_at = now
        self.unsaid, self.unsaid_count = [], 0


@dataclass(slots=True)
class _Running:
    context: RunContext
    request: RunRequest
    task: asyncio.Task[object] | None = None  # the task awaiting the job function, while it does
    reason: str | None = None  # why the job was interrupted
    thread: concurrent.futures.Future[object] | None = None  # a sync job's call on its thread
    cancels: int = 0  # the cancellations interrupt() sent the task, not yet withdrawn
    in_hook: bool = False  # whether on_run_start or on_run_end is running
    ended: bool = False  # the job has ended (its result may not be recorded yet)

    @property
    def in_user_code(self) -> bool:
        """Whether the job or one of its hooks is running (and may be awaiting something, such as stop())."""
        return self.task is not None or self.in_hook

    @property
    def thread_runs_on(self) -> bool:
        """Whether a sync job's function still runs on its thread: cancelling the task that awaited it cannot
        stop it."""
        return self.thread is not None and not self.thread.done()

    def thread_ended(self) -> tuple[Status, str | None] | None:
        """How a sync job's function ended, if it ran to its end: before the interruption came, or after it
        without having seen ``run.lease_is_lost`` (None otherwise: it has not ended, or it gave up on seeing
        it). The run was done, and its result stands. Recorded as interrupted, it would be handed back and run
        twice. (One that ended before the interruption cannot have seen it.)"""
        thread = self.thread
        if thread is None or not thread.done() or thread.cancelled() or self.context.lease_lost.seen_set:
            return None
        if (error := thread.exception()) is not None:
            return "error", _failure(error)
        if inspect.isawaitable(thread.result()):  # its work was still to come, in the coroutine it returned
            return None
        return "ok", None

    def interrupt(self, reason: str) -> None:
        """End the attempt here: cancel the job, and tell it (a sync job's thread cannot be cancelled; it can
        look at ``run.lease_is_lost`` between steps)."""
        if self.reason is None:
            self.reason = reason
        self.context.lease_lost.set()
        if self.task is not None:
            self.task.cancel()
            self.cancels += 1

    def job_ended(self) -> None:
        """The job has ended, however it ended: interrupt() cancels nothing any more, and the cancellations it sent
        are withdrawn, so that the task goes on to record the run (and catch-up to its next slot) instead of ending
        at its next check for a cancellation. A job may also have caught one and returned."""
        while self.cancels and self.task is not None and self.task.cancelling():
            self.task.uncancel()
            self.cancels -= 1
        self.task = None
        self.ended = True


class Scheduler(Generic[M]):
    """Runs cron jobs exactly once across every instance that shares the backend's store."""

    @overload
    def __init__(
        self: Scheduler[Leased],
        backend: RedisBackend[Leased] | None = None,
        *,
        lease_ms: int = 30_000,
        heartbeat_ms: int | None = None,
        history_size: int = DEFAULT_HISTORY_SIZE,
        history_ttl_ms: int | None = None,
        clock: Clock | None = None,
        instance_id: str | None = None,
        random: random.Random | None = None,
        on_run_start: RunStartHook | None = None,
        on_run_end: RunEndHook | None = None,
    ) -> None: ...

    @overload
    def __init__(
        self: Scheduler[ClaimOnly],
        backend: RedisBackend[ClaimOnly],
        *,
        history_size: int = DEFAULT_HISTORY_SIZE,
        history_ttl_ms: int | None = None,
        clock: Clock | None = None,
        instance_id: str | None = None,
        random: random.Random | None = None,
        on_run_start: RunStartHook | None = None,
        on_run_end: RunEndHook | None = None,
    ) -> None: ...

    def __init__(
        self,
        backend: RedisBackend[Any] | None = None,
        *,
        lease_ms: int | None = None,
        heartbeat_ms: int | None = None,
        history_size: int = DEFAULT_HISTORY_SIZE,
        history_ttl_ms: int | None = None,
        clock: Clock | None = None,
        instance_id: str | None = None,
        random: random.Random | None = None,
        on_run_start: RunStartHook | None = None,
        on_run_end: RunEndHook | None = None,
        **unknown: object,
    ) -> None:
        known = (
            "backend", "lease_ms", "heartbeat_ms", "history_size", "history_ttl_ms", "clock", "instance_id",
            "random", "on_run_start", "on_run_end",
        )  # fmt: skip
        for option in unknown:
            raise UnknownOptionError(option, "Scheduler", known)
        self.backend: RedisBackend[Any] = RedisBackend() if backend is None else backend
        if not isinstance(self.backend, RedisBackend):
            raise ConfigTypeError("backend", f"got {type(backend).__name__}", "a RedisBackend or ValkeyBackend")
        leases = self.backend.leases
        if not leases:
            for option, value in (("lease_ms", lease_ms), ("heartbeat_ms", heartbeat_ms)):
                if value is not None:
                    raise _lease_only(option, self.backend.config.name)
        self.lease_ms = check_int("lease_ms", DEFAULT_LEASE_MS if lease_ms is None else lease_ms, 10, DAY_MS)
        default_heartbeat = max(1, self.lease_ms // 3)
        self.heartbeat_ms = check_int(
            # At most half the lease: a heartbeat that failed is tried again before the lease ends, and the keeper
            # gives a run up once its lease is nearly over (see LEASE_MARGIN).
            "heartbeat_ms",
            default_heartbeat if heartbeat_ms is None else heartbeat_ms,
            1,
            self.lease_ms // 2,
            high_is="half of lease_ms",
        )
        self.history_size = check_int("history_size", history_size, 1, 1_000_000)
        self.history_ttl_ms = (
            None if history_ttl_ms is None else check_int("history_ttl_ms", history_ttl_ms, 1, 365 * DAY_MS)
        )
        self.clock: Clock = SystemClock() if clock is None else clock
        if isinstance(self.clock, type) or not isinstance(self.clock, Clock):
            got = f"the class {self.clock.__name__}" if isinstance(self.clock, type) else type(clock).__name__
            raise ConfigTypeError("clock", f"got {got}", "an object with wall_ms, monotonic, sleep (an instance)")
        methods = ("getrandbits", "randint")
        if random is not None and (
            isinstance(random, type) or not all(callable(getattr(random, m, None)) for m in methods)
        ):
            raise ConfigTypeError("random", f"got {type(random).__name__}", "a random.Random instance, or None")
        self.random = _SEEDED_BY_THE_OS if random is None else random
        # A default id names this process; a process forked from it (gunicorn --preload) takes its own at start.
        self._named_by_pid = os.getpid() if instance_id is None else None
        self._name(self._default_id() if instance_id is None else instance_id)
        hooks = (("on_run_start", on_run_start, ("run",)), ("on_run_end", on_run_end, ("run", "record")))
        for name, hook, arguments in hooks:
            allowed = f"a function or coroutine function taking ({', '.join(arguments)}), or None"
            if hook is not None:
                check_callable(name, hook, arguments, allowed)
        self.on_run_start = on_run_start
        self.on_run_end = on_run_end
        self._jobs: dict[str, Job] = {}
        self._registering = threading.RLock()  # add_job on an app's thread while start() runs
        self._policies: dict[str, JobPolicy] = {}
        self._shared: dict[object, object] = {}
        self._queue: list[_Due] = []
        # The store nodes with a round of claims on its way, and the queue entries for them that came due meanwhile,
        # which go together in the node's next round: each node's rounds go one after another, and on a cluster, a
        # node that does not answer holds up only the jobs whose keys it holds. A new dict for each start: a round
        # that outlives stop() releases its node in the dict of its own start.
        self._claiming: dict[Hashable, list[_Due]] = {}
        # The node of the round each job's claims are in, while it is on its way: the map of slots may give the job
        # to another node meanwhile (a failover), and its next claims must not go beside the ones still out.
        self._round_of: dict[str, Hashable] = {}
        self._stepped_back_ms = 0  # how far the wall clock went back while rounds were on their way
        # Claims the store put off to their slots ("early"): when each was due again, by this clock. Late is
        # counted from then, through any retries after store errors, as this clock runs ahead of the store's.
        self._due_again: dict[tuple[str, int], int] = {}
        # The jobs with a claim queued to be sent again after a store error (see _another_run_is_live).
        self._retrying: set[str] = set()
        self._failing: _Failing | None = None  # claims failing, until every job's is answered again
        self._seq = 0
        # When scheduling began (monotonic): at start, or for a job added later, then (see _plan_after_step_back).
        self._started_at: float | None = None
        self._added_at: dict[str, float] = {}
        self._running: dict[str, _Running] = {}  # by token
        self._tasks: set[asyncio.Task[Any]] = set()
        self._left_running: set[asyncio.Task[Any]] = set()  # jobs that ignored a stop(): no later stop waits again
        # Given no context, a done-callback runs in a copy of the current one: one more object for each of the
        # thousands of runs a burst starts. Forgetting a task needs none; one empty context per scheduler (a
        # context is entered by one thread at a time, and each scheduler's callbacks run on its loop's thread).
        self._callback_context = contextvars.Context()
        self._dispatcher: asyncio.Task[None] | None = None
        self._sleeper: asyncio.Task[None] | None = None
        self._naps: set[asyncio.Future[None]] = set()  # catch-ups' sleeps, which stop() ends
        self._stopping: asyncio.Future[None] | None = None
        self._on_stopped: list[Callable[[], object]] = []  # called on the loop as each stop ends (SchedulerThread)
        self._runs_stopping: list[tuple[asyncio.Task[Any], _Running]] = []  # runs whose job or hook awaits stop()
        self._stop_deadline = float("inf")  # when stop() stops waiting for runs (this scheduler's monotonic clock)
        self._stop_hurried = asyncio.Event()  # a later stop() brought the deadline forward
        # Set while start() runs (a second start() is refused meanwhile), and set once it ends: stop() waits.
        self._starting: asyncio.Event | None = None
        self._keeper: LeaseKeeper | None = None
        self._heartbeats: HeartbeatThread | None = None
        self._job_threads: concurrent.futures.ThreadPoolExecutor | None = None  # made for the first sync run
        self._started = False
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop of the last start()
        self._started_in = os.getpid()  # the process of the last start(): its loop, tasks and connections are there

    # --- jobs ----------------------------------------------------------------------------------------------

    @overload
    def job(
        self: Scheduler[Leased],
        name: str,
        cron: str,
        *,
        overlap: bool = False,
        max_attempts: int = 3,
        catch_up_ms: int = 0,
        jitter_ms: int = 0,
        max_late_ms: int = 60_000,
        timezone: str | ZoneInfo = "UTC",
    ) -> Callable[[F], F]: ...

    @overload
    def job(
        self: Scheduler[ClaimOnly],
        name: str,
        cron: str,
        *,
        jitter_ms: int = 0,
        max_late_ms: int = 60_000,
        timezone: str | ZoneInfo = "UTC",
    ) -> Callable[[F], F]: ...

    def job(self, name: str, cron: str, **options: Any) -> Callable[[F], F]:
        """Register the decorated function as a job (see :meth:`add_job` for the options)."""

        def register(function: F) -> F:
            self.add_job(name, cron, function, **options)
            return function

        return register

    @overload
    def add_job(
        self: Scheduler[Leased],
        name: str,
        cron: str,
        func: JobFunction,
        *,
        overlap: bool = False,
        max_attempts: int = 3,
        catch_up_ms: int = 0,
        jitter_ms: int = 0,
        max_late_ms: int = 60_000,
        timezone: str | ZoneInfo = "UTC",
    ) -> None: ...

    @overload
    def add_job(
        self: Scheduler[ClaimOnly],
        name: str,
        cron: str,
        func: JobFunction,
        *,
        jitter_ms: int = 0,
        max_late_ms: int = 60_000,
        timezone: str | ZoneInfo = "UTC",
    ) -> None: ...

    def add_job(self, name: str, cron: str, func: JobFunction, **options: Any) -> None:
        """Register ``func`` to run on the cron schedule, once per slot across all instances.

        Options: ``jitter_ms`` (claim up to this much after the slot: a delay drawn per run from the job's name and
        the slot, the same on every instance), ``max_late_ms`` (skip a run
        whose claim would come later than this after its slot), ``timezone`` (the zone the cron fields are read
        in: an IANA name or a ZoneInfo); lease strategy only: ``overlap`` (allow a run to start while the previous
        one is still going), ``max_attempts`` (attempts per run, counting backups' takeovers), ``catch_up_ms`` (at
        start, or when added to a started scheduler, run the slots of this last period that no instance claimed).

        On a started scheduler it may be called from any thread (a sync app beside :meth:`run_in_thread`).
        """
        with self._registering:  # start() marks the scheduler started under it: either it starts this job or
            loop = self._own_loop_elsewhere("add_job")  # the job is sent to its loop
            if loop is None:
                self._register(name, cron, func, options)
                return
        # The job's first slot goes into the dispatcher's queue and a catch-up starts a task: only the scheduler's
        # own loop may touch those, so the job is added there, and errors come back here.
        asyncio.run_coroutine_threadsafe(self._add_on_loop(name, cron, func, options), loop).result()

    def _register(self, name: str, cron: str, func: JobFunction, options: dict[str, Any]) -> None:
        known = ("overlap", "max_attempts", "catch_up_ms", "jitter_ms", "max_late_ms", "timezone")
        with _naming_job(name):
            for option in options:
                if option not in known:
                    raise UnknownOptionError(option, f"job {name!r}", known)
                if option in LEASE_OPTIONS and not self.backend.leases:
                    raise _lease_only(option, self.backend.config.name)
            job = Job.create(name, cron, func, JobOptions(**options))
        if job.name in self._jobs:
            raise ConfigError("name", f"a job named {job.name!r} is already registered", "a unique name per job")
        config = self.backend.config
        if config.name == "script":
            check_memory(job, config.name, config.window_ms, "strategy.window_ms")
        elif config.name == "idmp":
            check_memory(job, config.name, config.duration_sec, "strategy.duration_sec", "s")
            check_idmp_size(job, config.max_size, self.clock.wall_ms())
        elif config.name == "stream-id":
            check_claim_order(job, self.clock.wall_ms())
        # Jobs with equal schedules and options share one schedule, one set of options and one policy: ten
        # thousand jobs on one cron expression then hold three objects instead of thirty thousand, which the
        # garbage collector would walk through on each full collection.
        job = dataclasses.replace(job, schedule=self._share(job.schedule), options=self._share(job.options))
        self._jobs[job.name] = job
        self._policies[job.name] = self._share(
            JobPolicy(
                lease_ms=self.lease_ms,
                max_attempts=job.options.max_attempts,
                overlap=job.options.overlap,
                history_size=self.history_size,
                history_ttl_ms=self.history_ttl_ms,
                keep_ms=job.claim_horizon_ms(self.lease_ms) + CLAIM_MARGIN_MS,
                slot_gap_ms=job.schedule.min_gap_ms,
                late_after_ms=job.options.late_after_ms,
            )
        )
        if self._started:
            self._start_job(job, self.clock.wall_ms())
            self._wake()

    async def _add_on_loop(self, name: str, cron: str, func: JobFunction, options: dict[str, Any]) -> None:
        self.add_job(name, cron, func, **options)

    def _start_job(self, job: Job, now: int) -> None:
        """Schedule the job's next slot, and catch up (lease) the slots of its last ``catch_up_ms`` that no instance
        ran: at start, or when the job is added to a started scheduler."""
        self._schedule_next(job, now)
        if self._started_at is not None:  # added to a started scheduler
            self._added_at[job.name] = self.clock.monotonic()
        if job.options.catch_up_ms and self.backend.leases:
            self._spawn(self._catch_up(job, now), "anarchon-catch-up")

    def _share(self, value: S) -> S:
        return cast(S, self._shared.setdefault(value, value))

    @property
    def jobs(self) -> tuple[str, ...]:
        return tuple(self._jobs)

    def _job(self, name: object) -> Job:
        if not isinstance(name, str):
            raise ConfigTypeError("name", f"must be a string, got {type(name).__name__}", "a registered job's name")
        try:
            return self._jobs[name]
        except KeyError:
            raise JobNotFoundError(name, self._jobs) from None

    # --- lifecycle -----------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect, check the store and the strategy, catch up missed runs (lease), and start scheduling. Called
        while a stop goes on (one whose caller gave up waiting), it waits for the stop to end, then starts."""
        if self._is_live():  # in a fork's copy, the loop, the tasks and the stop to wait for are the parent's
            _check_same_process(self._started_in)
        self._forget_an_ended_loop()
        if self._stopping is not None:
            if self._loop is not None and self._loop is not _running_loop() and self._loop.is_running():
                # The stop's future is of that loop: awaited from this one, its end would never wake this wait.
                raise SchedulerStateError(
                    "start() was called on another event loop than the one the scheduler is stopping on (a "
                    "SchedulerThread's, say): wait for that stop to end (the thread's stop() returns then), then start"
                )
            if (caller := _RUN_OF.get()) is not None and caller[0] is self and caller[1].in_user_code:
                raise SchedulerStateError(
                    "start() called by a job or hook of the scheduler while it stops would wait for that job's run "
                    "to end: start the scheduler again from outside its jobs"
                )
            await asyncio.wait([self._stopping])  # how it ended was the stop's caller's to hear
        if self._started or (self._starting is not None and not self._starting.is_set()):
            raise SchedulerStateError("the scheduler is already started")
        if self.backend.scheduler is not None:
            raise SchedulerStateError(
                "the backend serves another started scheduler: give each scheduler a backend of its own "
                "(they may share a client)"
            )
        if self._named_by_pid not in (None, os.getpid()):
            self._named_by_pid = os.getpid()
            self._name(self._default_id())
        starting = self._starting = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._started_in = os.getpid()
        self.backend.scheduler = self
        try:
            try:
                # The jobs' slots from now on are this start's: one due while the store is reached and checked
                # (a store slow to answer, a first connection) runs late, rather than by no instance started then.
                now = self.clock.wall_ms()
                await self.backend.start(list(self._jobs))
                self._start_keeper()
            except BaseException:
                await self._stop_keeper()
                await self.backend.stop()
                self.backend.scheduler = None
                raise
            with self._registering:
                self._started = True
                jobs = list(self._jobs.values())
            self._started_at, self._added_at = None, {}
            for job in jobs:
                self._start_job(job, now)
            self._started_at = self.clock.monotonic()
            self._dispatcher = asyncio.create_task(self._dispatch(), name="anarchon-dispatcher")
            self._dispatcher.add_done_callback(self._dispatcher_ended)
        finally:
            starting.set()
        log.info("scheduler %s started with %d jobs on %s", self.instance_id, len(self._jobs), self.backend.server)

    async def stop(self, timeout: float = 30.0) -> None:
        """Stop claiming; wait up to ``timeout`` seconds for running jobs, then cancel them; close the connections
        anarchon opened. Under leases, a scheduled run cancelled with attempts left is handed back: another instance
        takes it over as the next attempt (which records this one as interrupted). Any other run cancelled is
        recorded as interrupted. Claims in flight, hand-backs and results get STOP_GRACE_S past ``timeout`` to reach
        the store; what still waits then is cancelled, and given STOP_GRACE_S more to end; the heartbeat thread gets
        STOP_GRACE_S more to close its connection and end, and the app's own commands still on their way (a
        history()) CLOSE_WAIT_S more to be answered. stop() returns by then however the store or a job
        behaves: a sync job's thread, or an async job that ignores cancellation, may run on (logged), and its run's
        lease runs out as after a crash.

        Stopping goes on if the caller is cancelled meanwhile; calling stop() again waits for it to end, and with a
        timeout that ends sooner, cuts the running jobs short by then (run() does so on a second signal). Called
        while start() runs, it waits for the start to end, then stops. Called by one of the scheduler's own jobs or
        hooks (or a task one started), it returns once all but that job's own run have ended (which cannot end
        before the call returns; the stop then waits for it)."""
        timeout = _check_timeout(timeout)
        if loop := self._own_loop_elsewhere("stop"):
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self.stop(timeout), loop))
            return
        if self._starting is not None:
            await self._starting.wait()
        if self._stopping is None:
            if not self._started:
                return
            # Set here, not when _stop() begins: a stop() called before then (a second signal read in the same
            # turn of the loop) brings this deadline forward.
            self._stop_deadline = self.clock.monotonic() + timeout
            self._stop_hurried = asyncio.Event()
            self._stopping = asyncio.ensure_future(self._stop())
            self._stopping.add_done_callback(self._stop_ended)
        else:
            self._hurry_stop(timeout)
        caller = _RUN_OF.get()
        if caller is not None and caller[0] is self:
            # A job or hook of this scheduler, or a task one started, which may await this call (directly, or
            # through gather, shield or wait_for): waiting for its run too would be waiting for itself, until the
            # timeout, then cut short and its run handed back to run again.
            await self._stopped_but_for(caller[1], caller[2])
            return
        await asyncio.shield(self._stopping)

    def _stop_ended(self, stopping: asyncio.Future[None]) -> None:
        """Forget a stop once it ends, whether its caller waited for it or gave up (a stop() cancelled by the
        app's own shutdown bound goes on): the next start() and stop() are new ones."""
        if self._stopping is stopping:
            self._stopping = None
        for listener in list(self._on_stopped):
            listener()

    def _hand_back_unsent(self, entries: list[_Due]) -> None:
        """Claims waiting to be sent again when stop() began (their answers never came) may have won: each is
        handed back, within stop()'s bounds, so that its lease does not keep the job's next runs from starting
        (skipped-overlap) on every instance until it runs out."""
        if self.backend.leases:
            for entry in entries:
                if entry[6] is not None:  # the token of a claim sent before
                    self._spawn(self._release_unanswered(self._request(entry)), "anarchon-hand-back")

    async def _release_unanswered(self, request: RunRequest) -> None:
        """Hand back a claim whose answer never came. It may have won: nothing runs it, and its lease would keep the
        job's runs from starting (skipped-overlap) on every instance until it ran out. The store refuses it if the
        claim did not win. Tried again while the store is out of reach, for as long as that lease could last,
        until stop() begins (then once more at most, within stop()'s bounds)."""
        give_up = self.clock.monotonic() + self.lease_ms / 1000
        extra = {"job": request.job, "slot": request.slot}
        if not self.backend.started:  # stop() gave up on the claim and closed the connection: nothing can be sent
            log.info("job %s slot %d: a claim whose answer never came could not be handed back (the connection is "
                     "closed); if it won, its lease runs out", request.job, request.slot, extra=extra)  # fmt: skip
            return
        while True:
            try:
                if await self.backend.strategy.release(self.backend.store, request):
                    log.info("job %s slot %d: a claim whose answer never came had won; handed back, not run",
                             request.job, request.slot, extra=extra)  # fmt: skip
                return
            except StoreUnavailableError as error:
                if not self._started or self.clock.monotonic() + RETRY_MIN_S >= give_up:
                    log.info("job %s slot %d: a claim whose answer never came could not be handed back (%s); if it "
                             "won, its lease runs out", request.job, request.slot, error, extra=extra)  # fmt: skip
                    return
                await self._nap(RETRY_MIN_S)
            except StoreError as error:
                log.warning("job %s slot %d: a claim whose answer never came could not be handed back: %s",
                            request.job, request.slot, error, extra=extra)  # fmt: skip
                return

    def _stop_work(self) -> set[asyncio.Task[Any]]:
        """What stop() waits for, as it is at each moment: a claim that settles meanwhile starts a hand-back."""
        tasks = {task for task in self._tasks if task.get_name() != "anarchon-heartbeats"} - self._left_running
        return tasks | {self._dispatcher} if self._dispatcher is not None else tasks

    async def _stopped_but_for(self, running: _Running, task: asyncio.Task[Any]) -> None:
        """Wait for the stop, but not for ``task`` while it runs the job or a hook of ``running``, which called
        stop() (from that task, or from one it started): it may be awaiting the call, and cannot end before it
        returns. Returns once all else the stop waits for has ended, or else when the stop has."""
        stopping = self._stopping
        caller = (task, running)
        self._runs_stopping.append(caller)
        try:
            while stopping is not None and not stopping.done():
                # Nor for the other runs whose job or hook awaits stop() meanwhile: each would wait for the other.
                awaiting = {other for other, run in self._runs_stopping if run.in_user_code}
                waited: set[asyncio.Future[Any]] = {
                    other for other in self._stop_work() if not other.done() and other not in awaiting
                }
                if running.in_user_code and not waited:
                    return
                waited.add(stopping)
                await asyncio.wait(waited, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._runs_stopping.remove(caller)

    def _hurry_stop(self, timeout: float) -> None:
        """A stop() while stopping (a second Ctrl-C): the running jobs are cut short ``timeout`` from now, if that
        is sooner than the stop's own deadline."""
        if (deadline := self.clock.monotonic() + timeout) < self._stop_deadline:
            self._stop_deadline = deadline
            self._stop_hurried.set()

    async def _stop(self) -> None:
        self._started = False
        loop = asyncio.get_running_loop()
        for nap in self._naps:
            nap.cancel()
        if self._dispatcher is not None:
            self._dispatcher.cancel()  # rounds of claims on their way settle; those not sent yet are handed back
        self._hand_back_unsent(self._waiting())
        work = self._stop_work
        # Claims in flight, runs and catch-ups (which stop between slots) go on, heartbeats included, for up to
        # `timeout` of this scheduler's clock, as its jobs' time: a process stopped (SIGSTOP) meanwhile acts on it
        # when it resumes, and so does one whose clock the simulator pauses. Then all of them end within the same
        # STOP_GRACE_S, and what is cancelled then within STOP_GRACE_S more, whatever waited on what.
        await _wait_until(self.clock, work, lambda: self._stop_deadline, self._stop_hurried)
        for running in list(self._running.values()):
            running.interrupt(STOPPED)
        abandoned, left = await _end_by(work, at=loop.time() + STOP_GRACE_S)
        if abandoned:
            log.warning(
                "scheduler %s: %d claims or runs had not ended %.0f s after stop()'s timeout (a store that does not "
                "answer, or a job that ignores cancellation) and were cancelled; runs they held and could not hand "
                "back are taken over by backups when their leases run out",
                self.instance_id, abandoned, STOP_GRACE_S,
            )  # fmt: skip
        for token, running in list(self._running.items()):
            if running.task in left:
                log.error(
                    "job %s slot %d attempt %d: the job ignores cancellation; stop() returns and leaves it running "
                    "(its lease runs out, and a backup may run the run again beside it)",
                    running.request.job, running.request.slot, running.context.attempt,
                )  # fmt: skip
                del self._running[token]  # a later start does not hold its lease, nor a later stop wait for it
        self._left_running |= left
        self._forget_rounds()
        try:
            await self._stop_keeper()
        finally:  # a heartbeat thread that would not end leaves the connection to close all the same
            try:
                await self.backend.stop()
            finally:  # a connection that failed to close leaves the backend to the next start all the same
                self.backend.scheduler = None
        log.info("scheduler %s stopped", self.instance_id)

    def _forget_rounds(self) -> None:
        """What the dispatcher kept of the claims due and on their way, and the threads of sync jobs (one cut
        short may still run: its thread ends with it)."""
        self._queue.clear()
        self._claiming, self._round_of = {}, {}
        self._stepped_back_ms = 0
        self._due_again = {}
        self._retrying = set()
        self._failing = None
        self._dispatcher = None
        if self._job_threads is not None:
            self._job_threads.shutdown(wait=False)
            self._job_threads = None

    def _forget_an_ended_loop(self) -> None:
        """A scheduler whose event loop closed without stop() (an asyncio.run() that returned, a test's loop) runs
        nothing: the loop cancelled its tasks as it ended. It is taken as stopped, so that it can start again on
        another loop. Nothing can reach the store through its connection, which is dropped: the runs the loop's end
        cut short are not handed back or recorded, and their leases run out (backups take them over, as after a
        crash)."""
        loop = self._loop
        if not self._is_live() or loop is None or not loop.is_closed():
            return
        log.warning("scheduler %s: the event loop it started on ended without stop(), and its runs with it (their "
                    "leases run out, and backups take them over as after a crash); it is stopped now. Await stop() "
                    "before the loop ends", self.instance_id)  # fmt: skip
        if self._heartbeats is not None:
            self._heartbeats.end(STOP_GRACE_S)
        self._keeper = self._heartbeats = None
        self._started, self._starting, self._stopping, self._sleeper = False, None, None, None
        for kept in (self._running, self._tasks, self._left_running, self._naps, self._runs_stopping):
            kept.clear()
        self._forget_rounds()
        self.backend.drop()

    async def __aenter__(self) -> Scheduler[M]:
        await self.start()
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    def run(self, stop_timeout: float = 30.0) -> None:
        """Block, running the scheduler until SIGINT or SIGTERM (for scripts and worker processes), then stop it,
        waiting up to ``stop_timeout`` seconds for running jobs (see :meth:`stop`). A second signal during the stop
        cuts the jobs short at once, and their runs are handed back: within a deadline such as a container's grace
        period (Kubernetes: 30 s by default), give ``stop_timeout`` a few seconds less."""
        stop_timeout = _check_timeout(stop_timeout, "stop_timeout")
        if threading.current_thread() is not threading.main_thread():
            raise SchedulerStateError(
                "run() stops the scheduler on SIGINT and SIGTERM, which only the main thread can handle: call it "
                "there, or use run_in_thread() and stop the scheduler from the app's own shutdown"
            )
        if _running_loop() is not None:
            raise SchedulerStateError(
                "run() runs an event loop of its own, and this thread runs one already: in async code, use "
                "`async with scheduler:` (or await scheduler.start() and scheduler.stop())"
            )
        asyncio.run(self._serve_until_signal(stop_timeout))

    async def _serve_until_signal(self, stop_timeout: float) -> None:
        signalled = asyncio.Event()
        hurrying: list[asyncio.Task[None]] = []

        def on_signal() -> None:
            if signalled.is_set():
                hurrying.append(asyncio.ensure_future(self.stop(0)))
            signalled.set()

        loop = asyncio.get_running_loop()
        installed = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(sig, on_signal)
                installed.append(sig)
        # Stopped another way (by one of its jobs), it leaves nothing to serve: run() returns then, as on a signal.
        self._on_stopped.append(signalled.set)
        try:
            await self.start()
            try:
                await signalled.wait()
            finally:
                await self.stop(stop_timeout)
                await asyncio.gather(*hurrying)
        finally:
            self._on_stopped.remove(signalled.set)
            for sig in installed:
                loop.remove_signal_handler(sig)

    def run_in_thread(self) -> SchedulerThread:
        """Start the scheduler on its own event loop in a daemon thread (for sync apps such as Django, Flask)."""
        return SchedulerThread(self)

    # --- manual runs and history ---------------------------------------------------------------------------

    def _is_live(self) -> bool:
        """Starting, started or stopping: the scheduler's tasks and connection exist, on its loop."""
        starting = self._starting is not None and not self._starting.is_set()
        return self._started or starting or self._stopping is not None

    async def _run_now_for_elsewhere(self, name: str) -> RunRecord:
        """run_now on the scheduler's loop for a caller on another thread (or loop). An async job's SystemExit or
        KeyboardInterrupt (its run recorded) leaves the scheduler's loop, where it ends the app, or on a scheduler
        thread stops the scheduler (see SchedulerThread._serve); passed on to the caller's thread, it would end
        that thread's work too, a second time."""
        try:
            return await self.run_now(name)
        except (SystemExit, KeyboardInterrupt) as error:
            raise SchedulerStateError(
                f"run_now({name!r}): the job raised {type(error).__name__}, which stops the scheduler; the run is "
                "recorded as an error"
            ) from error

    def _own_loop_elsewhere(self, method: str) -> asyncio.AbstractEventLoop | None:
        """The loop the scheduler started on, when the caller runs on another (an app's second loop or thread)
        while the scheduler is starting, started or stopping: its tasks and connection belong to its loop, so
        such a call is sent there. None otherwise, and when its loop has closed (it is stopped then)."""
        if not self._is_live():
            return None
        _check_same_process(self._started_in)
        loop = self._loop
        if loop is None or _running_loop() is loop:
            return None
        if loop.is_closed():
            self._forget_an_ended_loop()
            return None
        if not loop.is_running():
            raise SchedulerStateError(
                f"{method} was called on another event loop than the one the scheduler started on, and that loop "
                "no longer runs: stop the scheduler before its loop ends"
            )
        return loop

    async def run_now(self, name: str) -> RunRecord:
        """Run a job now, on this instance, outside its schedule; returns how the run ended.

        Under the lease strategy the manual run takes a lease like any run, and is skipped (``skipped-overlap``)
        while another run of the job holds a live lease, unless the job allows overlap. It may be called from
        another event loop than the scheduler's (it runs there), as may :meth:`history` and :meth:`stop`.
        """
        if loop := self._own_loop_elsewhere("run_now"):
            return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._run_now_for_elsewhere(name), loop))
        job = self._job(name)
        if not self._started:
            raise SchedulerStateError("run_now needs a started scheduler: call start() or use 'async with'")
        answered = asyncio.Event()
        # One of the scheduler's tasks, claim and run alike: stop() waits for a claim on its way as for a run, so
        # a run it wins is handed back or recorded before the connection closes, not left holding its lease.
        manual = self._spawn(self._run_manually(job, answered), "anarchon-manual-run")
        try:
            ended = await asyncio.shield(manual)
        except asyncio.CancelledError:
            caller = asyncio.current_task()
            if manual.cancelled() and caller is not None and not caller.cancelling():
                # stop() gave up waiting for the run (its result or end hook hung): the caller was not cancelled
                raise SchedulerStateError(
                    f"run_now({name!r}): the scheduler stopped before the run had ended; its history says how it "
                    "ended, if the store heard"
                ) from None
            if not answered.is_set():  # the caller gave up on the claim: the run is not started (see below)
                manual.cancel()
            raise
        if isinstance(ended, StoreError):
            raise ended
        return ended

    async def _run_manually(self, job: Job, answered: asyncio.Event) -> RunRecord | StoreError:
        now = self.clock.wall_ms()
        token = self._token()
        request = RunRequest(job.name, run_id(now, token[:8]), now, token, self.instance_id, manual=True)
        sent = self.clock.monotonic()
        try:
            [claim] = await self.backend.strategy.claim(self.backend.store, [(request, self._policies[job.name])])
        except StoreError as error:
            claim = error
        except asyncio.CancelledError:
            self._hand_back_unanswered(request)
            if self._started:  # its caller gave up
                raise
            return self._local_record(request, "interrupted", STOPPED)  # stop() gave up on the store's answer
        answered.set()
        if isinstance(claim, StoreError):
            if isinstance(claim, StoreUnavailableError):
                self._hand_back_unanswered(request)
            return claim
        if claim.forgotten:  # a new run id, at a moment the store has forgotten: this clock is far behind
            return self._local_record(request, "skipped-late", FORGOTTEN)
        if claim.outcome is not Outcome.WON:
            return await self._recorded_overlap(request)
        if not self._started:  # stop() began while the claim was on its way: the job is not started
            return await self._not_started(request, claim)
        return await self._execute(job, request, claim, sent)

    async def _recorded_overlap(self, request: RunRequest) -> RunRecord:
        """A manual run the store recorded skipped-overlap: its record as history() shows it (which run was still
        running, on the store's clock), or one made here if it cannot be read."""
        with contextlib.suppress(StoreError):
            for record in await self.backend.strategy.records_at(self.backend.store, request.job, request.slot):
                if record.run == request.run:
                    return record
        return self._local_record(request, "skipped-overlap", "another run of the job was still running")

    def _hand_back_unanswered(self, request: RunRequest) -> None:
        """A manual claim whose answer never came (the store went out of reach, or the caller gave up): handed back
        in the background (see _release_unanswered), also once stop() has begun, which waits for it as for the
        hand-backs of scheduled claims. Not once stop()'s timeout has passed: it gave up on the store (the claim
        was cancelled for it), and waits for nothing it did not cancel."""
        if self.backend.leases and (self._started or self.clock.monotonic() < self._stop_deadline):
            self._spawn(self._release_unanswered(request), "anarchon-hand-back")

    async def history(self, name: str, limit: int = 50) -> list[RunRecord]:
        """The job's recorded attempts, newest first. A scheduler not started reads them too (a web process
        showing what the scheduler processes ran): through a connection opened for the read and closed after.
        With ``history_ttl_ms``, attempts whose slot is older than that (on this instance's clock) are left out:
        the store drops them at its next write, which may be a long while away for a job that runs rarely."""
        if loop := self._own_loop_elsewhere("history"):
            return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self.history(name, limit), loop))
        job = self._job(name)
        check_int("limit", limit, 1, 1_000_000)
        async with self.backend.reading() as store:
            records = await self.backend.strategy.history(store, job.name, limit)
        if self.history_ttl_ms is None:
            return records
        oldest_kept = self.clock.wall_ms() - self.history_ttl_ms
        return [record for record in records if record.slot >= oldest_kept]

    # --- dispatching ---------------------------------------------------------------------------------------

    def _push(
        self,
        at_ms: int,
        job: str,
        slot: int,
        kind: Kind,
        failures: int = 0,
        token: str | None = None,
    ) -> None:
        self._seq += 1
        entry = (at_ms, self._seq, job, slot, kind, failures, token)
        heapq.heappush(self._queue, entry)
        if self._queue[0] is entry:  # due before what the dispatcher sleeps until (claim rounds push as they go)
            self._wake()

    def _schedule_next(self, job: Job, after_ms: int) -> None:
        slot = job.schedule.next_after(after_ms)
        if slot is None:
            log.warning("job %s: cron %r has no further slot", job.name, job.schedule.expression)
            return
        self._push(slot + job.jitter_for(slot), job.name, slot, "scheduled")

    def _dispatcher_ended(self, task: asyncio.Task[None]) -> None:
        """Only stop() ends the dispatcher. If anything else does, no job runs any more: say so, loudly."""
        if not task.cancelled() and task.exception() is not None:
            log.critical(
                "scheduler %s stopped scheduling: its dispatcher failed", self.instance_id, exc_info=task.exception()
            )

    def _wake(self) -> None:
        if self._sleeper is not None:
            self._sleeper.cancel()

    async def _dispatch(self) -> None:
        last, last_monotonic = self.clock.wall_ms(), self.clock.monotonic()
        while True:
            raise_if_cancelled()
            now, monotonic = self.clock.wall_ms(), self.clock.monotonic()
            # How much less the wall clock moved than the monotonic one: it was set back, by that much. (Not only
            # when it now shows less than before: set back by less than the dispatcher slept, it shows more.)
            went_back = last - now + round((monotonic - last_monotonic) * 1000)
            if went_back > STEP_BACK_MIN_MS:
                self._stepped_back_ms += went_back
            last, last_monotonic = now, monotonic
            if self._stepped_back_ms and not self._claiming:
                # Once no round is on its way: a round settles its claims by the clock it began with, and what
                # it queues (retries, backups) is planned again with the rest.
                self._plan_after_step_back(now, self._stepped_back_ms)
                self._stepped_back_ms = 0
            due: dict[Hashable, list[_Due]] = {}
            while self._queue and self._queue[0][0] <= now:
                entry = heapq.heappop(self._queue)
                node = self._round_of[entry[2]] if entry[2] in self._round_of else self.backend.lane(entry[2])
                held = self._claiming.get(node)
                (due.setdefault(node, []) if held is None else held).append(entry)
            if due:
                for node, entries in due.items():
                    self._claiming[node] = []
                    for entry in entries:
                        self._round_of[entry[2]] = node
                    self._spawn(self._claim_round(node, entries, now), "anarchon-claims")
                continue
            delay = MAX_SLEEP_S if not self._queue else (self._queue[0][0] - now) / 1000
            self._sleeper = asyncio.ensure_future(self.clock.sleep(min(delay, MAX_SLEEP_S)))
            try:
                await asyncio.wait([self._sleeper])  # returns early when _wake cancels the sleep
            finally:
                self._sleeper.cancel()  # when stop() cancels the dispatcher, its sleep ends too
                self._sleeper = None

    def _waiting(self) -> list[_Due]:
        """Every queue entry, with those held back while their job's claims are on their way."""
        return [*self._queue, *(entry for held in self._claiming.values() for entry in held)]

    async def _claim_round(self, node: Hashable, due: list[_Due], now: int) -> None:
        """Claim the due runs of one node (in waves, see _in_slot_order); its entries that come due meanwhile wait
        for the round to end, and go together in its next."""
        claiming, round_of = self._claiming, self._round_of
        try:
            if not self._started:  # stop() began before the round did: nothing is sent
                self._hand_back_unsent(due)
                return
            waves = self._in_slot_order(due)
            for index, wave in enumerate(waves):
                await self._claim(wave, now)
                if index + 1 < len(waves):
                    self._hold_back_after_failures(wave, waves[index + 1 :], now)
        except Exception:
            # A round's jobs may have lost their next slots: as when the dispatcher itself fails, no job is
            # scheduled any more, loudly, rather than some jobs falling silent.
            log.critical("scheduler %s stopped scheduling: a round of claims failed", self.instance_id,
                         exc_info=True)  # fmt: skip
            if self._dispatcher is not None:
                self._dispatcher.cancel()
        finally:
            for entry in due:
                round_of.pop(entry[2], None)
            held = claiming.pop(node, None)
            if claiming is self._claiming:
                for entry in held or ():
                    heapq.heappush(self._queue, entry)
                self._wake()

    def _in_slot_order(self, due: list[_Due]) -> list[list[_Due]]:
        """The due claims in waves to send one after another: one wave, unless the strategy's claim of a later slot
        makes the earlier ones unclaimable (stream-id) and a job has retries waiting. Then the retries of earlier
        slots of the due jobs, still waiting out their backoff, are taken along, and each wave holds the next slot of
        every job that has one left. After an outage the claim of a later slot, tried again fewer times and so
        sooner, would otherwise reach the store first, and the earlier slot could never be won. (Under the other
        strategies such a slot runs late, after the later one; sent along, it would make the later ones
        skipped-overlap under leases.)"""
        if not self.backend.strategy.claims_in_slot_order:
            return [due]  # order does not matter
        latest: dict[str, int] = {}
        for _, _, name, slot, _, _, _ in due:
            latest[name] = max(slot, latest.get(name, slot))
        earlier: set[_Due] = {e for e in self._queue if e[4] == "retry" and e[3] < latest.get(e[2], e[3])}
        if not earlier and all(entry[4] != "retry" for entry in due):
            return [due]  # no outage: nothing to order
        if earlier:
            self._queue = [entry for entry in self._queue if entry not in earlier]
            heapq.heapify(self._queue)
        waves: list[list[_Due]] = []
        sent: Counter[str] = Counter()  # how many waves each job's claims are in so far
        for entry in sorted([*earlier, *due], key=lambda claim: claim[3]):
            wave = sent[entry[2]]
            sent[entry[2]] += 1
            if wave == len(waves):
                waves.append([])
            waves[wave].append(entry)
        return waves

    def _hold_back_after_failures(self, sent: list[_Due], waves: list[list[_Due]], now: int) -> None:
        """Take the claims of the jobs whose claim in the wave just ``sent`` failed out of the ``waves`` still to
        send, and queue them to go with that claim's retry: sent now, they could reach the store before the earlier
        slot (and, on a store that does not answer, each wave would wait out the client's timeout)."""
        claimed = {(entry[2], entry[3]) for entry in sent}
        retry_at = {e[2]: e[0] for e in self._waiting() if e[4] == "retry" and (e[2], e[3]) in claimed}
        if not retry_at:
            return
        for wave in waves:
            kept = [entry for entry in wave if entry[2] not in retry_at]
            for _, _, name, slot, kind, failures, token in wave:
                if name in retry_at:
                    if kind == "scheduled":  # its next slot is planned now, as when it is claimed
                        self._schedule_after(name, slot, now)
                    self._push(retry_at[name], name, slot, "retry", failures, token)
            wave[:] = kept

    def _plan_after_step_back(self, now: int, step_ms: int) -> None:
        """The wall clock went back (a clock that ran ahead, set right): what was planned by the clock of before
        would wait that much longer, and a lone instance would run no slot meanwhile. A job whose planned slot
        is no longer its next goes on from the first slot that may still be claimed, as after a stall: when the
        clock went back is not known, so a slot since may have been missed (one claimed already, early while the
        clock was ahead, is answered done). So does a job with a slot that came before its scheduling began by the
        clock of before, and after by the corrected one: nothing claimed it. Retries and backups wait what they
        had left."""
        planned, self._queue = self._waiting(), []
        for held in self._claiming.values():
            held.clear()
        for at_ms, _, name, slot, kind, failures, token in planned:
            if kind == "scheduled":
                job = self._jobs[name]
                # No further back than when the job's scheduling began, by the corrected clock: the slots before
                # came due while no instance of this process could claim them (catch_up_ms's part).
                started = self._added_at.get(name, self._started_at or 0.0)
                began = now - int((self.clock.monotonic() - started) * 1000)
                resume_after = max(now - job.options.late_after_ms, began)
                owed = job.schedule.next_after(resume_after)
                missed = owed is not None and owed < slot and owed <= began + step_ms
                first = job.schedule.next_after(now)
                if missed or (first is not None and first < slot):
                    self._schedule_next(job, resume_after)
                    continue
            else:
                at_ms -= step_ms
            self._push(at_ms, name, slot, kind, failures, token)
        self._due_again = {key: at_ms - step_ms for key, at_ms in self._due_again.items()}
        log.warning("scheduler %s: the wall clock went back %d ms; the next slots are planned again from now",
                    self.instance_id, step_ms)  # fmt: skip

    async def _claim(self, due: list[_Due], now: int) -> None:
        """Claim the due runs in pipelines, and work out the next slots of the scheduled ones meanwhile."""
        batch: list[_Due] = []
        late: list[_Due] = []
        for entry in due:
            _, _, job, slot, kind, _, _ = entry
            # A backup may ask however late. A claim put off to its slot is late by how long after it was due again
            # it is sent: this clock, ahead of the store's, would see it late well before the store does.
            since = self._due_again.get((job, slot), slot) if kind == "early" else slot
            is_late = kind != "backup" and now > since + self._jobs[job].options.late_after_ms
            (late if is_late else batch).append(entry)
        if late:
            self._spawn(self._skip_late(late, now))
        if len(batch) > CLAIM_BATCH:
            # Every instance has the same runs due, in the same order. Each starts its pipelines at a point of
            # its own (at random), so that each first wins a stretch of runs of its own instead of all of them
            # contending for the same runs, pipeline after pipeline: every run is won sooner.
            start = self.random.randint(0, len(batch) - 1)
            batch = batch[start:] + batch[:start]
        lanes = asyncio.Semaphore(CLAIM_LANES)
        parts = [
            asyncio.ensure_future(self._claim_part(batch[first : first + CLAIM_BATCH], lanes))
            for first in range(0, len(batch), CLAIM_BATCH)
        ]
        try:
            for first in range(0, len(due), CLAIM_BATCH):
                # The first pipelines leave before any next slot is worked out; the rest of that work is done
                # in pieces, so that replies are read (and won runs started) in between.
                await asyncio.sleep(0)
                for _, _, name, slot, kind, _, _ in due[first : first + CLAIM_BATCH]:
                    if kind == "scheduled":
                        self._schedule_after(name, slot, now)
            if parts:
                await asyncio.wait(parts)
            for part in parts:
                part.result()  # what a pipeline raised
        except asyncio.CancelledError:
            # stop() gave up waiting (its timeout and grace are over): so do the claims still on their way.
            for part in parts:
                part.cancel()
            raise
        finally:
            # After stop() began, the pipelines in flight still settle, until its timeout: a run the store granted
            # meanwhile is handed back or recorded (see _settle), not left claimed and never run. stop() goes on
            # once none can settle behind its back.
            await asyncio.gather(*parts, return_exceptions=True)

    def _schedule_after(self, name: str, slot: int, now: int) -> None:
        """Plan the job's next slot after the one now claimed. After a stall or a clock jump, on from the first slot
        that may still be claimed: one skip recorded for the missed ones, not one each, and one line in the log
        for the rest."""
        job = self._jobs[name]
        resume_after = max(slot, now - job.options.late_after_ms)
        skipped = job.schedule.next_after(slot)
        if skipped is not None and skipped <= resume_after:
            log.warning(
                "job %s: every slot due from %d until %d skipped as well (later than max_late_ms: the scheduler was "
                "stalled, or its clock jumped forward)", name, skipped, resume_after, extra={"job": name},
            )  # fmt: skip
        self._schedule_next(job, resume_after)

    async def _claim_part(self, part: list[_Due], lanes: asyncio.Semaphore) -> None:
        strategy, store = self.backend.strategy, self.backend.store
        async with lanes:
            if not self._started:  # stop() began before it was sent: a claim won now would not run
                self._hand_back_unsent(part)
                return
            requests = [self._request(entry) for entry in part]
            sent, sent_ms = self.clock.monotonic(), self.clock.wall_ms()
            try:
                claims = await strategy.claim(store, [(request, self._policies[request.job]) for request in requests])
            except StoreError as error:
                claims = [error] * len(part)
            except Exception as error:  # an answer anarchon cannot read: retried, and the dispatcher goes on
                log.exception("claims of %d runs failed", len(part))
                claims = [StoreUnavailableError(f"the claim failed: {type(error).__name__}: {error}")] * len(part)
        queued_before, live_elsewhere = self._seq, set()
        failed: list[_Failed] = []
        for entry, request, claim in zip(part, requests, claims, strict=True):
            if self._settle(entry, request, claim, sent_ms, sent, failed) and entry[2] in self._retrying:
                live_elsewhere.add(entry[2])
        if live_elsewhere:
            self._another_run_is_live(live_elsewhere, sent_ms, queued_before)
        if self._started and (failed or self._failing is not None):
            answered = {entry[2]: claim for entry, claim in zip(part, claims, strict=True)
                        if not isinstance(claim, StoreUnavailableError)}  # fmt: skip
            settled = (name for name, claim in answered.items() if not isinstance(claim, StoreError))
            self._note_failures(failed, answered, settled)

    def _note_failures(self, failed: list[_Failed], answered: Iterable[str], settled: Iterable[str]) -> None:
        """Say the claims that failed (``answered``: jobs whose claims reached the store, refused or not;
        ``settled``: those not refused): at once, then at most once per FAILING_SAID_S, and once every job's
        claims are answered again (on a cluster, a node that stays down keeps its jobs' claims failing)."""
        now = self.clock.monotonic()
        failing = self._failing
        if failing is None:
            failing = self._failing = _Failing(now)
        failing.add(failed)
        reached = set(answered)
        failing.out_of_reach.difference_update(reached)
        failing.refused.difference_update(settled)
        if failing.given_up and reached:
            nodes = {self.backend.lane(name) for name in reached}
            failing.given_up = {name: node for name, node in failing.given_up.items() if node not in nodes}
        if failed and now - failing.said_at >= FAILING_SAID_S:
            failing.say(now)
        if failing.over:
            if failing.unsaid:
                failing.say(now)
            if failing.unreachable:
                log.info("claims reach the store again, after %.1f s; %d claims failed meanwhile",
                         now - failing.since, failing.total)  # fmt: skip
            self._failing = None

    def _late_retry_ended(self, name: str, *, reached_store: bool) -> None:
        """A failed claim of job ``name``, retried past its lateness, ended as a skip: none of the job's claims is
        failing now, and its next may be far off (a daily job's, a day later). A skip that reached the store says
        the job's commands do. One that did not holds back the line that says claims reach the store again until
        a claim on the job's node (any claim, where the store is one node) is answered."""
        if not self._started or (failing := self._failing) is None:
            return
        if reached_store:
            failing.given_up.pop(name, None)
            self._note_failures([], (name,), (name,))
        elif name in failing.out_of_reach:
            failing.out_of_reach.discard(name)
            failing.given_up[name] = self.backend.lane(name)

    def _request(self, entry: _Due) -> RunRequest:
        _, _, job, slot, _, _, token = entry
        if token is None:
            return RunRequest(job, run_id(slot), slot, self._token(), self.instance_id)
        return RunRequest(job, run_id(slot), slot, token, self.instance_id, retry=True)

    def _settle(
        self,
        entry: _Due,
        request: RunRequest,
        claim: Claim | StoreError,
        now: int,
        sent: float,
        failed: list[_Failed],
    ) -> bool:
        """Act on one claim's answer; True when the store answered that another run of the job is live. A claim
        that failed and is sent again goes into ``failed`` (name, slot, error, delay), for the log."""
        _, _, name, slot, kind, failures, _ = entry
        if isinstance(claim, StoreError):
            if not self._started:  # stop() began: it is not sent again
                log.warning("job %s: claim of slot %d failed (%s) as the scheduler stopped", name, slot, claim,
                            extra={"job": name, "slot": slot})  # fmt: skip
                if self.backend.leases:  # it may have won: handed back, as the retries queued when stop() began
                    self._spawn(self._release_unanswered(request), "anarchon-hand-back")
                return False
            delay_s = _doubling(RETRY_MIN_S, RETRY_MAX_S, failures)
            failed.append((name, slot, claim, failures + 1, delay_s))
            retry_kind: Kind = kind if kind in ("backup", "early") else "retry"
            self._push(now + int(delay_s * 1000), name, slot, retry_kind, failures + 1, request.token)
            self._retrying.add(name)
            return False
        if kind == "early":
            self._due_again.pop((name, slot), None)
        if claim.outcome is Outcome.WON:
            if self._started:
                self._spawn(self._execute(self._jobs[name], request, claim, sent))
            else:  # won while stop() began
                self._spawn(self._not_started(request, claim))
            return False
        extra = {"job": name, "slot": slot, "attempt": claim.attempt}
        if claim.outcome is Outcome.RUNNING:
            again_at = now + claim.lease_ms_left + 1
            if claim.attempt == 0:  # put off: another run of the job is going (see lease_claim.lua)
                log.info("job %s slot %d: put off by the store while another run is going (an earlier one, the "
                         "slot not due yet by the store's clock, or a later one begun early); claiming again in %d ms",
                         name, slot, claim.lease_ms_left, extra=extra)  # fmt: skip
                self._due_again[name, slot] = again_at
                self._push(again_at, name, slot, "early")
            else:
                log.debug("job %s slot %d: running elsewhere; standing by", name, slot, extra=extra)
                self._push(again_at, name, slot, "backup")
        elif claim.forgotten:  # a backup that was cut off or paused for longer than keep_ms
            log.info("job %s slot %d: not run: %s", name, slot, FORGOTTEN, extra=extra)
        elif claim.given_up:
            self._say_given_up(name, slot, claim)
        elif claim.outcome is Outcome.OVERLAP:  # a slot that will not run: as visible as a late one
            log.info("job %s slot %d: skipped-overlap: an earlier run of the job is still going", name, slot,
                     extra=extra)  # fmt: skip
        else:
            log.debug("job %s slot %d: %s", name, slot, claim.outcome.value, extra=extra)
        return claim.outcome in (Outcome.RUNNING, Outcome.OVERLAP)

    def _say_given_up(self, name: str, slot: int, claim: Claim) -> None:
        """This instance's claim gave the run up (it is logged once, by the one instance whose claim did): a run
        that will not run to its end, as visible as a skipped one."""
        log.warning("job %s slot %d: given up: attempt %d ended unfinished (its lease ran out, or it was handed back) "
                    "and the job's max_attempts (%d) are used up; recorded interrupted", name, slot, claim.attempt,
                    self._policies[name].max_attempts, extra={"job": name, "slot": slot})  # fmt: skip

    def _another_run_is_live(self, jobs: set[str], now: int, queued_before: int) -> None:
        """The store answered claims of ``jobs`` that another run of each is live. That run may be one this instance
        won unheard (the answer was lost or timed out, and the store ran the claim all the same, as a client that
        gave up sends a request once the node answers again): it holds the job's lease, and the job's next slots
        would be skipped for overlap until its retry, up to RETRY_MAX_S away, learnt it had won. So the jobs'
        claims waiting to be sent again after store errors go now: those queued before the answers came (one
        that failed beside them waits its backoff). The queue is rebuilt once for all of them: after an outage,
        a pipeline's answers may name thousands of jobs."""
        queue: list[_Due] = []
        waiting: set[str] = set()  # jobs left with a claim that failed beside the answers
        for entry in self._queue:
            at_ms, seq, name, slot, kind, failures, token = entry
            if name in jobs and at_ms > now and (kind == "retry" or failures > 0):
                if seq <= queued_before:
                    entry = (now, seq, name, slot, kind, failures, token)
                else:
                    waiting.add(name)
            queue.append(entry)
        heapq.heapify(queue)
        self._queue = queue
        self._retrying -= jobs - waiting
        self._wake()

    async def _skip_late(self, late: list[_Due], now: int) -> None:
        for entry in late:
            request = self._request(entry)
            job, slot = self._jobs[request.job], request.slot
            jitter = job.options.jitter_ms
            # One put off to its slot by the store: counted from when it was due again (the store's slot)
            since = self._due_again.pop((job.name, slot), slot) if entry[4] == "early" else slot
            message = f"claim came {now - since} ms after the slot; max_late_ms is {job.options.max_late_ms}" + (
                f" after a jitter_ms of {jitter}" if jitter else ""
            )
            extra = {"job": job.name, "slot": slot}
            try:
                recorded = await self.backend.strategy.skip(
                    self.backend.store, request, self._policies[job.name], "skipped-late", message
                )
            except StoreError as error:
                # Said once a job for an outage: every slot of a job every second would end so, a line each.
                said = (failing := self._failing) is not None and job.name in failing.given_up
                (log.debug if said else log.warning)(
                    "job %s slot %d skipped: %s; the skip was not recorded: %s%s",
                    job.name,
                    slot,
                    message,
                    error,
                    "" if said else " (its next slots' skips that fail too are not said until the store answers)",
                    extra=extra,
                )
                self._late_retry_ended(job.name, reached_store=False)
                continue
            self._late_retry_ended(job.name, reached_store=True)
            if recorded:
                log.warning("job %s slot %d skipped: %s", job.name, slot, message, extra=extra)
            elif request.retry and self.backend.strategy.leases:
                # The claim whose answer was lost may have won: the store then handed the run back to the backups.
                log.warning("job %s slot %d not run here: %s; a claim of it whose answer was lost is handed back to "
                            "any backup", job.name, slot, message, extra=extra)  # fmt: skip
            else:
                log.info("job %s slot %d not run here: %s; not recorded as skipped (it was claimed, the store "
                         "no longer remembers it, or its clock does not see it late)", job.name, slot, message,
                         extra=extra)  # fmt: skip

    async def _catch_up(self, job: Job, now: int) -> None:
        """Run, one after another, the slots of the last ``catch_up_ms`` that no instance claimed (one recorded
        skipped was decided: the claim is answered done).

        Each claim is sent only while its slot is still within ``catch_up_ms`` by the clock of that moment: the
        store keeps a finished run's state about that long (``keep_ms``), and a claim that came later, after a
        long catch-up or a long wait for the store, could find it trimmed and run the slot a second time."""
        since = await self._catch_up_since(job, now)
        for slot in job.schedule.slots_between(max(now - job.options.catch_up_ms, since), now):
            if not self._started:  # stop() waits for the slot in progress, not for the ones left
                return
            raise_if_cancelled()
            request = RunRequest(job.name, run_id(slot), slot, self._token(), self.instance_id, catch_up=True)
            unanswered, failures = False, 0
            while self._started:  # claimed again while the store is out of reach or another run holds it
                if self.clock.wall_ms() - slot > job.options.catch_up_ms:
                    log.info("job %s: slot %d is older than catch_up_ms now; not caught up", job.name, slot)
                    break
                sent = self.clock.monotonic()
                [claim] = await self.backend.strategy.claim(self.backend.store, [(request, self._policies[job.name])])
                unanswered = isinstance(claim, StoreUnavailableError)
                if unanswered:
                    failures += 1
                    await self._catch_up_retry(job, failures, claim)
                    continue
                if failures:
                    log.info("job %s: catch-up reaches the store again", job.name)
                    failures = 0
                if isinstance(claim, StoreError):
                    log.warning("job %s: catch-up claim of slot %d failed: %s", job.name, slot, claim)
                    break
                if claim.outcome is Outcome.RUNNING:
                    await self._nap((claim.lease_ms_left + 1) / 1000)
                    continue
                if claim.outcome is Outcome.WON and not self._started:  # stop() began while the claim was on its way
                    await self._not_started(request, claim)
                elif claim.outcome is Outcome.WON:
                    log.info("job %s: catching up slot %d", job.name, slot, extra={"job": job.name, "slot": slot})
                    await self._execute(job, request, claim, sent)
                elif claim.forgotten:  # only with a longer catch_up_ms than another instance's trim allows for
                    log.info("job %s: slot %d not caught up: %s", job.name, slot, FORGOTTEN)
                elif claim.given_up:
                    self._say_given_up(job.name, slot, claim)
                elif claim.outcome is Outcome.OVERLAP:  # recorded as skipped-overlap: as visible as the dispatcher's
                    log.info("job %s: slot %d not caught up: skipped-overlap: an earlier run of the job is still going",
                             job.name, slot)  # fmt: skip
                break
            if unanswered:  # given up (stop() began, or the slot aged) on a claim that may have won
                await self._release_unanswered(request)

    async def _catch_up_since(self, job: Job, now: int) -> int:
        """The moment the job's catch-up period may reach back to: a new job (first deployed, or on a store that
        lost its data) has no slot to catch up from before it was first started."""
        failures = 0
        while self._started:
            try:
                since = await self.backend.strategy.catch_up_since(self.backend.store, job.name, now)
            except StoreUnavailableError as error:
                failures += 1
                await self._catch_up_retry(job, failures, error)
                continue
            if failures:
                log.info("job %s: catch-up reaches the store again", job.name)
            if since > now - job.options.catch_up_ms:
                log.info("job %s: no catch-up before %d, when it was first started", job.name, since)
            return since
        return now

    async def _catch_up_retry(self, job: Job, failures: int, error: object) -> None:
        """Wait to send a catch-up's command again after ``failures`` in a row could not reach the store, backing
        off as claims do; said once (the claims' own lines say the outage goes on)."""
        delay_s = _doubling(RETRY_MIN_S, RETRY_MAX_S, failures - 1)
        if failures == 1:
            log.warning("job %s: catch-up cannot reach the store (%s); trying again, up to every %.0f s", job.name,
                        error, RETRY_MAX_S)  # fmt: skip
        await self._nap(delay_s)

    async def _nap(self, seconds: float) -> None:
        """Sleep on the scheduler's clock until ``seconds`` have passed or stop() begins."""
        if not self._started:  # stop() cancelled the naps it found: this one began after
            return
        nap = asyncio.ensure_future(self.clock.sleep(seconds))
        self._naps.add(nap)
        try:
            await asyncio.wait([nap])
        finally:
            nap.cancel()
            self._naps.discard(nap)

    # --- running -------------------------------------------------------------------------------------------

    def _spawn(self, coroutine: Coroutine[Any, Any, S], name: str = "anarchon-run") -> asyncio.Task[S]:
        task = asyncio.create_task(coroutine, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_ended, context=self._callback_context)
        return task

    def _task_ended(self, task: asyncio.Task[Any]) -> None:
        """Forget a task, and say how it failed if it did: no task is meant to raise, and asyncio would only
        mention it when the task is garbage-collected, if ever."""
        self._tasks.discard(task)
        self._left_running.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            log.error("scheduler %s: %s failed", self.instance_id, task.get_name(), exc_info=error)

    async def _execute(self, job: Job, request: RunRequest, claim: Claim, claim_sent: float) -> RunRecord:
        """Run one won attempt; ``claim_sent`` is when the claim left (monotonic), where its lease counts from."""
        context = RunContext(
            job=job.name, slot=request.slot, attempt=claim.attempt, token=request.token, fence=claim.fence,
            manual=request.manual, timezone=job.schedule.timezone,
        )  # fmt: skip
        running = _Running(context, request)
        task = asyncio.current_task()
        assert task is not None  # a run runs in a task: the scheduler's, or a catch-up's, or run_now's
        # The job, its hooks and the tasks they start know the run they are part of (see stop()). Reset after: a
        # catch-up's or run_now's task goes on.
        entered = _RUN_OF.set((self, running, task))
        try:
            return await self._attempt(job, request, claim, claim_sent, running)
        finally:
            _RUN_OF.reset(entered)
            if self._keeper is not None:  # however the attempt ended (its task cancelled from outside, too)
                self._keeper.release(request.token)

    async def _attempt(
        self, job: Job, request: RunRequest, claim: Claim, claim_sent: float, running: _Running
    ) -> RunRecord:
        context = running.context
        self._running[request.token] = running
        extra = {"job": job.name, "slot": request.slot, "attempt": claim.attempt}
        log.info("job %s slot %d attempt %d: started", job.name, request.slot, claim.attempt, extra=extra)
        started = self.clock.wall_ms()
        self._hold_lease(running, claim_sent, claim.lease_ms_left)
        status: Status = "ok"
        message: str | None = None
        leaving: BaseException | None = None  # SystemExit or KeyboardInterrupt from an async job, raised at the end
        # The job runs in this task, not one of its own: in a burst every job starts as soon as its run's turn
        # comes, instead of after every run's set-up. interrupt() cancels this task while it awaits the job.
        task = asyncio.current_task()
        try:
            if self.on_run_start is not None:
                await self._hook(self.on_run_start, context, running=running)
                if running.reason is None and not self._started:  # stop() began meanwhile: as for a run won then
                    running.reason = STOPPED
            ran_to_its_end = False
            if running.reason is None:
                running.task = task
                await self._call(job, context, running)
                # An async job that caught the cancellation and returned without looking at run.lease_is_lost went
                # on to its end (a write it had begun, finished): its result stands, as a sync job's that returns
                # without looking. Handed back, the run would run again. Not one that stop() gave up on and left
                # running: its lease was let go, and a backup may have run the run.
                ran_to_its_end = not context.lease_lost.seen_set and self._running.get(request.token) is running
            if running.reason is not None and not ran_to_its_end:
                # Interrupted while the start hook ran (the job is not started), or an async job that caught the
                # cancellation and returned, having seen run.lease_is_lost: it gave up, the run is not done.
                status, message = "interrupted", running.reason
        except asyncio.CancelledError as error:
            if task is not None and not task.cancelling():  # the job raised it itself: it failed
                status, message = "error", f"CancelledError: {error}"
                log.error("job %s slot %d attempt %d failed: CancelledError", job.name, request.slot, claim.attempt)
            elif running.reason is None or task is None:
                raise  # this task was cancelled from outside: not an interruption the scheduler asked for
            else:
                if (thread := running.thread) is not None and not thread.done():
                    # A thread cannot be cancelled; a job that checks run.lease_is_lost returns a step later.
                    await _wait_for_thread(thread, running, task)
                status, message = "interrupted", running.reason
                if (ended := running.thread_ended()) is not None:
                    status, message = ended
                    if status == "error":
                        log.error("job %s slot %d attempt %d failed: %s", job.name, request.slot, claim.attempt,
                                  message, extra=extra)  # fmt: skip
        except Exception as error:
            if running.reason is not None:  # what an async job raised when it caught its interruption: still cut short
                status, message = "interrupted", running.reason
                log.warning("job %s slot %d attempt %d raised when interrupted: %s: %s", job.name, request.slot,
                            claim.attempt, type(error).__name__, error, extra=extra)  # fmt: skip
            else:
                status, message = "error", _failure(error)
                # A job's SystemExit or KeyboardInterrupt is logged as raised, without the wrapper that carried it.
                shown = (error.__cause__ or error) if isinstance(error, _JobExit) else error
                log.error("job %s slot %d attempt %d failed", job.name, request.slot, claim.attempt, exc_info=shown,
                          extra=extra)  # fmt: skip
                if isinstance(error, _JobExit) and error.ends_the_app:
                    leaving = error.__cause__
        finally:
            running.job_ended()
            self._running.pop(request.token, None)  # gone if it ignored a stop's cancellation
        thread_runs_on = running.thread_runs_on  # read once: the message and the hand-back must agree
        if thread_runs_on:
            message = f"{message}; its function still runs on its thread (a sync function cannot be cancelled)"
        record = self._local_record(request, status, message, attempt=claim.attempt, fence=claim.fence, started=started)
        record = await self._end(request, claim, record, extra, hand_back_allowed=not thread_runs_on)
        # Heartbeats went on until the store had the result: a result held up by a short outage must still find the
        # lease live when the store answers again, or a backup takes the run over and runs it again. Let go before
        # the end hook (_execute lets go on every other way out).
        if self._keeper is not None:
            self._keeper.release(request.token)
        log.info("job %s slot %d attempt %d: %s", job.name, request.slot, claim.attempt, status, extra=extra)
        if self.on_run_end is not None:
            try:
                await self._hook(self.on_run_end, context, record, running=running)
            except _JobExit as error:  # the run is recorded already
                leaving = leaving or error.__cause__
        if leaving is not None:
            raise leaving
        return record

    async def _not_started(self, request: RunRequest, claim: Claim) -> RunRecord:
        """A run won after stop() began: not started, but handed back or recorded as interrupted."""
        record = self._local_record(request, "interrupted", STOPPED, attempt=claim.attempt, fence=claim.fence)
        return await self._end(request, claim, record, {"job": request.job, "slot": request.slot})

    async def _end(
        self,
        request: RunRequest,
        claim: Claim,
        record: RunRecord,
        extra: dict[str, Any],
        hand_back_allowed: bool = True,
    ) -> RunRecord:
        """Record how an attempt ended, or hand it back to the other instances unfinished: a scheduled run that
        stop() cut short, or whose lease this instance lost, with attempts left, under leases. A backup takes it
        over when it next looks, as it would after a crash once the lease ran out. A manual run is not retried by
        backups, and a sync job whose function still runs on its thread would run twice: those are recorded."""
        if not self.backend.started:  # stop() has closed the connection (it gave up on this run): nothing can be
            return record  # sent, and the lease runs out as after a crash
        hand_back = (
            hand_back_allowed and record.status == "interrupted" and self.backend.leases and not request.manual
            and (record.message == STOPPED or (record.message or "").startswith(LEASE_LOST))
            and claim.attempt < self._policies[request.job].max_attempts
        )  # fmt: skip
        if not hand_back:
            await self._finish(request, claim, record, extra)
            return record
        if not await self._release(request, extra):
            return record
        return dataclasses.replace(record, message=f"{record.message}: handed back for attempt {claim.attempt + 1}")

    async def _release(self, request: RunRequest, extra: dict[str, Any]) -> bool:
        """Hand a run back; whether the store took it."""
        try:
            released = await self.backend.strategy.release(self.backend.store, request)
        except StoreError as error:
            log.warning("job %s slot %d: could not hand the run back (%s); a backup takes it over when its lease "
                        "runs out", request.job, request.slot, error, extra=extra)  # fmt: skip
            return False
        if released:
            log.info("job %s slot %d: handed back to the other instances", request.job, request.slot, extra=extra)
        else:
            log.warning("job %s slot %d: the store refused the hand-back: the lease was lost", request.job,
                        request.slot, extra=extra)  # fmt: skip
        return released

    async def _finish(self, request: RunRequest, claim: Claim, record: RunRecord, extra: dict[str, Any]) -> None:
        """Record how an attempt ended. While the store cannot be reached, try again (soon, then every second), for
        as long as the attempt's lease could last and, while its heartbeats keep it, up to a lease more: a result that
        reaches the store before the lease runs out keeps a backup from running the run again. Trying again is
        safe, the store takes a result only from the current attempt. Once stop() has begun, only for as long as
        it waits for runs."""
        job, slot, attempt = request.job, request.slot, claim.attempt
        give_up = self.clock.monotonic() + self.lease_ms / 1000
        kept_until = give_up + self.lease_ms / 1000  # a result that keeps failing must not hold the run for ever
        tried = 0
        while True:
            try:
                accepted = await self.backend.strategy.finish(
                    self.backend.store, request, claim, self._policies[job], record
                )
            except StoreError as error:
                unreachable = isinstance(error, StoreUnavailableError)
                delay_s = _doubling(FINISH_RETRY_MIN_S, FINISH_RETRY_S, tried)
                retry_at = self.clock.monotonic() + delay_s
                lease_kept = retry_at < give_up or (
                    retry_at < kept_until and self._keeper is not None and self._keeper.holds(request.token)
                )
                # While stop() waits for runs, their results are tried again too, until it stops waiting.
                if not (unreachable and lease_kept and (self._started or retry_at < self._stop_deadline)):
                    log.warning("job %s slot %d: could not record the result: %s", job, slot, error, extra=extra)
                    return
                # The first failure is a warning; the tries after it, every second while the store is away, are not.
                (log.debug if tried else log.warning)(
                    "job %s slot %d: could not record the result (%s); retrying in %.1f s", job, slot, error,
                    delay_s, extra=extra,
                )  # fmt: skip
                tried += 1
                await self.clock.sleep(delay_s)
                continue
            if not accepted:
                # A retry is told a result an earlier try recorded is recorded, unless trim has dropped the run since.
                why = (
                    "lease lost, or an earlier try recorded it and the run was trimmed since" if tried else "lease lost"
                )
                log.warning(
                    "job %s slot %d attempt %d: the store refused the result (%s)", job, slot, attempt, why, extra=extra
                )
            elif tried:
                log.info("job %s slot %d: result recorded after %d failed tries", job, slot, tried, extra=extra)
            return

    async def _call(self, job: Job, context: RunContext, running: _Running) -> object:
        if job.is_async:
            return await _exits_as_errors(job.call(context))  # type: ignore[arg-type]
        if self._job_threads is None:
            self._job_threads = concurrent.futures.ThreadPoolExecutor(JOB_THREADS, thread_name_prefix="anarchon-job")
        # With the caller's contextvars.
        call = functools.partial(contextvars.copy_context().run, _on_its_thread, job.call, context)
        running.thread = self._job_threads.submit(call)
        result = await asyncio.wrap_future(running.thread)
        if inspect.isawaitable(result):  # a sync function that returned a coroutine: the job goes on in it
            running.thread = None
            return await _exits_as_errors(result)
        return result

    def _start_keeper(self) -> None:
        """Heartbeats go to a thread of their own when the clock is the system's (a virtual clock must keep them
        on the loop that drives time) and the client can open a second connection for it."""
        if not self.backend.leases:
            return
        margin_ms = self.lease_ms * LEASE_MARGIN
        if type(self.clock) is SystemClock:
            connection = self._heartbeat_connection()
            if connection is not None:
                keeper = LeaseKeeper(
                    self.backend.strategy, Store(connection, owned=True), SystemClock(),
                    heartbeat_ms=self.heartbeat_ms, margin_ms=margin_ms,
                )  # fmt: skip
                self._keeper, self._heartbeats = keeper, HeartbeatThread(keeper)
                return
        self._keeper = LeaseKeeper(
            self.backend.strategy, self.backend.store, self.clock, heartbeat_ms=self.heartbeat_ms, margin_ms=margin_ms,
            lane_of=self.backend.lane,
        )  # fmt: skip
        self._spawn(self._keeper.serve(), "anarchon-heartbeats")

    def _heartbeat_connection(self) -> Connection | None:
        """A second connection to the store, for the heartbeat thread; None (said in the log) when the client
        cannot open one: the heartbeats then stay on the event loop, where a job that blocks it delays them."""
        fork = getattr(self.backend.store.connection, "fork", None)
        if fork is None:
            log.info("heartbeats stay on the event loop: this client cannot open a second connection for their "
                     "thread (a job that blocks the loop delays them)")  # fmt: skip
            return None
        try:
            return cast(Connection, fork())
        except Exception as error:  # a pool anarchon cannot copy (Sentinel's needs its own arguments)
            log.warning("heartbeats stay on the event loop: no second connection for their thread: %s", error)
            return None

    async def _stop_keeper(self) -> None:
        if self._heartbeats is not None:
            await asyncio.to_thread(self._heartbeats.close, STOP_GRACE_S)
        for task in [task for task in self._tasks if task.get_name() == "anarchon-heartbeats"]:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self._keeper = self._heartbeats = None

    def _hold_lease(self, running: _Running, sent: float, lease_ms_left: int) -> None:
        keeper = self._keeper
        if keeper is None:
            return
        policy = self._policies[running.request.job]
        if self._heartbeats is None:
            keeper.hold(running.request, policy, sent, lease_ms_left, lambda reason: self._lose(running, reason))
            return
        loop = asyncio.get_running_loop()
        # The keeper's clock is its own thread's monotonic clock: the same one as SystemClock's.

        def lose(reason: str) -> None:
            loop.call_soon_threadsafe(self._lose, running, reason)

        keeper.hold(running.request, policy, sent, lease_ms_left, lose)

    def _lose(self, running: _Running, reason: str) -> None:
        request = running.request
        if running.ended:
            # Its result is on its way to the store, whose answer to it says whether a backup took over (refused)
            # or not. A heartbeat sent as the job ended is most often refused because that result came first.
            extra = {"job": request.job, "slot": request.slot}
            if reason == HEARTBEAT_REFUSED:
                log.debug("job %s slot %d: a heartbeat was refused after the job ended", request.job, request.slot,
                          extra=extra)  # fmt: skip
            else:
                log.info("job %s slot %d: the lease ended before the store had the run's result: %s", request.job,
                         request.slot, reason, extra=extra)  # fmt: skip
            return
        log.warning(
            "job %s slot %d: lease lost: %s",
            request.job,
            request.slot,
            reason,
            extra={"job": request.job, "slot": request.slot, "attempt": running.context.attempt},
        )
        running.interrupt(f"{LEASE_LOST}: {reason}")

    async def _hook(self, hook: Callable[..., object], *args: Any, running: _Running) -> None:
        running.in_hook = True
        try:
            result = hook(*args)
            if inspect.isawaitable(result):
                await result
        except asyncio.CancelledError:
            if (task := asyncio.current_task()) is not None and task.cancelling():
                raise  # the run's task is being cancelled (stop(), a lost lease): not the hook's failure
            log.exception("hook %r failed", hook)  # it raised CancelledError itself
        except (SystemExit, KeyboardInterrupt) as error:
            # As from a job (see _exits_as_errors): the start hook's run is recorded as failed before the exit goes
            # on, instead of being left running for each instance in turn to take over.
            raise _JobExit(_failure(error), ends_the_app=True) from error
        except GeneratorExit:
            raise
        except BaseException:  # any other (a library's own BaseException too): logged, as the hook's failure
            log.exception("hook %r failed", hook)
        finally:
            running.in_hook = False

    def _local_record(
        self,
        request: RunRequest,
        status: Status,
        message: str | None,
        *,
        attempt: int = 1,
        fence: int = 0,
        started: int | None = None,
    ) -> RunRecord:
        now = self.clock.wall_ms()
        return RunRecord(
            job=request.job, run=request.run, slot=request.slot, attempt=attempt, status=status,
            runner=request.runner, token=request.token, fence=fence, manual=request.manual,
            started=now if started is None else started, ended=now, message=message,
        )  # fmt: skip

    def _default_id(self) -> str:
        # A host name may hold what an instance id may not (spaces, accents, braces), or be longer.
        host = re.sub(r"[^A-Za-z0-9_.\-]", "-", socket.gethostname())[:180] or "instance"
        return f"{host}-{os.getpid()}-{self.random.getrandbits(16):04x}"

    def _name(self, instance_id: object) -> None:
        self.instance_id = _check_instance_id(instance_id)
        # Tokens mix the instance in: instances given generators of one seed (for repeatable jitter) draw the same
        # numbers, and two instances with one token would each take the other's claim for its own.
        self._token_salt = int.from_bytes(hashlib.blake2b(self.instance_id.encode(), digest_size=8).digest(), "big")

    def _token(self) -> str:
        return f"{self.random.getrandbits(64) ^ self._token_salt:016x}"

    def __repr__(self) -> str:
        return f"Scheduler(backend={self.backend!r}, jobs={list(self._jobs)}, instance_id={self.instance_id!r})"


class SchedulerThread:
    """A scheduler running on its own event loop in a daemon thread, driven from sync code. Stopped at the
    interpreter's exit if the app did not stop it (before Python shuts down the threads sync jobs run on)."""

    def __init__(self, scheduler: Scheduler[Any]) -> None:
        self.scheduler = scheduler
        self._process = os.getpid()
        self._loop = asyncio.new_event_loop()
        # Orders calls and stop(): none reaches a loop that is ending. Re-entrant: a signal handler's stop() may run
        # on a thread that holds it in a call (thread.history() in the main thread, say), and would wait for ever.
        self._lock = threading.RLock()
        self._stopping = False
        self._stopped_by: int | None = None  # the thread whose stop() came first
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="anarchon", daemon=True)
        self._thread.start()
        # Stopped another way (by one of its jobs, or from another loop), the scheduler leaves the loop and the
        # thread with nothing to do: they end then, as if stop() had been called here.
        scheduler._on_stopped.append(self._scheduler_stopped)
        _stopped_at_exit(self)  # before the start: a job may stop the scheduler as soon as it runs
        try:
            self._call(scheduler.start())
        except BaseException:
            scheduler._on_stopped.remove(self._scheduler_stopped)
            self._stopping = True
            self._end_loop()
            raise

    def _serve(self) -> None:
        """Run the loop until the thread ends. SystemExit or KeyboardInterrupt raised by an async job or hook (its
        run recorded first) leaves the loop: on this thread it cannot end the app, so it stops the scheduler, on
        the loop run again, and the thread then ends as after a stop from anywhere. Left stopped, the loop would
        never answer stop(), nor the interpreter's exit, which waits for it."""
        while True:
            try:
                self._loop.run_forever()
                return
            except BaseException as error:
                log.critical("scheduler %s: %s raised on its thread's event loop by a job or hook: stopping the "
                             "scheduler", self.scheduler.instance_id, type(error).__name__)  # fmt: skip
                self._loop.call_soon(self._stop_after_exit)

    def _stop_after_exit(self) -> None:
        """On the loop, after an exit left it: stop the scheduler, unless a stop is under way (it goes on)."""
        scheduler = self.scheduler
        if scheduler._started and scheduler._stopping is None:
            stopping = asyncio.ensure_future(scheduler.stop())
            stopping.add_done_callback(lambda task: task.cancelled() or task.exception())  # logged by stop()

    def _call(self, coroutine: Coroutine[Any, Any, S]) -> S:
        self._check_caller(coroutine)
        with self._lock:
            if self._stopping:
                coroutine.close()
                raise SchedulerStateError("the scheduler's thread is stopped: start a new one with run_in_thread()")
            try:
                future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
            except RuntimeError:  # the loop closed meanwhile: a signal handler's stop() ran on this very thread
                coroutine.close()
                raise SchedulerStateError("the scheduler's thread stopped before the call began") from None
        try:
            return future.result()
        except concurrent.futures.CancelledError:  # the thread stopped while the call waited
            raise SchedulerStateError("the scheduler's thread stopped before the call ended") from None

    def _check_caller(self, coroutine: Coroutine[Any, Any, object] | None = None) -> None:
        """A job or hook on the scheduler's own loop would wait here for that loop, which it holds: for ever. So
        would a process forked from this one, which has no such thread."""
        try:
            _check_same_process(self._process)
            if threading.current_thread() is self._thread:
                raise SchedulerStateError(
                    "called from the scheduler's own thread (a job or hook): await the scheduler's method instead"
                )
        except SchedulerStateError:
            if coroutine is not None:
                coroutine.close()
            raise

    def run_now(self, name: str) -> RunRecord:
        return self._call(self.scheduler._run_now_for_elsewhere(name))

    def history(self, name: str, limit: int = 50) -> list[RunRecord]:
        return self._call(self.scheduler.history(name, limit))

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the scheduler (see :meth:`Scheduler.stop`) and end its thread. Calling it again, from any thread,
        returns once it has stopped (at once from a signal handler that interrupts the first call's thread: that
        call returns once it has); with a timeout that ends sooner, it cuts the running jobs short by then. A
        KeyboardInterrupt that cuts the wait short cuts the jobs short too, and comes out once the stop has ended."""
        self._check_caller()
        caller = _RUN_OF.get()
        if caller is not None and caller[0] is self.scheduler:
            # A sync job (on its thread), or an async one through a thread that carries its context
            # (asyncio.to_thread): the scheduler's stop would take it for the job's own and not wait for it, and
            # the thread's end then cut the job off unrecorded, its run neither handed back nor finished.
            raise SchedulerStateError(
                "called by one of the scheduler's jobs, it would end the thread that job's run needs: stop "
                "from a thread of its own (threading.Thread(target=scheduler_thread.stop).start()), or await "
                "scheduler.stop() in an async job"
            )
        timeout = _check_timeout(timeout)  # refused here, the scheduler and its thread run on
        with self._lock:
            first, self._stopping = not self._stopping, True
            if first:
                self._stopped_by = threading.get_ident()
            elif not self._stopped.is_set():
                # A stop is under way: this one's timeout, if sooner, cuts its jobs short sooner.
                self._hurry(timeout)
        if not first:
            if threading.get_ident() != self._stopped_by:
                self._stopped.wait()
            # Else called while this very thread's stop() waits (by a signal handler): it returns once stopped.
            return
        try:
            stopping = asyncio.run_coroutine_threadsafe(self.scheduler.stop(timeout), self._loop)
            try:
                stopping.result()
            except BaseException:
                if not stopping.done():
                    # The wait was cut short here (a second Ctrl-C): the stop goes on, ending its runs now, and
                    # ends before the loop does. Cancelled half-way, it would leave runs neither handed back nor
                    # recorded, the heartbeat thread and a connection open, and the backend taken.
                    self._hurry(0)
                    concurrent.futures.wait([stopping])
                raise
        finally:
            self._end_loop()

    def _hurry(self, timeout: float) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: the stop is over
            self._loop.call_soon_threadsafe(self._hurry_stop, timeout)

    def _hurry_stop(self, timeout: float) -> None:
        """On the loop, a second stop(): the stop under way ends its runs ``timeout`` from now, if sooner. One whose
        first stop has not begun yet (posted just before) goes as a stop() of its own, which comes after it: the
        first stop would otherwise set its own deadline over this one's."""
        scheduler = self.scheduler
        if scheduler._stopping is not None:
            scheduler._hurry_stop(timeout)
        elif scheduler._started:
            hurry = asyncio.ensure_future(scheduler.stop(timeout))
            hurry.add_done_callback(lambda task: task.cancelled() or task.exception())  # the first stop's caller hears

    def _scheduler_stopped(self) -> None:
        """On the loop, as a stop of the scheduler ends: unless this thread's stop() made it, end the thread, from
        one of its own (the loop cannot wait for its own thread, nor for the lock: a stop() from a signal handler
        holds it while it waits for this very stop to end)."""
        self.scheduler._on_stopped.remove(self._scheduler_stopped)
        threading.Thread(target=self._end_unless_stopping, name="anarchon-end", daemon=True).start()

    def _end_unless_stopping(self) -> None:
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
        self._end_loop()

    def _end_loop(self) -> None:
        """Cancel what still runs on the loop (calls that were waiting on it end with the scheduler's error), then
        end the loop and its thread."""
        try:
            asyncio.run_coroutine_threadsafe(_cancel_the_rest(), self._loop).result()
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()
            _RUNNING_THREADS.discard(self)
            self._stopped.set()


_RUNNING_THREADS: set[SchedulerThread] = set()  # started and not stopped yet: stopped at the interpreter's exit
_exit_hook_lock = threading.Lock()
_exit_hook_registered = False


def _stopped_at_exit(thread: SchedulerThread) -> None:
    """Stop ``thread`` at the interpreter's exit if the app has not: when the app's threads have ended, before
    concurrent.futures shuts its pools down (these hooks run last registered, first; an atexit function would run
    after), as a run won then could not start on a job thread. The hook concurrent.futures itself uses; the
    stdlib has no public one that runs before it. Registered once for all threads: one per thread would keep
    every thread ever started, and its scheduler, until the exit."""
    global _exit_hook_registered
    with _exit_hook_lock:
        if not _exit_hook_registered:
            threading._register_atexit(_stop_running_threads)  # type: ignore[attr-defined]
            _exit_hook_registered = True
        _RUNNING_THREADS.add(thread)


def _stop_running_threads() -> None:
    for thread in list(_RUNNING_THREADS):
        thread.stop()


# A process forked from one running schedulers has none of their threads (a child of a gunicorn master started
# with --preload, or a multiprocessing "fork" worker): its exit must not wait for them.
os.register_at_fork(after_in_child=_RUNNING_THREADS.clear)


def _check_same_process(started_in: int) -> None:
    if os.getpid() != started_in:
        raise SchedulerStateError(
            f"the scheduler was started in process {started_in}, and this process is a fork of it: the "
            "scheduler's event loop, threads and connections stayed there. Build and start a scheduler in each "
            "process after the fork (in a gunicorn worker's post_fork hook, say), or start it in one process only"
        )


async def _cancel_the_rest() -> None:
    tasks = asyncio.all_tasks() - {asyncio.current_task()}
    for task in tasks:
        task.cancel()
    if tasks:  # a job that ignores cancellation is left: stop() said so when it gave up on it
        await asyncio.wait(tasks, timeout=STOP_GRACE_S)


Tasks: TypeAlias = Callable[[], set[asyncio.Task[Any]]]


async def _wait_until(clock: Clock, tasks: Tasks, deadline: Callable[[], float], moved: asyncio.Event) -> None:
    """Wait until ``deadline()`` on ``clock`` (its monotonic seconds) for ``tasks()``, those of the moment, to end;
    the deadline is read again whenever ``moved`` is set."""
    while (at := deadline()) > clock.monotonic():  # stop(timeout=0) waits for no timer
        moved.clear()
        timer = asyncio.ensure_future(clock.sleep(at - clock.monotonic()))
        moving = asyncio.ensure_future(moved.wait())
        try:
            while (pending := {task for task in tasks() if not task.done()}) and not (timer.done() or moved.is_set()):
                await asyncio.wait({*pending, timer, moving}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            timer.cancel()
            moving.cancel()
        if not moved.is_set():  # all ended, or the deadline came
            return


async def _wait_for_thread(thread: concurrent.futures.Future[Any], running: _Running, task: asyncio.Task[Any]) -> None:
    """Give an interrupted sync job's thread THREAD_GIVE_UP_S to end. Another interruption meanwhile (a lost lease,
    then stop()) does not cut the wait short, or the run would go unrecorded; a cancellation from outside does."""
    loop = asyncio.get_running_loop()
    ended, until = asyncio.wrap_future(thread), loop.time() + THREAD_GIVE_UP_S
    while not ended.done() and (left := until - loop.time()) > 0:
        try:
            await asyncio.wait([ended], timeout=left)
        except asyncio.CancelledError:
            if task.cancelling() > running.cancels:  # not (only) interrupt()'s
                raise


async def _end_by(tasks: Tasks, at: float) -> tuple[int, set[asyncio.Task[Any]]]:
    """Let ``tasks()``, those of the moment, end until the loop's time ``at``, then cancel those still going
    (waiting for a store that does not answer, or running a job) and give them STOP_GRACE_S more to end. Returns
    how many were cancelled, and those that did not end even then (a job that ignores cancellation): they are left
    running."""
    loop = asyncio.get_running_loop()
    while (pending := {task for task in tasks() if not task.done()}) and loop.time() < at:
        await asyncio.wait(pending, timeout=at - loop.time(), return_when=asyncio.FIRST_COMPLETED)
    left: set[asyncio.Task[Any]] = set()
    if pending:
        for task in pending:
            task.cancel()
        _, left = await asyncio.wait(pending, timeout=STOP_GRACE_S)
    return len(pending), left


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def raise_if_cancelled() -> None:
    """Re-raise a cancellation that an inner call swallowed.

    In Python 3.11, ``asyncio.wait_for`` (used inside clients) returns its inner call's result when the
    cancellation arrives just as that call completes; the task is left "cancelling" but runs on. Loops that must
    stop when cancelled check for it on every turn.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def _lease_only(option: str, strategy: str) -> ConfigError:
    return ConfigError(
        option,
        f"is a lease option, and the backend's strategy is {strategy!r}",
        'leave it unset, or use strategy="lease"',
    )


class _JobExit(Exception):
    """A job's function raised SystemExit or KeyboardInterrupt (its ``__cause__``). On an async job's task, which is
    the application's (a signal handler's sys.exit(), Ctrl-C in a loop run without asyncio.run), it ends the app
    once the run is recorded; on a sync job's thread it ends that thread only, as in any Python thread."""

    def __init__(self, message: str, *, ends_the_app: bool = False) -> None:
        super().__init__(message)
        self.ends_the_app = ends_the_app


def _on_its_thread(function: Callable[[RunContext], object], context: RunContext) -> object:
    """Call a sync job's function on its worker thread. SystemExit there ends that thread only, as in any Python
    thread: handed to the event loop as it is, asyncio would raise it out of the loop and end the application (and
    each instance that took the run over after it, in turn). The job failed: its run is recorded as an error. So
    is one that raised another BaseException (gevent's Timeout, a test framework's outcome)."""
    try:
        return function(context)
    except StopIteration as error:  # (a next() past the end) no asyncio future takes it: the run would never end
        raise _JobExit(_failure(error)) from error
    except (Exception, asyncio.CancelledError):
        raise  # recorded as they are (a CancelledError it raised itself, as an error)
    except BaseException as error:
        raise _JobExit(_failure(error)) from error


async def _exits_as_errors(job: Awaitable[object]) -> object:
    """Await an async job. SystemExit or KeyboardInterrupt raised in it (sys.exit() in a command-line entry point
    reused as a job, or a signal handler's) fails its run, which is recorded before the exit goes on to end the
    app: left running, the run would be taken over by each instance in turn, and end each of them. Another
    BaseException (gevent's Timeout, a test framework's outcome) fails the run and ends nothing else: raised out
    of the run's task, it would leave the run unrecorded, to be run again by each backup in turn."""
    try:
        return await job
    except (SystemExit, KeyboardInterrupt) as error:
        raise _JobExit(_failure(error), ends_the_app=True) from error
    except (Exception, asyncio.CancelledError, GeneratorExit):
        raise
    except BaseException as error:
        raise _JobExit(_failure(error)) from error


def _failure(error: BaseException) -> str:
    """How a job's exception is recorded: its type and message, or its type alone when it has none (a bare
    ``raise KeyboardInterrupt``); a SystemExit from a job as itself."""
    if isinstance(error, _JobExit):
        return str(error)
    message = str(error)
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


@contextlib.contextmanager
def _naming_job(name: str) -> Iterator[None]:
    """A job's bad option or cron names the job as well: jobs added in a loop (from a config file) are told
    apart. The error keeps its type and fields; its message gains the job."""
    try:
        yield
    except ConfigError as error:
        if f"job {name!r}" not in str(error):  # a long name (refused as such) is cut short, as its error cuts it
            error.args = (f"job {shown(name)}: {error}", *error.args[1:])
        raise


def _doubling(first_s: float, most_s: float, failed: int) -> float:
    """How long to wait after ``failed`` tries failed in a row: ``first_s``, twice as long after each failure, at
    most ``most_s``. The exponent is capped, as a backup's claims may fail for hours."""
    return min(most_s, first_s * 2.0 ** min(failed, 16))


def _check_timeout(value: object, option: str = "timeout") -> float:
    """Validate stop()'s timeout before stopping begins: a bad one found halfway would leave it half stopped."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigTypeError(option, f"must be a number of seconds, got {type(value).__name__}", "0 or more")
    if not (value >= 0 and is_finite(value)):
        why = "is below 0" if value < 0 else "is not a finite number of seconds"
        raise ConfigError(option, f"{shown(value)} {why}", "0 or more")
    return float(value)


def _check_instance_id(value: object) -> str:
    return check_job_name(value, "instance_id")
