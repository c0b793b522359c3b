"""Live mode: the scenario files against real Redis 5 / 7 / 8.6 and Valkey 9, in real time.

Every scheduler instance is an OS process (:mod:`sim.live_instance`) running the production library. Durations
are compressed by :data:`SCALE` (a job every 10 s runs every 2 s, leases of 3 s last 600 ms); the strategies of
a scenario run side by side on one server, each with its own instances and key prefix. Faults are real:

- crash: SIGKILL (and a new process on restart); stop: told on its stdin, the process runs
  `Scheduler.stop(timeout_s)` and exits (a deploy: a restart meanwhile starts the next process beside it);
  pause: SIGSTOP / SIGCONT;
- partition: each instance reaches the server through its own TCP proxy, owned here, which drops the instance's
  connections and refuses new ones while the partition lasts; slow: the proxy holds each reply back;
- clock skew, drift and late claims: the instance's clock offset and rate, changed through its stdin and kept
  by a process restarted after a crash (the drift gathered so far included);
- failover: the server has a replica; ``lag_ms`` before the failover the replica is detached (REPLICAOF NO ONE),
  so it deterministically misses what the primary acknowledges meanwhile; then the primary is killed and every
  proxy sends its instance to the former replica;
- store restart: the server is killed and started again without persistence, empty;
- run_now: sent to the instance's stdin (recorded as not made when its process is down, stopping or starting).

The history comes from the processes' JSON lines and the faults recorded here, on the machine's monotonic clock,
which every process shares; the checkers are the virtual mode's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from anarchon import RedisBackend, RunRecord, StoreError, StoreUnavailableError, SystemClock, ValkeyBackend
from anarchon._config import STRATEGY_NAMES, parse_strategy
from anarchon._job import JobOptions
from anarchon._scheduler import DEFAULT_LEASE_MS
from sim import nemesis
from sim.checkers import Judgement, judge
from sim.history import Event, Execution, History, read_records
from sim.live_instance import SkewedClock
from sim.run import Outcome
from sim.scenario import FaultSpec, JobSpec, Scenario, ScenarioError, toml_value
from sim.servers import RunningServer, start_server
from sim.world import START_RETRY_S, FaultWindow

SCALE = 0.2  # live seconds per scenario second
SETTLE_AFTER_FAULTS_S = 60  # scenario seconds judged after the last fault heals; the rest is cut
READY_TIMEOUT_S = 60
STOP_GRACE_S = 10  # past a stop fault's timeout, for the process to hand its runs back and exit
REPO = Path(__file__).resolve().parent.parent


VIRTUAL_ONLY = ("replication-hold",)


def scaled(scenario: Scenario, factor: float = SCALE) -> Scenario:
    """The scenario in live time: every duration, offset and period multiplied by ``factor``, the library's
    defaults of the time options it leaves unset included (lease_ms, max_late_ms, window_ms, duration_sec, …),
    and the run cut ``SETTLE_AFTER_FAULTS_S`` scenario seconds after the last fault heals. The library's own
    constants (retry delays, stop grace) stay as they are: live runs wait for a store that answers no more than
    a production instance would."""
    for spec in scenario.faults:
        if spec.kind in VIRTUAL_ONLY:
            raise ScenarioError(f"{scenario.name}: {spec.kind} is a fault of the virtual mode's replication log only")
        if spec.settings.get("clock_ms"):  # libfaketime under redis-server never accepted connections
            raise ScenarioError(f"{scenario.name}: a failover's clock_ms is for the virtual mode only")
    last_fault = max((f.at_s + min(f.duration_s, scenario.duration_s) for f in scenario.faults), default=0.0)
    duration = min(scenario.duration_s, last_fault + SETTLE_AFTER_FAULTS_S)

    def ms(value: Any) -> int:
        return round(float(value) * factor)

    def job(spec: JobSpec) -> JobSpec:
        match = re.fullmatch(r"\*/(\d+) \* \* \* \* \*", spec.cron)
        period = int(match.group(1)) * factor if match else 0
        # */N fires every N seconds only where N divides 60 (*/25 fires at :00, :25 and :50): before and after.
        if not match or period != int(period) or period < 1 or 60 % int(match.group(1)) or 60 % int(period):
            raise ScenarioError(f"{scenario.name}: live mode scales crons like '*/10 * * * * *' to whole seconds; "
                                f"{spec.cron!r} does not scale by {factor}")  # fmt: skip
        options = {
            k: ms(v) if k.endswith("_ms") else v for k, v in {**_time_defaults(JobOptions()), **spec.options}.items()
        }
        return replace(spec, cron=f"*/{int(period)} * * * * *", work_s=spec.work_s * factor, options=options)

    def fault(spec: FaultSpec) -> FaultSpec:
        settings = {
            k: ms(v) if k.endswith("_ms") else float(v) * factor if k.endswith("_s") else v
            for k, v in spec.settings.items()
        }
        return replace(spec, at_s=spec.at_s * factor, settings=settings)

    strategies = {
        name: {
            k: max(1, round(v * factor)) if k.endswith(("_ms", "_sec")) else v
            for k, v in {
                **_time_defaults(parse_strategy(name, STRATEGY_NAMES, "")),
                **scenario.strategies.get(name, {}),
            }.items()
        }
        for name in STRATEGY_NAMES
    }
    scheduler = {"lease_ms": DEFAULT_LEASE_MS, **scenario.scheduler}
    return replace(
        scenario,
        duration_s=duration * factor,
        instances=tuple(replace(i, offset_ms=ms(i.offset_ms)) for i in scenario.instances),
        jobs=tuple(job(j) for j in scenario.jobs),
        faults=tuple(fault(f) for f in scenario.faults),
        scheduler={k: ms(v) if k.endswith("_ms") else v for k, v in scheduler.items()},
        strategies=strategies,
    )


class Proxy:
    """A TCP proxy between one instance and the server: it can cut the instance off, hold the server's replies back
    (a slow network, a busy server), or send the instance elsewhere."""

    def __init__(self, host: str, port: int) -> None:
        self.upstream = (host, port)
        self.cuts = 0  # partitions in force: overlapping ones end when the last does
        self.replies_to_lose = 0  # of those, the ones that begin when the next reply comes (and is lost)
        self.refused = 0  # connections refused while cut off
        self.reply_delays: list[float] = []  # slow faults in force: each reply is held back the longest of them
        self._pairs: set[tuple[asyncio.StreamWriter, ...]] = set()
        self._server: asyncio.Server | None = None

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def cut_off(self) -> bool:
        return self.cuts > self.replies_to_lose

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        pair: tuple[asyncio.StreamWriter, ...] = (writer,)
        try:  # every way out closes what is open: refused, upstream down, or cancelled as the run's loop ends
            if self.cut_off:
                self.refused += 1
                return
            with contextlib.suppress(OSError):
                upstream = self.upstream
                up_reader, up_writer = await asyncio.open_connection(*upstream)
                pair = (writer, up_writer)
                if self.cut_off or self.upstream != upstream:  # cut off or redirected while it connected
                    self.refused += self.cut_off
                    return
                self._pairs.add(pair)
                replies = _pump(up_reader, writer, self._reply_lost, lambda: max(self.reply_delays, default=0.0))
                await asyncio.gather(_pump(reader, up_writer), replies)
        finally:
            self._pairs.discard(pair)
            for side in pair:
                side.transport.abort()

    def drop(self) -> None:
        for pair in list(self._pairs):
            for side in pair:
                side.transport.abort()

    def cut(self, *, reply_lost: bool = False) -> None:
        """Cut the instance off; with ``reply_lost``, once the server's next reply reaches the proxy, which drops
        it: the command it answers ran (a cut while a command is on its way)."""
        self.cuts += 1
        if reply_lost and self.cuts == 1:
            self.replies_to_lose += 1
        else:
            self.drop()

    def _reply_lost(self) -> bool:
        """Whether the reply that just came is to be lost: then the cut it waited for begins."""
        if not self.replies_to_lose:
            return False
        self.replies_to_lose -= 1
        self.drop()
        return True

    def heal(self) -> None:
        self.cuts -= 1
        self.replies_to_lose = min(self.replies_to_lose, self.cuts)  # a cut whose reply never came ends too

    def redirect(self, host: str, port: int) -> None:
        self.upstream = (host, port)
        self.drop()

    async def close(self) -> None:
        self.drop()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


async def _pump(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    lost: Callable[[], bool] = lambda: False,
    delay_s: Callable[[], float] = lambda: 0.0,
) -> None:
    """Pass what ``reader`` reads on to ``writer``, unless ``lost()`` says to drop it (and the link with it), each
    piece ``delay_s()`` after it came, in order: what came while a delay was in force keeps it."""
    loop = asyncio.get_running_loop()
    held: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()  # None: the reader's end

    async def deliver() -> None:
        with contextlib.suppress(OSError):
            while (item := await held.get()) is not None:
                due, data = item
                await asyncio.sleep(max(0.0, due - loop.time()))
                writer.write(data)
                await writer.drain()

    delivering = asyncio.ensure_future(deliver())
    try:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while data := await reader.read(65536):
                if lost():
                    break
                held.put_nowait((loop.time() + delay_s(), data))
            else:  # the other side closed: what is held back still arrives first
                held.put_nowait(None)
                await delivering
    finally:
        delivering.cancel()
        writer.transport.abort()


@dataclass
class Instance:
    """One instance of one strategy's group: its proxy, its processes, its log."""

    name: str
    strategy: str
    proxy: Proxy
    log: Path
    config: dict[str, Any]
    clock: SkewedClock  # the run's copy of the instance's clocks, which its processes take on
    process: asyncio.subprocess.Process | None = None  # the current one, starting or up
    # Processes told to stop, still exiting. A restart meanwhile starts the next process beside them, as a
    # supervisor does in a deploy (and as in virtual mode); they still take clock changes and pauses.
    leaving: list[asyncio.subprocess.Process] = field(default_factory=list)
    # Each process of the instance has its number, the incarnation (1, 2, … in the order they were started), which
    # its start records carry: a kill ends the executions of the process it killed, however many run at once.
    incarnation: dict[asyncio.subprocess.Process, int] = field(default_factory=dict)
    killed_at: list[tuple[int, float]] = field(default_factory=list)  # (incarnation, monotonic time)
    killed_at_end: set[int] = field(default_factory=set)  # incarnations the run's end killed, not a fault
    crashes: int = 0  # crash faults struck: a restart under way gives up once its process is killed
    # Pauses in force. They strike the instance, not one process of it: a process restarted within one starts
    # paused. (Partitions live in the proxy, which a restarted process connects through.)
    pauses: int = 0
    paused_at: float | None = None  # monotonic time the pauses in force began
    # Held while a process of it is being started: restarts of overlapping faults take turns, each finding
    # what the one before it left (a process up, or killed while it started).
    starting: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def stderr_log(self) -> Path:
        """Where its processes' stderr goes, beside the log of their records."""
        return self.log.with_suffix(".stderr")

    async def spawn(self, *, held: bool = False) -> None:
        """Start a process of the instance; ``held``: one of the run's first, whose scheduler starts when told."""
        clock = self.clock.state()
        number = len(self.incarnation) + 1
        self.config["clock"], self.config["incarnation"], self.config["held"] = clock, number, held
        stderr = await asyncio.to_thread(open, self.stderr_log, "ab")
        with stderr:
            self.process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "sim.live_instance", "--config", json.dumps(self.config),
                cwd=REPO, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=stderr,
                env={**os.environ, "PYTHONHASHSEED": "0"},
            )  # fmt: skip
        self.incarnation[self.process] = number
        if self.clock.state() != clock:  # a fault changed it while the process was starting, with none to tell
            await _tell(self.process, self._clock_line())

    async def ready(self, word: bytes = b"ready") -> bool:
        """Wait until the process says it has started (``word``: ``held``, set up and waiting to be told to start);
        False if it exited first (killed, or it could not reach the store). Time it spends paused does not count
        towards READY_TIMEOUT_S."""
        assert self.process is not None
        assert self.process.stdout is not None
        said = asyncio.ensure_future(self.process.stdout.readline())
        waited = 0.0
        try:
            while not (await asyncio.wait([said], timeout=1.0))[0]:
                waited += 0.0 if self.pauses else 1.0
                if waited >= READY_TIMEOUT_S:
                    raise RuntimeError(f"instance {self.strategy}/{self.name} did not start in {READY_TIMEOUT_S} s")
        finally:
            said.cancel()
        line = said.result()
        if line and line.strip() != word:
            raise RuntimeError(f"instance {self.strategy}/{self.name} did not start: {line!r}")
        return bool(line)

    async def restart(self) -> bool:
        """Start a new process: paused if a pause is in force; again every START_RETRY_S (scaled) while it exits
        because its proxy refused it the store. False if there is nothing to restart: a process is up already
        (two overlapping crashes end with one process), or the one starting was killed."""
        async with self.starting:
            return await self._restart()

    async def _restart(self) -> bool:
        crashes = self.crashes
        while self.process is None and self.crashes == crashes:
            refused = self.proxy.refused
            await self.spawn()
            starting = self.process
            assert starting is not None
            if self.pauses:
                self.signal(signal.SIGSTOP)
            started = await self.ready()
            if self.process is not starting:  # killed or told to stop as it started: down, as that fault left it
                return False
            if started:
                return True
            self.process = None
            await starting.wait()
            if self.proxy.refused == refused:
                said = self.stderr_log.read_text(errors="replace").strip().splitlines()[-20:]
                raise RuntimeError(  # its stderr quoted: the run's directory goes with the run
                    f"instance {self.strategy}/{self.name} exited as it started (status {starting.returncode}); "
                    "its stderr ends:\n" + "\n".join(said)
                )
            await asyncio.sleep(START_RETRY_S * SCALE)
        return False

    def pause(self) -> None:
        if not self.pauses:
            self.paused_at = time.monotonic()
        self.pauses += 1
        self.signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.pauses -= 1
        if not self.pauses:
            self.paused_at = None
            self.signal(signal.SIGCONT)

    def signal(self, number: signal.Signals) -> None:
        for process in self._processes():
            with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
                process.send_signal(number)

    def _processes(self) -> list[asyncio.subprocess.Process]:
        return [*self.leaving, *([self.process] if self.process is not None else [])]

    @property
    def label(self) -> str:
        return f"{self.strategy} instance {self.name}"

    @property
    def alive(self) -> bool:
        return bool(self._processes())

    @property
    def up(self) -> bool:
        return self.process is not None

    def cut_off(self, reply_lost: bool = False) -> None:
        self.proxy.cut(reply_lost=reply_lost)

    def reconnect(self) -> None:
        self.proxy.heal()

    def slow_down(self, delay_s: float) -> None:
        self.proxy.reply_delays.append(delay_s)

    def speed_up(self, delay_s: float) -> None:
        self.proxy.reply_delays.remove(delay_s)

    async def clock_changed(self) -> None:
        for process in self._processes():
            await _tell(process, self._clock_line())

    def _clock_line(self) -> str:
        return f"clock {json.dumps(self.clock.state())}"

    def cannot_run_now(self) -> str | None:
        if self.starting.locked():  # a restart is under way (its process may not exist yet)
            return "starting"
        return "down" if self.process is None else None

    async def run_now(self, job: str) -> str | None:
        """Told on its stdin; the claim's failure, if any, is in the process's own records."""
        if self.process is not None:
            await _tell(self.process, f"run_now {job}")
        return None

    async def crash(self) -> None:
        """SIGKILL the current process; with none, the ones still stopping (as in virtual mode)."""
        self.crashes += 1
        if self.process is not None:
            process, self.process = self.process, None
            await self._kill(process, self._jobs_stop_at())
            return
        for process in list(self.leaving):
            await self._kill(process, self._jobs_stop_at())

    async def kill_all(self) -> None:
        """The end of the run: every process of the instance is killed, its jobs counted as going on until now,
        paused or not (a zombie still paused at the end has not stopped its job; see the virtual world's end)."""
        for process in self._processes():
            if process.returncode is None:
                self.killed_at_end.add(self.incarnation[process])
            await self._kill(process, time.monotonic())
        self.process, self.leaving = None, []

    def _jobs_stop_at(self) -> float:
        """When a kill now stops the jobs: now, or when the pause it comes in began."""
        return time.monotonic() if self.paused_at is None else self.paused_at

    async def _kill(self, process: asyncio.subprocess.Process, stopped_at: float) -> None:
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):  # it exited a moment ago
                process.kill()  # a paused (stopped) process too, without running a moment first
            self.killed_at.append((self.incarnation[process], stopped_at))
        await process.wait()

    async def stop(self, timeout_s: float) -> None:
        """A graceful stop, as a deploy does: the process runs ``Scheduler.stop(timeout_s)`` and exits. One that
        has not exited well after that bound (paused meanwhile) is killed."""
        process = self.process
        if process is None:
            return
        self.process = None
        self.leaving.append(process)
        await _tell(process, f"stop {timeout_s}")
        try:
            await asyncio.wait_for(process.wait(), timeout_s + STOP_GRACE_S)
        except TimeoutError:
            await self._kill(process, self._jobs_stop_at())
        # Not when cancelled (the run ends): kill_all finds it then.
        self.leaving = [other for other in self.leaving if other is not process]


async def _tell(process: asyncio.subprocess.Process, line: str) -> None:
    if process.stdin is not None and process.returncode is None:
        process.stdin.write((line + "\n").encode())
        with contextlib.suppress(ConnectionError):
            await process.stdin.drain()


class LiveRun:
    def __init__(self, scenario: Scenario, server: RunningServer, strategies: list[str], workdir: Path) -> None:
        self.scenario = scenario
        self.server = server
        self.strategies = strategies
        self.workdir = workdir
        self.groups: dict[str, list[Instance]] = {}
        self.windows: dict[str, list[FaultWindow]] = {s: [] for s in strategies}
        self.faults: list[Event] = []
        self.t0 = 0.0

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def setup(self, scenario_path: Path) -> None:
        for strategy in self.strategies:
            group = []
            for spec in self.scenario.instances:
                proxy = Proxy(self.server.host, self.server.port)
                port = await proxy.start()
                log = self.workdir / f"{strategy}-{spec.name}.jsonl"
                config = {
                    "scenario": str(scenario_path), "strategy": strategy, "instance": spec.name, "log": str(log),
                    "prefix": f"{strategy}:", "valkey": self.server.is_valkey,
                    "url": f"redis://127.0.0.1:{port}/0?socket_timeout=2&socket_connect_timeout=2",
                }  # fmt: skip
                clock = SkewedClock(float(spec.offset_ms), spec.drift)
                group.append(Instance(spec.name, strategy, proxy, log, config, clock))
            self.groups[strategy] = group
        everyone = [i for group in self.groups.values() for i in group]
        for instance in everyone:
            await instance.spawn(held=True)  # its scheduler starts at the scenario's time 0 (see run)
        await self._all_say(b"held")

    async def _all_say(self, word: bytes) -> None:
        everyone = [i for group in self.groups.values() for i in group]
        for instance, said in zip(everyone, await asyncio.gather(*(i.ready(word) for i in everyone)), strict=True):
            if not said:
                raise RuntimeError(f"instance {instance.strategy}/{instance.name} exited as it started")

    async def run(self) -> float:
        """Run the scenario from the next wall-clock moment aligned like the simulator's start (slots of every
        job at the same offsets from it as in virtual time); return that moment (epoch seconds)."""
        grid = 60 * SCALE
        epoch_s = (time.time() // grid + 1) * grid
        await asyncio.sleep(epoch_s - time.time())
        self.t0 = time.monotonic() - (time.time() - epoch_s)
        for group in self.groups.values():  # every scheduler starts now, as each instance does in virtual time
            for instance in group:
                assert instance.process is not None
                await _tell(instance.process, "start")
        for spec in self.scenario.instances:
            if spec.offset_ms or spec.drift:  # skew from the start is a fault too, as in the virtual mode
                detail = f"instance {spec.name} clock {spec.offset_ms:+.0f} ms, drift {spec.drift:+g}"
                self.faults.append(Event(0.0, "fault", "nemesis", "skew", value=detail))
        # Faults strike once every scheduler has started, as in virtual time: one at time 0 would otherwise meet a
        # process still connecting (its start refused by a partition, or held by a pause past the run's end).
        await self._all_say(b"ready")
        strikes = [asyncio.ensure_future(self._strike(f)) for f in self.scenario.faults]
        try:
            await asyncio.sleep(self.scenario.duration_s - self.now())
        finally:  # also when the run is cancelled: no restart may start a process after the end's kill_all
            for task in strikes:
                task.cancel()
        for outcome in await asyncio.gather(*strikes, return_exceptions=True):
            if isinstance(outcome, Exception):  # a fault that could not strike: never silent
                raise outcome
        for group in self.groups.values():
            for instance in group:
                await instance.kill_all()  # the end: nothing after this moment is judged
        return epoch_s

    def record_fault(self, fault: FaultSpec, detail: str) -> None:
        self.faults.append(Event(self.now(), "fault", "nemesis", fault.kind, value=detail))

    def fault_window(self, fault: FaultSpec, start: float, end: float, target: Instance | None = None) -> None:
        """The window in which ``fault`` counts: for ``target``'s strategy, or for every strategy (a store fault)."""
        if target is None:
            for strategy in self.strategies:
                self.windows[strategy].append(FaultWindow(start, end, fault.kind))
            return
        self.windows[target.strategy].append(FaultWindow(start, end, fault.kind, target.name, fault=fault))

    def _targets(self, fault: FaultSpec) -> list[Instance | None]:
        """The fault's instance in every strategy's group. "winner", as in virtual mode: of the instances up, the
        one whose running job started first, else the first one up (None when every instance is down)."""
        chosen: list[Instance | None] = []
        for group in self.groups.values():
            if fault.instance != "winner":
                chosen.append(next(i for i in group if i.name == fault.instance))
                continue
            up = [i for i in group if i.up]
            running = [(start, i) for i in up for start in _running_since(i.log, i.killed_at)]
            chosen.append(min(running, key=lambda pair: pair[0])[1] if running else next(iter(up), None))
        return chosen

    async def _strike(self, fault: FaultSpec) -> None:
        if fault.kind == "failover":
            lag_s = float(fault.settings["lag_ms"]) / 1000
            await asyncio.sleep(max(0.0, fault.at_s - lag_s - self.now()))
            replica = self.server.replica
            assert replica is not None, "a failover scenario needs a server with a replica"
            detached = self.now()
            # Every write the primary acknowledged before ``detached`` reaches the replica before it is detached:
            # they precede this one in the replication stream, and WAIT returns once the replica has it.
            primary = self.server.async_client()
            try:
                await primary.set("anarchon-sim:detached", detached)
                if await primary.wait(1, 5000) < 1:
                    raise RuntimeError("the replica did not acknowledge the primary's writes within 5 s")
            finally:
                await primary.aclose()
            with contextlib.closing(replica.client()) as client:
                client.replicaof("NO", "ONE")  # from now on it misses the primary's writes
            await asyncio.sleep(max(0.0, fault.at_s - self.now()))
            self.server.kill()
            for group in self.groups.values():
                for instance in group:
                    instance.proxy.redirect(replica.host, replica.port)
            self.record_fault(fault, f"primary killed; the replica, detached {lag_s * 1000:.0f} ms before, took over")
            self.fault_window(fault, detached, self.now())
            return
        await asyncio.sleep(max(0.0, fault.at_s - self.now()))
        if fault.kind == "store-restart":
            # Killed, not stopped: a server told to shut down answers on until its next cron tick (up to 100 ms),
            # late enough for a claim meant for the empty store to reach the old one.
            await asyncio.to_thread(self.server.kill)
            down = self.now()  # everything it acknowledged is lost
            await asyncio.to_thread(self.server.restart)
            self.record_fault(fault, "store restarted empty")
            self.fault_window(fault, down, self.now())
            return
        await asyncio.gather(*(self._strike_instance(fault, target) for target in self._targets(fault)))

    async def _strike_instance(self, fault: FaultSpec, target: Instance | None) -> None:
        if target is None:
            self.record_fault(fault, "no instance is up: nothing struck")
            return
        await nemesis.strike(self, fault, target)

    def history(self, strategy: str, epoch_s: float) -> History:
        history = History(epoch_s=epoch_s)
        history.events.extend(self.faults)
        for instance in self.groups[strategy]:
            killed = {incarnation: t - self.t0 for incarnation, t in instance.killed_at}
            by_token: dict[str, tuple[Execution, int]] = {}
            for record in _read(instance.log):
                if "event" in record:
                    history.events.append(Event(**{**record["event"], "t": record["event"]["t"] - self.t0}))
                elif "start" in record:
                    s = record["start"]
                    execution = Execution(s["instance"], s["job"], s["slot"], s["run"], s["attempt"],
                                          s["fence"], s["token"], s["manual"], s["t"] - self.t0)  # fmt: skip
                    by_token[s["token"]] = execution, s["incarnation"]
                    history.executions.append(execution)
                elif "end" in record and record["end"]["token"] in by_token:
                    execution, _ = by_token[record["end"]["token"]]
                    execution.ended = record["end"]["t"] - self.t0
                    execution.completed = record["end"]["completed"]
            for execution, incarnation in by_token.values():
                if execution.ended is None:  # its process was killed (two may run at once: see Instance.leaving)
                    execution.ended = killed.get(incarnation, self.scenario.duration_s)
                    execution.killed = True
                    execution.cut_by_end = incarnation in instance.killed_at_end
        history.events.sort(key=lambda e: e.t)
        history.executions.sort(key=lambda e: e.started)
        return history


def _read(path: Path) -> Iterator[dict[str, Any]]:
    if not path.exists():
        return
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):  # a line cut short by SIGKILL
            yield json.loads(line)


def _running_since(path: Path, killed_at: Sequence[tuple[int, float]] = ()) -> list[float]:
    """When the jobs running now started: those started and not ended by a process not killed since (a killed
    process writes no end to the jobs it was running)."""
    killed = {incarnation for incarnation, _ in killed_at}
    started: dict[str, tuple[float, int]] = {}
    for record in _read(path):
        if "start" in record:
            started[record["start"]["token"]] = record["start"]["t"], record["start"]["incarnation"]
        elif "end" in record:
            started.pop(record["end"]["token"], None)
    return [t for t, incarnation in started.values() if incarnation not in killed]


def _time_defaults(options: Any) -> dict[str, int]:
    """The time settings of a library options dataclass (a job's, a strategy's), at their defaults."""
    return {f.name: getattr(options, f.name) for f in fields(options) if f.name.endswith(("_ms", "_sec"))}


def has_idmp(valkey: bool, version: Sequence[int]) -> bool:
    """Whether a server has XADD IDMP (Redis 8.6 and later)."""
    return not valkey and tuple(version[:2]) >= (8, 6)


def supported(strategy: str, server: RunningServer) -> bool:
    return strategy != "idmp" or has_idmp(server.is_valkey, server.version_info)


async def run_live(scenario: Scenario, target: str, strategies: list[str]) -> dict[str, Outcome]:
    """Run ``scenario`` (unscaled) on a fresh server of ``target`` with each strategy side by side; judge each."""
    live = scaled(scenario)
    uses_failover = any(f.kind == "failover" for f in live.faults)
    with tempfile.TemporaryDirectory(prefix="anarchon-live-") as directory:
        workdir = Path(directory)
        scenario_path = workdir / "scenario.toml"
        scenario_path.write_text(_toml(live))
        with start_server(target, replica=uses_failover) as server:
            chosen = [s for s in strategies if supported(s, server)]
            run = LiveRun(live, server, chosen, workdir)
            try:
                await run.setup(scenario_path)
                epoch_s = await run.run()
            finally:
                for group in run.groups.values():
                    for instance in group:
                        await instance.kill_all()
                        await instance.proxy.close()
            # The store the instances last used: the replica once a failover promoted it.
            store = server.replica if any(w.kind == "failover" for w in run.windows[chosen[0]]) else server
            outcomes = {}
            for strategy in chosen:
                history = run.history(strategy, epoch_s)
                with contextlib.suppress(StoreError):  # not read: P7 is unknown
                    history.records = await _records(live, strategy, store)
                judgement = judge_live(live, strategy, history, run.windows[strategy])
                outcomes[strategy] = Outcome(
                    live, strategy, 0, history, judgement, run.windows[strategy], target, server.version
                )
            return outcomes


async def _records(scenario: Scenario, strategy: str, store: RunningServer | None) -> list[RunRecord]:
    """What ``Scheduler.history`` tells of each job of ``strategy``'s instances at the end of the run."""
    if store is None:
        raise StoreUnavailableError("the failover left no replica to read the records from")
    options: dict[str, Any] = {"strategy": scenario.strategy_option(strategy), "prefix": f"{strategy}:"}
    backend: RedisBackend[Any] = (
        ValkeyBackend(valkey=store.url(), **options) if store.is_valkey else RedisBackend(redis=store.url(), **options)
    )
    return await read_records(backend, scenario, strategy, SystemClock())


def judge_live(live: Scenario, strategy: str, history: History, windows: list[FaultWindow]) -> Judgement:
    """The checkers on a live run of the compressed scenario ``live``: their margins compressed with it."""
    return judge(live, strategy, history, windows, slack_s=5 * SCALE, late_margin_s=1.0 * SCALE)


def _toml(scenario: Scenario) -> str:
    """A scenario as a TOML file, for the instance processes to load."""
    lines = [f"name = {toml_value(scenario.name)}", f"duration_s = {scenario.duration_s}", "", "[scheduler]"]
    lines += [f"{k} = {toml_value(v)}" for k, v in scenario.scheduler.items()]
    for name, settings in scenario.strategies.items():
        lines += ["", f'[strategies."{name}"]', *[f"{k} = {toml_value(v)}" for k, v in settings.items()]]
    for instance in scenario.instances:
        lines += ["", "[[instances]]", f"name = {toml_value(instance.name)}", f"offset_ms = {instance.offset_ms}"]
    for job in scenario.jobs:
        lines += ["", "[[jobs]]", f"name = {toml_value(job.name)}", f"cron = {toml_value(job.cron)}",
                  f"work_s = {job.work_s}", *[f"{k} = {toml_value(v)}" for k, v in job.options.items()]]  # fmt: skip
    return "\n".join(lines) + "\n"
