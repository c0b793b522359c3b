"""Model and store, fed the same operations through the strategy objects, give the same answers.

One Hypothesis state machine per strategy, run against every target of the `server` fixture (fakeredis and
the real servers). A mismatch fails with the shrunk program of operations. Each operation on the store is
compared with the model fed the server's clock of that moment (see tests/models/support.py). The lease machine
also compares the store's finished runs with the model's after each call that closes one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterator
from dataclasses import replace
from typing import Any, ClassVar, TypeVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    MultipleResults,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
    run_state_machine_as_test,
)

from anarchon import RunRecord
from anarchon._records import Status
from anarchon._store import as_list, as_text
from anarchon._strategies import Claim, JobPolicy, Outcome, RunRequest
from anarchon._strategies.script import ScriptStrategy
from models import idmp, lease, script, stream_id
from tests.models.support import SLOT, FenceMap, Harness, assert_same_claim, bind, one_claim

T = TypeVar("T")

# A passing run takes a few seconds; after a mismatch, shrinking replays programs on the store for minutes.
pytestmark = pytest.mark.timeout(600)

SETTINGS = settings(
    max_examples=20, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TOKENS = st.sampled_from(["a", "b"])
SLOTS = st.sampled_from([SLOT, SLOT + 60_000, SLOT + 120_000, SLOT + 180_000])
LONG_MS = 600_000  # never over during a test
SHORT_MS = 1  # over by the next operation: a sleep follows the call that set it

# The lease scripts compare a run's slot with the server's clock: skip with late_after_ms and keep_ms, the closed
# score max(slot, now), and trim (its drops, its abandoned check) with now - keep_ms. So the lease machine's slots
# lie around the server's clock at the start of each example, at these ages (now - slot): two ahead of it (scored by
# their slots when closed, never abandoned; two, so that one is often in progress while another closes), 2 minutes
# and a day past. Ages and the durations below are at least 30 s apart, far more than an example lasts: each
# comparison comes out the same all through it, for the model and the store alike.
LEASE_AGES = [-120_000, -30_000, 120_000, 86_400_000]
# A skip 2 minutes past the slot: late with 0 or 1 minute, not yet late with 5.
LATE_AFTER_MS = st.sampled_from([0, 60_000, 300_000])
# 0: a run closed during the test is past keep_ms by the next call (a sleep follows each call that closes one): trim
# drops it and closes abandoned runs, and skip records nothing. 1 hour: trim keeps every run closed during the test,
# and skip records a run 2 minutes past (if late) but not one a day past.
KEEP_MS = st.sampled_from([0, 3_600_000])
# None: trim waits for history_size to be exceeded. 1 (a sleep follows each close): it drops every run past keep_ms
# at once. 10 minutes: it does its work on every call, with keep_ms's cut-off.
HISTORY_TTL_MS = st.sampled_from([None, SHORT_MS, LONG_MS])


@pytest.fixture
def harness(server: Any) -> Iterator[Harness]:
    harness = Harness(server)
    try:
        yield harness
    finally:
        harness.close()


class StoreMachine(RuleBasedStateMachine):
    harness: ClassVar[Harness]

    def __init__(self) -> None:
        super().__init__()
        self.job = self.harness.new_job()
        self.slowest_ms = 0

    def timed(self, coroutine: Coroutine[Any, Any, T]) -> tuple[int, T]:
        """The server's clock before the call, and the call's result."""
        before, result, after = self.harness.timed(coroutine)
        self.slowest_ms = max(self.slowest_ms, after - before)
        return before, result

    @property
    def slack_ms(self) -> int:
        # A lease end, or the moment of a call, on the server lies within one call's time of the model's.
        return 2 * self.slowest_ms + 2

    def request(self, slot: int, token: str) -> RunRequest:
        return self.run_request(str(slot), token)

    def run_request(self, run: str, token: str) -> RunRequest:
        """A request for a run by its id: a scheduled run's, or a manual one's ("m<slot>-<tag>")."""
        manual = run.startswith("m")
        return RunRequest(self.job, run, lease.run_slot(run), token, f"runner-{token}", manual=manual)


class LeaseMachine(StoreMachine):
    runs = Bundle("runs")  # the run ids of the example (see place_runs)
    # Runs a claim won (by run id): heartbeats, finishes and releases go mostly to runs in progress, where each
    # changes something (on the others, they are refused alike); refusals still come from a wrong token or a run
    # since ended.
    won = Bundle("won")

    def __init__(self) -> None:
        super().__init__()
        self.backend = self.harness.backend("lease")
        self.model = lease.LeaseStore()
        self.policy = JobPolicy()
        self.skips = 0
        self.closed = False  # the last call closed a run (and so may have trimmed others)
        self.last_claim: tuple[str, str, bool] | None = None  # (run, token, catch_up)
        self.fences = FenceMap()

    @initialize(
        overlap=st.booleans(),
        max_attempts=st.integers(1, 3),
        history_size=st.integers(1, 3),
        keep_ms=KEEP_MS,
        ttl_ms=HISTORY_TTL_MS,
        late_after_ms=LATE_AFTER_MS,
    )
    def choose_policy(
        self,
        overlap: bool,
        max_attempts: int,
        history_size: int,
        keep_ms: int,
        ttl_ms: int | None,
        late_after_ms: int,
    ) -> None:
        self.policy = JobPolicy(
            overlap=overlap, max_attempts=max_attempts, history_size=history_size, keep_ms=keep_ms,
            history_ttl_ms=ttl_ms, late_after_ms=late_after_ms,
        )  # fmt: skip

    # Four runs: trim runs in the call that closed a run, so it finds at most three active ones, and it looks at
    # 3 random active runs: at them all. ``manual``: which of them, if any, is a manual run (run_now at that
    # moment): a run of its own, which backups never take over (the other token claims it too, as no instance
    # would, to compare those answers as well).
    @initialize(target=runs, manual=st.sampled_from([None, *range(len(LEASE_AGES))]))
    def place_runs(self, manual: int | None) -> MultipleResults[str]:
        now = self.harness.run(self.harness.target.server_ms())
        runs = [str(now - age) for age in LEASE_AGES]
        if manual is not None:
            runs[manual] = f"m{runs[manual]}-x"
        return multiple(*runs)

    def update(self, model: lease.LeaseStore, *, settle: bool = False) -> None:
        """Take the model's state after a call, and sleep until the next call if it must come 1 ms or more later:
        ``settle`` when the call set a 1 ms lease or ended one, which must be over by then. And when it closed a
        run: its score is the server's clock of the call, which the model knows only to within the call's time, and
        a later trim compares it with its own clock less keep_ms (or history_ttl_ms), 0 (or 1) ms."""
        self.closed = any(r.closed and r != self.model.run(run) for run, r in model.runs)
        if settle or self.closed:
            self.harness.settle()
        self.model = model

    @invariant()
    def same_finished_runs(self) -> None:
        """After a call that closed a run, and so may have trimmed, the store's slots set (each finished run,
        scored with its slot or the moment it ended if later) holds the model's finished runs and scores, and the
        state's "forgotten" field the model's latest slot dropped. Answers
        show a wrong score, a wrong drop or a wrong close only once some claim asks for that run, if ever."""
        if not self.closed:
            return
        self.closed = False
        key = self.backend.strategy.keys.lease(self.job).slots
        real = {as_text(run): self.score(key, run) for run in as_list(self.raw("ZRANGE", key, 0, -1))}
        expected = {run: r.closed for run, r in self.model.runs if not r.running}
        assert real.keys() == expected.keys(), f"finished runs: store {sorted(real)}, model {sorted(expected)}"
        for run, closed in expected.items():
            # A moment of closing differs by up to a call's time; a slot, not at all.
            assert abs(real[run] - closed) <= self.slack_ms, f"run {run} scored {real[run]}, in the model {closed}"
        forgotten = self.raw("HGET", self.backend.strategy.keys.lease(self.job).state, "forgotten")
        assert int(as_text(forgotten) if forgotten else 0) == self.model.forgotten, "the latest slot trim dropped"

    @invariant()
    def same_deferred_slot(self) -> None:
        """The slots claimed before they were due while another run was live, which late skips leave alone."""
        deferred = self.raw("HGET", self.backend.strategy.keys.lease(self.job).state, "deferred")
        listed = sorted(int(slot) for slot in (as_text(deferred) if deferred else "").split())
        assert listed == list(self.model.deferred), "the slots put off"

    def raw(self, *command: Any) -> Any:
        return self.harness.run(self.harness.target.raw(*command))

    def score(self, key: str, run: Any) -> int:
        # One ZSCORE per run: fakeredis and the servers shape a ZRANGE WITHSCORES reply differently.
        return int(float(as_text(self.raw("ZSCORE", key, run))))

    @rule(target=won, run=runs, token=TOKENS, short=st.booleans(), catch_up=st.booleans())
    def claim(self, run: str, token: str, short: bool, catch_up: bool) -> MultipleResults[str]:
        # A catch-up claims scheduled runs only.
        request = self.run_request(run, token)._replace(catch_up=catch_up and not run.startswith("m"))
        policy = replace(self.policy, lease_ms=SHORT_MS if short else LONG_MS)
        strategy, store = self.backend.strategy, self.backend.store
        now, results = self.timed(strategy.claim(store, [(request, policy)]))
        # As the strategy sends it: a manual run is not retried by backups.
        sent = replace(policy, max_attempts=1) if request.manual else policy
        model, expected = lease.claim(self.model, run, token, now, sent, request.catch_up)
        self.update(model, settle=short and expected.outcome is Outcome.WON)
        real = one_claim(results)
        assert_same_claim(expected, real, self.slack_ms, self.fences)
        self.last_claim = (run, token, request.catch_up)
        return multiple(run) if real.outcome is Outcome.WON else multiple()

    # The last claim sent again with its token, as the scheduler does when the answer to the first was lost: it
    # may have won (its lease renewed), closed the run (given up, skipped for overlap), or anything since.
    @precondition(lambda self: self.last_claim is not None)
    @rule(target=won, short=st.booleans())
    def claim_again(self, short: bool) -> MultipleResults[str]:
        assert self.last_claim is not None
        run, token, catch_up = self.last_claim
        return self.claim(run, token, short, catch_up)

    def token_for(self, run_id: str, token: str, holder: bool) -> str:
        """``holder``: the token of the run's current attempt (as the model has it), so that heartbeats and
        finishes are not mostly refused."""
        run = self.model.run(run_id)
        return run.token if holder and run is not None else token

    @rule(run=won, token=TOKENS, holder=st.booleans(), short=st.booleans())
    def heartbeat(self, run: str, token: str, holder: bool, short: bool) -> None:
        token = self.token_for(run, token, holder)
        policy = replace(self.policy, lease_ms=SHORT_MS if short else LONG_MS)
        beat = self.backend.strategy.heartbeat(self.backend.store, self.run_request(run, token), policy)
        now, left = self.timed(beat)
        model, expected = lease.heartbeat(self.model, run, token, now, policy)
        self.update(model, settle=short and expected > 0)
        assert left == expected, f"heartbeat: store {left}, model {expected}"

    @rule(run=won, token=TOKENS, holder=st.booleans(), status=st.sampled_from(["ok", "error", "interrupted"]))
    def finish(self, run: str, token: str, holder: bool, status: Status) -> None:
        token = self.token_for(run, token, holder)
        request = self.run_request(run, token)
        record = RunRecord(
            job=self.job, run=run, slot=request.slot, attempt=1, status=status, runner=request.runner, token=token,
            fence=0, manual=request.manual, started=request.slot, ended=request.slot + 1,
            message="boom" if status == "error" else None,
        )  # fmt: skip
        claim = Claim(Outcome.WON, 1)  # lease's finish goes by the token alone
        strategy, store = self.backend.strategy, self.backend.store
        now, accepted = self.timed(strategy.finish(store, request, claim, self.policy, record))
        model, expected = lease.finish(self.model, run, token, status, now, self.policy)
        self.update(model)
        assert accepted == expected, f"finish: store {accepted}, model {expected}"

    @rule(run=won, token=TOKENS, holder=st.booleans())
    def release(self, run: str, token: str, holder: bool) -> None:
        token = self.token_for(run, token, holder)
        releasing = self.backend.strategy.release(self.backend.store, self.run_request(run, token))
        now, released = self.timed(releasing)
        model, expected = lease.release(self.model, run, token, now)
        # Settled after a hand-back: it is stamped with the server's moment of the call, which the model knows only
        # to within the call's time, and a later trim compares that moment with its own clock less keep_ms.
        self.update(model, settle=model != self.model)
        assert released == expected, f"release: store {released}, model {expected}"

    # A recorded skip ends a run (until trimmed); with a few runs, more would leave little else to compare. A refused
    # one changes nothing, and each refusal has its reason: those are not counted.
    @precondition(lambda self: self.skips < 2)
    @rule(run=runs, token=TOKENS, holder=st.booleans())
    def skip(self, run: str, token: str, holder: bool) -> None:
        if run.startswith("m"):
            return  # only a scheduled run is claimed late
        token = self.token_for(run, token, holder)
        skipping = self.backend.strategy.skip(
            self.backend.store, self.run_request(run, token), self.policy, "skipped-late", "too late"
        )
        now, recorded = self.timed(skipping)
        model, expected = lease.skip(self.model, run, token, now, self.policy)
        # Settled after a hand-back too (the caller's own running attempt, skipped late), as after release().
        self.update(model, settle=model != self.model)
        self.skips += expected
        assert recorded == expected, f"skip: store {recorded}, model {expected}"


class ScriptMachine(StoreMachine):
    """Claims read the job's stream through a window of 10 minutes (it sees every entry of the test) or of
    1 ms (it sees none of the earlier entries: such a claim waits a little first)."""

    def __init__(self) -> None:
        super().__init__()
        self.backends = {w: self.harness.backend({"name": "script", "window_ms": w}) for w in (LONG_MS, SHORT_MS)}
        self.model = script.ScriptStore()
        self.policy = JobPolicy()
        self.fences = FenceMap()

    @initialize(history_size=st.integers(1, 3), ttl_ms=st.sampled_from([None, 1]))
    def choose_policy(self, history_size: int, ttl_ms: int | None) -> None:
        self.policy = JobPolicy(history_size=history_size, history_ttl_ms=ttl_ms)

    @rule(slot=SLOTS, token=TOKENS, short=st.booleans(), for_skip=st.booleans())
    def claim(self, slot: int, token: str, short: bool, for_skip: bool) -> None:
        """``for_skip``: a late skip's claim, which reads back to the window before the slot."""
        window_ms = SHORT_MS if short else LONG_MS
        strategy, store = self.backends[window_ms].strategy, self.backends[window_ms].store
        assert isinstance(strategy, ScriptStrategy)
        if short:
            self.harness.settle()
        request = self.request(slot, token)
        if for_skip:
            now, result = self.timed(strategy.claim_for_skip(store, request, self.policy))
            results = [result]
        else:
            now, results = self.timed(strategy.claim(store, [(request, self.policy)]))
        self.model, expected = script.claim(self.model, slot, token, now, window_ms, self.policy, for_skip=for_skip)
        assert_same_claim(expected, one_claim(results), self.slack_ms, self.fences)


class StreamIdMachine(StoreMachine):
    def __init__(self) -> None:
        super().__init__()
        self.backend = self.harness.backend("stream-id")
        self.model = stream_id.StreamIdStore()

    @rule(slot=SLOTS, token=TOKENS, retry=st.booleans())
    def claim(self, slot: int, token: str, retry: bool) -> None:
        """``retry``: the claim is sent again after its answer was lost (whether or not its first try got there);
        a claim with a token used before but not marked as a retry is one the client itself sent again."""
        strategy, store = self.backend.strategy, self.backend.store
        request = self.request(slot, token)._replace(retry=retry)
        _, results = self.timed(strategy.claim(store, [(request, JobPolicy())]))
        self.model, expected = stream_id.claim(self.model, slot, token)
        assert_same_claim(expected, one_claim(results), 0)


IDMP_MAX_SIZE = 2  # fewer than the slots used: the server forgets the oldest


class IdmpMachine(StoreMachine):
    """A duration far longer than the test; forgetting by duration is test_idmp_forgets_after_the_duration."""

    def __init__(self) -> None:
        super().__init__()
        self.backend = self.harness.backend({"name": "idmp", "duration_sec": 900, "max_size": IDMP_MAX_SIZE})
        self.harness.run(self.backend.strategy.prepare(self.backend.store, [self.job]))  # XCFGSET on its stream
        self.model = idmp.IdmpStore()
        self.fences = FenceMap()

    @rule(slot=SLOTS, token=TOKENS)
    def claim(self, slot: int, token: str) -> None:
        strategy, store = self.backend.strategy, self.backend.store
        now, results = self.timed(strategy.claim(store, [(self.request(slot, token), JobPolicy())]))
        self.model, expected = idmp.claim(self.model, slot, token, now, 900_000, IDMP_MAX_SIZE)
        assert_same_claim(expected, one_claim(results), 0, self.fences)


def needs_idmp(harness: Harness) -> None:
    if not harness.target.supports_idmp:
        pytest.skip(f"idmp needs Redis 8.6+; {harness.target.name} is {harness.target.describe}")


def test_lease(harness: Harness) -> None:
    # Longer programs than the other machines': what trim decides by a slot takes several steps to set up (a run
    # ahead of the clock claimed, its lease lapsed, another run finished).
    lease_settings = settings(SETTINGS, max_examples=40, stateful_step_count=50)
    run_state_machine_as_test(bind(LeaseMachine, harness), settings=lease_settings)


def test_lease_a_late_skip_of_a_slot_put_off_behind_a_run_begun_early_is_refused_alike(harness: Harness) -> None:
    """A path the random programs seldom take (in none of 18 runs of test_lease): a due slot claimed while a run of
    a later slot, begun early by a clock ahead, holds its lease is put off ("deferred"), and a late skip of it is
    then refused, by the store and the model alike. (A model without that rule would record the skip.)"""
    backend, job = harness.backend("lease"), harness.new_job()
    strategy, store = backend.strategy, backend.store
    policy = JobPolicy(keep_ms=3_600_000, late_after_ms=0, lease_ms=600_000)
    now = harness.run(harness.target.server_ms())
    early, due = str(now + 30_000), str(now - 120_000)
    model, fences = lease.LeaseStore(), FenceMap()
    for run, token in ((early, "a"), (due, "b")):
        request = RunRequest(job, run, int(run), token, f"runner-{token}")
        at, claims, _ = harness.timed(strategy.claim(store, [(request, policy)]))
        model, expected = lease.claim(model, run, token, at, policy)
        assert_same_claim(expected, one_claim(claims), 1_000, fences)
    assert model.deferred == (int(due),)
    skip = RunRequest(job, due, int(due), "a", "runner-a")
    at, recorded, _ = harness.timed(strategy.skip(store, skip, policy, "skipped-late", "too late"))
    assert recorded is False
    assert lease.skip(model, due, "a", at, policy)[1] is False
    assert lease.skip(replace(model, deferred=()), due, "a", at, policy)[1] is True


@pytest.mark.parametrize("trimmed", [False, True], ids=["kept", "after-a-trim"])
def test_script_a_late_skip_finds_a_claim_made_before_its_slot_alike(harness: Harness, trimmed: bool) -> None:
    """Paths the random programs never take (their slots are long past): a claim made 900 ms before its slot, by
    a clock ahead, is found by a late skip's claim, which looks back a window before the slot, and is left alone;
    also after another slot's claim trimmed the stream (history_size 1), which keeps the entries of slots still
    inside the window. (A model whose skip did not look back, or whose trim took the early entry, would record the
    skip beside the run.)"""
    window_ms = 1000
    backend, job = harness.backend({"name": "script", "window_ms": window_ms}), harness.new_job()
    strategy, store = backend.strategy, backend.store
    assert isinstance(strategy, ScriptStrategy)
    policy, model, fences = JobPolicy(history_size=1), script.ScriptStore(), FenceMap()

    def claim(slot: int, token: str, for_skip: bool = False) -> Claim:
        nonlocal model
        request = RunRequest(job, str(slot), slot, token, f"runner-{token}")
        if for_skip:
            at, result, _ = harness.timed(strategy.claim_for_skip(store, request, policy))
            results = [result]
        else:
            at, results, _ = harness.timed(strategy.claim(store, [(request, policy)]))
        model, expected = script.claim(model, slot, token, at, window_ms, policy, for_skip=for_skip)
        assert_same_claim(expected, one_claim(results), 0, fences)
        return expected

    early = harness.run(harness.target.server_ms()) + 900
    claim(early, "a")
    # Its slot 300 ms past, the early claim more than a window old
    harness.run(asyncio.sleep(max(0, early + 300 - harness.run(harness.target.server_ms())) / 1000))
    if trimmed:
        claim(early + 60_000, "c")
    expected = claim(early, "b", for_skip=True)
    assert expected.outcome is Outcome.LOST  # the skip left the run alone


def test_lease_a_backup_waiting_for_another_run_keeps_the_run_from_trim_alike(harness: Harness) -> None:
    """A path the random programs' keep_ms (0 or an hour) never shows: a backup that waits for a live run_now marks
    the lapsed slot's run as asked for, so the trim after run_now's finish, keep_ms past the run's lease end, does
    not close it as abandoned; the backup then takes it over (attempt 2) in the store and the model alike."""
    backend, job = harness.backend("lease"), harness.new_job()
    strategy, store = backend.strategy, backend.store
    policy = JobPolicy(keep_ms=1500, max_attempts=3, late_after_ms=0)
    model, fences = lease.LeaseStore(), FenceMap()
    now = harness.run(harness.target.server_ms())
    old, manual = str(now - 86_400_000), f"m{now}-x"

    def claim(run: str, token: str, lease_ms: int) -> Claim:
        nonlocal model
        request = RunRequest(job, run, lease.run_slot(run), token, f"runner-{token}", manual=run.startswith("m"))
        sent = replace(policy, lease_ms=lease_ms, max_attempts=1 if request.manual else policy.max_attempts)
        at, claims, _ = harness.timed(strategy.claim(store, [(request, sent)]))
        model, expected = lease.claim(model, run, token, at, sent)
        assert_same_claim(expected, one_claim(claims), 1_000, fences)
        return expected

    assert claim(old, "a", 1).outcome is Outcome.WON
    harness.settle()
    assert claim(manual, "m", LONG_MS).outcome is Outcome.WON
    harness.run(asyncio.sleep(2.0))  # the slot's lease ended 2 s ago: more than keep_ms
    assert claim(old, "b", LONG_MS).outcome is Outcome.RUNNING  # waits for the run_now
    request = RunRequest(job, manual, now, "m", "runner-m", manual=True)
    record = RunRecord(
        job=job, run=manual, slot=now, attempt=1, status="ok", runner="runner-m", token="m", fence=0, manual=True,
        started=now, ended=now + 1, message=None,
    )  # fmt: skip
    at, accepted, _ = harness.timed(strategy.finish(store, request, Claim(Outcome.WON, 1), policy, record))
    model, model_accepted = lease.finish(model, manual, "m", "ok", at, policy)
    assert (accepted, model_accepted) == (True, True)
    harness.settle()
    taken = claim(old, "b", LONG_MS)
    assert (taken.outcome, taken.attempt) == (Outcome.WON, 2)


def test_lease_trim_waits_for_a_tenth_over_history_size_alike(harness: Harness) -> None:
    """With history_size 20, trim leaves the finished runs be until they are a tenth over it (22), then drops
    them down to 20, in the store and the model alike. The random programs' history sizes (1-3) make that tenth
    always the minimum of one, so a model that ignored the rule passed them."""
    backend, job = harness.backend("lease"), harness.new_job()
    strategy, store = backend.strategy, backend.store
    policy = JobPolicy(history_size=20, keep_ms=0, lease_ms=LONG_MS)
    day_ago = harness.run(harness.target.server_ms()) - 86_400_000  # older than keep_ms: trim may drop them all
    slots_key = strategy.keys.lease(job).slots
    model, kept, fences = lease.LeaseStore(), [], FenceMap()
    for k in range(25):
        run, token = str(day_ago + k * 60_000), f"t{k}"
        request = RunRequest(job, run, int(run), token, "runner")
        at, claims, _ = harness.timed(strategy.claim(store, [(request, policy)]))
        model, expected = lease.claim(model, run, token, at, policy)
        assert_same_claim(expected, one_claim(claims), 1_000, fences)
        record = RunRecord(
            job=job, run=run, slot=int(run), attempt=1, status="ok", runner="runner", token=token, fence=0,
            manual=False, started=int(run), ended=int(run) + 1, message=None,
        )  # fmt: skip
        at, accepted, _ = harness.timed(strategy.finish(store, request, Claim(Outcome.WON, 1), policy, record))
        model, model_accepted = lease.finish(model, run, token, "ok", at, policy)
        assert (accepted, model_accepted) == (True, True)
        harness.settle()
        members = harness.run(harness.target.raw("ZRANGE", slots_key, 0, -1))
        finished = sorted(as_text(member) for member in as_list(members))
        assert finished == sorted(run for run, r in model.runs if not r.running), f"after the finish of run {k + 1}"
        kept.append(len(finished))
    assert kept == [*range(1, 23), 20, 21, 22]


def test_script(harness: Harness) -> None:
    run_state_machine_as_test(bind(ScriptMachine, harness), settings=SETTINGS)


def test_stream_id(harness: Harness) -> None:
    run_state_machine_as_test(bind(StreamIdMachine, harness), settings=SETTINGS)


def test_idmp(harness: Harness) -> None:
    needs_idmp(harness)
    run_state_machine_as_test(bind(IdmpMachine, harness), settings=SETTINGS)


def test_idmp_forgets_after_the_duration(harness: Harness) -> None:
    """The server forgets a run once its entry is 1 s old, from a cron that runs once a second: a claim made
    2.2 s later wins again."""
    needs_idmp(harness)
    backend = harness.backend({"name": "idmp", "duration_sec": 1, "max_size": 10})
    job = harness.new_job()
    harness.run(backend.strategy.prepare(backend.store, [job]))
    model = idmp.IdmpStore()
    fences = FenceMap()
    for token, pause_s in (("a", 0.0), ("b", 0.0), ("c", 2.2)):
        harness.run(asyncio.sleep(pause_s))
        request = RunRequest(job, str(SLOT), SLOT, token, f"runner-{token}")
        now, real, _ = harness.timed(backend.strategy.claim(backend.store, [(request, JobPolicy())]))
        model, expected = idmp.claim(model, SLOT, token, now, 1000, 10)
        assert_same_claim(expected, one_claim(real), 0, fences)
    assert len({fence for fence in fences.pairs.values() if fence}) == 2  # "a" won, "b" lost, "c" won again
