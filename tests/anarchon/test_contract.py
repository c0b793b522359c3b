"""One contract, every strategy, every target: what each claim strategy promises on a real store."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import fakeredis
import pytest
from redis.crc import key_slot

from anarchon import (
    RedisBackend,
    StoreFormatError,
    StoreReplyError,
    StoreUnavailableError,
    UnsupportedStrategyError,
)
from anarchon._adapters import adapt
from anarchon._store import Command, Connection, Reply, ScriptCall, ServerInfo, as_text, command_key
from anarchon._strategies import Claim, JobPolicy, Outcome, RunRequest, run_id
from anarchon._strategies.idmp import CONFIGURE
from sim.servers import start_server
from tests.anarchon.support import (
    IDMP_TRIMMED_QUICKLY,
    SLOT,
    StoreTarget,
    claim_one,
    record,
    request,
    server_ms,
    trimmed_after_claims_sent_together,
)
from tests.support import Recording, backend_for, runs_script

STRATEGIES = ["lease", "stream-id", "idmp", "script"]
OVERLAP_OK = JobPolicy(overlap=True)  # several runs of one job live at once, where a test needs that
# A lease or window that must still be live at the next request, on a real server: no test process stalls this
# long between two requests, however loaded the machine. The tests then wait it out in real time.
LIVE_MS = 1_000


@pytest.fixture(autouse=True)
def every_script_keeps_to_one_cluster_slot(monkeypatch: pytest.MonkeyPatch) -> Any:
    """On a cluster a script whose keys hash to different slots is refused (CROSSSLOT): checked for every script
    these tests run, on every target."""
    crossing: list[tuple[str, Sequence[str]]] = []
    evalsha = ScriptCall.evalsha

    def checked(call: ScriptCall) -> list[Any]:
        if len({key_slot(key.encode()) for key in call.keys}) > 1:
            crossing.append((call.script.name, call.keys))
        return evalsha(call)

    monkeypatch.setattr(ScriptCall, "evalsha", checked)
    yield
    assert crossing == []


@pytest.fixture(params=STRATEGIES)
def strategy(request: pytest.FixtureRequest, target: StoreTarget) -> str:
    name: str = request.param
    if name == "idmp" and not target.supports_idmp:
        pytest.skip(f"idmp needs Redis 8.6+; {target.name} is {target.describe}")
    return name


async def test_one_winner_among_20_concurrent_claimers(target: StoreTarget, strategy: str) -> None:
    backends = [await target.started_backend(strategy) for _ in range(20)]
    policy = JobPolicy(lease_ms=10_000, overlap=True)
    for slot in (SLOT, SLOT + 1000, SLOT + 2000):
        claims = await asyncio.gather(
            *(b.strategy.claim(b.store, [(request(slot, f"t{i}"), policy)]) for i, b in enumerate(backends))
        )
        outcomes = [claim.outcome for [claim] in claims]
        assert outcomes.count(Outcome.WON) == 1, outcomes
        loser = Outcome.RUNNING if strategy == "lease" else Outcome.LOST
        assert outcomes.count(loser) == 19, outcomes


async def test_a_claim_batch_is_answered_in_order(target: StoreTarget, strategy: str) -> None:
    backend = await target.started_backend(strategy)
    policy = OVERLAP_OK
    first = await backend.strategy.claim(backend.store, [(request(SLOT + i, "a"), policy) for i in range(50)])
    assert [c.outcome for c in first] == [Outcome.WON] * 50
    again = await backend.strategy.claim(backend.store, [(request(SLOT + i, "b"), policy) for i in range(50)])
    assert {c.outcome for c in again} == {Outcome.RUNNING if strategy == "lease" else Outcome.LOST}
    # Answers that differ within one batch, so that answers handed back out of order would show.
    later = SLOT + 100_000
    mixed = await backend.strategy.claim(
        backend.store, [(request(later + i, token), policy) for i in range(25) for token in ("a", "b")]
    )
    loser = Outcome.RUNNING if strategy == "lease" else Outcome.LOST
    assert [c.outcome for c in mixed] == [Outcome.WON, loser] * 25
    fences = [c.fence for c in mixed[::2]]
    assert fences == sorted(set(fences))  # each won claim's own fence, in the order they were sent


async def test_stale_tokens_cannot_heartbeat_or_finish(target: StoreTarget) -> None:
    backend = await target.started_backend("lease")
    policy = JobPolicy(lease_ms=5_000)
    mine, other = request(SLOT, "mine"), request(SLOT, "other")
    claim = await claim_one(backend, mine, policy)
    assert claim.outcome is Outcome.WON
    assert await backend.strategy.heartbeat(backend.store, other, policy) == 0
    assert not await backend.strategy.finish(backend.store, other, claim, policy, record(other, claim))
    assert await backend.strategy.heartbeat(backend.store, mine, policy) == 5_000
    assert await backend.strategy.finish(backend.store, mine, claim, policy, record(mine, claim))
    assert await backend.strategy.heartbeat(backend.store, mine, policy) == 0  # finished: nothing to extend


async def test_a_finish_sent_again_is_told_the_result_is_recorded_once(target: StoreTarget) -> None:
    """A finish whose reply was lost is sent again: the store has the result already. The same status from the
    same attempt is told so; another status, or another token, is refused; one record is kept."""
    backend = await target.started_backend("lease")
    policy = JobPolicy(lease_ms=5_000)
    mine = request(SLOT, "mine")
    claim = await claim_one(backend, mine, policy)
    finished = record(mine, claim, "error", "boom")
    assert await backend.strategy.finish(backend.store, mine, claim, policy, finished)
    assert await backend.strategy.finish(backend.store, mine, claim, policy, finished)
    assert not await backend.strategy.finish(backend.store, mine, claim, policy, record(mine, claim))  # "ok"
    other = request(SLOT, "other")
    assert not await backend.strategy.finish(backend.store, other, claim, policy, record(other, claim, "error"))
    history = await backend.strategy.history(backend.store, "sync", 10)
    assert [(r.status, r.message, r.token) for r in history] == [("error", "boom", "mine")]


async def test_a_heartbeat_that_comes_after_its_lease_ended_is_refused(target: StoreTarget) -> None:
    """Its holder has given the run up by then. Brought back, the lease would block the job's next slot as an
    overlap (nobody runs it) and hold the backups off for another lease; or run beside a run begun meanwhile."""
    backend = await target.started_backend("lease")
    policy = JobPolicy(lease_ms=300)
    mine = request(SLOT, "mine")
    assert (await claim_one(backend, mine, policy)).outcome is Outcome.WON
    await asyncio.sleep(0.35)
    assert await backend.strategy.heartbeat(backend.store, mine, policy) == 0
    due = await claim_one(backend, request(SLOT + 1000, "next"), policy)
    assert due.outcome is Outcome.WON  # not skipped as an overlap of a lease nobody holds


async def test_expired_lease_is_taken_over_with_a_new_attempt_and_a_larger_fence(target: StoreTarget) -> None:
    backend = await target.started_backend("lease")
    policy = JobPolicy(lease_ms=LIVE_MS, max_attempts=3)
    first, backup = request(SLOT, "first"), request(SLOT, "backup")
    won = await claim_one(backend, first, policy)
    standby = await claim_one(backend, backup, policy)
    assert (won.outcome, won.attempt) == (Outcome.WON, 1)
    assert standby.outcome is Outcome.RUNNING
    assert 0 < standby.lease_ms_left <= LIVE_MS
    await asyncio.sleep(LIVE_MS / 1000 + 0.05)
    taken = await claim_one(backend, backup, policy)
    assert isinstance(taken, Claim)
    assert (taken.outcome, taken.attempt) == (Outcome.WON, 2)
    assert taken.fence > won.fence
    assert await backend.strategy.heartbeat(backend.store, first, policy) == 0
    assert not await backend.strategy.finish(backend.store, first, won, policy, record(first, won))
    assert await backend.strategy.finish(backend.store, backup, taken, policy, record(backup, taken))
    history = await backend.strategy.history(backend.store, "sync", 10)
    assert [(r.attempt, r.status) for r in history] == [(2, "ok"), (1, "interrupted")]
    assert history[1].message == "lease expired; taken over by attempt 2"


async def test_a_lease_ends_by_the_servers_clock_when_the_runs_stream_is_ahead_of_it(target: StoreTarget) -> None:
    """A clock set back, or a failover to a server whose clock is behind, leaves the runs stream's last id ahead
    of the clock (a new entry's id is never below it). Each attempt's lease still ends lease_ms after its claim by
    the server's clock: a backup takes a crashed winner's run over then, not ten minutes later."""
    backend = await target.started_backend("lease")
    policy = JobPolicy(lease_ms=150, max_attempts=3)
    before = await target.server_ms()
    await target.raw("XADD", "{cron:sync}:runs", f"{before + 600_000}-0", "run", "from a clock ahead")
    first, backup = request(SLOT, "first"), request(SLOT, "backup")
    won = await claim_one(backend, first, policy)
    await asyncio.sleep(0.2)
    taken = await claim_one(backend, backup, policy)
    assert (won.outcome, taken.outcome, taken.attempt) == (Outcome.WON, Outcome.WON, 2)
    await asyncio.sleep(0.2)
    third = await claim_one(backend, request(SLOT, "third"), policy)
    assert (third.outcome, third.attempt) == (Outcome.WON, 3)
    after = await target.server_ms()
    history = await backend.strategy.history(backend.store, "sync", 10)
    assert [r.attempt for r in history] == [2, 1]  # the third is running
    assert all(before <= r.started <= after for r in history), [r.started - before for r in history]


async def test_a_released_run_is_taken_over_at_once_by_the_next_attempt(target: StoreTarget) -> None:
    backend = await target.started_backend("lease")
    policy = JobPolicy(lease_ms=60_000, max_attempts=3)
    first, backup = request(SLOT, "first"), request(SLOT, "backup")
    won = await claim_one(backend, first, policy)
    assert (await claim_one(backend, backup, policy)).outcome is Outcome.RUNNING  # a minute of lease left
    assert not await backend.strategy.release(backend.store, backup)  # not the backup's to give back
    assert await backend.strategy.release(backend.store, first)
    assert await backend.strategy.release(backend.store, first)  # again: a hand-back whose answer was lost
    # A heartbeat sent before the hand-back (the heartbeat thread has a connection of its own) that arrives after
    # it does not take the lease back for another minute.
    assert await backend.strategy.heartbeat(backend.store, first, policy) == 0
    # Nor does a finish close the run under the backup (the scheduler sends one or the other, never both).
    assert not await backend.strategy.finish(backend.store, first, won, policy, record(first, won, "interrupted"))
    late_copy = await claim_one(backend, first, policy)  # of its own claim: nor does it take the run back
    assert (late_copy.outcome, late_copy.attempt) == (Outcome.DONE, 1)
    taken = await claim_one(backend, backup, policy)  # no wait for the minute's lease
    assert (taken.outcome, taken.attempt) == (Outcome.WON, 2)
    assert taken.fence > won.fence
    assert not await backend.strategy.finish(backend.store, first, won, policy, record(first, won))
    assert not await backend.strategy.release(backend.store, first)
    assert await backend.strategy.finish(backend.store, backup, taken, policy, record(backup, taken))
    history = await backend.strategy.history(backend.store, "sync", 10)
    assert [(r.attempt, r.status, r.token) for r in history] == [(2, "ok", "backup"), (1, "interrupted", "first")]
    assert history[1].message == "handed back; taken over by attempt 2"


async def test_a_released_run_with_no_attempts_left_is_closed_by_the_next_claim(target: StoreTarget) -> None:
    backend = await target.started_backend("lease")
    policy = JobPolicy(lease_ms=60_000, max_attempts=1)
    first = request(SLOT, "first")
    await claim_one(backend, first, policy)
    assert await backend.strategy.release(backend.store, first)
    closing = await claim_one(backend, request(SLOT, "backup"), policy)
    assert (closing.outcome, closing.attempt, closing.given_up) == (Outcome.DONE, 1, True)
    later = await claim_one(backend, request(SLOT, "later"), policy)
    assert (later.outcome, later.given_up) == (Outcome.DONE, False)  # said by the claim that gave it up alone
    [entry] = await backend.strategy.history(backend.store, "sync", 10)
    assert (entry.attempt, entry.status, entry.token) == (1, "interrupted", "first")
    assert entry.message == "handed back; no attempts left"


async def test_a_copy_of_the_claim_that_gave_a_run_up_is_told_so_again(target: StoreTarget) -> None:
    """The claim that gives a run up may lose its answer: its retry (the same token) hears "given up" again, so
    that its instance says so; no other claim does, the attempt's own included. The record keeps the attempt's
    token."""
    backend = await target.started_backend("lease")
    policy = JobPolicy(lease_ms=60_000, max_attempts=1)
    first = request(SLOT, "first")
    await claim_one(backend, first, policy)
    assert await backend.strategy.release(backend.store, first)
    closer = request(SLOT, "closer")
    assert (await claim_one(backend, closer, policy)).given_up
    again = await claim_one(backend, closer._replace(retry=True), policy)
    assert (again.outcome, again.attempt, again.given_up) == (Outcome.DONE, 1, True)
    for token in ("first", "other"):
        answer = await claim_one(backend, request(SLOT, token), policy)
        assert (answer.outcome, answer.given_up) == (Outcome.DONE, False), token
    [entry] = await backend.strategy.history(backend.store, "sync", 10)
    assert (entry.attempt, entry.status, entry.token) == (1, "interrupted", "first")


async def test_a_copy_of_the_claim_that_skipped_a_run_for_overlap_is_told_so_again(target: StoreTarget) -> None:
    """The claim that records a run skipped-overlap may lose its answer: its retry hears "overlap" again (with the
    lease left of the run still live, 0 once none is), so that its instance says the slot was skipped; another
    claim hears done."""
    backend = await target.started_backend("lease")
    policy = JobPolicy(lease_ms=60_000)
    earlier = request(SLOT, "earlier")
    won = await claim_one(backend, earlier, policy)
    skipper = request(SLOT + 60_000, "skipper")
    first = await claim_one(backend, skipper, policy)
    again = await claim_one(backend, skipper._replace(retry=True), policy)
    assert first.outcome is again.outcome is Outcome.OVERLAP
    assert 50_000 < again.lease_ms_left <= first.lease_ms_left <= 60_000
    other = await claim_one(backend, request(SLOT + 60_000, "other"), policy)
    assert (other.outcome, other.attempt) == (Outcome.DONE, 1)
    assert await backend.strategy.finish(backend.store, earlier, won, policy, record(earlier, won))
    after = await claim_one(backend, skipper._replace(retry=True), policy)
    assert (after.outcome, after.lease_ms_left) == (Outcome.OVERLAP, 0)
    history = await backend.strategy.history(backend.store, "sync", 10)
    assert [(r.slot, r.status) for r in history] == [(SLOT + 60_000, "skipped-overlap"), (SLOT, "ok")]


async def test_catch_up_reaches_back_to_a_new_jobs_first_start_or_all_the_way_for_a_job_that_ran(
    target: StoreTarget,
) -> None:
    """The first catch-up of a job no instance ever claimed fixes the moment it was first started; later ones get
    the same answer. A job's first claim on the store fixes it too, just before that run's slot: deployed
    without catch-up first, or claimed again after the store lost its data, it has missed nothing from before. A
    job that ran on a store written before claims fixed it may have missed any slot: 0."""
    backend = await target.started_backend("lease")
    since = backend.strategy.catch_up_since
    assert await since(backend.store, "new", SLOT) == SLOT
    assert await since(backend.store, "new", SLOT + 60_000) == SLOT
    assert await target.raw("HGET", "{cron:new}:state", "since") == str(SLOT)  # beside the fence, in the state
    await claim_one(backend, request(SLOT, "a", job="ran"), JobPolicy())
    assert await since(backend.store, "ran", SLOT + 60_000) == SLOT - 1  # its slot counts (after "since")
    await claim_one(backend, request(SLOT + 1000, "a", job="ran"), JobPolicy())
    assert await since(backend.store, "ran", SLOT + 120_000) == SLOT - 1  # the first claim's, not a later one's
    await target.raw("HDEL", "{cron:ran}:state", "since")  # as a store written before claims fixed it
    assert await since(backend.store, "ran", SLOT + 180_000) == 0


async def test_a_clock_ahead_does_not_put_a_jobs_first_start_later_than_the_stores_now(target: StoreTarget) -> None:
    """An instance whose clock runs 30 s ahead asks first (or claims a slot 30 s ahead first): the job's catch-up
    still reaches back to the store's now, not to the moment its clock showed, so the slots in between, which no
    instance claimed, stay within a catch-up's reach."""
    backend = await target.started_backend("lease")
    since = backend.strategy.catch_up_since
    before = await target.server_ms()
    assert before <= await since(backend.store, "asked", before + 30_000) <= await target.server_ms()
    ahead = before + 30_000
    await claim_one(backend, request(ahead, "a", job="claimed"), JobPolicy())
    assert before <= await since(backend.store, "claimed", ahead + 60_000) <= await target.server_ms()


@pytest.mark.parametrize("claim_only", ["stream-id", "script"])  # idmp's is theirs (ClaimOnlyStrategy)
async def test_claim_only_strategies_have_nothing_to_release(target: StoreTarget, claim_only: str) -> None:
    backend = await target.started_backend(claim_only)
    mine = request(SLOT, "mine")
    assert (await claim_one(backend, mine, JobPolicy())).outcome is Outcome.WON
    assert not await backend.strategy.release(backend.store, mine)


async def test_every_lease_attempt_appends_to_runs(target: StoreTarget) -> None:
    backend = await target.started_backend("lease")
    policy = JobPolicy(lease_ms=LIVE_MS, max_attempts=3)
    first = await claim_one(backend, request(SLOT, "first"), policy)
    standby = await claim_one(backend, request(SLOT, "backup"), policy)
    assert (first.outcome, standby.outcome) == (Outcome.WON, Outcome.RUNNING)  # a backup's wait adds nothing
    await asyncio.sleep(LIVE_MS / 1000 + 0.05)  # the first attempt's lease runs out
    second = await claim_one(backend, request(SLOT, "backup"), policy)
    assert (second.outcome, second.attempt) == (Outcome.WON, 2)
    entries = await target.raw("XRANGE", "{cron:sync}:runs", "-", "+")
    attempts = [dict(zip(fields[::2], fields[1::2], strict=True)) for _, fields in entries]
    assert [(a["run"], a["slot"], a["attempt"], a["token"], a["runner"]) for a in attempts] == [
        (str(SLOT), str(SLOT), "1", "first", "runner-first"),
        (str(SLOT), str(SLOT), "2", "backup", "runner-backup"),
    ]
    # A first attempt's fence is the store's clock as its entry's id has it (ms × 1000); a takeover's comes from the
    # TIME its claim read before adding the entry, which may be a ms apart from the id: it is above the last.
    assert int(as_text(entries[0][0]).split("-")[0]) * 1000 == first.fence
    assert first.fence < second.fence


async def test_a_run_out_of_attempts_is_done_and_recorded_interrupted(target: StoreTarget) -> None:
    backend = await target.started_backend("lease")
    policy = JobPolicy(lease_ms=100, max_attempts=1)
    won = await claim_one(backend, request(SLOT, "a"), policy)
    assert won.outcome is Outcome.WON
    await asyncio.sleep(0.15)
    late = await claim_one(backend, request(SLOT, "b"), policy)
    assert late.outcome is Outcome.DONE
    [entry] = await backend.strategy.history(backend.store, "sync", 10)
    assert (entry.attempt, entry.status, entry.token) == (1, "interrupted", "a")


async def test_done_after_finish_whatever_the_status(target: StoreTarget) -> None:
    backend = await target.started_backend("lease")
    policy = JobPolicy()
    for slot, status in ((SLOT, "ok"), (SLOT + 1, "error")):
        req = request(slot, "a")
        claim = await claim_one(backend, req, policy)
        message = "boom" if status == "error" else None
        assert await backend.strategy.finish(backend.store, req, claim, policy, record(req, claim, status, message))
        after = await claim_one(backend, request(slot, "b"), policy)
        assert after.outcome is Outcome.DONE
    [error, ok] = await backend.strategy.history(backend.store, "sync", 10)
    assert (error.status, error.message, ok.status, ok.message) == ("error", "boom", "ok", None)


async def test_a_retried_claim_recognises_its_own_token(target: StoreTarget, strategy: str) -> None:
    backend = await target.started_backend(strategy)
    req = request(SLOT, "mine")
    first = await claim_one(backend, req, JobPolicy())
    retry = await claim_one(backend, req._replace(retry=True), JobPolicy())
    assert first.outcome is retry.outcome is Outcome.WON
    if strategy == "lease":  # nobody heard the first fence: the renewed lease takes the next
        assert retry.fence > first.fence
    else:
        assert retry.fence == first.fence
    # Another instance's retry is not fooled.
    rival = await claim_one(backend, request(SLOT, "rival")._replace(retry=True), JobPolicy())
    assert rival.outcome is (Outcome.RUNNING if strategy == "lease" else Outcome.LOST)


async def test_a_claim_the_client_sent_twice_is_won(target: StoreTarget, strategy: str) -> None:
    """A client that sends a command again when its reply is late (redis-py's default retry, on a client the app
    passes in): the second copy meets the first's write, and the claim is still the caller's, not another's."""
    backend = await target.started_backend(strategy)
    req = request(SLOT, "mine")
    first = await claim_one(backend, req, JobPolicy())
    again = await claim_one(backend, req, JobPolicy())  # not marked as a retry: anarchon did not send it again
    assert first.outcome is again.outcome is Outcome.WON
    if strategy == "lease":
        assert again.fence > first.fence
    else:
        assert again.fence == first.fence


@pytest.mark.parametrize(
    ("lease_ms", "retried_after_s"), [(LIVE_MS, LIVE_MS / 1000 + 0.05), (1000, 0.95)], ids=["ran-out", "nearly-out"]
)
async def test_a_retried_claim_renews_its_own_lease(target: StoreTarget, lease_ms: int, retried_after_s: float) -> None:
    """The first claim's answer was lost. Its retry comes after the lease ran out (the store stayed out of reach
    for longer; nobody took over), or with 50 ms of it left: less than the share of the lease a winner gives up
    before its end (5 %), so the caller would stop the run before its first heartbeat. Either way the retry
    renews the lease in full, as a heartbeat would."""
    backend = await target.started_backend("lease")
    policy = JobPolicy(lease_ms=lease_ms)
    req = request(SLOT, "mine")
    first = await claim_one(backend, req, policy)
    await asyncio.sleep(retried_after_s)
    retry = await claim_one(backend, req._replace(retry=True), policy)
    assert (retry.outcome, retry.attempt, retry.lease_ms_left) == (Outcome.WON, 1, lease_ms)
    assert retry.fence > first.fence
    backup = await claim_one(backend, request(SLOT, "backup"), policy)
    assert backup.outcome is Outcome.RUNNING  # the lease is live again, and whole: no takeover
    assert lease_ms // 2 < backup.lease_ms_left <= lease_ms  # not the 50 ms a lease nearly out had left
    assert await backend.strategy.finish(backend.store, req, retry, policy, record(req, retry))


async def test_a_retried_claim_whose_lease_ran_out_takes_a_fence_above_those_taken_meanwhile(
    target: StoreTarget,
) -> None:
    """The first claim's answer was lost; its lease ran out; the next slot's run took fence 2 and ended. The
    renewed lease, whose first fence nobody heard, takes the next one: the fences acknowledged keep growing
    (found by the explorer with lost answers and late claims)."""
    backend = await target.started_backend("lease")
    policy = JobPolicy(lease_ms=300)
    mine = request(SLOT, "mine")
    first = await claim_one(backend, mine, policy)
    await asyncio.sleep(0.35)
    following = request(SLOT + 1000, "next")
    next_run = await claim_one(backend, following, policy)
    assert next_run.fence > first.fence
    assert await backend.strategy.finish(backend.store, following, next_run, policy, record(following, next_run))
    retry = await claim_one(backend, mine._replace(retry=True), policy)
    assert (retry.outcome, retry.attempt) == (Outcome.WON, 1)
    assert retry.fence > next_run.fence
    assert await backend.strategy.finish(backend.store, mine, retry, policy, record(mine, retry))
    [recorded] = [r for r in await backend.strategy.history(backend.store, mine.job, 5) if r.slot == SLOT]
    assert (recorded.status, recorded.fence) == ("ok", retry.fence)
    third = await claim_one(backend, request(SLOT + 2000, "third"), policy)
    assert third.fence > retry.fence  # the counter moved with it


async def test_lease_fences_keep_growing_after_the_store_lost_the_jobs_state(target: StoreTarget) -> None:
    """A store that lost its data (restarted without persistence) starts the job's fence counter again. The fences
    of the attempts that follow still exceed those before, as they follow the server's clock: a downstream system
    that refuses stale fences refuses none of the runs that come after the loss."""
    backend = await target.started_backend("lease")
    policy = JobPolicy()
    before = []
    for k in range(3):
        run = request(SLOT + k * 1000, f"t{k}")
        won = await claim_one(backend, run, policy)
        assert await backend.strategy.finish(backend.store, run, won, policy, record(run, won))
        before.append(won.fence)
    assert before == sorted(set(before))
    await asyncio.sleep(0.002)  # a store that restarts does so in more than the ms of the last claim
    await target.raw("FLUSHALL")
    after = await claim_one(backend, request(SLOT + 3000, "t3"), policy)
    assert after.outcome is Outcome.WON
    assert after.fence > before[-1], (before, after)


async def test_lease_a_retried_claim_takes_a_fence_above_one_a_failover_lost(target: StoreTarget) -> None:
    """The first claim's answer was lost. Another run of the job then won on the primary, which failed before its
    replica had that claim (emulated: its run's state and the fence counter put back as the replica has them).
    The retry, renewing its lease on the promoted replica, takes a fence above the one the lost claim was told: a
    downstream system that took that run's writes does not refuse this one's."""
    backend = await target.started_backend("lease")
    policy = JobPolicy(lease_ms=60_000, overlap=True)
    keys = backend.strategy.keys.lease("sync")
    mine, other = request(SLOT, "mine"), request(SLOT + 1000, "other")
    assert (await claim_one(backend, mine, policy)).outcome is Outcome.WON
    replicated = await target.raw("HGET", keys.state, "fence")
    await asyncio.sleep(0.002)
    lost = await claim_one(backend, other, policy)
    await target.raw("HDEL", keys.state, other.run)
    await target.raw("SREM", keys.active, other.run)
    await target.raw("HSET", keys.state, "fence", replicated)
    await asyncio.sleep(0.002)  # a failover takes longer than the ms of the lost claim
    retry = await claim_one(backend, mine._replace(retry=True), policy)
    assert retry.outcome is Outcome.WON
    assert retry.fence > lost.fence


async def test_a_retried_claim_whose_lease_ran_out_waits_for_a_run_that_started_meanwhile(
    target: StoreTarget,
) -> None:
    """Overlap forbidden: the next slot's run started once the retried run's lease had run out; renewing that
    lease would run the two side by side."""
    backend = await target.started_backend("lease")
    policy = JobPolicy(lease_ms=LIVE_MS)
    req = request(SLOT, "mine")
    first = await claim_one(backend, req, policy)
    await asyncio.sleep(LIVE_MS / 1000 + 0.05)
    following = await claim_one(backend, request(SLOT + 1_000, "next"), policy)
    assert following.outcome is Outcome.WON
    retry = await claim_one(backend, req._replace(retry=True), policy)
    assert (retry.outcome, retry.attempt, retry.fence) == (Outcome.RUNNING, 1, first.fence)
    assert 0 < retry.lease_ms_left <= LIVE_MS  # it asks again when the other run's lease ends


def remembering(strategy: str, seconds: int) -> Any:
    """The strategy, set to remember a run for ``seconds`` where it forgets runs (script, idmp)."""
    settings = {"script": {"window_ms": seconds * 1000}, "idmp": {"duration_sec": seconds}}.get(strategy)
    return {"name": strategy, **settings} if settings else strategy


async def test_a_late_skip_is_recorded_only_while_the_store_remembers_the_run(
    target: StoreTarget, strategy: str
) -> None:
    """Past what the store remembers of a run (lease: keep_ms; script: window_ms; idmp: duration_sec; stream-id:
    forever) its claim could win again although the run ran: no skip is recorded then. A script or idmp skip's
    claim finds an early claim (see the next tests): their skips are recorded through the whole window."""
    backend = await target.started_backend(remembering(strategy, 120))
    policy = JobPolicy(late_after_ms=100, keep_ms=1_000)
    now = await target.server_ms()
    forgets = strategy in ("script", "idmp")
    forgotten = now - (121_000 if forgets else 61_000)
    remembered = [now - 65_000, now - 500] if forgets else [now - 500]
    for slot in (forgotten, *remembered):  # in slot order: stream-id refuses an earlier slot after a later one
        request = RunRequest("sync", run_id(slot), slot, f"t{slot}", "b")
        recorded = await backend.strategy.skip(backend.store, request, policy, "skipped-late", "too late")
        assert recorded is (slot in remembered or strategy == "stream-id"), slot - now


async def test_script_a_late_skip_finds_the_claim_of_a_clock_far_ahead(target: StoreTarget) -> None:
    """An instance whose clock ran 100 s ahead claimed a slot 130 s ago (its entry is older than the 120 s window,
    its slot inside it) and runs it still: no result yet. A late skip of the slot must not claim it again and
    record a skip beside the run. Its claim looks back to window_ms before the slot, and trims keep an entry
    whose slot is inside the window, if it was made no more than window_ms before its slot: one of a clock 210 s
    ahead goes (kept, a clock a year ahead would hold up every trim for a year). A skip's claim of a slot more
    than window_ms past claims nothing: trims may have taken its early claim."""
    backend = await target.started_backend({"name": "script", "window_ms": 120_000})
    policy = JobPolicy(late_after_ms=100, history_size=1)
    now = await target.server_ms()
    slot = now - 30_000
    runs = backend.keys.claim("sync").runs
    await target.raw("XADD", runs, f"{now - 200_000}-0", "slot", now + 10_000, "token", "far", "runner", "z")
    await target.raw("XADD", runs, f"{now - 130_000}-0", "slot", slot, "token", "early", "runner", "a")
    # A claim of a later slot trims the stream to history_size, but not the entry whose slot is inside the window.
    assert (await claim_one(backend, request(now, "b"), policy)).outcome is Outcome.WON
    late = RunRequest("sync", run_id(slot), slot, "late", "c")
    assert not await backend.strategy.skip(backend.store, late, policy, "skipped-late", "too late")
    assert await backend.strategy.history(backend.store, "sync", 10) == []
    entries = await target.raw("XRANGE", runs, "-", "+")
    assert [(fields[1], fields[3]) for _, fields in entries] == [(str(slot), "early"), (str(now), "b")]
    too_late = RunRequest("sync", run_id(now - 121_000), now - 121_000, "late", "c")
    assert (await backend.strategy.claim_for_skip(backend.store, too_late, policy)).outcome is Outcome.LOST
    assert len(await target.raw("XRANGE", runs, "-", "+")) == 2


async def test_idmp_a_late_skip_finds_the_claim_of_a_clock_ahead_the_server_forgot(target: StoreTarget) -> None:
    """An instance whose clock ran 2 s ahead claimed a slot early and runs it still; the server forgets the claim's
    id 3 to 4 s (duration_sec, counted in whole seconds) after the claim, before the slot's duration is over. A
    late skip of the slot then must not claim it again and record a skip beside the run: its claim looks for the
    slot's entry among those of the stream's duration before the slot."""
    if not target.supports_idmp:
        pytest.skip(f"idmp needs Redis 8.6+; {target.name} is {target.describe}")
    backend = await target.started_backend({"name": "idmp", "duration_sec": 3, "max_size": 100})
    policy = JobPolicy(late_after_ms=100)
    slot = await target.server_ms() + 2_000
    assert (await claim_one(backend, request(slot, "early"), policy)).outcome is Outcome.WON
    await asyncio.sleep(4.1)
    # Forgotten, as the test needs (within a second after the duration), while the slot is inside its own
    assert await _ids_remembered(target, "cron:sync:runs", wait_s=0.7) == 0
    late = RunRequest("sync", run_id(slot), slot, "late", "b")
    assert not await backend.strategy.skip(backend.store, late, policy, "skipped-late", "too late")
    assert await backend.strategy.history(backend.store, "sync", 10) == []
    assert await target.raw("XLEN", backend.keys.claim("sync").runs) == 1


async def test_idmp_history_ttl_ms_keeps_the_entries_a_late_skip_looks_through(target: StoreTarget) -> None:
    """As above, with history_ttl_ms 1 ms: a record of another slot, once the server forgot the early claim's id,
    ages the runs stream. It must keep the early claim's entry, which a skip of its slot looks for until the
    slot's duration is over: every entry of the last two durations stays."""
    if not target.supports_idmp:
        pytest.skip(f"idmp needs Redis 8.6+; {target.name} is {target.describe}")
    backend = await target.started_backend({"name": "idmp", "duration_sec": 3, "max_size": 100})
    policy = JobPolicy(late_after_ms=100, history_ttl_ms=1)
    slot = await target.server_ms() + 2_000
    assert (await claim_one(backend, request(slot, "early"), policy)).outcome is Outcome.WON
    await asyncio.sleep(4.1)
    # Forgotten, as the test needs (within a second after the duration), while the slot is inside its own
    assert await _ids_remembered(target, "cron:sync:runs", wait_s=0.7) == 0
    other = request(slot + 1_000, "other")
    claim = await claim_one(backend, other, policy)
    assert await backend.strategy.finish(backend.store, other, claim, policy, record(other, claim))
    late = RunRequest("sync", run_id(slot), slot, "late", "b")
    assert not await backend.strategy.skip(backend.store, late, policy, "skipped-late", "too late")
    assert [r.slot for r in await backend.strategy.history(backend.store, "sync", 10)] == [other.slot]


async def test_idmp_a_skips_claim_after_the_runs_duration_claims_nothing(target: StoreTarget) -> None:
    """A skip checks that the run is inside its duration a round trip before its claim runs. A claim that comes
    after the duration, once the server forgot the id of the run's claim made on time, must not win the run again
    (and record a skip beside it): the claim script checks the duration by the server's clock too."""
    if not target.supports_idmp:
        pytest.skip(f"idmp needs Redis 8.6+; {target.name} is {target.describe}")
    backend = await target.started_backend({"name": "idmp", "duration_sec": 2, "max_size": 100})
    policy = JobPolicy(late_after_ms=100)
    slot = await target.server_ms() - 100
    assert (await claim_one(backend, request(slot, "on-time"), policy)).outcome is Outcome.WON
    await asyncio.sleep(3.2)  # past the duration
    assert await _ids_remembered(target, "cron:sync:runs", wait_s=1.0) == 0  # forgotten, within a second after it
    late = RunRequest("sync", run_id(slot), slot, "late", "b")
    assert (await backend.strategy.claim_for_skip(backend.store, late, policy)).outcome is Outcome.LOST
    assert await target.raw("XLEN", backend.keys.claim("sync").runs) == 1


async def test_idmp_a_stream_made_again_with_shorter_settings_gets_this_instances_back(target: StoreTarget) -> None:
    """The store lost its data, and an instance of a deploy with a shorter duration made the job's stream again
    with its settings. An instance with a longer one, whose late claims the stream must remember, reads the
    stream's settings again with the claim of a slot five minutes past the last time (with its read-back, in the
    same round trip), and starts configuring the stream again then; the job's next claim waits for that."""
    if not target.supports_idmp:
        pytest.skip(f"idmp needs Redis 8.6+; {target.name} is {target.describe}")
    longer = await target.started_backend({"name": "idmp", "duration_sec": 6, "max_size": 100})
    slot = await target.server_ms()
    assert (await claim_one(longer, request(slot, "a"), JobPolicy())).outcome is Outcome.WON
    assert await target.raw("DEL", "cron:sync:runs") == 1
    await target.started_backend({"name": "idmp", "duration_sec": 2, "max_size": 100})
    assert await _idmp_settings(target, "cron:sync:runs") == (2, 100)
    assert (await claim_one(longer, request(slot + 299_000, "a"), JobPolicy())).outcome is Outcome.WON
    assert await _idmp_settings(target, "cron:sync:runs") == (2, 100)
    checked = request(slot + 300_000, "a")
    assert (await claim_one(longer, checked, JobPolicy())).outcome is Outcome.WON
    # The job's next claim waits for the configuration, which copied the checking claim's run back in.
    assert (await claim_one(longer, request(checked.slot, "late"), JobPolicy())).outcome is Outcome.LOST
    assert await _idmp_settings(target, "cron:sync:runs") == (6, 100)


async def test_idmp_the_runs_stream_is_aged_by_the_servers_clock(target: StoreTarget) -> None:
    """A record of an instance whose clock runs 6 s ahead, with history_ttl_ms 1 ms, must not age out the entry of
    a run the server still remembers (duration 4 s): its claim, retried after its answer was lost, would read
    nothing back and be told "lost", and nobody would run the run."""
    if not target.supports_idmp:
        pytest.skip(f"idmp needs Redis 8.6+; {target.name} is {target.describe}")
    backend = await target.started_backend({"name": "idmp", "duration_sec": 4, "max_size": 100})
    policy = JobPolicy(history_ttl_ms=1)
    now = await target.server_ms()
    mine = request(now - 500, "mine")
    assert (await claim_one(backend, mine, policy)).outcome is Outcome.WON  # its answer lost, say
    ahead = request(now + 60_000, "ahead")
    claim = await claim_one(backend, ahead, policy)
    recorded = replace(record(ahead, claim), ended=await target.server_ms() + 6_000)
    assert await backend.strategy.finish(backend.store, ahead, claim, policy, recorded)
    assert (await claim_one(backend, mine._replace(retry=True), policy)).outcome is Outcome.WON


async def test_once_started_every_command_names_a_job_key(target: StoreTarget, strategy: str) -> None:
    """Claims, heartbeats, finishes, late skips, catch-ups and history reads each name a key of their job: on a
    cluster each goes to the job's node, in that node's queue (a command without a key goes to any node, in a
    queue of its own), and the clock a skip is judged by is that node's."""
    if strategy == "idmp" and not target.supports_idmp:
        pytest.skip(f"idmp needs Redis 8.6+; {target.name} is {target.describe}")
    connection = Recording(adapt(target.new_client()))
    backend = target.backend(strategy, connection=connection)
    await backend.start(["sync"])
    connection.sent.clear()
    policy = JobPolicy(late_after_ms=100)
    now = await target.server_ms()
    ran = request(now - 2000, "a")
    claim = await claim_one(backend, ran, policy)
    await backend.strategy.heartbeat(backend.store, ran, policy)
    assert await backend.strategy.finish(backend.store, ran, claim, policy, record(ran, claim))
    late = request(now - 1000, "b")
    assert await backend.strategy.skip(backend.store, late, policy, "skipped-late", "too late")
    await backend.strategy.catch_up_since(backend.store, "sync", now)
    assert len(await backend.strategy.history(backend.store, "sync", 10)) == 2
    assert [command for command in connection.sent if command_key(command) is None] == []


async def test_lease_a_late_retry_of_a_won_claim_hands_the_run_back_to_its_backups(target: StoreTarget) -> None:
    """A claim won, its answer lost, and the store out of reach until the run was too late to start: the retry
    (same token) is a skip. Instances that claimed the run meanwhile were told it was running and stand by as
    backups; recorded skipped, the run would be lost to them (found by the explorer's unanswered fault). It is
    handed back instead: a backup's next claim takes it over at once. Another token's skip changes nothing."""
    backend = await target.started_backend("lease")
    policy = JobPolicy(late_after_ms=100, keep_ms=60_000)
    slot = await target.server_ms() - 1_000
    req = RunRequest("sync", run_id(slot), slot, "lost-answer", "a")
    won = await claim_one(backend, req, policy)
    assert won.outcome is Outcome.WON
    backup = RunRequest("sync", run_id(slot), slot, "backup", "b")
    assert (await claim_one(backend, backup, policy)).outcome is Outcome.RUNNING
    assert not await backend.strategy.skip(backend.store, backup, policy, "skipped-late", "too late")
    # Another token's skip left the run to its holder: its lease goes on, and the backup still stands by.
    assert await backend.strategy.heartbeat(backend.store, req, policy) > 0
    assert (await claim_one(backend, backup, policy)).outcome is Outcome.RUNNING
    retry = req._replace(retry=True)
    assert not await backend.strategy.skip(backend.store, retry, policy, "skipped-late", "too late")
    assert not await backend.strategy.heartbeat(backend.store, retry, policy)  # handed back: no longer its run
    takeover = await claim_one(backend, backup, policy)
    assert (takeover.outcome, takeover.attempt) == (Outcome.WON, 2)
    assert takeover.fence > won.fence
    assert await backend.strategy.finish(backend.store, backup, takeover, policy, record(backup, takeover))
    records = [
        (r.status, r.attempt) for r in await backend.strategy.history(backend.store, "sync", 5) if r.slot == slot
    ]
    assert records == [("ok", 2), ("interrupted", 1)]


async def test_no_late_skip_is_recorded_beside_a_run_the_store_forgot(target: StoreTarget, strategy: str) -> None:
    if strategy not in ("script", "idmp"):
        pytest.skip(f"{strategy} does not forget a run within a test's time")
    backend = await target.started_backend(remembering(strategy, 1))
    policy = JobPolicy(late_after_ms=100)
    slot = await target.server_ms() + 200
    ran = RunRequest("sync", run_id(slot), slot, "ran", "a")
    claim = await claim_one(backend, ran, policy)
    assert claim.outcome is Outcome.WON
    assert await backend.strategy.finish(backend.store, ran, claim, policy, record(ran, claim))
    await asyncio.sleep(1.5)  # the store forgets the claim: a new one would win
    late = RunRequest("sync", run_id(slot), slot, "late", "b")
    assert not await backend.strategy.skip(backend.store, late, policy, "skipped-late", "too late")
    history = await backend.strategy.history(backend.store, "sync", 10)
    assert [r.status for r in history if r.slot == slot] == ["ok"]


async def test_idmp_no_late_skip_is_recorded_beside_a_run_whose_id_max_size_evicted(target: StoreTarget) -> None:
    """idmp keeps at most max_size ids per job: a job whose runs come often forgets one well before duration_sec.
    A claim of it then wins again, and a stalled instance's late skip would be recorded beside the run's ok."""
    if not target.supports_idmp:
        pytest.skip(f"idmp needs Redis 8.6+; {target.name} is {target.describe}")
    backend = await target.started_backend({"name": "idmp", "duration_sec": 300, "max_size": 2})
    policy = JobPolicy(late_after_ms=100)
    slot = await target.server_ms() - 10_000
    ran = RunRequest("sync", run_id(slot), slot, "ran", "a")
    claim = await claim_one(backend, ran, policy)
    assert await backend.strategy.finish(backend.store, ran, claim, policy, record(ran, claim))
    for later in (slot + 1000, slot + 2000):  # two later ids: the first one's is evicted
        assert (await claim_one(backend, request(later, f"t{later}"), policy)).outcome is Outcome.WON
    late = RunRequest("sync", run_id(slot), slot, "late", "b")
    assert not await backend.strategy.skip(backend.store, late, policy, "skipped-late", "too late")
    history = await backend.strategy.history(backend.store, "sync", 10)
    assert [r.status for r in history if r.slot == slot] == ["ok"]


async def test_idmp_a_late_skip_claims_nothing_once_the_server_keeps_max_size_ids(target: StoreTarget) -> None:
    """Where the server keeps max_size ids of the job already, a skip's claim could neither tell whether its run was
    claimed (its id may be gone: here a run still going, with no result yet) nor add an id without pushing out
    another run's, whose late claim would then win it again. It claims nothing, and no skip is recorded. Before,
    the first skip was recorded beside the run going on, and the second pushed out a run's id, which a late claim
    then won again."""
    if not target.supports_idmp:
        pytest.skip(f"idmp needs Redis 8.6+; {target.name} is {target.describe}")
    backend = await target.started_backend({"name": "idmp", "duration_sec": 300, "max_size": 2})
    policy = JobPolicy(late_after_ms=100)
    base = await target.server_ms() - 10_000
    for slot in (base, base + 1000, base + 2000):  # the first still going; its id pushed out by the next two
        assert (await claim_one(backend, request(slot, f"t{slot}"), policy)).outcome is Outcome.WON
    for slot in (base, base + 500):  # the run going on; a run nobody claimed
        late = RunRequest("sync", run_id(slot), slot, f"late{slot}", "b")
        assert not await backend.strategy.skip(backend.store, late, policy, "skipped-late", "too late")
    assert (await claim_one(backend, request(base + 1000, "again"), policy)).outcome is Outcome.LOST
    assert await backend.strategy.history(backend.store, "sync", 10) == []


async def test_idmp_trim_keeps_history_size_entries_of_claims_sent_together(target: StoreTarget) -> None:
    """40 claims sent in one batch share a ms or two. The trim after a later run's record deletes the oldest past
    history_size (and max_size), 31 of them here; it deleted every entry of the last one's ms as well, and kept 1."""
    if not target.supports_idmp:
        pytest.skip(f"idmp needs Redis 8.6+; {target.name} is {target.describe}")
    assert (
        await trimmed_after_claims_sent_together(await target.started_backend({"name": "idmp", **IDMP_TRIMMED_QUICKLY}))
        == 10
    )


async def test_idmp_a_late_claim_of_a_run_whose_entry_is_gone_loses(target: StoreTarget) -> None:
    """The stream keeps as many entries as the server remembers ids (max_size), so a known id's entry is there.
    Should it be gone all the same (deleted by hand here), a late claim of that run gets the old entry's ID, reads
    back nothing, and must lose: the run ran."""
    if not target.supports_idmp:
        pytest.skip(f"idmp needs Redis 8.6+; {target.name} is {target.describe}")
    backend = await target.started_backend({"name": "idmp", "duration_sec": 300, "max_size": 1000})
    policy = JobPolicy(history_size=1)
    first = await target.server_ms() - 60_000
    for slot in (first, first + 1000, first + 2000):
        assert (await claim_one(backend, request(slot, f"t{slot}"), policy)).outcome is Outcome.WON
    [[entry_id, _]] = await target.raw("XRANGE", "cron:sync:runs", "-", "+", "COUNT", 1)
    assert await target.raw("XDEL", "cron:sync:runs", entry_id) == 1
    late = await claim_one(backend, request(first, "late"), policy)
    assert late.outcome is Outcome.LOST
    assert await target.raw("XLEN", "cron:sync:runs") == 2  # the known id added no entry
    assert (await claim_one(backend, request(first + 3000, "next"), policy)).outcome is Outcome.WON


@pytest.mark.parametrize("claim_only", ["stream-id", "idmp", "script"])
async def test_a_won_claim_retried_after_many_later_runs_still_wins(target: StoreTarget, claim_only: str) -> None:
    """A claim won, but its answer was lost; by the time it is retried (same token) more runs than history_size
    plus a stream node (100 entries) were claimed and recorded. Within keep_ms (script: window_ms; idmp:
    duration_sec and max_size) its entry is still there to be read back, and the retry wins: told "lost", it would
    leave its run to nobody, as every other instance lost that run."""
    if claim_only == "idmp" and not target.supports_idmp:
        pytest.skip(f"idmp needs Redis 8.6+; {target.name} is {target.describe}")
    backend = await target.started_backend(claim_only)
    policy = JobPolicy(history_size=5, keep_ms=600_000)
    first = await target.server_ms() - 200_000
    mine = RunRequest("sync", run_id(first), first, "mine", "a")
    assert (await claim_one(backend, mine, policy)).outcome is Outcome.WON
    for i in range(1, await node_max_entries(target) + 31):
        later = request(first + i * 1000, f"t{i}")
        claim = await claim_one(backend, later, policy)
        assert claim.outcome is Outcome.WON
        assert await backend.strategy.finish(backend.store, later, claim, policy, record(later, claim))
    retry = await claim_one(backend, mine._replace(retry=True), policy)
    assert retry.outcome is Outcome.WON


@pytest.mark.parametrize("claim_only", ["stream-id", "idmp", "script"])
async def test_history_ttl_ms_ages_the_claim_only_streams_out(target: StoreTarget, claim_only: str) -> None:
    """The manual stream and the runs stream (script's claim script ages its runs itself); idmp keeps its runs
    for two IDMP durations at least (a claim reads its entry back, a late skip's claim looks through them)."""
    if claim_only == "idmp" and not target.supports_idmp:
        pytest.skip(f"idmp needs Redis 8.6+; {target.name} is {target.describe}")
    backend = await target.started_backend(remembering(claim_only, 1))
    policy = JobPolicy(history_ttl_ms=300, keep_ms=300)  # keep_ms: no late or retried claim asks for older runs

    async def run_once(manual: bool) -> None:
        now = await target.server_ms()
        req = RunRequest("sync", run_id(now, "m") if manual else run_id(now), now, f"t{now}{manual}", "a", manual)
        claim = await claim_one(backend, req, policy)
        assert claim.outcome is Outcome.WON
        assert await backend.strategy.finish(backend.store, req, claim, policy, record(req, claim))

    await run_once(manual=True)
    await run_once(manual=False)
    await asyncio.sleep(2.2 if claim_only == "idmp" else 1.2)  # past history_ttl_ms, and twice idmp's duration_sec
    await run_once(manual=False)  # its record trims what is older than history_ttl_ms
    manual = await target.raw("XRANGE", "cron:sync:manual", "-", "+")
    runs = await target.raw("XRANGE", "cron:sync:runs", "-", "+")
    assert manual == []
    assert len(runs) == 1
    assert [r.manual for r in await backend.strategy.history(backend.store, "sync", 10)] == [False]


async def test_history_ttl_ms_keeps_the_stream_id_entry_a_retried_claim_reads_back(target: StoreTarget) -> None:
    backend = await target.started_backend("stream-id")
    policy = JobPolicy(history_ttl_ms=1, keep_ms=60_000)
    now = await target.server_ms()
    mine = RunRequest("sync", run_id(now), now, "mine", "a")
    await claim_one(backend, mine, policy)  # its answer lost, say: the claim is retried below
    later = RunRequest("sync", run_id(now + 1), now + 1, "later", "b")
    claim = await claim_one(backend, later, policy)
    assert await backend.strategy.finish(backend.store, later, claim, policy, record(later, claim))  # trims
    retry = await claim_one(backend, mine._replace(retry=True), policy)
    assert retry.outcome is Outcome.WON


async def test_stream_id_keeps_the_runs_of_the_keep_period_a_slot_a_minute_for_a_five_field_job(
    target: StoreTarget,
) -> None:
    """A job's slots a minute apart: its claims keep history_size entries plus one a minute of the keep period
    (16 here), not one a second (606), and a retry within the keep period still reads its entry back."""
    backend = await target.started_backend("stream-id")
    policy = JobPolicy(history_size=5, keep_ms=600_000, slot_gap_ms=60_000)
    node = await node_max_entries(target)
    first = await target.server_ms() // 60_000 * 60_000 - (node + 30) * 60_000
    slots = [first + i * 60_000 for i in range(node + 30)]
    for slot in slots:
        assert (await claim_one(backend, request(slot, f"t{slot}"), policy)).outcome is Outcome.WON
    assert 5 + 10 + 1 <= await target.raw("XLEN", "cron:sync:runs") <= 5 + 10 + node  # whole nodes go
    retry = RunRequest("sync", run_id(slots[-10]), slots[-10], f"t{slots[-10]}", "b", retry=True)
    assert (await claim_one(backend, retry, policy)).outcome is Outcome.WON


async def test_overlap_is_refused_while_another_run_holds_a_live_lease(target: StoreTarget) -> None:
    backend = await target.started_backend("lease")
    forbid, allow = JobPolicy(lease_ms=5_000), JobPolicy(lease_ms=5_000, overlap=True)
    old = await claim_one(backend, request(SLOT, "a"), forbid)
    assert old.outcome is Outcome.WON
    next_run = await claim_one(backend, request(SLOT + 60_000, "b"), forbid)
    assert next_run.outcome is Outcome.OVERLAP
    again = await claim_one(backend, request(SLOT + 60_000, "c"), forbid)
    assert again.outcome is Outcome.DONE  # the skip was recorded once
    allowed = await claim_one(backend, request(SLOT + 120_000, "d"), allow)
    assert allowed.outcome is Outcome.WON
    statuses = [(r.slot, r.status) for r in await backend.strategy.history(backend.store, "sync", 10)]
    assert statuses == [(SLOT + 60_000, "skipped-overlap")]


async def test_a_claim_before_its_slot_waits_for_the_slot_to_decide_an_overlap(target: StoreTarget) -> None:
    """An instance whose clock runs ahead claims the next slot while the previous run still holds its lease.
    Whether a run is still live at the slot decides, by the store's clock: until then the claim is told to come
    again at the slot, nothing is recorded, and no late skip closes the slot meanwhile (one of a slot nobody
    claimed is recorded). A manual run is decided at once."""
    backend = await target.started_backend("lease")
    policy = JobPolicy(lease_ms=60_000, late_after_ms=100, keep_ms=3_600_000)
    now = await target.server_ms()
    current = request(now - 1_000, "a")
    won = await claim_one(backend, current, policy)
    assert won.outcome is Outcome.WON
    close, soon = now + LIVE_MS, now + 30_000  # the claims below come before `close`
    for slot in (close, soon):
        early = await claim_one(backend, request(slot, "b"), policy)
        assert (early.outcome, early.attempt) == (Outcome.RUNNING, 0)
        assert slot - now - 5_000 < early.lease_ms_left <= slot - now  # at the slot
    manual = RunRequest("sync", run_id(soon, "x"), soon, "m", "d", manual=True)
    assert (await claim_one(backend, manual, policy)).outcome is Outcome.OVERLAP
    await asyncio.sleep((close + policy.late_after_ms + 50 - await target.server_ms()) / 1000)
    # Late now: the slot put off is left to its early claimant; one nobody claimed is recorded skipped.
    for slot, recorded in ((close, False), (now - 10_000, True)):
        late = RunRequest("sync", run_id(slot), slot, f"z{slot}", "e")
        assert await backend.strategy.skip(backend.store, late, policy, "skipped-late", "too late") is recorded
    assert await backend.strategy.finish(backend.store, current, won, policy, record(current, won))
    again = await claim_one(backend, request(soon, "b"), policy)  # nothing live now: it runs, early
    assert again.outcome is Outcome.WON
    statuses = {(r.slot, r.status) for r in await backend.strategy.history(backend.store, "sync", 10)}
    assert statuses == {(now - 1_000, "ok"), (soon, "skipped-overlap"), (now - 10_000, "skipped-late")}


async def test_a_due_slot_waits_for_a_later_slot_begun_early_instead_of_being_skipped(target: StoreTarget) -> None:
    """An instance whose clock runs a whole period or more ahead (a clock jumped forward) won a later slot early,
    while no run was live. The claim of the slot due now meets its run: it is not skipped for overlap (the slot
    would be lost, as the instance ahead has passed it) but told to come again when that run's lease ends, and
    no late skip closes it meanwhile. A run of a slot that is due holds the claims of earlier slots off as before."""
    backend = await target.started_backend("lease")
    policy = JobPolicy(lease_ms=60_000, late_after_ms=100, keep_ms=3_600_000)
    now = await target.server_ms()
    early = request(now + 600_000, "a")  # ten minutes ahead
    won = await claim_one(backend, early, policy)
    assert won.outcome is Outcome.WON
    due = request(now - 1_000, "b")
    told = await claim_one(backend, due, policy)
    assert (told.outcome, told.attempt) == (Outcome.RUNNING, 0)
    assert 55_000 < told.lease_ms_left <= 60_000  # when the early run's lease ends
    late = RunRequest("sync", due.run, due.slot, "z", "e")
    assert not await backend.strategy.skip(backend.store, late, policy, "skipped-late", "too late")
    assert await backend.strategy.finish(backend.store, early, won, policy, record(early, won))
    assert (await claim_one(backend, due, policy)).outcome is Outcome.WON
    later = request(now - 500, "c")  # due, and its claim meets the run of an earlier slot that is due too
    assert (await claim_one(backend, later, policy)).outcome is Outcome.OVERLAP


@pytest.mark.parametrize("manual_first", [False, True])
async def test_a_claim_that_waits_for_other_runs_waits_for_the_last_of_them(
    target: StoreTarget, manual_first: bool
) -> None:
    """Two runs of the job hold live leases (started while overlap was allowed), one for 5 s, one for 60 s: a
    claim that may not overlap them is told to come back when the later lease ends, and names that run, in
    whatever order the job's active set lists them (sorted integers, or hash or insertion order once a manual
    run id joined it)."""
    backend = await target.started_backend("lease")
    short, long = JobPolicy(lease_ms=5_000, overlap=True), JobPolicy(lease_ms=60_000, overlap=True)
    first = RunRequest("sync", run_id(SLOT, "x"), SLOT, "m", "a", manual=True) if manual_first else request(SLOT, "a")
    for req, policy in ((first, short), (request(SLOT + 1000, "b"), long)):
        assert (await claim_one(backend, req, policy)).outcome is Outcome.WON
    refused = await claim_one(backend, request(SLOT + 2000, "c"), JobPolicy(lease_ms=5_000))
    assert refused.outcome is Outcome.OVERLAP
    assert 55_000 < refused.lease_ms_left <= 60_000
    [skipped] = [r for r in await backend.strategy.history(backend.store, "sync", 10) if r.slot == SLOT + 2000]
    assert skipped.message == f"run {SLOT + 1000} was still running"


async def test_keys_and_types_are_the_documented_ones(target: StoreTarget, strategy: str) -> None:
    backend = await target.started_backend(strategy, prefix="billing:cron:")
    policy = JobPolicy(lease_ms=5_000, overlap=True)
    running, finished = request(SLOT, "a"), request(SLOT + 1000, "a")
    manual = RunRequest("sync", run_id(SLOT + 5, "x"), SLOT + 5, "m", "runner-m", manual=True)
    claims = await backend.strategy.claim(backend.store, [(running, policy), (finished, policy), (manual, policy)])
    assert all(isinstance(c, Claim) and c.outcome is Outcome.WON for c in claims), claims
    claim = claims[1]
    await backend.strategy.finish(backend.store, finished, claim, policy, record(finished, claim))
    if strategy == "lease":
        expected = {
            "{billing:cron:sync}:state": "hash",
            "{billing:cron:sync}:active": "set",
            "{billing:cron:sync}:slots": "zset",
            "{billing:cron:sync}:runs": "stream",
            "{billing:cron:sync}:results": "zset",
        }
    else:
        expected = {
            "billing:cron:sync:runs": "stream",
            "billing:cron:sync:manual": "stream",
            "billing:cron:sync:results": "zset",
        }
    expected["billing:cron:format"] = "string"
    keys = await target.raw("KEYS", "*")
    assert sorted(keys) == sorted(expected)
    for key, kind in expected.items():
        assert await target.raw("TYPE", key) == kind, key
    assert await target.raw("GET", "billing:cron:format") == "1"


async def node_max_entries(target: StoreTarget) -> int:
    """The most entries one stream macro node holds: what MAXLEN ~ may leave beyond the length asked for."""
    if target.is_fake:
        return 100  # fakeredis has no CONFIG; 100 is the servers' default
    _, value = await target.raw("CONFIG", "GET", "stream-node-max-entries")
    return int(value)


async def test_history_is_trimmed_but_never_a_running_or_claimable_run(target: StoreTarget, strategy: str) -> None:
    backend = await target.started_backend(strategy)
    history_size, finished = 5, 130  # more runs than history_size plus one stream node (100 entries)
    keep_none = JobPolicy(lease_ms=60_000, history_size=history_size, keep_ms=0, overlap=True)
    now = int(await target.server_ms())
    old_running = request(now - 3_600_000 - 1, "long")  # an hour old, still running
    claim = await claim_one(backend, old_running, keep_none)
    assert claim.outcome is Outcome.WON
    for i in range(finished):
        req = request(now - 3_600_000 + i * 1000, "a")
        c = await claim_one(backend, req, keep_none)
        await backend.strategy.finish(backend.store, req, c, keep_none, record(req, c))
    newest = await backend.strategy.history(backend.store, "sync", 3)  # no more than asked for, newest first
    assert [r.slot for r in newest] == [now - 3_600_000 + i * 1000 for i in (129, 128, 127)]
    results = "{cron:sync}:results" if strategy == "lease" else "cron:sync:results"
    runs = "{cron:sync}:runs" if strategy == "lease" else "cron:sync:runs"
    # XADD / XTRIM MAXLEN ~ n removes whole macro nodes only: the server leaves at least n entries, and fewer
    # than n plus the entries of the oldest node it kept (a node holds at most stream-node-max-entries).
    node = await node_max_entries(target)
    runs_len = await target.raw("XLEN", runs)
    if strategy == "lease":  # trimmed once the history is a tenth (here one run) over history_size
        assert history_size <= await target.raw("ZCARD", results) <= history_size + 1
        # Every attempt appends to runs; finish trims it, at most `slack` claims after the last trim.
        slack = 1
        assert history_size <= runs_len <= history_size + node - 1 + slack, runs_len
    else:
        assert await target.raw("ZCARD", results) == history_size
    if strategy == "lease":
        assert await target.raw("ZCARD", "{cron:sync}:slots") <= history_size + 1 + 100
        # The hour-old run is still in progress: its state stays, and a backup still gets "running".
        still = await claim_one(backend, request(old_running.slot, "b"), keep_none)
        assert still.outcome is Outcome.RUNNING
        # Runs a late claim could still ask for are kept: with a long keep_ms nothing finished is dropped.
        keep_all = JobPolicy(lease_ms=60_000, history_size=history_size, keep_ms=86_400_000, overlap=True)
        for i in range(30):
            req = request(now + i * 1000, "k")
            c = await claim_one(backend, req, keep_all)
            await backend.strategy.finish(backend.store, req, c, keep_all, record(req, c))
        replay = await claim_one(backend, request(now, "late"), keep_all)
        assert replay.outcome is Outcome.DONE
    elif strategy == "script":
        # Every entry lies inside the 5-minute window a late claim still reads: none may go.
        assert runs_len == 1 + finished
    elif strategy == "stream-id":  # each claim's XADD trims with MAXLEN ~ history_size + 1 (keep_ms 0)
        assert history_size + 1 <= runs_len <= history_size + node, runs_len
    else:  # idmp: each claim's XADD keeps as many as the server remembers ids (max_size, 1,000 here)
        assert runs_len == 1 + finished


async def test_lease_runs_that_end_in_the_claim_are_trimmed_too(target: StoreTarget) -> None:
    """A job whose every attempt dies (its worker killed each time): no finish ever comes, and each run ends in a
    claim, out of attempts. Its slots skipped for overlap end there too. The claim trims the history then, as a
    finish would: it stays about history_size runs instead of growing with every run."""
    backend = await target.started_backend("lease")
    history_size, runs = 2, 8
    # One pipeline: the second claim comes while the first's lease is live. The store runs the two scripts back
    # to back, but fakeredis runs each in this process, which a loaded machine can stall for tens of ms.
    lease_ms = 300
    policy = JobPolicy(lease_ms=lease_ms, max_attempts=1, history_size=history_size, keep_ms=0)
    now = int(await target.server_ms())
    for i in range(runs):
        slot = now - 3_600_000 + i * 1000
        won, overlap = await backend.strategy.claim(
            backend.store, [(request(slot, "dies"), policy), (request(slot + 500, "next"), policy)]
        )
        assert isinstance(won, Claim)
        assert isinstance(overlap, Claim)
        assert won.outcome is Outcome.WON
        await asyncio.sleep((lease_ms + 5) / 1000)  # the lease runs out: the worker died
        done = await claim_one(backend, request(slot, "backup"), policy)
        assert (overlap.outcome, done.outcome) == (Outcome.OVERLAP, Outcome.DONE)
    state_fields = await target.raw("HLEN", "{cron:sync}:state")
    statuses = Counter(r.status for r in await backend.strategy.history(backend.store, "sync", 1000))
    assert sum(statuses.values()) <= history_size + 1
    assert set(statuses) <= {"interrupted", "skipped-overlap"}
    assert await target.raw("ZCARD", "{cron:sync}:slots") <= history_size + 1
    assert state_fields <= history_size + 1 + 3  # and the fence counter, "forgotten" and "since"
    assert await target.raw("SCARD", "{cron:sync}:active") == 0


async def test_lease_a_claim_for_a_run_trim_dropped_is_done_not_won_again(target: StoreTarget) -> None:
    """A claim may come after trim dropped its run: a backup cut off from the store, or paused, for longer than
    keep_ms. The state keeps the latest slot trim dropped ("forgotten"), and a claim for it or an earlier slot
    without a state is "done" (it won a new first attempt before: the slot ran twice). Later slots are claimed
    as ever."""
    backend = await target.started_backend("lease")
    keep_none = JobPolicy(lease_ms=60_000, history_size=1, keep_ms=0)
    now = int(await target.server_ms())
    slots = [now - 3_600_000 + i * 1000 for i in range(4)]
    for slot in slots:
        req = request(slot, "a")
        won = await claim_one(backend, req, keep_none)
        assert await backend.strategy.finish(backend.store, req, won, keep_none, record(req, won))
        await asyncio.sleep(0.002)  # each run ends in a ms of its own: trim drops the runs that ended before it
    # The third finish found 3 finished runs, more than history_size plus its tenth (at least one): it dropped
    # the two that had ended before it. The fourth found 2.
    assert await target.raw("HGET", "{cron:sync}:state", "forgotten") == str(slots[1])
    for slot in (slots[0] - 1000, slots[0], slots[1]):
        assert not await target.raw("HEXISTS", "{cron:sync}:state", str(slot))
        late = await claim_one(backend, request(slot, "late"), keep_none)
        assert late == Claim(Outcome.DONE, 0, 0, 0)
        assert late.forgotten
    kept = await claim_one(backend, request(slots[2], "late"), keep_none)
    assert (kept.outcome, kept.attempt, kept.forgotten) == (Outcome.DONE, 1, False)  # done as it ended
    assert (await claim_one(backend, request(now, "new"), keep_none)).outcome is Outcome.WON


async def test_lease_a_run_nobody_took_over_is_closed_at_the_jobs_next_finish(target: StoreTarget) -> None:
    """A run handed back when no instance was left to take it over stays claimable for as long as a claim could
    ask for it. Then trim closes it as interrupted, and its record says it was handed back, not that its lease ran
    out. However far the history is from history_size: a run handed back as every instance stopped (or whose
    instances all died) gets its record with the job's next run once keep_ms has passed, not a thousand runs
    later."""
    backend = await target.started_backend("lease")
    policy = JobPolicy(lease_ms=60_000, history_size=1000, keep_ms=0)
    now = int(await target.server_ms())
    handed = request(now - 60_000, "gone")
    await claim_one(backend, handed, policy)
    assert await backend.strategy.release(backend.store, handed)
    await asyncio.sleep(0.002)  # the finish below comes after the hand-back's moment plus keep_ms (0)
    following = request(now, "next")
    won = await claim_one(backend, following, policy)
    assert await backend.strategy.finish(backend.store, following, won, policy, record(following, won))
    history = await backend.strategy.history(backend.store, "sync", 10)
    assert [(r.slot, r.status, r.message) for r in history] == [
        (following.slot, "ok", None),
        (handed.slot, "interrupted", "abandoned: handed back; no instance took the run over"),
    ]


async def test_lease_a_finish_after_trim_closed_the_run_as_abandoned_is_refused(target: StoreTarget) -> None:
    """Trim closed the run as interrupted, its holder silent for longer than keep_ms past its lease. A finish of
    that holder coming then, with "interrupted" too, is refused: it is no retry of a finish that ended the run,
    and trim's record stands."""
    backend = await target.started_backend("lease")
    policy = JobPolicy(lease_ms=10, history_size=1000, keep_ms=0)
    now = int(await target.server_ms())
    silent = request(now - 60_000, "silent")
    silent_claim = await claim_one(backend, silent, policy)
    await asyncio.sleep(0.02)  # its lease and keep_ms (0) past
    following = request(now, "next")
    won = await claim_one(backend, following, policy)
    assert await backend.strategy.finish(backend.store, following, won, policy, record(following, won))
    late = record(silent, silent_claim, "interrupted", "lease lost")
    assert not await backend.strategy.finish(backend.store, silent, silent_claim, policy, late)
    history = await backend.strategy.history(backend.store, "sync", 10)
    assert [(r.slot, r.status, r.message) for r in history] == [
        (following.slot, "ok", None),
        (silent.slot, "interrupted", "abandoned: lease expired; no instance took the run over"),
    ]


async def test_lease_trim_leaves_a_handed_back_run_to_the_backups_for_keep_ms(target: StoreTarget) -> None:
    """A hand-back gives the backups keep_ms from its moment, as a crash does from the end of its lease, however
    old the run's slot (a long job): trim does not close the run meanwhile, and a backup takes it over."""
    backend = await target.started_backend("lease")
    policy = JobPolicy(lease_ms=60_000, history_size=1, keep_ms=60_000)
    now = int(await target.server_ms())
    handed = request(now - 3_600_000, "gone")  # a long job, an hour in
    await claim_one(backend, handed, policy)
    assert await backend.strategy.release(backend.store, handed)
    for i in range(3):  # the third finish trims, and looks for abandoned runs among the active ones
        req = request(now - 7_200_000 + i * 1000, "a")
        won = await claim_one(backend, req, policy)
        assert await backend.strategy.finish(backend.store, req, won, policy, record(req, won))
    taken = await claim_one(backend, request(handed.slot, "backup"), policy)
    assert (taken.outcome, taken.attempt) == (Outcome.WON, 2)


async def test_script_deletes_entries_older_than_its_window_and_keeps_newer_ones(target: StoreTarget) -> None:
    """Over history_size, the script drops entries a claim no longer reads (older than window_ms) and keeps
    every entry inside the window, however many."""
    backend = await target.started_backend({"name": "script", "window_ms": LIVE_MS})
    policy = JobPolicy(history_size=5)
    old = [SLOT + i * 1000 for i in range(8)]
    new = [SLOT + 100_000 + i * 1000 for i in range(8)]
    claims = await backend.strategy.claim(backend.store, [(request(slot, "a"), policy) for slot in old])
    assert [c.outcome for c in claims if isinstance(c, Claim)] == [Outcome.WON] * 8
    assert await target.raw("XLEN", "cron:sync:runs") == 8  # all inside the window: none may go
    await asyncio.sleep(LIVE_MS / 1000 + 0.05)  # the old entries fall out of the window
    claims = await backend.strategy.claim(backend.store, [(request(slot, "b"), policy) for slot in new])
    assert [c.outcome for c in claims if isinstance(c, Claim)] == [Outcome.WON] * 8
    entries = await target.raw("XRANGE", "cron:sync:runs", "-", "+")
    assert [int(fields[1]) for _, fields in entries] == new  # fields: slot, <slot>, token, <token>, …


async def test_script_a_records_history_ttl_keeps_the_claims_of_its_window(target: StoreTarget) -> None:
    """history_ttl_ms ages the history, not the claims: a record's trim leaves every entry inside window_ms, and a
    late claim of a run claimed 1.2 s before (past the 0.3 s ttl, inside the 300 s window) loses."""
    backend = await target.started_backend({"name": "script", "window_ms": 300_000})
    policy = JobPolicy(history_ttl_ms=300, keep_ms=300)
    first = int(await target.server_ms())
    assert (await claim_one(backend, request(first, "a"), policy)).outcome is Outcome.WON
    await asyncio.sleep(1.2)
    later = request(int(await target.server_ms()), "b")
    won = await claim_one(backend, later, policy)
    # Its record ends now: the trim that follows it deletes what is older than 0.3 s, unless a claim reads it.
    assert await backend.strategy.finish(backend.store, later, won, policy, record(later, won))
    assert (await claim_one(backend, request(first, "late"), policy)).outcome is Outcome.LOST


async def test_script_forgets_a_run_after_its_window(target: StoreTarget) -> None:
    backend = await target.started_backend({"name": "script", "window_ms": LIVE_MS})
    first = await claim_one(backend, request(SLOT, "a"), JobPolicy())
    lost = await claim_one(backend, request(SLOT, "b"), JobPolicy())
    await asyncio.sleep(LIVE_MS / 1000 + 0.05)
    again = await claim_one(backend, request(SLOT, "c"), JobPolicy())
    assert [c.outcome for c in (first, lost, again)] == [Outcome.WON, Outcome.LOST, Outcome.WON]


async def test_stream_id_misses_an_earlier_slot_claimed_after_a_later_one(target: StoreTarget) -> None:
    backend = await target.started_backend("stream-id")
    later = await claim_one(backend, request(SLOT + 1000, "a"), JobPolicy())
    earlier = await claim_one(backend, request(SLOT, "b"), JobPolicy())
    assert (later.outcome, earlier.outcome) == (Outcome.WON, Outcome.LOST)


async def test_stream_id_records_the_skip_of_a_slot_passed_by_a_later_claim_once(target: StoreTarget) -> None:
    """After a stall longer than the gap between slots, the next slot's claim reaches the store before the missed
    slot's skip, and the stream refuses the missed slot's id. No instance claimed that slot, and none can any more
    (ids only grow): the skip is recorded all the same, once, whichever instances report it. A slot that was
    claimed is not skipped, nor one older than every entry of the stream (trimmed or not, it cannot tell)."""
    backend = await target.started_backend("stream-id")
    policy = JobPolicy(late_after_ms=100)
    now = await target.server_ms()
    ran, missed, following = now - 3_000, now - 2_000, now - 1_000
    for slot in (ran, following):
        assert (await claim_one(backend, request(slot, f"t{slot}"), policy)).outcome is Outcome.WON

    def skip(slot: int, runner: str) -> Any:
        late = RunRequest("sync", run_id(slot), slot, f"skip-{runner}", runner)
        return backend.strategy.skip(backend.store, late, policy, "skipped-late", f"seen late by {runner}")

    assert await skip(missed, "b")
    assert not await skip(missed, "c")  # once
    assert not await skip(ran, "b")
    assert not await skip(ran - 1_000, "b")  # before the stream's first entry
    history = await backend.strategy.history(backend.store, "sync", 10)
    assert [(r.slot, r.status, r.message) for r in history] == [(missed, "skipped-late", "seen late by b")]
    assert await target.raw("XLEN", "cron:sync:runs") == 2  # the skip claimed nothing


async def test_a_newer_store_format_is_refused_and_left_untouched(target: StoreTarget, strategy: str) -> None:
    await target.raw("SET", "cron:format", "2")
    backend = target.backend(strategy)
    with pytest.raises(StoreFormatError) as caught:
        await backend.start(["sync"])
    assert caught.value.code == "ANARCHON_STORE_FORMAT"
    assert "ANARCHON_STORE_FORMAT" in str(caught.value)
    assert await target.raw("KEYS", "*") == ["cron:format"]
    assert await target.raw("GET", "cron:format") == "2"


async def test_noscript_is_handled_transparently(target: StoreTarget, strategy: str) -> None:
    backend = await target.started_backend(strategy)
    first = await claim_one(backend, request(SLOT, "a"), OVERLAP_OK)
    await target.raw("SCRIPT", "FLUSH")
    second = await claim_one(backend, request(SLOT + 1000, "a"), OVERLAP_OK)
    await target.raw("SCRIPT", "FLUSH")
    third = await claim_one(backend, request(SLOT + 1000, "b"), OVERLAP_OK)
    expected_third = Outcome.RUNNING if strategy == "lease" else Outcome.LOST
    assert [c.outcome for c in (first, second, third)] == [Outcome.WON, Outcome.WON, expected_third]


async def _command_calls(target: StoreTarget, command: str) -> int:
    """How many times a real server ran ``command`` (INFO commandstats; fakeredis has no INFO)."""
    stats = await target.raw("INFO", "commandstats")
    line = next((line for line in stats.splitlines() if line.startswith(f"cmdstat_{command}:")), "calls=0,")
    return int(line.split("calls=")[1].split(",")[0])


async def _ids_remembered(target: StoreTarget, key: str, wait_s: float) -> int:
    """How many idempotent ids the stream's server remembers (XINFO STREAM's iids-tracked), once it remembers
    none or ``wait_s`` has passed."""
    deadline = time.monotonic() + wait_s
    while True:
        info = await target.raw("XINFO", "STREAM", key)
        remembered = int(dict(zip(info[::2], info[1::2], strict=True))["iids-tracked"])
        if remembered == 0 or time.monotonic() >= deadline:
            return remembered
        await asyncio.sleep(0.05)


async def _idmp_settings(target: StoreTarget, key: str) -> tuple[int, int]:
    """The stream's IDMP duration and size, as XINFO STREAM shows them."""
    info = await target.raw("XINFO", "STREAM", key)
    fields = dict(zip(info[::2], info[1::2], strict=True))
    return fields["idmp-duration"], fields["idmp-maxsize"]


async def _xcfgset_calls(target: StoreTarget) -> int:
    return await _command_calls(target, "xcfgset")


async def test_noscript_in_a_batch_of_claims_is_handled(target: StoreTarget, strategy: str) -> None:
    """A batch of claims of several jobs, all answered NOSCRIPT (scripts lost to a restart, a promoted replica
    or eviction): one EVAL per script loads it, the other claims go again by SHA, and every answer lands in
    its own claim's place."""
    backend = await target.started_backend(strategy)
    runs = [(job, SLOT + i * 1000) for i in range(3) for job in ("sync", "billing", "report")]
    winners: list[Claim] = []
    for token in ("a", "b"):
        await target.raw("SCRIPT", "FLUSH")
        evals = None if target.is_fake else await _command_calls(target, "eval")
        batch = [(request(slot, token, job=job), OVERLAP_OK) for job, slot in runs]
        claims = await backend.strategy.claim(backend.store, batch)
        assert all(isinstance(c, Claim) for c in claims), claims
        answers = [c for c in claims if isinstance(c, Claim)]
        if token == "a":
            winners = answers
            assert [c.outcome for c in answers] == [Outcome.WON] * len(runs)
            for job in ("sync", "billing", "report"):  # each job's fences grow with its slots
                fences = [c.fence for (j, _), c in zip(runs, answers, strict=True) if j == job]
                assert fences == sorted(set(fences)), (job, fences)
        elif strategy == "lease":  # each backup learns the fence of the attempt that holds its own run
            assert [(c.outcome, c.fence) for c in answers] == [(Outcome.RUNNING, w.fence) for w in winners]
        else:
            assert [c.outcome for c in answers] == [Outcome.LOST] * len(runs)
        if evals is not None:
            # stream-id and idmp claim with plain commands; idmp configures the two jobs new to it with a script
            scripted = strategy in ("lease", "script") or (strategy == "idmp" and token == "a")
            assert await _command_calls(target, "eval") == evals + (1 if scripted else 0)


async def test_idmp_refuses_to_start_where_unsupported(target: StoreTarget) -> None:
    if target.supports_idmp:
        pytest.skip(f"{target.name} supports idmp")
    backend = target.backend("idmp", as_redis=True)  # ValkeyBackend would refuse idmp at creation
    with pytest.raises(UnsupportedStrategyError) as caught:
        await backend.start(["sync"])
    for other in ("'lease'", "'stream-id'", "'script'"):
        assert other in str(caught.value)
    assert await target.raw("KEYS", "*") == []  # refused before writing anything


@pytest.mark.parametrize("version", [(8, 0, 0), (8, 4, 2), (8, 5, 9)])
async def test_idmp_refuses_to_start_on_a_redis_8_before_8_6(version: tuple[int, ...]) -> None:
    """Redis 8.0 to 8.5 know XADD, not its IDMP option: refused by name at start, not failing at the first claim."""
    client = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer(version=version), protocol=2)
    with pytest.raises(UnsupportedStrategyError) as caught:
        await RedisBackend(redis=client, strategy="idmp").start(["sync"])
    assert f"Redis {'.'.join(map(str, version))}" in str(caught.value)
    for other in ("'lease'", "'stream-id'", "'script'"):
        assert other in str(caught.value)
    assert await client.keys("*") == []
    assert ServerInfo("redis", (8, 6, 0)).has_idmp
    assert not ServerInfo("valkey", (9, 1, 2)).has_idmp


CLAIM_ONLY_SIDE_BY_SIDE = [
    ("stream-id", "idmp", "stream-id or script"),
    ("script", "idmp", "stream-id or script"),
    ("idmp", "stream-id", "script or idmp"),
    ("idmp", "script", "idmp"),
    ("script", "stream-id", "script or idmp"),
    ("stream-id", "script", None),  # script cannot tell stream-id's entries from its own made at the slot's ms
    ("idmp", {"name": "idmp", "duration_sec": 900}, None),  # a longer duration: the runs copied, with IDMP
    ({"name": "idmp", "duration_sec": 100, "max_size": 100}, "idmp", None),  # the server's defaults: no XCFGSET
    ("stream-id", "stream-id", None),
    ("script", "script", None),
]


@pytest.mark.parametrize(("first", "then", "other"), CLAIM_ONLY_SIDE_BY_SIDE)
async def test_a_claim_only_strategy_started_where_another_claimed_says_so(
    target: StoreTarget, first: Any, then: Any, other: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    """No claim-only strategy sees all of another's claims in a job's runs stream (idmp sees only those added with
    IDMP; a script claim made before its slot by the server's clock leaves the slot to stream-id as well):
    instances of two of them on one prefix would run some slots once each. An instance that finds claims of
    another one in a job's stream says so at start, where it can tell them; idmp after idmp (a deploy that changes
    its settings included) says nothing."""
    if "idmp" in repr((first, then)) and not target.supports_idmp:
        pytest.skip(f"idmp needs Redis 8.6+; {target.name} is {target.describe}")
    earlier = await target.started_backend(first)
    claims = [await claim_one(earlier, request(SLOT + i * 1000, f"a{i}"), JobPolicy()) for i in range(2)]
    assert [claim.outcome for claim in claims] == [Outcome.WON] * 2
    caplog.clear()
    await target.started_backend(then)
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.module == "_backend"]
    warning = (
        f"1 jobs (sync) have runs claimed by {other} under the prefix 'cron:': claim-only strategies do not see all "
        "of each other's claims, and instances of each would run some slots once each. Give each strategy a prefix "
        "of its own"
    )
    assert said == ([] if other is None else [warning])


async def test_idmp_configures_the_stream_once(target: StoreTarget) -> None:
    if not target.supports_idmp:
        pytest.skip(f"idmp needs Redis 8.6+; {target.name} is {target.describe}")
    backend = await target.started_backend({"name": "idmp", "duration_sec": 900, "max_size": 50})
    assert await _idmp_settings(target, "cron:sync:runs") == (900, 50)
    configured = await _xcfgset_calls(target)
    won = await claim_one(backend, request(SLOT, "a"), JobPolicy())
    await backend.strategy.prepare(backend.store, ["sync"])  # same values: must not clear what the server tracks
    again = await target.started_backend({"name": "idmp", "duration_sec": 900, "max_size": 50})
    lost = await claim_one(again, request(SLOT, "b"), JobPolicy())
    assert (won.outcome, lost.outcome) == (Outcome.WON, Outcome.LOST)
    assert await _xcfgset_calls(target) == configured  # another instance's start found the stream as wanted


def _configures(commands: Sequence[Command]) -> bool:
    """Whether the commands run the idmp configure script (by SHA or source)."""
    return any(runs_script(command, CONFIGURE) for command in commands)


class ConfigureTrips(Recording):
    """A connection that counts the round trips that carry the idmp configure script."""

    def __init__(self, inner: Connection) -> None:
        super().__init__(inner)
        self.trips = 0

    def _count(self, commands: Sequence[Command]) -> None:
        self.trips += _configures(commands)

    async def execute(self, command: Command) -> Reply:
        self._count([command])
        return await super().execute(command)

    async def execute_many(self, commands: Sequence[Command]) -> list[Any]:
        self._count(commands)
        return await super().execute_many(commands)


async def test_idmp_configures_its_jobs_streams_side_by_side(target: StoreTarget) -> None:
    """start() configures every job's stream in a pipeline, and so does a batch of claims of jobs added after it:
    one round trip per job, start() with thousands of jobs waited seconds (and a cluster node that did not answer
    held it up a timeout per job of that node)."""
    if not target.supports_idmp:
        pytest.skip(f"idmp needs Redis 8.6+; {target.name} is {target.describe}")
    connection = ConfigureTrips(adapt(target.new_client()))
    backend = target.backend({"name": "idmp", "duration_sec": 900, "max_size": 50}, connection=connection)
    jobs = [f"job{n}" for n in range(40)]
    await backend.start(jobs)
    assert connection.trips <= 2  # the first job's at once, the others' together once it is answered
    assert [await _idmp_settings(target, f"cron:{job}:runs") for job in jobs] == [(900, 50)] * len(jobs)
    connection.trips = 0
    added = [(request(SLOT, "a", job=f"added{n}"), JobPolicy()) for n in range(40)]
    claims = await backend.strategy.claim(backend.store, added)
    assert [c.outcome for c in claims if isinstance(c, Claim)] == [Outcome.WON] * len(added)
    assert connection.trips <= 2
    assert await _idmp_settings(target, "cron:added39:runs") == (900, 50)


async def test_idmp_a_deploy_that_changes_its_settings_keeps_the_runs_remembered(target: StoreTarget) -> None:
    """XCFGSET makes the server forget every run a stream remembers. An instance started with a longer duration
    (a deploy) must find the runs claimed before it taken: a late claim loses, and a winner whose answer was lost
    wins when it asks again. One of the previous deploy started again leaves the longer settings as they are."""
    if not target.supports_idmp:
        pytest.skip(f"idmp needs Redis 8.6+; {target.name} is {target.describe}")
    old = {"name": "idmp", "duration_sec": 300, "max_size": 50}
    first = await target.started_backend(old)
    won = [await claim_one(first, request(slot, "a"), JobPolicy()) for slot in (SLOT, SLOT + 1000)]
    assert [c.outcome for c in won] == [Outcome.WON] * 2
    new = await target.started_backend({"name": "idmp", "duration_sec": 900, "max_size": 50})
    assert await _idmp_settings(target, "cron:sync:runs") == (900, 50)
    late = await claim_one(new, request(SLOT, "b"), JobPolicy())
    retried = await claim_one(first, request(SLOT, "a"), JobPolicy())
    assert (late.outcome, retried.outcome) == (Outcome.LOST, Outcome.WON)
    configured = await _xcfgset_calls(target)
    restarted = await target.started_backend(old)  # an instance of the previous deploy, started again
    assert await _idmp_settings(target, "cron:sync:runs") == (900, 50)
    assert await _xcfgset_calls(target) == configured
    for backend, slot in ((restarted, SLOT), (new, SLOT + 1000)):
        assert (await claim_one(backend, request(slot, "c"), JobPolicy())).outcome is Outcome.LOST
    assert (await claim_one(new, request(SLOT + 2000, "c"), JobPolicy())).outcome is Outcome.WON


async def test_idmp_an_instance_with_a_shorter_duration_does_not_shorten_the_streams(target: StoreTarget) -> None:
    """Instances of two deploys side by side: the one with the longer duration accepted its jobs' max_late_ms
    against it, so a run it claims must be remembered that long, whatever duration the other deploy's instances
    start with. (Set to the shorter one, the server would forget the run after it, and a claim that came later
    would win the run again.)"""
    if not target.supports_idmp:
        pytest.skip(f"idmp needs Redis 8.6+; {target.name} is {target.describe}")
    longer = await target.started_backend({"name": "idmp", "duration_sec": 3, "max_size": 50})
    assert (await claim_one(longer, request(SLOT, "a"), JobPolicy())).outcome is Outcome.WON
    shorter = await target.started_backend({"name": "idmp", "duration_sec": 1, "max_size": 20})
    assert await _idmp_settings(target, "cron:sync:runs") == (3, 50)
    await asyncio.sleep(1.5)  # past the shorter duration, within the longer
    assert (await claim_one(longer, request(SLOT, "b"), JobPolicy())).outcome is Outcome.LOST
    assert (await claim_one(shorter, request(SLOT, "c"), JobPolicy())).outcome is Outcome.LOST


async def test_idmp_an_instance_with_a_smaller_size_keeps_the_runs_the_stream_remembers(target: StoreTarget) -> None:
    """Instances of two deploys side by side: b's settings (900 s, 1,000 runs), which the stream has, and a's (300 s,
    100 runs). a claims and records 400 runs. Trimmed to a's own size, the stream would hold about 100 entries while
    the server remembers 400 ids: b's claim retried after its answer was lost would read nothing back and be told
    "lost" (nobody runs that run), and a deploy that raises the settings again could add back only the runs still
    there (a late claim of the others would win them again)."""
    if not target.supports_idmp:
        pytest.skip(f"idmp needs Redis 8.6+; {target.name} is {target.describe}")
    b = await target.started_backend({"name": "idmp", "duration_sec": 900, "max_size": 1000})
    a = await target.started_backend({"name": "idmp", "duration_sec": 300, "max_size": 100})
    policy = JobPolicy(history_size=100)
    first = await target.server_ms() - 600_000
    mine = request(first, "b")
    assert (await claim_one(b, mine, policy)).outcome is Outcome.WON  # its answer lost, say
    for i in range(1, 400):
        req = request(first + i * 1000, f"a{i}")
        claim = await claim_one(a, req, policy)
        assert claim.outcome is Outcome.WON
        assert await a.strategy.finish(a.store, req, claim, policy, record(req, claim))
    assert (await claim_one(b, mine._replace(retry=True), policy)).outcome is Outcome.WON
    raised = await target.started_backend({"name": "idmp", "duration_sec": 1800, "max_size": 1000})
    assert await _idmp_settings(target, "cron:sync:runs") == (1800, 1000)
    for i in (0, 1, 250, 399):
        assert (await claim_one(raised, request(first + i * 1000, "late"), policy)).outcome is Outcome.LOST, i


async def test_idmp_configures_a_job_added_after_start_before_its_first_claim(target: StoreTarget) -> None:
    """A job registered on a running scheduler gets its stream's duration and size too: with the server's
    defaults (100 s) a claim later than that would win the run again. Its first claims, concurrent, configure
    it once (a second XCFGSET after a claim would clear that claim's id)."""
    if not target.supports_idmp:
        pytest.skip(f"idmp needs Redis 8.6+; {target.name} is {target.describe}")
    backend = target.backend({"name": "idmp", "duration_sec": 900, "max_size": 50})
    await backend.start([])
    before = await _xcfgset_calls(target)
    first = [(request(SLOT, token, job="later"), JobPolicy()) for token in ("a", "b", "c")]
    claims = await asyncio.gather(*(backend.strategy.claim(backend.store, [one]) for one in first))
    assert sorted(c.outcome.value for [c] in claims if isinstance(c, Claim)) == ["lost", "lost", "won"]
    assert await _idmp_settings(target, "cron:later:runs") == (900, 50)
    assert await _xcfgset_calls(target) == before + 1


class FailFirstConfiguration:
    """A connection whose first run of the idmp configure script, once armed, fails as if the store could not be
    reached."""

    def __init__(self, inner: Connection) -> None:
        self.inner = inner
        self.armed = False

    def _check(self, commands: Sequence[Command]) -> None:
        if self.armed and _configures(commands):
            self.armed = False
            raise StoreUnavailableError("store unavailable: connection reset (injected)")

    async def execute(self, command: Command) -> Reply:
        self._check([command])
        return await self.inner.execute(command)

    async def execute_many(self, commands: Sequence[Command]) -> list[Reply | StoreReplyError]:
        self._check(commands)
        return await self.inner.execute_many(commands)

    async def server_info(self) -> ServerInfo:
        return await self.inner.server_info()

    async def close(self) -> None:
        await self.inner.close()


async def test_idmp_a_failed_configuration_fails_only_that_jobs_claims_and_is_tried_again(
    target: StoreTarget,
) -> None:
    """A claim of a job whose stream is not configured yet configures it first. When that fails, the claims of
    that job get the error (claimed with the server's default duration, a late claim could win the run again),
    the other jobs' claims go on, and the next claim of the job configures it."""
    if not target.supports_idmp:
        pytest.skip(f"idmp needs Redis 8.6+; {target.name} is {target.describe}")
    connection = FailFirstConfiguration(adapt(target.new_client()))
    backend = target.backend({"name": "idmp", "duration_sec": 900, "max_size": 50}, connection=connection)
    await backend.start(["sync"])
    connection.armed = True
    batch = [request(SLOT, "a", job="later"), request(SLOT, "a"), request(SLOT + 1000, "a", job="later")]
    claims = await backend.strategy.claim(backend.store, [(r, JobPolicy()) for r in batch])
    assert isinstance(claims[0], StoreUnavailableError)
    assert claims[2] is claims[0]
    other_job = claims[1]
    assert isinstance(other_job, Claim)
    assert other_job.outcome is Outcome.WON
    assert await target.raw("EXISTS", "cron:later:runs") == 0  # nothing was claimed unconfigured
    before = await _xcfgset_calls(target)
    [retried] = await backend.strategy.claim(backend.store, [(request(SLOT, "b", job="later"), JobPolicy())])
    assert isinstance(retried, Claim)
    assert retried.outcome is Outcome.WON
    assert await _idmp_settings(target, "cron:later:runs") == (900, 50)
    assert await _xcfgset_calls(target) == before + 1
    lost = await claim_one(backend, request(SLOT, "c", job="later"), JobPolicy())
    assert lost.outcome is Outcome.LOST


async def test_idmp_a_stream_that_vanished_is_made_and_configured_again(target: StoreTarget) -> None:
    """The store lost a job's stream (a restart without its data, a flush, an eviction). The next claim must not
    make it with the server's defaults (100 s, 100 ids), under which a claim later than 100 s would win a run
    again: the stream is made and configured again, and the claim goes on."""
    if not target.supports_idmp:
        pytest.skip(f"idmp needs Redis 8.6+; {target.name} is {target.describe}")
    backend = await target.started_backend({"name": "idmp", "duration_sec": 900, "max_size": 50})
    assert (await claim_one(backend, request(SLOT, "a"), JobPolicy())).outcome is Outcome.WON
    await target.raw("DEL", "cron:sync:runs")
    batch = [(request(SLOT + 1000, "a"), JobPolicy()), (request(SLOT + 1000, "a", job="other"), JobPolicy())]
    claims = await backend.strategy.claim(backend.store, batch)
    assert [c.outcome for c in claims if isinstance(c, Claim)] == [Outcome.WON, Outcome.WON]
    assert await _idmp_settings(target, "cron:sync:runs") == (900, 50)
    lost = await claim_one(backend, request(SLOT + 1000, "b"), JobPolicy())
    assert lost.outcome is Outcome.LOST


async def test_results_are_json_records(target: StoreTarget, strategy: str) -> None:
    backend = await target.started_backend(strategy)
    req = request(SLOT, "a")
    claim = await claim_one(backend, req, JobPolicy())
    message = 'quotes " and \\ backslashes\nand newlines'
    await backend.strategy.finish(backend.store, req, claim, JobPolicy(), record(req, claim, "error", message))
    results = "{cron:sync}:results" if strategy == "lease" else "cron:sync:results"
    [member] = await target.raw("ZRANGE", results, 0, -1)
    assert json.loads(member)["message"] == message
    [entry] = await backend.strategy.history(backend.store, "sync", 5)
    assert (entry.job, entry.slot, entry.status, entry.message, entry.runner) == (
        "sync",
        SLOT,
        "error",
        message,
        "runner-a",
    )


async def test_a_takeover_waits_while_another_run_holds_a_live_lease(target: StoreTarget) -> None:
    """Taking an expired run over while a later slot runs would run two runs of the job at once."""
    backend = await target.started_backend("lease")
    short, forbid = JobPolicy(lease_ms=150), JobPolicy(lease_ms=5_000)
    old = await claim_one(backend, request(SLOT, "crashed"), short)
    assert old.outcome is Outcome.WON
    await asyncio.sleep(0.2)  # the old run's winner died: its lease ran out
    new = await claim_one(backend, request(SLOT + 60_000, "b"), forbid)
    assert new.outcome is Outcome.WON  # an expired lease blocks nothing
    backup = await claim_one(backend, request(SLOT, "backup"), forbid)
    assert backup.outcome is Outcome.RUNNING  # it waits: the new run is live
    assert 0 < backup.lease_ms_left <= 5_000
    finished = request(SLOT + 60_000, "b")
    assert await backend.strategy.finish(backend.store, finished, new, forbid, record(finished, new))
    taken = await claim_one(backend, request(SLOT, "backup"), forbid)
    assert (taken.outcome, taken.attempt) == (Outcome.WON, 2)


async def test_lease_runs_skipped_for_overlap_are_trimmed_while_the_run_they_wait_for_goes_on(
    target: StoreTarget,
) -> None:
    """A run that goes on for hours (it heartbeats) holds the job's lease: every slot due meanwhile is skipped for
    overlap, in its claim, and no finish comes to trim after them. The claim trims, as a finish would: the
    history, the slots set and the state stay about history_size runs instead of growing with every skipped slot
    until the long run ends."""
    backend = await target.started_backend("lease")
    history_size = 2
    policy = JobPolicy(lease_ms=600_000, history_size=history_size, keep_ms=0)
    now = int(await target.server_ms())
    long = request(now - 3_600_000, "long")
    assert (await claim_one(backend, long, policy)).outcome is Outcome.WON
    for i in range(1, 9):
        skipped = await claim_one(backend, request(long.slot + i * 1000, f"next{i}"), policy)
        assert skipped.outcome is Outcome.OVERLAP
        await asyncio.sleep(0.002)  # each skip ends in a ms of its own: the next trim finds it past keep_ms (0)
    statuses = [r.status for r in await backend.strategy.history(backend.store, "sync", 1000)]
    assert set(statuses) == {"skipped-overlap"}
    assert len(statuses) <= history_size + 1
    assert await target.raw("ZCARD", "{cron:sync}:slots") <= history_size + 1
    # The finished runs kept, the long run, and the fence counter, "forgotten" and "since".
    assert await target.raw("HLEN", "{cron:sync}:state") <= history_size + 1 + 1 + 3


async def test_lease_a_job_first_caught_up_keeps_that_moment_after_its_first_claim(target: StoreTarget) -> None:
    """A catch-up that asked before any claim fixed the moment the job was first started; the job's first claim,
    of a later slot, leaves it (an instance started later still catches up the slots between)."""
    backend = await target.started_backend("lease")
    since = backend.strategy.catch_up_since
    assert await since(backend.store, "new", SLOT) == SLOT
    await claim_one(backend, request(SLOT + 60_000, "a", job="new"), JobPolicy())
    assert await since(backend.store, "new", SLOT + 120_000) == SLOT


@pytest.fixture
def store_clock(target: StoreTarget, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The in-process store's clock (TIME, stream ids), in ms, held where the test sets it: what a script decides
    at the very ms a lease ends. Half a ms in, so that no rounding of the float moves it to the ms before."""
    if not target.is_fake:
        pytest.skip("only the in-process store's clock can be held")
    clock = [(int(time.time()) + 1) * 1000]
    monkeypatch.setattr(time, "time", lambda: (clock[0] + 0.5) / 1000)
    return clock


async def test_lease_a_retried_claim_at_the_ms_its_lease_ends_waits_for_a_run_begun_in_that_ms(
    target: StoreTarget, store_clock: list[int]
) -> None:
    """At the ms a lease ends it is over (another run of the job may start: it is not live), so a retry of its
    claim whose answer was lost then meets that run and waits, instead of renewing its lease beside it with a
    fence below the new run's."""
    backend = await target.started_backend("lease")
    policy = JobPolicy(lease_ms=100)
    now = store_clock[0]
    first = request(now - 1_000, "a")
    first_fence = (await claim_one(backend, first, policy)).fence
    store_clock[0] = now + 100  # first's lease ends at this ms
    second = await claim_one(backend, request(now - 500, "b"), policy)
    assert second.outcome is Outcome.WON
    assert second.fence > first_fence
    retry = await claim_one(backend, first, policy)
    assert (retry.outcome, retry.lease_ms_left) == (Outcome.RUNNING, 100)


async def test_lease_at_the_ms_a_lease_ends_a_backup_takes_the_run_over_and_another_slot_runs(
    target: StoreTarget, store_clock: list[int]
) -> None:
    """A lease is live until the ms it ends, not at it: then a backup takes the run over, and a claim of another
    slot of the job runs instead of being skipped for overlap."""
    backend = await target.started_backend("lease")
    policy = JobPolicy(lease_ms=100)
    now = store_clock[0]
    first = request(now - 1_000, "a")
    assert (await claim_one(backend, first, policy)).outcome is Outcome.WON
    store_clock[0] = now + 99
    assert (await claim_one(backend, request(now - 500, "c"), policy)).outcome is Outcome.OVERLAP
    store_clock[0] = now + 100
    other = await claim_one(backend, request(now - 400, "d"), JobPolicy(lease_ms=100))
    assert other.outcome is Outcome.WON
    assert await backend.strategy.finish(
        backend.store, request(now - 400, "d"), other, policy, record(request(now - 400, "d"), other)
    )
    backup = await claim_one(backend, request(first.slot, "b"), policy)
    assert (backup.outcome, backup.attempt) == (Outcome.WON, 2)


async def test_a_due_slot_meeting_a_manual_run_from_a_clock_ahead_is_skipped_not_put_off(target: StoreTarget) -> None:
    """A manual run's id carries the moment run_now was called by its instance's clock, which may be ahead of the
    store's: the run is not a later slot begun early, and a due slot that meets it is skipped for overlap at once
    (no instance will claim it again), not told to come again when its lease ends."""
    backend = await target.started_backend("lease")
    policy = JobPolicy(lease_ms=60_000)
    now = await target.server_ms()
    manual = RunRequest("sync", run_id(now + 600_000, "x"), now + 600_000, "m", "runner-m", manual=True)
    assert (await claim_one(backend, manual, policy)).outcome is Outcome.WON
    due = await claim_one(backend, request(now - 1_000, "b"), policy)
    assert due.outcome is Outcome.OVERLAP


async def test_lease_history_keeps_history_size_runs_at_every_trim(target: StoreTarget) -> None:
    """Trim cuts the history down to history_size records, not below it: after each finish the latest
    history_size runs (or all, while fewer) are there."""
    backend = await target.started_backend("lease")
    history_size = 3
    policy = JobPolicy(lease_ms=60_000, history_size=history_size, keep_ms=0)
    now = int(await target.server_ms())
    for i in range(12):
        req = request(now - 3_600_000 + i * 1000, "a")
        won = await claim_one(backend, req, policy)
        assert await backend.strategy.finish(backend.store, req, won, policy, record(req, won))
        history = await backend.strategy.history(backend.store, "sync", 100)
        assert len(history) >= min(i + 1, history_size), (i, len(history))
        await asyncio.sleep(0.002)


async def test_lease_forgotten_is_the_latest_slot_dropped_whatever_order_the_runs_ended_in(
    target: StoreTarget,
) -> None:
    """Trim drops finished runs in the order they ended, which is not their slots' order (a long run of an earlier
    slot ends after a short one of a later slot): "forgotten" is still the latest slot dropped, and a late claim
    of any dropped run is done, not won again."""
    backend = await target.started_backend("lease")
    policy = JobPolicy(lease_ms=60_000, history_size=1, keep_ms=0, overlap=True)
    now = int(await target.server_ms())
    long, short, third = (request(now - 3_600_000 + i * 1000, t) for i, t in enumerate(("long", "short", "third")))
    claims = {}
    for req in (long, short, third):
        claims[req.token] = await claim_one(backend, req, policy)
        assert claims[req.token].outcome is Outcome.WON
    for req in (short, long, third):  # the later slot ends first; the third finish drops the other two
        c = claims[req.token]
        assert await backend.strategy.finish(backend.store, req, c, policy, record(req, c))
        await asyncio.sleep(0.002)
    assert await target.raw("HGET", "{cron:sync}:state", "forgotten") == str(short.slot)
    for slot in (long.slot, short.slot):
        late = await claim_one(backend, request(slot, "late"), policy)
        assert late.outcome is Outcome.DONE, slot


async def test_lease_a_slot_claimed_early_twice_is_put_off_once(target: StoreTarget) -> None:
    """Every instance whose clock runs ahead claims the slot early and is told to come again: the job's "deferred"
    list names the slot once, however many claims put it off."""
    backend = await target.started_backend("lease")
    policy = JobPolicy(lease_ms=60_000, keep_ms=3_600_000)
    now = await target.server_ms()
    assert (await claim_one(backend, request(now - 1_000, "a"), policy)).outcome is Outcome.WON
    for token in ("b", "c"):
        early = await claim_one(backend, request(now + 30_000, token), policy)
        assert (early.outcome, early.attempt) == (Outcome.RUNNING, 0)
    assert await target.raw("HGET", "{cron:sync}:state", "deferred") == str(now + 30_000)


async def test_lease_a_late_skip_counts_from_the_ms_after_late_after_ms_through_keep_ms(
    target: StoreTarget, store_clock: list[int]
) -> None:
    """By the store's clock a run is late once more than late_after_ms past its slot, and its skip is recorded
    through keep_ms past it inclusive (trim keeps its state until after that)."""
    backend = await target.started_backend("lease")
    policy = JobPolicy(late_after_ms=100, keep_ms=1_000)
    now = store_clock[0]

    async def skip(slot: int) -> bool:
        req = request(slot, f"z{slot}")
        return await backend.strategy.skip(backend.store, req, policy, "skipped-late", "too late")

    assert not await skip(now - 100)  # exactly late_after_ms: not late yet
    assert await skip(now - 101)
    assert await skip(now - 1_000)  # exactly keep_ms: still recorded
    assert not await skip(now - 1_001)


async def test_lease_trim_leaves_a_lapsed_run_to_the_backups_through_keep_ms(
    target: StoreTarget, store_clock: list[int]
) -> None:
    """A run whose lease lapsed is closed as abandoned only once its lease end is more than keep_ms past: at
    keep_ms exactly a backup may still ask, and takes it over."""
    backend = await target.started_backend("lease")
    policy = JobPolicy(lease_ms=100, history_size=1, keep_ms=1_000)
    now = store_clock[0]
    lapsed = request(now - 3_600_000, "gone")
    await claim_one(backend, lapsed, policy)  # its lease ends at now + 100
    store_clock[0] = now + 100 + 1_000
    req = request(now - 7_200_000, "a")
    won = await claim_one(backend, req, policy)
    assert await backend.strategy.finish(backend.store, req, won, policy, record(req, won))  # trims
    taken = await claim_one(backend, request(lapsed.slot, "backup"), policy)
    assert (taken.outcome, taken.attempt) == (Outcome.WON, 2)


async def test_idmp_a_deploy_that_shortens_the_duration_keeps_the_runs_of_the_longer_one(target: StoreTarget) -> None:
    """A deploy that shortens duration_sec clears the ids the stream remembers (XCFGSET) and adds again the runs
    of the longer, previous duration, not only those of its own: a run claimed longer ago than the new duration
    is not won again by a claim that comes right after the deploy."""
    if not target.supports_idmp:
        pytest.skip(f"idmp needs Redis 8.6+; {target.name} is {target.describe}")
    first = await target.started_backend({"name": "idmp", "duration_sec": 300, "max_size": 50})
    assert (await claim_one(first, request(SLOT, "a"), JobPolicy())).outcome is Outcome.WON
    await asyncio.sleep(1.2)  # the run's entry is now older than the next deploy's duration
    shorter = await target.started_backend({"name": "idmp", "duration_sec": 1, "max_size": 50})
    assert (await claim_one(shorter, request(SLOT, "b"), JobPolicy())).outcome is Outcome.LOST


async def test_lease_a_run_begun_at_its_slots_very_ms_is_not_early(target: StoreTarget, store_clock: list[int]) -> None:
    """A run claimed at the ms of its slot is on time, not begun early by a clock ahead: a due earlier slot that
    meets it is skipped for overlap, not put off until its lease ends."""
    backend = await target.started_backend("lease")
    policy = JobPolicy(lease_ms=60_000)
    now = store_clock[0]
    assert (await claim_one(backend, request(now, "a"), policy)).outcome is Outcome.WON
    assert (await claim_one(backend, request(now - 1_000, "b"), policy)).outcome is Outcome.OVERLAP


async def test_lease_an_overlap_behind_two_leases_ending_together_names_the_greater_run(
    target: StoreTarget, store_clock: list[int]
) -> None:
    """Two live runs whose leases end at the same ms: the skip names the greater run id, as documented."""
    backend = await target.started_backend("lease")
    allow = JobPolicy(lease_ms=60_000, overlap=True)
    now = store_clock[0]
    for slot, token in ((now - 3_000, "a"), (now - 2_000, "b")):
        assert (await claim_one(backend, request(slot, token), allow)).outcome is Outcome.WON
    refused = await claim_one(backend, request(now - 1_000, "c"), JobPolicy(lease_ms=60_000))
    assert (refused.outcome, refused.lease_ms_left) == (Outcome.OVERLAP, 60_000)
    [skipped] = [r for r in await backend.strategy.history(backend.store, "sync", 10) if r.slot == now - 1_000]
    assert skipped.message == f"run {now - 2_000} was still running"


async def test_claim_only_a_skip_at_exactly_late_after_ms_is_not_recorded(
    target: StoreTarget, store_clock: list[int]
) -> None:
    """By the store's clock, a run exactly late_after_ms past its slot is not late yet (as the scheduler counts
    it): no instance has passed it, and no skip is recorded; a ms later it is."""
    backend = await target.started_backend("stream-id")
    policy = JobPolicy(late_after_ms=100)
    now = store_clock[0]
    for slot, recorded in ((now - 101, True), (now - 100, False)):
        req = request(slot, f"z{slot}")
        assert await backend.strategy.skip(backend.store, req, policy, "skipped-late", "too late") is recorded


@pytest.mark.parametrize("strategy", ["lease", "script", "stream-id"])
async def test_scripts_run_on_a_redis_5_set_to_replicate_scripts_verbatim(real_target: str, strategy: str) -> None:
    """Redis 5 (and 6) can be set to replicate scripts verbatim (``lua-replicate-commands no``), where a write
    after TIME or XADD '*' is refused: the scripts ask for effects replication. Claim, a backup's claim, heartbeat,
    finish and a late skip go through."""
    if real_target != "redis-5":
        pytest.skip(f"only Redis 5 and 6 replicate scripts verbatim when told; {real_target} has effects only")
    with start_server(real_target, extra_args=["--lua-replicate-commands", "no"]) as running:
        backend = backend_for(real_target, running.url(), strategy)
        await backend.start(["sync"])
        try:
            policy = JobPolicy(lease_ms=5_000, late_after_ms=1_000)
            now = await server_ms(backend.store)
            late = request(now - 10_000, "late")  # first: under stream-id, a later slot's claim shuts it out
            assert await backend.strategy.skip(backend.store, late, policy, "skipped-late", "too late")
            mine = request(now, "mine")
            won = await claim_one(backend, mine, policy)
            assert won.outcome is Outcome.WON
            lost = await claim_one(backend, request(now, "theirs"), policy)
            assert lost.outcome is (Outcome.RUNNING if strategy == "lease" else Outcome.LOST)
            if strategy == "lease":
                assert await backend.strategy.heartbeat(backend.store, mine, policy) == 5_000
            assert await backend.strategy.finish(backend.store, mine, won, policy, record(mine, won))
            history = await backend.strategy.history(backend.store, "sync", 10)
            assert [(r.slot, r.status) for r in history] == [(now, "ok"), (now - 10_000, "skipped-late")]
        finally:
            await backend.stop()
