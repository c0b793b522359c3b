"""lease: the job's run states, as lease_claim/heartbeat/finish/skip.lua keep them.

The state hash holds one run per run id plus the job's fence counter, its "forgotten" slot (the latest slot of
a run trim dropped) and its "deferred" slots (claimed early and told to come again). The scripts keep
the ACTIVE set equal to the runs whose status is ``running`` and the SLOTS set equal to the others, so the model
keeps only the runs, the counter and those slots. Runs are
keyed by their run id, as in the store: ``"<slot>"`` for a scheduled run, ``"m<slot>-<tag>"`` for a manual one
(whose claims the strategy sends with ``max_attempts`` 1: callers pass that policy).
History (the runs stream, the results set) is not modelled: no answer depends on it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from anarchon._strategies import Claim, JobPolicy, Outcome

RUNNING = "running"
ABANDONED_SAMPLE = 3  # trim looks at SRANDMEMBER(active, 3)


class Unpredictable(Exception):
    """The store's next state depends on a random choice the model does not make."""


def run_slot(run: str) -> int:
    """The slot a run id carries (lease_state.lua's run_slot): ``"<slot>"`` or ``"m<slot>-<tag>"``."""
    return int(run[1:].partition("-")[0]) if run.startswith("m") else int(run)


def _by_slot(pair: tuple[str, Run]) -> tuple[int, str]:
    """The order the model keeps runs in, so that equal stores are equal states (the explorer compares them). No
    answer depends on it, as none depends on the order SMEMBERS lists the job's active runs in."""
    return run_slot(pair[0]), pair[0]


@dataclass(frozen=True, slots=True)
class Run:
    status: str  # running | ok | error | interrupted | skipped-late | skipped-overlap
    attempt: int
    token: str
    lease_end: int  # server ms; 0 for a run that never ran, minus the moment of its hand-back for one handed back
    fence: int
    closed: int = 0  # a finished run's score in the SLOTS set: its slot, or the moment it ended if later

    @property
    def running(self) -> bool:
        return self.status == RUNNING

    def close(self, status: str, slot: int, now: int) -> Run:
        return replace(self, status=status, closed=max(slot, now))


@dataclass(frozen=True, slots=True)
class LeaseStore:
    runs: tuple[tuple[str, Run], ...] = ()  # (run id, run), by slot (see _by_slot)
    fence: int = 0  # the job's fence counter: the fence of the latest attempt started
    forgotten: int = 0  # the latest slot of a run that trim dropped: a claim for it or an earlier one is "done"
    # The slots of the last keep_ms claimed early while another run was live, told to come again at the slot: a
    # late skip of one waits. Sorted (the store lists them in the order put off: no answer depends on it).
    deferred: tuple[int, ...] = ()

    def run(self, run_id: str) -> Run | None:
        for key, r in self.runs:
            if key == run_id:
                return r
        return None

    def put(self, run_id: str, run: Run, fence: int | None = None) -> LeaseStore:
        runs = sorted((*(pair for pair in self.runs if pair[0] != run_id), (run_id, run)), key=_by_slot)
        return replace(self, runs=tuple(runs), fence=self.fence if fence is None else fence)

    def drop(self, run_ids: Iterable[str]) -> LeaseStore:
        gone = set(run_ids)
        kept = tuple(pair for pair in self.runs if pair[0] not in gone)
        return replace(self, runs=kept, forgotten=max((self.forgotten, *map(run_slot, gone))))


def claim(
    store: LeaseStore, run: str, token: str, now: int, policy: JobPolicy, catch_up: bool = False
) -> tuple[LeaseStore, Claim]:
    slot = run_slot(run)
    r = store.run(run)
    live = _live_others(store, run, now, policy)
    other_end = max((o.lease_end for _, o in live), default=None)  # when the last of them ends
    if r is None:
        if slot <= store.forgotten:  # trimmed long ago: a claim this late must not run it again
            return store, Claim(Outcome.DONE)
        # One of them of a scheduled slot still ahead of now: begun early by an instance whose clock runs ahead.
        early_other = any(not other.startswith("m") and run_slot(other) > now for other, _ in live)
        if other_end is not None and not run.startswith("m") and (slot > now or early_other):
            # Early by the store's clock (the caller's runs ahead): a run being live at the slot decides. Or the
            # live run is of a later slot begun early (its instance's clock runs ahead): this one waits for its
            # lease. The caller claims again then; meanwhile a late skip of the slot waits for it.
            kept = {s for s in store.deferred if s > now - policy.keep_ms}
            wait = max(slot, other_end if early_other else 0) - now
            return replace(store, deferred=tuple(sorted(kept | {slot}))), Claim(Outcome.RUNNING, 0, 0, wait)
        if other_end is not None and catch_up:  # a catch-up's claim waits for that lease, and claims again
            return store, Claim(Outcome.RUNNING, 0, 0, other_end - now)
        if other_end is not None:
            skipped = Run("skipped-overlap", 1, token, 0, 0).close("skipped-overlap", slot, now)
            # A run that ends in its claim has no finish to trim after it: the claim trims.
            return trim(store.put(run, skipped), now, policy), Claim(Outcome.OVERLAP, 0, 0, other_end - now)
        return _start(store, run, token, now, policy, 1)
    if not r.running:
        if r.token == token:  # a copy of the claim that closed the run, its answer lost: told what it was told
            if r.status == "interrupted":
                return store, Claim(Outcome.DONE, r.attempt, r.fence, given_up=True)
            if r.status == "skipped-overlap":
                return store, Claim(Outcome.OVERLAP, 0, 0, 0 if other_end is None else other_end - now)
        return store, Claim(Outcome.DONE, r.attempt, r.fence)
    if r.token == token:  # a retried claim: the caller already holds the run; its lease is renewed (a heartbeat)
        if r.lease_end < 0:  # unless the caller handed the run back since: a copy of its claim came late
            return store, Claim(Outcome.DONE, r.attempt, r.fence)
        if r.lease_end <= now and other_end is not None:  # renewed, it would run beside another live run: it waits
            return _waited(store, run, r, live, slot, now), Claim(Outcome.RUNNING, r.attempt, r.fence, other_end - now)
        # Nobody heard the first answer, and other runs may have taken fences since (here, or on a server whose
        # claims a failover lost): the renewal takes the next, so that the fences acknowledged keep growing.
        new_fence = next_fence(store.fence, now)
        renewed = replace(r, lease_end=now + policy.lease_ms, fence=new_fence)
        return store.put(run, renewed, new_fence), Claim(Outcome.WON, r.attempt, renewed.fence, policy.lease_ms)
    if r.lease_end > now:
        return store, Claim(Outcome.RUNNING, r.attempt, r.fence, r.lease_end - now)
    if r.attempt >= policy.max_attempts:
        interrupted = replace(r.close("interrupted", slot, now), token=token)  # the state keeps the closer's token
        return trim(store.put(run, interrupted), now, policy), Claim(Outcome.DONE, r.attempt, r.fence, given_up=True)
    if other_end is not None:  # a takeover would run beside another live run: the backup waits for its lease
        return _waited(store, run, r, live, slot, now), Claim(Outcome.RUNNING, r.attempt, r.fence, other_end - now)
    return _start(store, run, token, now, policy, r.attempt + 1)


def _waited(store: LeaseStore, run: str, r: Run, live: list[tuple[str, Run]], slot: int, now: int) -> LeaseStore:
    """A claim waiting for the live runs marks the run asked for now (keeping a hand-back's sign), so that trim
    does not abandon it; not when one of them is of a later slot (the job has moved on: trim may close it)."""
    if any(not other.startswith("m") and run_slot(other) > slot for other, _ in live):
        return store
    return store.put(run, replace(r, lease_end=-now if r.lease_end < 0 else now))


def _live_others(store: LeaseStore, run: str, now: int, policy: JobPolicy) -> list[tuple[str, Run]]:
    """When overlap is forbidden, the job's other runs whose lease is live at ``now`` (none when it is allowed)."""
    if policy.overlap:
        return []
    return [(other, o) for other, o in store.runs if other != run and o.running and o.lease_end > now]


def _start(
    store: LeaseStore, run_id: str, token: str, now: int, policy: JobPolicy, attempt: int
) -> tuple[LeaseStore, Claim]:
    """The attempt starts at ``now``, with the next fence (see :func:`next_fence`)."""
    fence = next_fence(store.fence, now)
    run = Run(RUNNING, attempt, token, now + policy.lease_ms, fence)
    return store.put(run_id, run, fence), Claim(Outcome.WON, attempt, fence, policy.lease_ms)


def next_fence(fence: int, now: int) -> int:
    """The fence of an attempt started at ``now`` (ms): one more than the job's counter, or ``now`` × 1000 where
    that is more, so that fences keep growing past a store that lost the job's state, or a failover that lost its
    latest claims."""
    return max(fence + 1, now * 1000)


def heartbeat(store: LeaseStore, run: str, token: str, now: int, policy: JobPolicy) -> tuple[LeaseStore, int]:
    """The lease ms left after the extension, 0 if refused: also once the lease has ended (its holder gave the run
    up by then; a heartbeat that late would bring back a lease nobody holds)."""
    r = store.run(run)
    if r is None or not r.running or r.token != token or r.lease_end <= now:
        return store, 0
    return store.put(run, replace(r, lease_end=now + policy.lease_ms)), policy.lease_ms


def finish(
    store: LeaseStore, run: str, token: str, status: str, now: int, policy: JobPolicy
) -> tuple[LeaseStore, bool]:
    """Record how the current attempt ended; True also for a run that this call ended already (tried again after
    its reply was lost): a run ended with the caller's token and this status. An attempt that handed its run back
    is refused."""
    r = store.run(run)
    if r is None or r.token != token:
        return store, False
    if not r.running:
        return store, r.status == status
    if r.lease_end < 0:  # the attempt handed the run back
        return store, False
    return trim(store.put(run, r.close(status, run_slot(run), now)), now, policy), True


def release(store: LeaseStore, run: str, token: str, now: int) -> tuple[LeaseStore, bool]:
    """The current attempt gives its run back unfinished: its lease end becomes ``-now`` (over, and marked handed
    back), and a heartbeat or a claim of that attempt that arrives afterwards is refused."""
    r = store.run(run)
    if r is None or not r.running or r.token != token:
        return store, False
    return store.put(run, replace(r, lease_end=-now)), True


def skip(store: LeaseStore, run: str, token: str, now: int, policy: JobPolicy) -> tuple[LeaseStore, bool]:
    """Record a run claimed too late as skipped-late, unless it already has a state, or the store's clock says it
    is not late yet or more than ``keep_ms`` past its slot (its state may have been trimmed), or an early claim of
    it was told to claim again at the slot (``deferred``: it may still). A running attempt
    of the caller's own token (its claim won, the answer was lost, the retry came late) is handed back, as
    :func:`release` does, for the instances told it was running to take it over; nothing is recorded."""
    slot = run_slot(run)
    r = store.run(run)
    if r is not None and r.running and r.token == token:
        return release(store, run, token, now)[0], False
    if r is not None or not slot + policy.late_after_ms < now <= slot + policy.keep_ms or slot in store.deferred:
        return store, False
    return trim(store.put(run, Run("skipped-late", 1, token, 0, 0).close("skipped-late", slot, now)), now, policy), True


def trim(store: LeaseStore, now: int, policy: JobPolicy) -> LeaseStore:
    """What finish and skip drop. First, abandoned runs (lease expired and slot both older than ``keep_ms``) are
    closed as interrupted, at every trim. Then runs nobody can claim any more (slot and end both older than
    ``keep_ms``) beyond ``history_size`` or ``history_ttl_ms`` are dropped: without ``history_ttl_ms``, only once
    the finished runs are a tenth over ``history_size`` (at least one)."""
    horizon = now - policy.keep_ms
    active = [(run, r) for run, r in store.runs if r.running]
    abandoned = [(run, r) for run, r in active if abs(r.lease_end) < horizon and run_slot(run) < horizon]
    if abandoned and len(active) > ABANDONED_SAMPLE:
        raise Unpredictable(f"trim closes the abandoned runs among {ABANDONED_SAMPLE} random active ones")
    for run, r in abandoned:  # the state keeps no token: a finish that late is refused, not taken for a retry
        store = store.put(run, replace(r.close("interrupted", run_slot(run), now), token=""))
    slack = max(1, policy.history_size // 10)
    if not policy.history_ttl_ms and sum(1 for _, r in store.runs if not r.running) <= policy.history_size + slack:
        return store
    # ZRANGEBYSCORE order: by score, then by member (the run id, as text)
    finished = sorted((r.closed, run) for run, r in store.runs if not r.running)
    dropped: list[str] = []
    excess = len(finished) - policy.history_size
    if excess > 0:
        dropped += [run for closed, run in finished if closed < horizon][: min(excess, 100)]
    if policy.history_ttl_ms:
        dropped += [run for closed, run in finished if closed < min(now - policy.history_ttl_ms, horizon)][:100]
    return store.drop(dropped)
