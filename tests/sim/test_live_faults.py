"""Live mode strikes faults as virtual mode does: the same scenario, the same faults. Processes are stand-ins
here, servers real where a fault strikes the store; the live matrix (scenarios/test_live.py) runs the real
processes."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import pytest
import redis

from sim import live
from sim.live import Instance, LiveRun, Proxy
from sim.live_instance import SkewedClock
from sim.scenario import FaultSpec, ScenarioError, parse
from sim.servers import start_server

SCENARIO = parse({
    "name": "live-faults", "duration_s": 1.0, "instances": [{"name": "a"}, {"name": "b"}, {"name": "c"}],
    "jobs": [{"name": "tick", "cron": "*/2 * * * * *", "work_s": 0.1}],
})  # fmt: skip


class StandInProcess:
    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self.stdin = None  # what it is told goes nowhere
        self.signals: list[int] = []  # never a real signal: the pid is no real process of ours

    def kill(self) -> None:
        self.returncode = -9

    def send_signal(self, number: int) -> None:
        self.signals.append(number)

    async def wait(self) -> int | None:
        return self.returncode


class StandIn(Instance):
    """An instance whose processes are stand-ins that start at once."""

    spawned = 0

    async def spawn(self) -> None:
        StandIn.spawned += 1
        self.adopt(StandInProcess(StandIn.spawned))

    def adopt(self, process: StandInProcess) -> None:
        """``process`` becomes the instance's current one, numbered as spawn numbers it."""
        self.process = cast(Any, process)
        self.incarnation[self.process] = len(self.incarnation) + 1

    async def ready(self) -> bool:
        return True


class SlowStandIn(StandIn):
    """An instance whose processes take 0.2 s to say whether they started (no, if killed meanwhile)."""

    async def ready(self) -> bool:
        process = self.process
        await asyncio.sleep(0.2)
        return process is not None and process.returncode is None


def _run(tmp_path: Path, up: str = "abc", kind: type[StandIn] = StandIn) -> tuple[LiveRun, dict[str, StandIn]]:
    run = LiveRun(SCENARIO, server=cast(Any, None), strategies=["lease"], workdir=tmp_path)
    instances = {}
    for name in "abc":
        instance = kind(name, "lease", Proxy("127.0.0.1", 1), tmp_path / f"{name}.jsonl", {}, SkewedClock())
        instance.log.write_text("")
        if name in up:
            instance.adopt(StandInProcess(0))
        instances[name] = instance
    run.groups["lease"] = list(instances.values())
    run.t0 = time.monotonic()
    return run, instances


def _strike(run: LiveRun, *faults: FaultSpec) -> None:
    """Play the faults together, each from its moment, as a live run does."""

    async def together() -> None:
        await asyncio.gather(*(run._strike(fault) for fault in faults))

    asyncio.run(together())


def _log(instance: Instance, *records: dict[str, Any]) -> None:
    with instance.log.open("a") as log:
        for record in records:
            log.write(json.dumps(record) + "\n")


def _started(token: str, t: float, incarnation: int = 1, instance: str = "a") -> dict[str, Any]:
    start = {"instance": instance, "job": "tick", "slot": 0, "run": "0", "attempt": 1, "fence": 1, "manual": False}
    return {"start": {**start, "token": token, "incarnation": incarnation, "t": t}}


def test_the_winner_is_the_instance_up_whose_running_job_started_first(tmp_path: Path) -> None:
    run, instances = _run(tmp_path)
    winner = FaultSpec(0.5, "pause", {"instance": "winner", "duration_s": 1})
    # a started a job, was killed without writing its end, and came back idle; b runs one since after that.
    now = time.monotonic()
    _log(instances["a"], _started("A1", now - 10))
    instances["a"].killed_at.append((1, now - 9))
    _log(instances["b"], _started("B1", now - 5, instance="b"))
    assert run._targets(winner) == [instances["b"]]
    _log(instances["b"], {"end": {"token": "B1", "t": now - 1, "completed": True}})
    instances["a"].process = None
    assert run._targets(winner) == [instances["b"]]  # nobody runs a job: the first one up
    for instance in instances.values():
        instance.process = None
    assert run._targets(winner) == [None]


def test_an_execution_cut_short_ends_when_its_own_process_was_killed(tmp_path: Path) -> None:
    """Two processes of one instance run jobs at once (the old one stopping, the next one started): each
    execution they leave without an end ended when its own process was killed, not at another's kill."""
    run, instances = _run(tmp_path)
    a = instances["a"]
    t0 = run.t0
    _log(a, _started("OLD", t0 + 0.1, incarnation=1), _started("NEW", t0 + 0.2, incarnation=2))
    a.killed_at.extend([(2, t0 + 0.5), (1, t0 + 0.8)])  # the new one crashed first; the old one's grace ran out
    ended = {e.token: round(e.ended or 0, 3) for e in run.history("lease", epoch_s=0).executions}
    assert ended == {"OLD": 0.8, "NEW": 0.5}


def test_an_execution_of_a_process_killed_while_paused_ended_when_the_pause_began(tmp_path: Path) -> None:
    """SIGSTOP, then SIGKILL: the job did nothing after the pause began, and a backup that took its run over
    meanwhile did not run beside it."""
    run, instances = _run(tmp_path, up="a")
    a = instances["a"]
    _log(a, _started("A1", run.t0 + 0.1))
    before = time.monotonic()
    a.pause()
    after = time.monotonic()
    time.sleep(0.3)
    asyncio.run(a.crash())
    [execution] = run.history("lease", epoch_s=0).executions
    assert execution.ended is not None
    assert before - run.t0 <= execution.ended <= after - run.t0  # as the pause began, not at the kill
    assert not execution.cut_by_end


def test_an_execution_of_a_process_still_paused_when_the_run_ends_went_on_until_the_end(tmp_path: Path) -> None:
    """The end of the run is no crash: a zombie still paused then had not stopped its job (it believes it holds
    its lease beside the backup that took its run over), and its execution must overlap the backup's."""
    run, instances = _run(tmp_path, up="a")
    a = instances["a"]
    _log(a, _started("A1", run.t0 + 0.1))
    a.pause()
    time.sleep(0.3)
    before = time.monotonic()
    asyncio.run(a.kill_all())
    after = time.monotonic()
    [execution] = run.history("lease", epoch_s=0).executions
    assert execution.ended is not None
    assert before - run.t0 <= execution.ended <= after - run.t0  # at the end, not as the pause began
    assert execution.cut_by_end  # not stopped: P2 cannot call it missed, nor the margins measure its end


def test_a_crash_of_an_instance_down_already_strikes_nothing_and_restarts_nothing(tmp_path: Path) -> None:
    run, _ = _run(tmp_path)
    first = FaultSpec(0.0, "crash", {"instance": "a", "restart_after_s": 0.3})
    again = FaultSpec(0.1, "crash", {"instance": "a", "restart_after_s": 0.05})
    _strike(run, first, again)
    assert [event.value for event in run.faults] == [
        "lease instance a killed",
        "lease instance a is down already: nothing struck",
        "lease instance a restarted",
    ]
    assert run.faults[-1].t >= 0.3  # when the first crash says, not the second
    # The first crash's window, and its extension to the moment the restarted process was up.
    assert {(w.kind, w.instance) for w in run.windows["lease"]} == {("crash", "a")}
    assert run.windows["lease"][0].start < run.faults[1].t  # from the first crash, not the second


def test_a_crash_that_kills_a_process_as_it_starts_restarts_the_instance_itself(tmp_path: Path) -> None:
    """The second crash kills the process the first crash's restart is starting; the first restart gives up, and
    the second starts a process once it has (as in virtual mode, where each restart keeps trying)."""
    run, instances = _run(tmp_path, kind=SlowStandIn)
    first = FaultSpec(0.0, "crash", {"instance": "a", "restart_after_s": 0.1})  # starting from 0.1 s to 0.3 s
    second = FaultSpec(0.2, "crash", {"instance": "a", "restart_after_s": 0.05})
    _strike(run, first, second)
    assert [event.value for event in run.faults] == [
        "lease instance a killed",
        "lease instance a killed",
        "lease instance a restarted",
    ]
    assert run.faults[-1].t >= 0.3 + 0.2  # once the first restart gave up, its own start took 0.2 s
    assert instances["a"].process is not None
    assert len(instances["a"].killed_at) == 2


class LingeringProcess(StandInProcess):
    """A process that is slow to stop: it exits only when killed."""

    def __init__(self, pid: int) -> None:
        super().__init__(pid)
        self.exited = asyncio.Event()

    def kill(self) -> None:
        super().kill()
        self.exited.set()

    async def wait(self) -> int | None:
        await self.exited.wait()
        return self.returncode


async def _stopping_beside_a_restart(
    tmp_path: Path, stop_timeout_s: float
) -> tuple[StandIn, LingeringProcess, asyncio.Future[None]]:
    """Instance a with a process told to stop (it lingers until killed), and the restart due meanwhile."""
    _, instances = _run(tmp_path, up="")
    a = instances["a"]
    old = LingeringProcess(100)
    a.adopt(old)
    stopping = asyncio.ensure_future(a.stop(stop_timeout_s))
    await asyncio.sleep(0.05)
    assert a.alive
    assert not a.up
    assert a.cannot_run_now() == "down"
    assert await a.restart()
    assert a.process is not old
    assert a.up
    return a, old, stopping


async def test_a_restart_while_a_process_stops_starts_the_next_one_beside_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As in virtual mode, a process that is stopping is not up: a restart due meanwhile (a crash's) starts the
    next process at once, and the end of the stop, here a kill once its grace ran out, leaves that one alone."""
    monkeypatch.setattr(live, "STOP_GRACE_S", 0.2)
    a, old, stopping = await _stopping_beside_a_restart(tmp_path, 0.0)
    new = cast(StandInProcess, a.process)
    await stopping
    assert (old.returncode, new.returncode) == (-9, None)
    assert a.process is new
    assert a.leaving == []
    assert [incarnation for incarnation, _ in a.killed_at] == [1]  # the old one


async def test_a_process_still_stopping_when_the_run_ends_is_killed_with_the_others(tmp_path: Path) -> None:
    """The run's end cancels the stop that waits for it; the old process must not live on beside the new one's
    end, writing records into the log that the history reads."""
    a, old, stopping = await _stopping_beside_a_restart(tmp_path, 5.0)
    new = cast(StandInProcess, a.process)
    stopping.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await stopping
    await a.kill_all()
    assert (old.returncode, new.returncode) == (-9, -9)
    assert not a.alive


async def test_a_crash_strikes_the_new_process_and_leaves_the_stopping_one_to_its_stop(tmp_path: Path) -> None:
    """As in virtual mode, a crash kills the instance's current process; with none up, the one still stopping."""
    a, old, stopping = await _stopping_beside_a_restart(tmp_path, 5.0)
    new = cast(StandInProcess, a.process)
    await a.crash()
    assert (old.returncode, new.returncode) == (None, -9)
    assert a.alive  # the old one is still stopping
    assert not a.up
    await a.crash()
    assert old.returncode == -9
    await stopping
    assert not a.alive


async def test_a_stop_that_strikes_a_process_as_it_starts_leaves_the_instance_down(tmp_path: Path) -> None:
    """The process starting is up for faults (as in virtual mode): a stop moves it out before it says whether it
    started. The restart then reports nothing restarted, instead of failing or calling a stopped process up."""
    _, instances = _run(tmp_path, up="", kind=SlowStandIn)
    a = instances["a"]
    restarting = asyncio.ensure_future(a.restart())
    await asyncio.sleep(0.1)
    assert a.up
    await a.stop(0.0)
    assert await restarting is False
    assert not a.up


async def test_a_store_restart_strikes_at_once_the_old_server_answers_nothing_sent_after_it(
    real_target: str, tmp_path: Path
) -> None:
    """The old server is killed before the fault's window begins. One told to shut down answers on until its
    next cron tick, up to 100 ms, and a claim sent as the store restarts, meant for the empty store, could reach
    it: the scenario would not happen."""
    answers: list[tuple[float, int]] = []  # (sent, the pid of the server that answered)
    asking = True

    def ask(client: redis.Redis) -> None:
        while asking:
            sent = time.monotonic() - run.t0
            with contextlib.suppress(redis.RedisError):
                answers.append((sent, int(client.info("server")["process_id"])))

    with start_server(real_target) as server, contextlib.closing(server.client(socket_timeout=2)) as client:
        run = LiveRun(SCENARIO, server=server, strategies=["lease"], workdir=tmp_path)
        run.t0 = time.monotonic()
        old = int(client.info("server")["process_id"])
        asker = threading.Thread(target=ask, args=(client,))
        asker.start()
        try:
            await run._strike(FaultSpec(0.1, "store-restart", {}))
            await asyncio.sleep(0.05)
        finally:
            asking = False
            await asyncio.to_thread(asker.join)
    (window,) = run.windows["lease"]
    assert [sent for sent, pid in answers if pid == old and sent >= window.start] == []
    assert {pid == old for _, pid in answers} == {True, False}  # asked before the fault, and of the new server


def test_a_late_instance_is_back_on_time_in_the_history(tmp_path: Path) -> None:
    run, _ = _run(tmp_path)
    _strike(run, FaultSpec(0.0, "late", {"instance": "a", "delay_ms": 100, "duration_s": 0.05}))
    assert [event.value for event in run.faults] == [
        "lease instance a claims 100 ms late",
        "lease instance a back on time",
    ]


def test_a_connection_whose_upstream_does_not_answer_is_closed_when_the_run_ends() -> None:
    """An instance connects to its proxy while the server does not answer the proxy's connect (its accept queue
    is full): the run's loop ends meanwhile, and the connection the proxy accepted is closed, not left for the
    garbage collector to warn about in a later test."""
    with contextlib.ExitStack() as stack:
        upstream = stack.enter_context(socket.socket())
        upstream.bind(("127.0.0.1", 0))
        upstream.listen(0)
        stack.enter_context(socket.create_connection(upstream.getsockname()))  # fills the accept queue

        async def connect_through_the_proxy() -> int:
            proxy = Proxy(*upstream.getsockname())
            port = await proxy.start()
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            await asyncio.sleep(0.2)  # the proxy accepted it and waits on the upstream's connect
            waiting = len([t for t in asyncio.all_tasks() if t is not asyncio.current_task()])
            writer.close()
            await proxy.close()
            return waiting

        with asyncio.Runner() as runner:  # as the live run's loop ends: what still waits is cancelled
            assert runner.run(connect_through_the_proxy()) == 1
        gc.collect()  # an unclosed transport would warn here (warnings are errors in the suite)


@pytest.mark.parametrize("fault", ["cut", "redirect"])
async def test_a_connection_still_connecting_upstream_when_a_partition_begins_is_dropped(
    fault: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The proxy accepted an instance's connection and is connecting upstream when the instance is cut off (or
    sent to another server by a failover): once connected, it drops the connection instead of carrying the
    instance's commands to the store through the partition (or to the old server)."""

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(100):
            writer.write(data)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    connect = asyncio.open_connection

    async def slow_connect(*args: Any, **kwargs: Any) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        await asyncio.sleep(0.2)  # a busy server that accepts late
        return await connect(*args, **kwargs)

    proxy = Proxy(*server.sockets[0].getsockname()[:2])
    port = await proxy.start()
    monkeypatch.setattr(asyncio, "open_connection", slow_connect)  # the proxy's connects upstream, from now
    reader, writer = await connect("127.0.0.1", port)
    try:
        await asyncio.sleep(0.05)
        proxy.cut() if fault == "cut" else proxy.redirect("127.0.0.1", 1)
        await asyncio.sleep(0.3)
        writer.write(b"a claim\n")
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        assert await asyncio.wait_for(reader.read(100), 1) == b""  # closed, not echoed
    finally:
        writer.close()
        await proxy.close()
        server.close()
        await server.wait_closed()


@contextlib.asynccontextmanager
async def _echo_behind_a_proxy(in_pieces: bool = False) -> AsyncIterator[tuple[Proxy, int, list[tuple[float, bytes]]]]:
    """A server that echoes what it receives, behind a proxy: yields the proxy, its port, and what the server
    received (when, what). ``in_pieces``: each echo goes back in two writes, 10 ms apart. At the end every side of
    every connection is closed, the server's too."""
    received: list[tuple[float, bytes]] = []
    served: list[asyncio.Task[None]] = []  # the server's side of each connection, awaited before the loop ends

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served.append(cast(asyncio.Task[None], asyncio.current_task()))
        while data := await reader.read(100):
            received.append((time.monotonic(), data))
            for piece in (data[:3], data[3:]) if in_pieces else (data,):
                writer.write(piece)
                await writer.drain()
                await asyncio.sleep(0.01 if in_pieces else 0)
        writer.close()
        await writer.wait_closed()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    proxy = Proxy(*server.sockets[0].getsockname()[:2])
    port = await proxy.start()
    try:
        yield proxy, port, received
    finally:
        await proxy.close()
        server.close()
        await server.wait_closed()
        await asyncio.wait_for(asyncio.gather(*served, return_exceptions=True), 1)


async def _closed(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(ConnectionError):
        await writer.wait_closed()


async def test_a_slow_proxy_holds_each_reply_back_while_the_server_runs_the_request_at_once() -> None:
    """A slow fault: the request reaches the server when sent; the reply reaches the instance the delay later,
    in order, also for a reply that came in pieces; once the fault ends replies pass at once again."""
    async with _echo_behind_a_proxy(in_pieces=True) as (proxy, port, received):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        proxy.reply_delays.append(0.3)
        sent = time.monotonic()
        writer.write(b"a claim\n")
        await writer.drain()
        reply = await asyncio.wait_for(reader.readexactly(8), 2)
        heard = time.monotonic()
        assert reply == b"a claim\n"
        assert received[0][0] - sent < 0.1  # run at once
        assert 0.3 <= heard - sent < 0.6  # heard the delay later
        proxy.reply_delays.remove(0.3)
        sent = time.monotonic()
        writer.write(b"a beat\n")
        await writer.drain()
        assert await asyncio.wait_for(reader.readexactly(7), 2) == b"a beat\n"
        assert time.monotonic() - sent < 0.2
        await _closed(writer)


async def test_a_cut_with_the_reply_lost_lets_the_next_request_through_and_drops_its_reply() -> None:
    """A partition that begins while a command is on its way: the proxy passes the instance's request to the server
    and drops the server's reply, and with it the connection; then it refuses new ones until the partition heals."""
    async with _echo_behind_a_proxy() as (proxy, port, received):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        proxy.cut(reply_lost=True)
        assert not proxy.cut_off  # until the reply comes
        writer.write(b"a claim\n")
        await writer.drain()
        assert await asyncio.wait_for(reader.read(100), 1) == b""  # closed, not echoed
        await _closed(writer)
        assert [data for _, data in received] == [b"a claim\n"]  # the server ran it
        assert proxy.cut_off
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert await asyncio.wait_for(reader.read(100), 1) == b""  # refused while cut off
        await _closed(writer)
        proxy.heal()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"healed\n")
        assert await asyncio.wait_for(reader.readline(), 1) == b"healed\n"
        await _closed(writer)


async def test_a_restarted_process_reads_the_time_its_instance_clock_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As in virtual mode, an instance's clocks outlive its processes: one started after a crash goes on with the
    instance's offset and the drift it had gathered, not with the scenario's starting offset."""
    clock = SkewedClock(3000.0)
    instance = Instance("a", "lease", Proxy("127.0.0.1", 1), tmp_path / "a.jsonl", {}, clock)
    set_from = time.monotonic()
    clock.set_drift(1.0)  # twice as fast from now on: it gains what time passes
    set_by = time.monotonic()  # the drift began between the two reads
    await asyncio.sleep(0.2)
    clock.offset_ms -= 1000  # a jump back
    configs: list[dict[str, Any]] = []

    async def start(*argv: str, **_: Any) -> StandInProcess:
        configs.append(json.loads(argv[argv.index("--config") + 1]))
        return StandInProcess(1)

    monkeypatch.setattr(asyncio, "create_subprocess_exec", start)
    await instance.spawn()
    assert configs[0]["clock"] == clock.state()
    process_clock = SkewedClock()
    process_clock.take(configs[0]["clock"])
    gained_before_ms = (time.monotonic() - set_by) * 1000  # at least, by the moment of the read
    wall_before_ms = time.time_ns() // 1_000_000
    process_wall_ms = process_clock.wall_ms()
    wall_after_ms = time.time_ns() // 1_000_000
    gained_after_ms = (time.monotonic() - set_from) * 1000  # at most
    assert gained_before_ms >= 200
    # What the drift gained is kept: the process clock reads 2 s ahead plus the gain, at a moment between the reads.
    assert process_wall_ms - wall_before_ms >= 2000 + gained_before_ms - 2
    assert process_wall_ms - wall_after_ms <= 2000 + gained_after_ms + 2


async def test_an_instance_that_exits_as_it_starts_is_reported_with_its_status_and_the_end_of_its_stderr(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run's directory, and the instance's logs in it, go with the run: the error quotes what the process said."""
    instance = Instance("a", "lease", Proxy("127.0.0.1", 1), tmp_path / "a.jsonl", {}, SkewedClock())
    exec_ = asyncio.create_subprocess_exec
    said = "; ".join(f"print('line {n}', file=sys.stderr)" for n in range(25))

    async def start(*_: str, **options: Any) -> asyncio.subprocess.Process:
        return await exec_(sys.executable, "-c", f"import sys; {said}; sys.exit(3)", **options)

    monkeypatch.setattr(asyncio, "create_subprocess_exec", start)
    with pytest.raises(RuntimeError) as raised:
        await instance.restart()
    message = str(raised.value)
    assert message.startswith("instance lease/a exited as it started (status 3); its stderr ends:\nline 5\n")
    assert message.endswith("\nline 24")


@pytest.mark.parametrize(("seconds", "drift"), [(1.0, -0.5), (3.0, 9.0)], ids=["slower", "faster"])
async def test_a_sleep_over_a_drift_change_lasts_its_time_on_the_instance_clock(seconds: float, drift: float) -> None:
    """A sleep on a clock whose rate changes d s in (0.1, later on a busy machine): d s, then the rest at the new
    rate. At half speed, 1 s takes 2 - d s (a sleep that kept the old rate ended at 1 s); at ten times the speed,
    3 s take d + (3 - d) / 10 s, about 0.4 (one left to end at the old rate ended at 3 s, 2.6 s late by the
    clock: a heartbeat sent that late loses a lease that was not lost)."""
    clock = SkewedClock()
    began, clock_began = time.monotonic(), clock.monotonic()
    changed: list[float] = []

    async def change() -> None:
        await asyncio.sleep(0.1)
        changed.append(time.monotonic() - began)
        clock.set_drift(drift)
        changed.append(time.monotonic() - began)

    changing = asyncio.ensure_future(change())
    await clock.sleep(seconds)
    await changing
    took = time.monotonic() - began
    assert changed[1] < 1.0, "the change came late: the sleep's end is too near to judge"
    assert clock.monotonic() - clock_began >= seconds
    # The change came between the two reads: the sleep's end lies between those it gives, either way round.
    expected = [change + (seconds - change) / (1 + drift) for change in changed]
    assert min(expected) - 0.005 <= took < max(expected) + 1.5


@pytest.mark.parametrize(("cron", "scales"), [("*/10 * * * * *", True), ("*/25 * * * * *", False)])
def test_live_mode_scales_only_seconds_crons_that_fire_every_n_seconds(cron: str, scales: bool) -> None:
    """*/25 in the seconds field fires at :00, :25 and :50 (25 s, 25 s, then 10 s): scaled to */5 it would be
    another schedule, not the scenario's in live time."""
    scenario = parse({
        "name": "crons", "duration_s": 60, "instances": [{"name": "a"}],
        "jobs": [{"name": "tick", "cron": cron, "work_s": 1}],
    })  # fmt: skip
    if scales:
        assert [job.cron for job in live.scaled(scenario).jobs] == ["*/2 * * * * *"]
    else:
        with pytest.raises(ScenarioError, match="does not scale"):
            live.scaled(scenario)


@pytest.mark.parametrize(
    ("fault", "refusal"),
    [
        ({"kind": "replication-hold", "duration_s": 5}, "replication log only"),
        ({"kind": "failover", "lag_ms": 100, "clock_ms": -5000}, "clock_ms is for the virtual mode only"),
        ({"kind": "failover", "lag_ms": 100}, None),  # to a server on the same clock: live mode makes it
    ],
)
def test_live_mode_refuses_the_faults_it_cannot_make_real_servers_do(
    fault: dict[str, Any], refusal: str | None
) -> None:
    scenario = parse({
        "name": "faults", "duration_s": 60, "instances": [{"name": "a"}],
        "jobs": [{"name": "tick", "cron": "*/10 * * * * *", "work_s": 1}], "faults": [{"at_s": 20, **fault}],
    })  # fmt: skip
    if refusal is None:
        assert [spec.kind for spec in live.scaled(scenario).faults] == [fault["kind"]]
    else:
        with pytest.raises(ScenarioError, match=refusal):
            live.scaled(scenario)
