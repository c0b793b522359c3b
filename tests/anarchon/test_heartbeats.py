"""The lease keeper on its own: which refused heartbeats mean a lost lease."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import AsyncIterator, Sequence
from typing import cast

import pytest

from anarchon import StoreError, StoreUnavailableError, SystemClock
from anarchon._heartbeats import HEARTBEAT_REFUSED, LeaseKeeper
from anarchon._store import Command, Connection, Reply, Store
from anarchon._strategies import JobPolicy, RunRequest, Strategy
from sim.vtime import run_virtual
from sim.world import SimClock
from tests.support import eventually

REQUEST = RunRequest("job", "1700000000000", 1_700_000_000_000, "token-a", "a")


@contextlib.asynccontextmanager
async def serving(keeper: LeaseKeeper) -> AsyncIterator[None]:
    """The keeper beating, until the block ends."""
    task = asyncio.create_task(keeper.serve())
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


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
    async with serving(keeper):
        keeper.hold(REQUEST, JobPolicy(), SystemClock().monotonic(), 10_000, lost.append)
        await eventually(lambda: strategy.beats >= 1, cap_s=5)
        await asyncio.sleep(0.1)  # a few more heartbeat periods: the run is no longer kept, nothing more happens
    return strategy.beats, lost


async def test_a_refused_heartbeat_reports_the_lease_lost_once() -> None:
    beats, lost = await refused_heartbeat_reports(ended_meanwhile=False)
    assert (beats, lost) == (
        1,
        [HEARTBEAT_REFUSED],
    )


async def test_a_heartbeat_refused_because_the_run_just_ended_reports_nothing() -> None:
    beats, lost = await refused_heartbeat_reports(ended_meanwhile=True)
    assert (beats, lost) == (1, [])


class FailingOnceStrategy:
    """Its first heartbeat fails with an exception that is no store error; the next ones extend the lease."""

    def __init__(self, error: BaseException) -> None:
        self.error = error
        self.beats = 0

    async def heartbeat(self, store: Store, request: RunRequest, policy: JobPolicy) -> int:
        self.beats += 1
        if self.beats == 1:
            raise self.error
        return 10_000


@pytest.mark.parametrize(
    "error",
    # A CancelledError of the call alone (a client that cancels a call of its own), not of the keeper.
    [ValueError("a reply nobody expected"), asyncio.CancelledError("a client cancelled its call")],
    ids=["value-error", "cancelled-error"],
)
async def test_a_heartbeat_failing_unexpectedly_is_tried_again_and_the_keeper_goes_on(error: BaseException) -> None:
    strategy = FailingOnceStrategy(error)
    keeper = LeaseKeeper(cast(Strategy, strategy), cast(Store, None), SystemClock(), heartbeat_ms=20, margin_ms=0)
    lost: list[str] = []
    task = asyncio.create_task(keeper.serve())
    try:
        keeper.hold(REQUEST, JobPolicy(), SystemClock().monotonic(), 10_000, lost.append)
        await eventually(lambda: strategy.beats >= 3, cap_s=5)  # the retry a second later, then the next beat
        assert strategy.beats >= 3
        assert not task.done()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert lost == []


class FailingFirstStrategy:
    """Its first heartbeat fails as if the connection had dropped; the next ones extend the lease."""

    def __init__(self, clock: SimClock, lease_ms: int) -> None:
        self.clock = clock
        self.lease_ms = lease_ms
        self.beats: list[float] = []

    async def heartbeat(self, store: Store, request: RunRequest, policy: JobPolicy) -> int:
        self.beats.append(round(self.clock.monotonic(), 3))
        if len(self.beats) == 1:
            raise StoreUnavailableError("connection reset")
        return self.lease_ms


def test_a_failed_heartbeat_of_a_short_lease_is_tried_again_before_the_lease_ends() -> None:
    # lease 2 s, heartbeat 1 s, 50 ms of margin: the beat at 1 s fails; a retry 1 s later would meet the deadline
    # (1.95 s) and lose the lease. It comes halfway to the deadline instead, and keeps the lease.
    async def main() -> tuple[list[float], list[str]]:
        clock = SimClock()
        strategy = FailingFirstStrategy(clock, lease_ms=2000)
        keeper = LeaseKeeper(cast(Strategy, strategy), cast(Store, None), clock, heartbeat_ms=1000, margin_ms=50)
        lost: list[str] = []
        async with serving(keeper):
            keeper.hold(REQUEST, JobPolicy(), clock.monotonic(), 2000, lost.append)
            await asyncio.sleep(4)
        return strategy.beats, lost

    beats, lost = run_virtual(main(), epoch_s=1_700_000_000, seed=1)
    assert (beats, lost) == ([1.0, 1.475, 2.475, 3.475], [])


class FailingWhileDownStrategy:
    """Its heartbeats fail while the store is down: from 1 s to 2.5 s and from 5 s to 5.5 s."""

    def __init__(self, clock: SimClock) -> None:
        self.clock = clock

    async def heartbeat(self, store: Store, request: RunRequest, policy: JobPolicy) -> int:
        now = self.clock.monotonic()
        if 1 <= now < 2.5 or 5 <= now < 5.5:
            raise StoreUnavailableError("connection refused")
        return 10_000


def test_heartbeats_that_fail_are_said_once_per_outage(caplog: pytest.LogCaptureFixture) -> None:
    """Two runs held, lease 10 s, heartbeat 1 s: the beats at 1 s and 5 s fail, and each is tried again every second
    until it gets through. The first failure of each outage is a warning, the other runs' and the retries debug
    lines, and the end of the outage one line: not a warning for every try of every run held."""
    caplog.set_level(logging.DEBUG, logger="anarchon")

    async def main() -> list[str]:
        clock = SimClock()
        keeper = LeaseKeeper(
            cast(Strategy, FailingWhileDownStrategy(clock)), cast(Store, None), clock, heartbeat_ms=1000, margin_ms=0
        )
        lost: list[str] = []
        async with serving(keeper):
            for token in ("a", "b"):
                keeper.hold(REQUEST._replace(token=token), JobPolicy(), clock.monotonic(), 10_000, lost.append)
            await asyncio.sleep(7)
        return lost

    assert run_virtual(main(), epoch_s=1_700_000_000, seed=1) == []
    said = [(r.levelname, r.getMessage()) for r in caplog.records if "heartbeat" in r.getMessage()]
    failed = "job job: heartbeat failed: connection refused"
    assert said == [
        ("WARNING", failed), ("DEBUG", failed), ("DEBUG", failed), ("DEBUG", failed),
        ("INFO", "heartbeats reach the store again; 4 failed meanwhile"),
        ("WARNING", failed), ("DEBUG", failed),
        ("INFO", "heartbeats reach the store again; 2 failed meanwhile"),
    ]  # fmt: skip


def hold_noting_the_loss(keeper: LeaseKeeper, request: RunRequest, lease_ms: int, lost: dict[str, float]) -> None:
    """Hold a run just won with a whole lease of ``lease_ms``; ``lost[job]`` notes when it is told it lost it."""
    clock = keeper.clock
    keeper.hold(
        request, JobPolicy(lease_ms=lease_ms), clock.monotonic(), lease_ms,
        lambda _: lost.setdefault(request.job, clock.monotonic()),
    )  # fmt: skip


class OneFailsOneHangs:
    """The first run's heartbeats fail at once; the second run's get no answer."""

    def __init__(self, failing: RunRequest) -> None:
        self.failing = failing

    async def heartbeat(self, store: Store, request: RunRequest, policy: JobPolicy) -> int:
        if request is self.failing:
            raise StoreUnavailableError("connection reset")
        await asyncio.sleep(3600)
        return 0


def test_a_run_learns_its_lease_is_lost_at_its_deadline_while_another_runs_beat_hangs() -> None:
    # x's beat fails and waits for its retry; y's beat is sent and hangs. While the keeper waits for y, x's
    # deadline (0.95 s: lease 1 s less 50 ms) passes: x must be told then, before a backup can take it over.
    x = RunRequest("x", "1", 1, "token-x", "a")
    y = RunRequest("y", "1", 1, "token-y", "a")

    async def main() -> dict[str, float]:
        clock = SimClock()
        keeper = LeaseKeeper(
            cast(Strategy, OneFailsOneHangs(x)), cast(Store, None), clock, heartbeat_ms=300, margin_ms=50
        )
        lost: dict[str, float] = {}
        async with serving(keeper):
            hold_noting_the_loss(keeper, x, 1000, lost)
            await asyncio.sleep(0.25)
            hold_noting_the_loss(keeper, y, 1000, lost)
            await asyncio.sleep(3)
        return lost

    lost = run_virtual(main(), epoch_s=1_700_000_000, seed=1)
    assert lost == {"x": 0.95, "y": 1.2}


class Extending:
    def __init__(self, clock: SimClock) -> None:
        self.clock = clock
        self.beats: list[float] = []

    async def heartbeat(self, store: Store, request: RunRequest, policy: JobPolicy) -> int:
        self.beats.append(round(self.clock.monotonic(), 3))
        return policy.lease_ms


def test_a_run_won_with_less_lease_left_than_a_heartbeat_period_is_beaten_before_its_deadline() -> None:
    # A claim retried with its own token won the run with 300 ms of its 1 s lease left: the deadline is 250 ms
    # away (50 ms of margin), before the 333 ms heartbeat period. The first beat comes halfway, at 125 ms.
    async def main() -> tuple[list[float], list[str]]:
        clock = SimClock()
        strategy = Extending(clock)
        keeper = LeaseKeeper(cast(Strategy, strategy), cast(Store, None), clock, heartbeat_ms=333, margin_ms=50)
        lost: list[str] = []
        async with serving(keeper):
            keeper.hold(REQUEST, JobPolicy(lease_ms=1000), clock.monotonic(), 300, lost.append)
            await asyncio.sleep(1)
        return strategy.beats, lost

    beats, lost = run_virtual(main(), epoch_s=1_700_000_000, seed=1)
    assert (beats, lost) == ([0.125, 0.458, 0.791], [])


class HangsFor:
    """The heartbeats of one run get no answer until ``answer`` is set; the others' extend the lease."""

    def __init__(self, hanging: RunRequest) -> None:
        self.hanging = hanging
        self.answer = asyncio.Event()
        self.beats: dict[str, int] = {}

    async def heartbeat(self, store: Store, request: RunRequest, policy: JobPolicy) -> int:
        self.beats[request.job] = self.beats.get(request.job, 0) + 1
        if request is self.hanging:
            await self.answer.wait()
        return policy.lease_ms


def test_a_runs_heartbeats_go_on_while_another_runs_beat_hangs() -> None:
    # y (a 60 s lease) sends its beat at 0.3 s, which hangs (its cluster node stopped answering). x is won at
    # 0.35 s with a lease of 1 s: its beats go out and are answered beside y's, every 0.3 s, and x keeps its
    # lease. y's beat is answered at 3.35 s, before it would be given up on (halfway to y's deadline).
    x = RunRequest("x", "1", 1, "token-x", "a")
    y = RunRequest("y", "1", 1, "token-y", "a")

    async def main() -> tuple[dict[str, float], dict[str, int], list[str]]:
        unretrieved: list[str] = []  # what asyncio reports of futures dropped with an exception never read
        asyncio.get_running_loop().set_exception_handler(lambda _, context: unretrieved.append(context["message"]))
        clock = SimClock()
        strategy = HangsFor(y)
        keeper = LeaseKeeper(cast(Strategy, strategy), cast(Store, None), clock, heartbeat_ms=300, margin_ms=50)
        lost: dict[str, float] = {}
        async with serving(keeper):
            hold_noting_the_loss(keeper, y, 60_000, lost)
            await asyncio.sleep(0.35)
            hold_noting_the_loss(keeper, x, 1000, lost)
            await asyncio.sleep(3)
            strategy.answer.set()
            await asyncio.sleep(0.1)
        gc.collect()
        return lost, strategy.beats, unretrieved

    # x's beats at 0.65, 0.95 … 3.35 s; y's second beat goes out as its first is answered (it was due long since).
    assert run_virtual(main(), epoch_s=1_700_000_000, seed=1) == ({}, {"x": 10, "y": 2}, [])


class HangsOnce:
    """The first heartbeat gets no answer for ``hang_s`` (a stale connection, until the client's socket timeout
    gives up on it); the others extend the lease at once."""

    def __init__(self, clock: SimClock, hang_s: float) -> None:
        self.clock = clock
        self.hang_s = hang_s
        self.beats: list[float] = []
        self.abandoned: list[float] = []

    async def heartbeat(self, store: Store, request: RunRequest, policy: JobPolicy) -> int:
        self.beats.append(round(self.clock.monotonic(), 4))
        if len(self.beats) == 1:
            try:
                await asyncio.sleep(self.hang_s)
            except asyncio.CancelledError:
                self.abandoned.append(round(self.clock.monotonic(), 4))
                raise
            raise StoreUnavailableError("Timeout reading from socket")
        return policy.lease_ms


def test_a_heartbeat_that_hangs_is_given_up_on_halfway_to_the_deadline_and_sent_again() -> None:
    # Lease 10 s, heartbeat 3.333 s, 0.5 s of margin: the first beat goes out at 3.333 s with the deadline at
    # 9.5 s, and hangs for 10 s. Waited for, it would fail at 13.333 s, after the deadline: the lease would be
    # lost while the store answered every other command. It is given up on halfway to the deadline (6.4165 s),
    # and sent again 1 s later: the lease is kept.
    async def main() -> tuple[list[float], list[float], dict[str, float]]:
        clock = SimClock()
        strategy = HangsOnce(clock, hang_s=10)
        keeper = LeaseKeeper(cast(Strategy, strategy), cast(Store, None), clock, heartbeat_ms=3333, margin_ms=500)
        lost: dict[str, float] = {}
        async with serving(keeper):
            hold_noting_the_loss(keeper, REQUEST, 10_000, lost)
            await asyncio.sleep(12)
        return strategy.beats, strategy.abandoned, lost

    beats, abandoned, lost = run_virtual(main(), epoch_s=1_700_000_000, seed=1)
    assert (beats, abandoned, lost) == ([3.333, 7.4165, 10.7495], [6.4165], {})


class StaleAfterOneAnswer:
    """A connection (under a real :class:`Store`): its first command is answered after 50 ms; the pipeline that
    follows (the beats queued behind it) gets no answer, as on a connection that went stale, until it is cancelled,
    which drops the connection; what comes after is answered at once."""

    def __init__(self, clock: SimClock) -> None:
        self.clock = clock
        self.calls = 0
        self.cancelled: list[tuple[float, list[str]]] = []

    async def execute(self, command: Command) -> Reply:
        self.calls += 1
        if self.calls == 1:
            await asyncio.sleep(0.05)
        return int(command[2])

    async def execute_many(self, commands: Sequence[Command]) -> list[Reply | StoreError]:
        self.calls += 1
        if self.calls == 2:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.cancelled.append((round(self.clock.monotonic(), 4), [str(c[1]) for c in commands]))
                raise
        return [int(command[2]) for command in commands]


class BeatsThroughTheStore:
    async def heartbeat(self, store: Store, request: RunRequest, policy: JobPolicy) -> int:
        return int(cast(int, await store.execute("BEAT", request.job, policy.lease_ms)))


def test_beats_sent_together_are_given_up_on_together_and_the_retry_goes_on_a_new_connection() -> None:
    # a, b (leases of 1 s) held at 0 and c (60 s) at 10 ms, with 0.3 s heartbeats: at 0.3 s a's beat goes out
    # alone, and b's and c's (at 0.31 s) queue behind it in the store's lane, then leave together, at 0.35 s, on a
    # connection gone stale. b's is given up on at 0.625 s, halfway to its deadline: c's, still unanswered on the
    # same node, is given up on with it, or it would hold the pipeline, and b's retry behind it, until b's
    # deadline (0.95 s): a lease lost while the store answers. The retries go out on a new connection.
    a, b, c = (RunRequest(job, "1", 1, f"token-{job}", "i") for job in "abc")

    async def main() -> tuple[dict[str, float], list[tuple[float, list[str]]]]:
        clock = SimClock()
        connection = StaleAfterOneAnswer(clock)
        store = Store(cast(Connection, connection), owned=False)
        keeper = LeaseKeeper(cast(Strategy, BeatsThroughTheStore()), store, clock, heartbeat_ms=300, margin_ms=50)
        lost: dict[str, float] = {}
        async with serving(keeper):
            hold_noting_the_loss(keeper, a, 1000, lost)
            hold_noting_the_loss(keeper, b, 1000, lost)
            await asyncio.sleep(0.01)
            hold_noting_the_loss(keeper, c, 60_000, lost)
            await asyncio.sleep(3)
        return lost, connection.cancelled

    assert run_virtual(main(), epoch_s=1_700_000_000, seed=1) == ({}, [(0.625, ["b", "c"])])


class OneNodeSilent:
    """Two cluster nodes (a ``Sharded`` connection under a real :class:`Store`): the jobs whose names start with
    "x" are on one that stopped answering; the other answers in 100 ms. Notes the cancelled calls to that one."""

    def __init__(self) -> None:
        self.cancelled_on_the_other = 0

    def lane(self, key: object) -> str:
        return "x" if str(key).startswith("x") else "y"

    async def _answer(self, commands: Sequence[Command]) -> list[Reply | StoreError]:
        if self.lane(commands[0][1]) == "x":
            await asyncio.sleep(3600)
        try:
            await asyncio.sleep(0.1)
        except asyncio.CancelledError:
            self.cancelled_on_the_other += 1
            raise
        return [int(command[2]) for command in commands]

    async def execute(self, command: Command) -> Reply:
        [reply] = await self._answer([command])
        return cast(Reply, reply)

    async def execute_many(self, commands: Sequence[Command]) -> list[Reply | StoreError]:
        return await self._answer(commands)


def test_a_cluster_node_that_stops_answering_costs_the_leases_of_its_own_runs_only() -> None:
    # Five runs on node x, silent, and one on node y, which answers in 100 ms; leases of 1 s, heartbeats every
    # 0.3 s. x's runs give their beats up ever more often as their deadline (0.95 s) nears: that must not cancel
    # y's beats, on their way to another node.
    async def main() -> tuple[dict[str, float], int]:
        clock = SimClock()
        connection = OneNodeSilent()
        store = Store(cast(Connection, connection), owned=False)
        keeper = LeaseKeeper(
            cast(Strategy, BeatsThroughTheStore()), store, clock, heartbeat_ms=300, margin_ms=50,
            lane_of=lambda job: store.lane(job),
        )  # fmt: skip
        lost: dict[str, float] = {}
        async with serving(keeper):
            for job in ["x0", "x1", "x2", "x3", "x4", "y"]:
                hold_noting_the_loss(keeper, RunRequest(job, "1", 1, f"token-{job}", "i"), 1000, lost)
            await asyncio.sleep(3)
        return lost, connection.cancelled_on_the_other

    lost, cancelled = run_virtual(main(), epoch_s=1_700_000_000, seed=1)
    assert (lost, cancelled) == ({f"x{i}": 0.95 for i in range(5)}, 0)


class AnsweredLateThenHangs:
    """The first heartbeat is answered ``delay_s`` after it is sent, extending the lease; later ones get no answer."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.beats = 0

    async def heartbeat(self, store: Store, request: RunRequest, policy: JobPolicy) -> int:
        self.beats += 1
        await asyncio.sleep(self.delay_s if self.beats == 1 else 3600)
        return policy.lease_ms


def test_a_heartbeat_answered_late_extends_the_lease_from_when_it_was_sent() -> None:
    # Lease 1 s, heartbeat 0.3 s, 50 ms of margin. The beat sent at 0.3 s is answered at 0.6 s: the store may
    # have renewed the lease as soon as the beat arrived, so it may end at 1.3 s, and the deadline is 1.25 s.
    # Counted from the answer, it would be 1.55 s: the job would go on past its lease, beside a backup.
    async def main() -> tuple[int, dict[str, float]]:
        clock = SimClock()
        strategy = AnsweredLateThenHangs(delay_s=0.3)
        keeper = LeaseKeeper(cast(Strategy, strategy), cast(Store, None), clock, heartbeat_ms=300, margin_ms=50)
        lost: dict[str, float] = {}
        async with serving(keeper):
            hold_noting_the_loss(keeper, REQUEST, 1000, lost)
            await asyncio.sleep(3)
        return strategy.beats, lost

    # The later beats, unanswered, are given up on and sent again until the deadline.
    beats, lost = run_virtual(main(), epoch_s=1_700_000_000, seed=1)
    assert (beats > 2, lost) == (True, {"job": 1.25})


class AnsweredLate:
    """Every heartbeat is answered ``delay_s`` after it is sent: a store slow to answer, not one that hangs."""

    def __init__(self, clock: SimClock, delay_s: float) -> None:
        self.clock = clock
        self.delay_s = delay_s
        self.beats: list[float] = []

    async def heartbeat(self, store: Store, request: RunRequest, policy: JobPolicy) -> int:
        self.beats.append(round(self.clock.monotonic(), 4))
        await asyncio.sleep(self.delay_s)
        return policy.lease_ms


@pytest.mark.parametrize(("delay_s", "kept"), [(1.2, True), (1.4, True), (1.5, False)])
def test_a_store_slow_to_answer_keeps_the_lease_while_a_beat_can_come_back_before_the_deadline(
    delay_s: float, kept: bool
) -> None:
    # Lease 3 s, heartbeat 1 s, 150 ms of margin; the claim, sent at 0 s, was answered delay_s later, and so is
    # every beat. Given up on halfway to the deadline (at 2.025 s for the first beat, sent at 1.2 s), each answer
    # would come too late and the one sent again after the deadline (2.85 s). The store's round trip says it is
    # slow, not hung: the beat is waited for, and answered before the deadline while the delay is under half of
    # what the deadline leaves (1.425 s).
    async def main() -> tuple[list[float], dict[str, float]]:
        clock = SimClock()
        strategy = AnsweredLate(clock, delay_s)
        keeper = LeaseKeeper(cast(Strategy, strategy), cast(Store, None), clock, heartbeat_ms=1000, margin_ms=150)
        lost: dict[str, float] = {}
        async with serving(keeper):
            await asyncio.sleep(delay_s)  # the claim's answer
            keeper.hold(
                REQUEST, JobPolicy(lease_ms=3000), 0.0, 3000, lambda _: lost.setdefault("job", clock.monotonic())
            )
            await asyncio.sleep(10)
        return strategy.beats, lost

    beats, lost = run_virtual(main(), epoch_s=1_700_000_000, seed=1)
    if kept:
        assert (lost, len(beats)) == ({}, len(set(beats)))  # no beat sent twice: none given up on
        assert len(beats) >= 6
    else:
        assert lost == {"job": 2.85}
