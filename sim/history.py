"""What happened in a simulation: the operation history and the execution ledger, kept outside the store.

History: immutable records, ``invoke`` then ``ok`` / ``fail`` / ``info`` (info: outcome unknown) for each store
operation of each instance, and a ``fault`` record for each fault, all stamped with true (simulator) time.
Ledger: every execution of a job function, from its first instruction to its last, and whether it ran to the end.
Records: what ``Scheduler.history`` tells of each job at the end, read from the store the instances last used.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Awaitable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple, TypeVar

from anarchon import Clock, RedisBackend, RunContext, RunRecord, Scheduler, StoreError, StoreUnavailableError
from anarchon._store import ServerInfo, Store
from anarchon._strategies import Claim, JobPolicy, Outcome, RunRequest, Strategy
from sim.links import NotSent
from sim.scenario import Scenario

T = TypeVar("T")
READ_ALL = 1_000_000  # the most records history() gives at once: more than any run stores


@dataclass(frozen=True, slots=True)
class Event:
    t: float  # true time, seconds since the simulation began
    kind: str  # invoke | ok | fail | info | fault
    process: str  # an instance, or "nemesis"
    op: str  # claim | heartbeat | finish | skip, or the fault's kind
    job: str = ""
    run: str = ""
    token: str = ""
    value: str = ""
    attempt: int = 0  # the run's attempt this operation belongs to; 0 while a claim has not named one


class ClaimAnswer(NamedTuple):
    """What the store answered a claim, as an ``ok`` claim event's value holds it."""

    outcome: str  # an Outcome's value
    attempt: int
    fence: int
    lease_ms: int | None = None  # the lease left (absent from the values of some tests' histories)

    def __str__(self) -> str:
        return f"{self.outcome} attempt={self.attempt} lease_ms={self.lease_ms} fence={self.fence}"

    @classmethod
    def of(cls, event: Event) -> ClaimAnswer | None:
        """The answer an ``ok`` claim event records; None for any other event."""
        if event.kind != "ok" or event.op != "claim":
            return None
        return _claim_answer(event.value)


@functools.lru_cache(maxsize=1 << 16)  # every checker asks for the answers of one history
def _claim_answer(value: str) -> ClaimAnswer:
    outcome, *fields = value.split()
    values = dict(field.split("=", 1) for field in fields)
    lease_ms = values.get("lease_ms")
    return ClaimAnswer(
        outcome, int(values["attempt"]), int(values["fence"]), None if lease_ms is None else int(lease_ms)
    )


@dataclass(slots=True)
class Execution:
    instance: str
    job: str
    slot: int
    run: str  # the run's id in the store: its slot for a scheduled run; a manual run's own id
    attempt: int
    fence: int
    token: str
    manual: bool
    started: float  # true time
    ended: float | None = None
    completed: bool = False
    cut_by_end: bool = False  # still going when the run ended (``ended`` is then the end): its outcome unknown
    killed: bool = False  # its process was killed as it ran (a crash, or the run's end): nothing of it ran after

    def overlaps(self, other: Execution) -> bool:
        end = self.ended if self.ended is not None else float("inf")
        other_end = other.ended if other.ended is not None else float("inf")
        return self.started < other_end and other.started < end


@dataclass
class History:
    epoch_s: float = 0.0  # the wall clock (s since the Unix epoch) at true time 0: slots are wall times
    events: list[Event] = field(default_factory=list)
    executions: list[Execution] = field(default_factory=list)
    records: list[RunRecord] | None = None  # None: not read (a history made by hand, or a live store gone)

    def add(self, event: Event) -> None:
        self.events.append(event)

    def digest(self) -> str:
        """A fingerprint of everything that happened: equal for two runs of one seed, or the run is not
        deterministic."""
        hasher = hashlib.sha256()
        for event in self.events:
            hasher.update(json.dumps(asdict(event), sort_keys=True).encode())
        for execution in self.executions:
            hasher.update(json.dumps(asdict(execution), sort_keys=True).encode())
        for record in self.records or ():
            hasher.update(json.dumps(asdict(record), sort_keys=True).encode())
        return hasher.hexdigest()[:16]

    def as_json(self) -> dict[str, Any]:
        return {
            "events": [asdict(event) for event in self.events],
            "executions": [asdict(execution) for execution in self.executions],
            "records": None if self.records is None else [asdict(record) for record in self.records],
        }


async def read_records(backend: RedisBackend[Any], scenario: Scenario, strategy: str, clock: Clock) -> list[RunRecord]:
    """Every record ``Scheduler.history`` gives of the scenario's jobs, newest first per job, through ``backend``: read
    by a scheduler that is not started, as a process that shows the history reads it."""
    scheduler: Scheduler[Any] = Scheduler(
        backend, clock=clock, instance_id="reader", **scenario.scheduler_options(strategy)
    )
    for job in scenario.jobs:
        scheduler.add_job(job.name, job.cron, _never_runs, **scenario.job_options(job, strategy))
    return [record for job in scenario.jobs for record in await scheduler.history(job.name, limit=READ_ALL)]


async def _never_runs(run: RunContext) -> None:
    raise AssertionError(f"the reader's scheduler is never started, yet it ran {run.job}")


class RecordingStrategy:
    """Wraps an instance's strategy and writes every operation to the history, as invoke and completion."""

    def __init__(self, inner: Strategy, history: History, process: str, now: Any) -> None:
        self.inner = inner
        self.log = history  # not `history`: that is the strategy's method, which schedulers call
        self.process = process
        self.now = now  # () -> true time
        self.name = inner.name
        self.leases = inner.leases
        self.claims_in_slot_order = inner.claims_in_slot_order
        self.scripts = inner.scripts
        self._attempts: dict[str, int] = {}  # token -> the attempt its claim won
        self.runs: dict[str, str] = {}  # token -> the run its claim named (a manual run's id is not its slot)
        # Its process was killed: what the scheduler object still calls (its stop() after the kill, where the
        # simulator ends it) is nothing the process did, and goes unrecorded.
        self.killed = False

    def _record(self, kind: str, op: str, request: RunRequest, value: str = "") -> None:
        attempt = self._attempts.get(request.token, 0)
        event = Event(self.now(), kind, self.process, op, request.job, request.run, request.token, value, attempt)
        self.log.add(event)

    def _completion(self, op: str, request: RunRequest, result: object) -> None:
        if isinstance(result, NotSent):  # the store never saw it: a failure, not an unknown outcome
            self._record("fail", op, request, str(result))
        elif isinstance(result, StoreUnavailableError):
            self._record("info", op, request, str(result))
        elif isinstance(result, StoreError):
            self._record("fail", op, request, str(result))
        elif isinstance(result, Claim):
            if result.outcome is Outcome.WON:
                self._attempts[request.token] = result.attempt
            answer = ClaimAnswer(result.outcome.value, result.attempt, result.fence, result.lease_ms_left)
            self._record("ok", op, request, str(answer))
        else:
            self._record("ok", op, request, str(result))

    def check_server(self, server: ServerInfo) -> None:
        self.inner.check_server(server)

    async def prepare(self, store: Store, jobs: Sequence[str]) -> None:
        await self.inner.prepare(store, jobs)

    async def claim(self, store: Store, requests: Sequence[tuple[RunRequest, JobPolicy]]) -> list[Claim | StoreError]:
        if self.killed:
            return await self.inner.claim(store, requests)
        for request, _ in requests:
            self.runs[request.token] = request.run
            self._record("invoke", "claim", request)
        try:
            results = await self.inner.claim(store, requests)
        except StoreError as error:
            for request, _ in requests:
                self._completion("claim", request, error)
            raise
        for (request, _), result in zip(requests, results, strict=True):
            self._completion("claim", request, result)
        return results

    async def heartbeat(self, store: Store, request: RunRequest, policy: JobPolicy) -> int:
        return await self._call("heartbeat", request, self.inner.heartbeat(store, request, policy))

    async def finish(
        self, store: Store, request: RunRequest, claim: Claim, policy: JobPolicy, record: RunRecord
    ) -> bool:
        return await self._call("finish", request, self.inner.finish(store, request, claim, policy, record))

    async def release(self, store: Store, request: RunRequest) -> bool:
        return await self._call("release", request, self.inner.release(store, request))

    async def skip(self, store: Store, request: RunRequest, policy: JobPolicy, status: Any, message: str) -> bool:
        return await self._call("skip", request, self.inner.skip(store, request, policy, status, message))

    async def catch_up_since(self, store: Store, job: str, now: int) -> int:
        return await self.inner.catch_up_since(store, job, now)

    async def history(self, store: Store, job: str, limit: int) -> list[RunRecord]:
        return await self.inner.history(store, job, limit)

    async def records_at(self, store: Store, job: str, slot: int) -> list[RunRecord]:
        return await self.inner.records_at(store, job, slot)

    async def _call(self, op: str, request: RunRequest, call: Awaitable[T]) -> T:
        if self.killed:
            return await call
        self._record("invoke", op, request)
        try:
            result = await call
        except StoreError as error:
            self._completion(op, request, error)
            raise
        self._completion(op, request, result)
        return result
