"""Store outages, live: the store stops for 10 s and comes back, with its data or empty.

Three ways a store goes away, each on a throwaway server of redis-7 and valkey-9:

- ``pause``: SIGSTOP, then SIGCONT. The server keeps its data and its connections but answers nothing: commands
  hang until the client's socket timeout, and the commands sent meanwhile are executed when it resumes (their
  replies are lost). The most faithful "comes back with its data": a stalled host, a long fork, a frozen VM.
- ``crash``: SIGKILL, then a restart on the same port with an append-only file written on every command
  (``appendfsync always``), so the store comes back with every write it acknowledged. Connections are refused
  while it is down and the pooled ones are dead when it is back: the reconnecting path.
- ``empty``: SIGKILL, then a restart without persistence: the store comes back empty (scripts, format and runs
  forgotten).

Three lease instances and three script instances run side by side (two prefixes on one store), with jobs every
second, and a long job that is running when the store goes away. Every execution is written to a ledger kept
outside the store. Connections are opened by anarchon from a URL with ``?socket_timeout=2`` (the default is
10 s): a paused store makes a command fail after 2 s, several times during the outage.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Iterator
from typing import Any, Literal

import pytest

from anarchon import RunContext, Scheduler, StoreUnavailableError
from sim.servers import start_server
from sim.servers._running import RunningServer
from tests.support import Ledger, backend_for, eventually, now_ms, second_from_now

Outage = Literal["pause", "crash", "empty"]
OUTAGE_S = 10.0
TIMEOUT_QUERY = "?socket_timeout=2"
LEASE_MS = 18_000  # longer than the outage: a run in progress when the store went away is still leased after it
DURABLE = ("--appendonly", "yes", "--appendfsync", "always")
# A claim named in the lines that say claims failed together, with its try and its delay ("claims of 3 runs
# failed in the last 5.0 s (…); retrying: job tick slot … (try 3 failed; next in 2.0 s), …"); a claim said alone,
# when it failed first, is not read: it is never the third try.
RETRY = re.compile(r"job (\S+) slot (\d+) \(try (\d+) failed; next in ([\d.]+) s\)")


class Outages:
    """Takes a throwaway server away and brings it back (process control blocks: it runs in a worker thread)."""

    def __init__(self, server: RunningServer, kind: Outage) -> None:
        self.server = server
        self.kind = kind

    async def begin(self) -> None:
        if self.kind == "pause":
            await asyncio.to_thread(self.server.pause)
        else:
            await asyncio.to_thread(self.server.kill)

    async def end(self) -> None:
        if self.kind == "pause":
            await asyncio.to_thread(self.server.resume)
        else:
            await asyncio.to_thread(self.server.restart)  # waits until it answers; AOF replayed in "crash"


def serve(target: str, kind: Outage) -> Any:
    return start_server(target, extra_args=DURABLE if kind == "crash" else ())


def every_slot(first: int, last: int) -> Iterator[int]:
    return iter(range(first, last + 1, 1000))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["pause", "crash", "empty"])
async def test_schedulers_ride_out_a_store_outage(
    live_target: str, kind: Outage, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    ledger = Ledger()
    long_started = asyncio.Event()

    async def signal_start(run: RunContext) -> None:
        long_started.set()

    with serve(live_target, kind) as server:
        url = server.url() + TIMEOUT_QUERY
        schedulers: list[Scheduler[Any]] = []
        long_slot = second_from_now(3)  # once: every instance contends for the same long run
        for i in range(3):
            lease: Scheduler[Any] = Scheduler(
                backend_for(live_target, url), instance_id=f"lease-{i}", lease_ms=LEASE_MS
            )
            lease.add_job("tick", "* * * * * *", ledger.job(f"lease-{i}", 0.05), overlap=True)
            lease.add_job("solo", "* * * * * *", ledger.job(f"lease-{i}", 0.05))
            lease.add_job("long", long_slot, ledger.job(f"lease-{i}", 2.0, before=signal_start))
            script: Scheduler[Any] = Scheduler(
                backend_for(live_target, url, "script", prefix="script:"), instance_id=f"script-{i}"
            )
            script.add_job("script-tick", "* * * * * *", ledger.job(f"script-{i}", 0.05))
            schedulers += [lease, script]
        outage = Outages(server, kind)
        await asyncio.gather(*(s.start() for s in schedulers))
        first = now_ms() // 1000 * 1000 + 1000  # the first slot every scheduler was up for
        try:
            await asyncio.wait_for(long_started.wait(), 10)
            await asyncio.sleep(0.5)  # the long job is half a second into its 2 s
            down_ms = now_ms()
            await outage.begin()
            await asyncio.sleep(OUTAGE_S)
            await outage.end()
            back_ms = now_ms()
            # Slots due during the outage are claimed as their retries come due (backing off up to 16 s); the
            # long job's backups ask for it again when its lease would have run out.
            [long_run] = {e.slot for e in ledger.of("long")}
            settled_ms = max(back_ms + 2_000, long_run + LEASE_MS + 3_000)

            def settled() -> bool:
                ran = ledger.slots("tick")
                return now_ms() >= settled_ms and all(ran[slot] for slot in every_slot(first, back_ms))

            await eventually(settled, 40)
            last = now_ms() // 1000 * 1000 - 1000
            history = {job: await schedulers[0].history(job, limit=200) for job in ("solo", "long")}
        finally:
            await asyncio.gather(*(s.stop() for s in schedulers))

    # Never crashed: nothing logged an error (an exception escaping a task is logged by asyncio as an error).
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == []
    # Logged the outage and backed off: some slot's claim failed several times, each retry waiting longer.
    tries = [(int(match[3]), float(match[4])) for r in caplog.records for match in RETRY.finditer(r.getMessage())]
    assert tries, "no failed claim was logged during the outage"
    assert any(failed >= 3 and delay >= 2.0 for failed, delay in tries), tries

    def forgotten(executions: list[Any]) -> bool:
        """A second execution is allowed only for a run the store forgot (it came back empty): the first one
        started before the outage, the second after the store was back."""
        first_run, *again = sorted(executions, key=lambda e: e.started_ms)
        return kind == "empty" and len(again) == 1 and first_run.started_ms < down_ms <= back_ms <= again[0].started_ms

    for job in ("tick", "solo", "long", "script-tick"):
        twice = {slot: runs for slot, runs in ledger.by_slot(job).items() if len(runs) > 1}
        assert all(forgotten(runs) for runs in twice.values()), (job, twice)

    # Never stopped scheduling, and the slots due during the outage ran once the store was back (well within
    # max_late_ms): every slot of the jobs free to overlap, before, during and after the outage.
    for job in ("tick", "script-tick"):
        ran = ledger.slots(job)
        assert [slot for slot in every_slot(first, last) if not ran[slot]] == [], (job, down_ms, back_ms)
        assert any(slot >= back_ms for slot in ran)
    # A job that must not overlap: each slot of the outage ran, or (its backlog claimed at once when the store
    # came back, each claim finding the previous run still going) was recorded as skipped-overlap. None is lost.
    solo_ran = ledger.slots("solo")
    recorded = {r.slot: r.status for r in history["solo"]}
    unaccounted = [slot for slot in every_slot(down_ms // 1000 * 1000 + 1000, last) if not solo_ran[slot]]
    assert {slot: recorded.get(slot) for slot in unaccounted} == dict.fromkeys(unaccounted, "skipped-overlap")
    # The long job was running when the store went away. Where the store kept its data, its result reached the
    # store once it was back (before its lease ran out), so no backup ran it again.
    long_runs = ledger.of("long")
    if kind != "empty":
        assert [(e.attempt, e.ended_ms is not None) for e in long_runs] == [(1, True)]
        assert [(r.attempt, r.status) for r in history["long"]] == [(1, "ok")]


@pytest.mark.parametrize("spec", ["url", "options"])
async def test_a_stopped_store_fails_a_command_once_without_client_retries(live_target: str, spec: str) -> None:
    """A command to a paused store fails after one socket timeout, however the connection was given (URL or
    options dict): the client does not reconnect and try again behind the scheduler's back, which would hold
    every caller (and ``stop()``) for many timeouts. The scheduler retries claims itself, with their tokens.

    The command was sent, so the store executes it when it resumes: its outcome was unknown, not failed."""
    with start_server(live_target) as server:
        connection: Any = (
            server.url() + "?socket_timeout=0.5"
            if spec == "url"
            else {"host": server.host, "port": server.port, "socket_timeout": 0.5}
        )
        backend = backend_for(live_target, connection)
        await backend.start()

        def connections() -> int:  # counts the connection that asks, too
            return int(server.info("stats")["total_connections_received"])

        try:
            before = connections()
            await asyncio.to_thread(server.pause)
            try:
                with pytest.raises(StoreUnavailableError):
                    await backend.store.execute("INCR", "sent")
            finally:
                await asyncio.to_thread(server.resume)
            assert connections() - before == 1  # only this second look: no reconnection while the store was away
            probe = server.client(socket_timeout=10)
            try:
                for _ in range(100):  # the resumed server works through what it received while stopped
                    if probe.get("sent") is not None:
                        break
                    await asyncio.sleep(0.05)
                assert probe.get("sent") == b"1"
            finally:
                probe.close()
        finally:
            await backend.stop()
