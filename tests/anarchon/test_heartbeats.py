"""The lease keeper on its own: which refused heartbeats mean a lost lease."""

from __future__ import annotations

import asyncio
from typing import cast

from anarchon import SystemClock
from anarchon._heartbeats import LeaseKeeper
from anarchon._store import Store
from anarchon._strategies import JobPolicy, RunRequest, Strategy
from tests.support import eventually

REQUEST = RunRequest("job", "1700000000000", 1_700_000_000_000, "token-a", "a")


class RefusingStrategy:
    """Refuses every heartbeat; with ``ended_meanwhile`` the run's job ends while the heartbeat is on its way."""

    def __init__(self, ended_meanwhile: bool) -> None:
        self.ended_meanwhile = ended_meanwhile
        self.keeper: LeaseKeeper | None = None
        self.beats = 0

    async def heartbeat(self, store: Store, request: RunRequest, policy: JobPolicy) -> int:
        self.beats += 1
        if self.ended_meanwhile and self.keeper is not None:
            self.keeper.release(request.token)  # what the scheduler does when the job ends
        return 0


async def refused_heartbeat_reports(ended_meanwhile: bool) -> tuple[int, list[str]]:
    strategy = RefusingStrategy(ended_meanwhile)
    keeper = LeaseKeeper(
        cast(Strategy, strategy), cast(Store, None), SystemClock(), heartbeat_ms=20, margin_ms=0
    )  # fmt: skip
    strategy.keeper = keeper
    lost: list[str] = []
    serving = asyncio.create_task(keeper.serve())
    try:
        keeper.hold(REQUEST, JobPolicy(), SystemClock().monotonic(), 10_000, lost.append)
        await eventually(lambda: strategy.beats >= 1, cap_s=5)
        await asyncio.sleep(0.1)  # a few more heartbeat periods: the run is no longer kept, nothing more happens
    finally:
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
    return strategy.beats, lost


async def test_a_refused_heartbeat_reports_the_lease_lost_once() -> None:
    beats, lost = await refused_heartbeat_reports(ended_meanwhile=False)
    assert (beats, lost) == (1, ["the heartbeat was refused: another attempt holds the run"])


async def test_a_heartbeat_refused_because_the_run_just_ended_reports_nothing() -> None:
    beats, lost = await refused_heartbeat_reports(ended_meanwhile=True)
    assert (beats, lost) == (1, [])


class FailingOnceStrategy:
    """Its first heartbeat fails with an exception that is no store error; the next ones extend the lease."""

    def __init__(self) -> None:
        self.beats = 0

    async def heartbeat(self, store: Store, request: RunRequest, policy: JobPolicy) -> int:
        self.beats += 1
        if self.beats == 1:
            raise ValueError("a reply nobody expected")
        return 10_000


async def test_a_heartbeat_failing_unexpectedly_is_tried_again_and_the_keeper_goes_on() -> None:
    strategy = FailingOnceStrategy()
    keeper = LeaseKeeper(cast(Strategy, strategy), cast(Store, None), SystemClock(), heartbeat_ms=20, margin_ms=0)
    lost: list[str] = []
    serving = asyncio.create_task(keeper.serve())
    try:
        keeper.hold(REQUEST, JobPolicy(), SystemClock().monotonic(), 10_000, lost.append)
        await eventually(lambda: strategy.beats >= 3, cap_s=5)  # the retry a second later, then the next beat
        assert not serving.done()
    finally:
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
    assert lost == []
