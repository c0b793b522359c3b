"""The virtual-mode world: scheduler instances (the production library, unmodified) on one embedded store, their
clocks, the faults of a scenario, and the history and ledger of everything that happened.

Only time, randomness and the store connection are injected. Each instance gets a :class:`SimClock` (its own
offset and drift over true time; its timers do not fire while the instance is paused) and a
:class:`~sim.links.Link` to the store that the nemesis can cut, hold (pause) or redirect (failover). A store with
a replica keeps a replication log (:mod:`sim.replica`) that the nemesis delays or holds, and whose undelivered
rest a failover drops.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any

import fakeredis

from anarchon import RedisBackend, RunContext, Scheduler, StoreError, StoreUnavailableError
from anarchon._store import Connection
from sim import fakestore, nemesis
from sim.history import Event, Execution, History, RecordingStrategy, read_records
from sim.idmp import IdmpConnection, IdmpState
from sim.links import Link
from sim.replica import Dataset, Entry, KeyState, ReplicatedConnection, Replication
from sim.scenario import FaultSpec, InstanceSpec, JobSpec, Scenario
from sim.vtime import Sleepers

EPOCH_S = 1_800_000_000  # 2027-01-15T08:00:00Z: simulations start at a fixed, round moment
STORE_VERSION = (7, 0)
IDMP_VERSION = (8, 6)  # the idmp strategy needs it; its IDMP is emulated (sim.idmp)
REPLICA_FAULTS = ("failover", "replication-hold")
MIN_SLEEP_S = 1e-6
START_RETRY_S = 1.0  # a process that cannot reach the store as it starts exits; its supervisor starts it again
log = logging.getLogger("sim")


@dataclass(frozen=True)
class FaultWindow:
    """When a fault struck and healed (true time), and which instance it hit ("" for the store). A failover's
    window spans the writes the promoted replica had not received: from the earliest of them to the failover;
    ``lost_writes`` is False when it had received them all (the window is then the failover's instant).
    ``lost_words``, when known, holds the arguments of the commands whose writes the store lost (a lost claim's
    token is among them); when not (None), every claim acknowledged within the window counts as lost. ``fault``
    is the one that struck ``instance`` (its settings say how far a clock fault moved the instance's clock)."""

    start: float
    end: float
    kind: str
    instance: str = ""
    lost_writes: bool = True
    lost_words: frozenset[str] | None = None
    fault: FaultSpec | None = field(default=None, compare=False)

    def hits(self, instance: str, start: float, end: float) -> bool:
        """Whether this fault makes ``instance`` unhealthy (down, paused or cut off) at some moment from ``start``
        to ``end``. Up to its end included: an instance started again exactly at a slot's time leaves that slot to
        the others (a scheduler's slots are those after the moment it is started)."""
        unhealthy = self.kind in ("crash", "stop", "pause", "partition")
        return self.instance == instance and unhealthy and self.start <= end and start <= self.end


class SimClock:
    """An instance's clock over true (loop) time: ``offset_ms`` ahead, running ``1 + drift`` times as fast (0.001:
    1 ms per s fast). A paused instance is a stopped process (SIGSTOP, as live mode pauses it): nothing of it runs
    and its timers do not fire, while its clocks, the system's, run on; at the resume it reads the time it would
    have read unpaused, and every timer due meanwhile fires at once, so it carries on from where it stopped, late."""

    def __init__(self, offset_ms: float = 0.0, drift: float = 0.0) -> None:
        self.offset_ms = offset_ms
        self.drift = drift
        self.running = asyncio.Event()
        self.running.set()
        self._base_local = 0.0  # the instance's own seconds at true time _base_true
        self._base_true = 0.0
        self._changes = 0  # pauses and drift changes so far: a sleep that saw one works out the rest
        self._sleepers = Sleepers()

    @staticmethod
    def true_s() -> float:
        return asyncio.get_running_loop().time()

    def _local_s(self) -> float:
        return self._base_local + (self.true_s() - self._base_true) * (1 + self.drift)

    def _rebase(self) -> None:
        self._base_local, self._base_true = self._local_s(), self.true_s()
        self._changes += 1

    def set_drift(self, drift: float) -> None:
        self._rebase()
        self.drift = drift
        self._sleepers.wake()

    def pause(self) -> None:
        self._changes += 1  # a sleep falling due in the pause waits for the resume
        self.running.clear()

    def resume(self) -> None:
        self.running.set()

    def wall_ms(self) -> int:
        return int((EPOCH_S + self._local_s()) * 1000 + self.offset_ms)

    def monotonic(self) -> float:
        return self._local_s()

    async def sleep(self, seconds: float) -> None:
        left = max(0.0, seconds)
        until = self._local_s() + left
        while True:
            await self.gate()
            changes = self._changes
            # At least a microsecond of true time: a sleep whose length rounds away would leave the loop's time,
            # and the instance's clock with it, where they were, and a caller that sleeps until a moment of its
            # clock would ask again for ever (one whose clock runs 6 times as fast did).
            await self._sleepers.sleep(max(left / (1 + self.drift), MIN_SLEEP_S))
            if self._changes == changes:
                return
            await self.gate()
            left = until - self._local_s()
            if left <= 0:
                return

    async def gate(self) -> None:
        while not self.running.is_set():
            await self.running.wait()


class SimStore:
    """The embedded store (Redis 7.0, or 8.6 with IDMP emulated), and what failover and restarts do to it.

    ``replicated``: the store has a replica, fed by a replication log (:mod:`sim.replica`) that a failover
    promotes. Only scenarios with failover or replication faults pay for the log."""

    def __init__(self, version: tuple[int, ...] = STORE_VERSION, *, replicated: bool = False) -> None:
        fakestore.install()
        self.version = version
        self.idmp = IdmpState()
        self.clock_ahead_s = 0.0  # the serving server's clock over true time (time.time() reads it: run_virtual)
        self._new_server()
        self.replication = Replication(self._read_key, self.idmp) if replicated else None

    def _new_server(self) -> None:
        self.server = fakeredis.FakeServer(version=self.version)
        self._probe = fakeredis.FakeRedis(server=self.server)  # blocking: reads keys for the log at once

    def _read_key(self, key: str) -> KeyState | None:
        """A key of the current primary, read at once: no other instance's command can come between a write and
        the log entry that records it."""
        dumped = self._probe.dump(key)
        if dumped is None:
            return None
        ttl = self._probe.pttl(key)
        return KeyState(dumped, None if ttl < 0 else int(time.time() * 1000) + ttl)

    def connection(self) -> Connection:
        # Straight into the engine: the wire is not what the simulator tests (every client adapter is tested
        # against real servers), and an unreachable store is the link's to model (sim/links.py).
        connection: Connection = fakestore.EmbeddedConnection(self.server)
        if self.version >= (8, 6):
            connection = IdmpConnection(connection, self.idmp)
        return ReplicatedConnection(connection, self.replication) if self.replication else connection

    def promote(self, lag_s: float, clock_s: float = 0.0) -> list[Entry]:
        """The replica, ``lag_s`` behind, becomes the primary: what it had not received is gone, and so are the
        scripts (they are not replicated). Its clock is ``clock_s`` ahead of the old primary's: TIME and new
        stream ids follow it (an id never below the stream's last one), and expiries, replicated as absolute
        times (Redis 7+), come that much sooner. Returns the log's entries whose writes it lacked."""
        assert self.replication is not None, "a failover needs a store with a replica"
        dataset, lacked = self.replication.replica(lag_s)
        self.clock_ahead_s += clock_s
        now_ms = int(time.time() * 1000)
        self._new_server()
        for key, state in dataset.keys.items():
            if state.expires_ms is None:
                self._probe.restore(key, 0, state.dumped)  # RESTORE's TTL 0: no expiry
            elif state.expires_ms > now_ms:
                self._probe.restore(key, state.expires_ms - now_ms, state.dumped)
            # else it has expired by now: the replica would have let it go
        self.idmp.streams = {key: copy.deepcopy(stream) for key, stream in dataset.idmp.items()}
        self.replication.restart(dataset)  # the new primary's replica starts in sync with it
        return lacked

    def lose_everything(self) -> None:
        """A restart without persistence: empty, no cached scripts (and a replica that resynchronises empty)."""
        self._new_server()
        self.idmp.streams = {}
        if self.replication is not None:
            self.replication.restart(Dataset())


@dataclass
class SimInstance:
    world: World
    spec: InstanceSpec
    clock: SimClock = field(init=False)
    link: Link | None = None
    scheduler: Scheduler[Any] | None = None
    running_jobs: dict[str, Execution] = field(default_factory=dict)  # by token
    # Pause and partition faults in force. They strike the instance, not one process of it: a process restarted
    # within them comes back paused or cut off until they end.
    pauses: int = 0
    paused_at: float | None = None  # true time the pauses in force began: its jobs did nothing since
    partitions: int = 0
    reply_delays: list[float] = field(default_factory=list)  # slow faults in force: the longest one counts
    kills: int = 0  # processes killed so far: a restart gives up once the process it is starting is killed
    stopping: bool = False  # its process is stopping (a stop fault): down for new faults, but it can still crash
    stop_at_resume: Scheduler[Any] | None = None  # told to stop while paused: it acts on it at the resume
    serving: bool = False  # its process has started (a restart within a pause waits for the resume to start)
    recorder: RecordingStrategy | None = None  # its process's strategy, which writes its operations to the history

    def __post_init__(self) -> None:
        self.clock = SimClock(self.spec.offset_ms, self.spec.drift)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def up(self) -> bool:
        return self.scheduler is not None

    @property
    def label(self) -> str:
        return f"instance {self.name}"

    @property
    def alive(self) -> bool:
        return self.up or self.stopping

    async def clock_changed(self) -> None:
        """Nothing to tell: the scheduler reads this clock."""

    def cannot_run_now(self) -> str | None:
        if self.scheduler is None or not self.serving:  # no process, or one still starting, to call it on
            return "starting" if self.up else "down"
        return None

    async def run_now(self, job: str) -> str | None:
        # A paused process (SIGSTOP) takes the call when it resumes, as live mode's reads it from its stdin then:
        # the manual run is named, claimed and leased by its clock of that moment.
        await self.clock.gate()
        if self.scheduler is None or not self.serving:
            return "its process went down before it could take the call"
        try:
            await self.scheduler.run_now(job)
        except StoreError as error:
            return str(error)
        return None

    async def start(self) -> None:
        """Start a process of this instance: raises StoreUnavailableError if it cannot reach the store."""
        world = self.world
        self.link = Link(world.store.connection(), self.name, gate=self.clock.gate)
        if self.partitions:
            self.link.cut()
        self._set_reply_delay()
        backend: RedisBackend[Any] = RedisBackend(
            redis=self.link, strategy=world.scenario.strategy_option(world.strategy)
        )  # type: ignore[call-overload]
        recorder = self.recorder = RecordingStrategy(backend.strategy, world.history, self.name, world.now)
        backend.strategy = recorder
        scheduler: Scheduler[Any] = Scheduler(
            backend,
            clock=self.clock,
            instance_id=self.name,
            random=random.Random(world.rng.getrandbits(64)),
            **world.scenario.scheduler_options(world.strategy),
        )
        for job in world.scenario.jobs:
            work = self._work(job, recorder)
            scheduler.add_job(job.name, job.cron, work, **world.scenario.job_options(job, world.strategy))
        self.scheduler = scheduler  # up from now: a second restart racing this one must see it
        try:
            await scheduler.start()
        except StoreUnavailableError:
            if self.scheduler is scheduler:
                self.scheduler = None
            raise
        self.serving = self.scheduler is scheduler

    def _work(self, job: JobSpec, recorder: RecordingStrategy) -> Any:
        async def work(run: RunContext) -> None:
            execution = Execution(
                self.name, run.job, run.slot, recorder.runs[run.token], run.attempt, run.fence, run.token,
                run.manual, self.world.now(),
            )  # fmt: skip
            self.world.history.executions.append(execution)
            self.running_jobs[run.token] = execution
            try:
                await self.clock.sleep(job.work_s)  # the work: virtual time, ended at the resume if due in a pause
            finally:
                alive = self.running_jobs.pop(run.token, None) is not None  # a kill ended it already
                if alive:
                    execution.ended = self.world.now()
            execution.completed = alive

        return work

    async def end(self) -> None:
        """The end of the simulation: the process is killed as by a crash, but its jobs count as going on until
        now, paused or not. A paused process had not stopped them: a zombie still paused at the end believes it
        holds its lease beside the backup that took its run over, and the checkers must see it."""
        for execution in self.running_jobs.values():
            execution.cut_by_end = True
        self._stop_jobs(self.world.now())
        await self.crash()

    def _stop_jobs(self, at: float) -> None:
        """The process is killed: its jobs stop where they are, at ``at``."""
        for execution in self.running_jobs.values():
            execution.ended = at
            execution.killed = True
        self.running_jobs.clear()

    async def crash(self) -> None:
        """SIGKILL: the store hears nothing more from this process (one that is stopping, too); its jobs stop
        where they are."""
        if not self.alive or self.link is None:
            return
        self.kills += 1
        self.serving = False
        self.stopping = False
        self.link.kill()
        if self.recorder is not None:  # a killed process attempts nothing more: the stop below is bookkeeping
            self.recorder.killed = True
        # Its jobs stopped where they are: when the kill came, or when the pause it came in began.
        self._stop_jobs(self.world.now() if self.paused_at is None else self.paused_at)
        scheduler, self.scheduler = self.scheduler, None
        if scheduler is None:  # it was stopping: that stop() ends now, against the dead link
            scheduler, self.stop_at_resume = self.stop_at_resume, None  # unless it has not begun
            if scheduler is None:
                return
        # A paused process stays paused while it dies: its tasks are cancelled where they wait, and its commands
        # fail at the dead link without waiting for a resume; no timer of it fires. Its next process starts
        # paused while the pause lasts.
        await scheduler.stop(timeout=0)

    async def stop(self, timeout_s: float) -> None:
        """A graceful stop, as a deploy does: ``Scheduler.stop(timeout_s)`` waits for the running jobs, cancels
        what still runs (a lease run with attempts left is handed back), and the process exits."""
        if self.scheduler is None or self.link is None:
            return
        self.kills += 1
        self.serving = False
        self.stopping = True
        scheduler, self.scheduler, link = self.scheduler, None, self.link
        try:
            # A paused process (SIGSTOP) acts on its stop only when it resumes, as live mode's does: until then
            # its jobs go on, frozen. Killed meanwhile, it is stopped by the crash. A pause that begins once the
            # stop is under way holds stop()'s timeout (it waits on the instance's clock, whose timers fire at the
            # resume): the jobs are cut short at the resume, as a live process's are.
            self.stop_at_resume = scheduler
            await self.clock.gate()
            if self.stop_at_resume is None:
                return
            self.stop_at_resume = None
            await scheduler.stop(timeout=timeout_s)
        finally:
            if self.stopping:  # not crashed meanwhile
                self.stopping = False
                link.kill()  # the process exits: its connection closes (stop() leaves a client it was given open)

    async def restart(self) -> bool:
        """Start a new process, again every START_RETRY_S while it cannot reach the store. False if there is
        nothing to restart: a process is up already (two overlapping crash faults end with two restarts: one
        process), or the one starting was killed."""
        kills = self.kills
        while not self.up and self.kills == kills:
            try:
                await self.start()
            except StoreUnavailableError:
                await asyncio.sleep(START_RETRY_S)
            else:
                return True
        return False

    def pause(self) -> None:
        if not self.pauses:
            self.paused_at = self.world.now()
        self.pauses += 1
        self.clock.pause()

    def resume(self) -> None:
        self.pauses -= 1
        if not self.pauses:
            self.paused_at = None
            self.clock.resume()

    def cut_off(self, reply_lost: bool = False) -> None:
        self.partitions += 1
        if self.link is not None:
            self.link.cut(reply_lost=reply_lost)

    def slow_down(self, delay_s: float) -> None:
        self.reply_delays.append(delay_s)
        self._set_reply_delay()

    def speed_up(self, delay_s: float) -> None:
        self.reply_delays.remove(delay_s)
        self._set_reply_delay()

    def _set_reply_delay(self) -> None:
        if self.link is not None:
            self.link.reply_delay_s = max(self.reply_delays, default=0.0)

    def reconnect(self) -> None:
        self.partitions -= 1
        if not self.partitions and (self.up or self.stopping) and self.link is not None:
            self.link.heal()


class World:
    def __init__(self, scenario: Scenario, strategy: str, seed: int) -> None:
        self.scenario = scenario
        self.strategy = strategy
        self.seed = seed
        self.rng = random.Random(seed)
        self.history = History(epoch_s=EPOCH_S)
        replicated = any(fault.kind in REPLICA_FAULTS for fault in scenario.faults)
        self.store = SimStore(IDMP_VERSION if strategy == "idmp" else STORE_VERSION, replicated=replicated)
        self.instances = {spec.name: SimInstance(self, spec) for spec in scenario.instances}
        self.fault_windows: list[FaultWindow] = []

    @staticmethod
    def now() -> float:
        return asyncio.get_running_loop().time()

    def record_fault(self, fault: FaultSpec, detail: str) -> None:
        self.history.add(Event(self.now(), "fault", "nemesis", fault.kind, value=detail))

    async def run(self) -> History:
        for instance in self.instances.values():
            clock = instance.clock
            if clock.offset_ms or clock.drift:  # skew from the start is a fault too
                detail = f"instance {instance.name} clock {clock.offset_ms:+.0f} ms, drift {clock.drift:+g}"
                self.history.add(Event(self.now(), "fault", "nemesis", "skew", value=detail))
            await instance.start()
        faults = [asyncio.ensure_future(self._strike(fault)) for fault in self.scenario.faults]
        await asyncio.sleep(self.scenario.duration_s)
        for task in faults:
            task.cancel()
        for outcome in await asyncio.gather(*faults, return_exceptions=True):
            if isinstance(outcome, Exception):  # a fault that could not strike is a testbed bug: never silent
                raise outcome
        for instance in self.instances.values():  # the end: nothing after this moment is judged, or reaches the store
            if instance.link is not None:
                instance.link.kill()
        for instance in self.instances.values():
            await instance.end()
        backend: RedisBackend[Any] = RedisBackend(
            redis=self.store.connection(), strategy=self.scenario.strategy_option(self.strategy)
        )  # type: ignore[call-overload]
        with contextlib.suppress(StoreError):  # not read: P7 is unknown (a store lost for good, as in live mode)
            self.history.records = await read_records(backend, self.scenario, self.strategy, SimClock())
        return self.history

    def _target(self, fault: FaultSpec) -> SimInstance | None:
        """The instance a fault strikes; for "winner", the one whose run started first, else any that is up
        (None when every instance is down)."""
        if fault.instance != "winner":
            return self.instances[fault.instance]
        running = [i for i in self.instances.values() if i.up and i.running_jobs]
        if running:
            return min(running, key=lambda i: min(e.started for e in i.running_jobs.values()))
        return next((i for i in self.instances.values() if i.up), None)

    async def _strike(self, fault: FaultSpec) -> None:
        start = fault.at_s
        if fault.kind == "failover":
            lag_s = float(fault.settings["lag_ms"]) / 1000
            clock_ms = int(fault.settings.get("clock_ms", 0))
            await asyncio.sleep(start)
            lacked = self.store.promote(lag_s, clock_ms / 1000)
            self._redirect()
            clock = f", its clock {clock_ms:+d} ms from the old one's" if clock_ms else ""
            self.record_fault(fault, f"promoted a replica {lag_s * 1000:.0f} ms behind{clock}")
            # The window runs from the earliest write the replica lacked; the claims lost are those whose writes
            # it lacked, known by their tokens.
            since = min((entry.t for entry in lacked), default=start)
            lost = frozenset(word for entry in lacked for word in entry.words)
            self.fault_windows.append(FaultWindow(since, start, fault.kind, lost_writes=bool(lacked), lost_words=lost))
            return
        if fault.kind == "replication-hold":
            await asyncio.sleep(start)
            replication = self.store.replication
            assert replication is not None
            replication.hold(start, start + fault.duration_s)
            self.record_fault(fault, f"replication to the replica held for {fault.duration_s:g} s")
            self.fault_windows.append(FaultWindow(start, start + fault.duration_s, fault.kind))
            return
        await asyncio.sleep(start)
        if fault.kind == "store-restart":
            self.store.lose_everything()
            self._redirect()
            self.record_fault(fault, "store restarted empty")
            self.fault_windows.append(FaultWindow(start, start, fault.kind))
            return
        target = self._target(fault)
        if target is None:
            self.record_fault(fault, "no instance is up: nothing struck")
            return
        await nemesis.strike(self, fault, target)

    def fault_window(self, fault: FaultSpec, start: float, end: float, target: SimInstance) -> None:
        self.fault_windows.append(FaultWindow(start, end, fault.kind, target.name, fault=fault))

    def _redirect(self) -> None:
        """Every instance's connection now reaches the current store (Sentinel or DNS would do this)."""
        for instance in self.instances.values():
            if instance.link is not None:
                instance.link.inner = self.store.connection()
