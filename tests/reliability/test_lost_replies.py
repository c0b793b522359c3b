"""Lost replies, live: a claim or a finish reaches the store, runs, and its reply never comes back (the connection
drops).

A small TCP proxy sits between the instance and a real server. Armed, it forwards the claim, waits for the
server's reply, keeps it and closes the connection instead of passing it on. The client sees a dropped
connection (outcome unknown) and the scheduler claims again, on a new connection, with the same token.

Every strategy's retry wins if the first try won and loses if it lost, so the run is executed exactly once:

- ``lease`` and ``script`` claims carry the token and the scripts recognise it.
- ``stream-id``'s claim is a bare ``XADD`` at the slot's ID; the retry is refused ("equal or smaller than the
  target stream top item") as an instance that lost would be, and reads the slot's entry back: its own token
  there makes it the winner.

A finish whose reply was lost is tried again: the retry is told the result is recorded, and it is recorded once.
A heartbeat whose connection goes silent is given up on and sent again, on a new connection, before the lease ends.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest

from anarchon import Scheduler, StoreUnavailableError
from anarchon._strategies import Claim, JobPolicy, Outcome, RunRequest, run_id
from anarchon._strategies._base import fence_of
from anarchon._strategies.lease import CLAIM as LEASE_CLAIM
from anarchon._strategies.lease import FINISH as LEASE_FINISH
from anarchon._strategies.lease import HEARTBEAT as LEASE_HEARTBEAT
from anarchon._strategies.script import CLAIM as SCRIPT_CLAIM
from sim.servers import start_server
from sim.servers._running import RunningServer
from tests.reliability.proxy import LossyProxy
from tests.support import Ledger, backend_for, eventually, second_from_now

MARKERS = {"lease": LEASE_CLAIM.sha.encode(), "script": SCRIPT_CLAIM.sha.encode(), "stream-id": b"XADD"}
FINISH_MARKERS = {"lease": LEASE_FINISH.sha.encode(), "script": b"ZADD", "stream-id": b"ZADD"}
SLOT = 1_700_000_000_000
POLICY = JobPolicy(lease_ms=30_000)


def as_claim(strategy: str, reply: Any) -> Claim:
    """What the scheduler would have made of the reply it never got."""
    assert not isinstance(reply, Exception) or strategy == "stream-id", reply
    if strategy == "lease":
        answer, attempt, fence, left = reply.split(" ")
        return Claim(Outcome(answer), int(attempt), int(fence), int(left))
    if strategy == "script":
        answer, entry_id = reply
        return Claim(Outcome.WON, 1, fence_of(entry_id)) if answer == "won" else Claim(Outcome.LOST)
    return Claim(Outcome.LOST) if isinstance(reply, Exception) else Claim(Outcome.WON, 1, fence_of(reply))


def decided(claim: Claim) -> tuple[Outcome, int]:
    """A claim's outcome and attempt: not the lease time left (which shrinks between the two tries), nor the fence
    (a lease renewed by a retry takes the next: nobody heard the first)."""
    return (claim.outcome, claim.attempt)


def scheduler_through(
    proxy: LossyProxy, target: str, strategy: str, job: str, ledger: Ledger, work_s: float = 0.0, **options: Any
) -> Scheduler[Any]:
    """Instance "a" on a connection through the proxy, with ``job`` due 2 s from now (once a minute)."""
    scheduler: Scheduler[Any] = Scheduler(backend_for(target, proxy.url(), strategy), instance_id="a", **options)
    scheduler.add_job(job, second_from_now(2), ledger.job("a", work_s))
    return scheduler


@pytest.fixture
async def lossy(live_target: str) -> AsyncIterator[tuple[RunningServer, LossyProxy]]:
    with start_server(live_target) as server:
        proxy = await LossyProxy(server.host, server.port).start()
        try:
            yield server, proxy
        finally:
            await proxy.close()


@pytest.mark.parametrize("first", ["won", "lost"])
@pytest.mark.parametrize("strategy", ["lease", "script", "stream-id"])
async def test_a_claim_retried_after_its_reply_was_lost_has_the_first_tries_outcome(
    live_target: str, lossy: tuple[RunningServer, LossyProxy], strategy: str, first: str
) -> None:
    server, proxy = lossy
    mine = backend_for(live_target, proxy.url(), strategy)
    theirs = backend_for(live_target, server.url(), strategy)
    await mine.start(["sync"])
    await theirs.start(["sync"])
    try:
        if first == "lost":  # another instance holds the run already
            [their_claim] = await theirs.strategy.claim(
                theirs.store, [(RunRequest("sync", str(SLOT), SLOT, "theirs", "b"), POLICY)]
            )
            assert isinstance(their_claim, Claim)
            assert their_claim.outcome is Outcome.WON
        request = RunRequest("sync", run_id(SLOT), SLOT, "mine", "a")
        proxy.arm(MARKERS[strategy])
        [unknown] = await mine.strategy.claim(mine.store, [(request, POLICY)])
        assert isinstance(unknown, StoreUnavailableError)  # the connection dropped: outcome unknown
        [lost_reply] = proxy.lost  # the store did decide: this is what it answered
        [retry] = await mine.strategy.claim(mine.store, [(request._replace(retry=True), POLICY)])
        assert isinstance(retry, Claim)
    finally:
        await mine.stop()
        await theirs.stop()
    first_try = as_claim(strategy, lost_reply)
    expected = Outcome.WON if first == "won" else (Outcome.RUNNING if strategy == "lease" else Outcome.LOST)
    assert first_try.outcome is expected
    assert decided(retry) == decided(first_try)
    if strategy == "lease" and first == "won":
        assert retry.fence > first_try.fence
    else:
        assert retry.fence == first_try.fence


@pytest.mark.parametrize("strategy", ["lease", "script", "stream-id"])
async def test_a_scheduler_whose_claim_reply_is_lost(
    live_target: str, lossy: tuple[RunningServer, LossyProxy], strategy: str, caplog: pytest.LogCaptureFixture
) -> None:
    """End to end: the scheduler's first claim of a slot loses its reply; the retry comes 0.5 s later."""
    caplog.set_level(logging.DEBUG, logger="anarchon")
    _, proxy = lossy
    ledger = Ledger()
    scheduler = scheduler_through(proxy, live_target, strategy, "tick", ledger)

    def retried() -> bool:  # the retry ran the job, or was answered "lost"
        lost = any(r.getMessage().endswith(": lost") for r in caplog.records)
        return bool(proxy.lost) and (bool(ledger.executions) or lost)

    async with scheduler:
        proxy.arm(MARKERS[strategy])
        await eventually(retried, 15)
        await asyncio.sleep(0.5)  # a second execution, were there one, would have started by now
        history = await scheduler.history("tick")
    [lost_reply] = proxy.lost
    assert as_claim(strategy, lost_reply).outcome is Outcome.WON  # the first try won, and was never told
    assert any("claim of slot" in r.getMessage() and "failed" in r.getMessage() for r in caplog.records)
    assert [(e.attempt, e.ended_ms is not None) for e in ledger.executions] == [(1, True)]
    assert [(r.attempt, r.status, r.runner) for r in history] == [(1, "ok", "a")]


@pytest.mark.parametrize("strategy", ["lease", "script", "stream-id"])
async def test_a_scheduler_whose_finish_reply_is_lost_records_the_result_once(
    live_target: str, lossy: tuple[RunningServer, LossyProxy], strategy: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The run's result reaches the store and its reply is lost: the retry is told it is recorded, not refused."""
    caplog.set_level(logging.DEBUG, logger="anarchon")
    _, proxy = lossy
    ledger = Ledger()
    scheduler = scheduler_through(proxy, live_target, strategy, "tick", ledger)

    def recorded_after_a_retry() -> bool:
        return any("result recorded after 1 failed tries" in r.getMessage() for r in caplog.records)

    async with scheduler:
        proxy.arm(FINISH_MARKERS[strategy])
        await eventually(recorded_after_a_retry, 15)
        history = await scheduler.history("tick")
    [lost_reply] = proxy.lost
    assert lost_reply == 1  # the first try recorded it (ZADD: one member added), and was never told
    assert [(e.attempt, e.ended_ms is not None) for e in ledger.executions] == [(1, True)]
    assert [(r.attempt, r.status, r.runner) for r in history] == [(1, "ok", "a")]
    assert not [r.getMessage() for r in caplog.records if "refused the result" in r.getMessage()]


async def test_a_heartbeat_whose_connection_goes_silent_is_sent_again_and_the_lease_kept(
    live_target: str, lossy: tuple[RunningServer, LossyProxy], caplog: pytest.LogCaptureFixture
) -> None:
    """A URL's connections wait 10 s for an answer, longer than the lease has left. Lease 3 s, heartbeat 1 s: the
    first beat's connection goes silent; the beat is given up on halfway to the deadline (0.93 s later) and sent
    again on a new connection, and the 5 s run ends as it should, its lease kept throughout."""
    caplog.set_level(logging.DEBUG, logger="anarchon")
    _, proxy = lossy
    ledger = Ledger()
    scheduler = scheduler_through(proxy, live_target, "lease", "long", ledger, 5, lease_ms=3000)
    async with scheduler:
        proxy.arm(LEASE_HEARTBEAT.sha.encode(), hang=True)
        await eventually(lambda: any(e.ended_ms is not None for e in ledger.executions), 15)
        history = await scheduler.history("long")
    messages = [r.getMessage() for r in caplog.records]
    assert proxy.lost == [3000]  # the store renewed the lease, and the answer never came
    [failed] = [m for m in messages if "heartbeat failed" in m]
    prefix, waited = failed.removesuffix(" s").rsplit(" ", 1)
    assert prefix == "job long: heartbeat failed: no answer in"
    # Halfway from the beat to its run's deadline: 0.925 s for a beat sent on time, (1.85 - d) / 2 for one a loaded
    # machine sent d late (0.924 s seen), at least 0.5 s while d is under 0.85 s; and before that deadline (1.85 s).
    # When exactly is the virtual-time keeper tests' to say.
    assert 0.5 <= float(waited) < 1.85
    assert "heartbeats reach the store again; 1 failed meanwhile" in messages
    assert not [m for m in messages if "lease lost" in m]
    assert [(e.attempt, e.ended_ms is not None) for e in ledger.executions] == [(1, True)]
    assert [(r.attempt, r.status) for r in history] == [(1, "ok")]
