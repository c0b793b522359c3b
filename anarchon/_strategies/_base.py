"""The protocol every claim strategy implements, and the values that cross it."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from .._errors import StoreError
from .._records import RunRecord, Status, decode_record, result_score
from .._store import Script, ServerInfo, Store, as_list, as_text


class Outcome(enum.StrEnum):
    WON = "won"  # this instance runs the attempt
    # lease: another attempt holds a live lease; stand by as a backup. With attempt 0: claimed before its slot by
    # the store's clock while another run of the job is live; claim again when told (lease_ms_left)
    RUNNING = "running"
    OVERLAP = "overlap"  # lease: another run of the job is live; this run was recorded as skipped-overlap
    DONE = "done"  # lease: finished, skipped, or out of attempts
    LOST = "lost"  # claim-only: another instance claimed the run


OUTCOMES = {outcome.value: outcome for outcome in Outcome}  # by value, cheaper than Outcome(value)


class Claim(NamedTuple):
    """A claim's answer. A named tuple: one is made per claim, and a tuple is built faster than a frozen
    dataclass."""

    outcome: Outcome
    attempt: int = 0
    fence: int = 0
    lease_ms_left: int = 0  # lease: how long the holder's lease lasts from the server's point of view
    given_up: bool = False  # lease, "done": this claim gave the run up, its attempts used up (recorded interrupted)

    @property
    def forgotten(self) -> bool:
        """lease: the run is older than anything the store still remembers (trim dropped it, or a later one): it
        ran or was decided long ago, and is not run again."""
        return self.outcome is Outcome.DONE and self.attempt == 0


CLAIM_MARGIN_MS = 60_000  # kept beyond a job's claim horizon, for clock differences between instances


class RunRequest(NamedTuple):
    """One instance asking for one run. ``run`` is the store's id of the run: the slot for a scheduled run,
    ``m<slot>-<tag>`` for a manual one (see :func:`run_id`). ``retry``: the claim is sent again, with the same
    token, after a try that may have reached the store (its answer never came). ``catch_up``: a catch-up's claim
    of a slot gone by (lease), which waits for a live run of the job where a slot coming due would be skipped
    for it. A named tuple, like :class:`Claim`: one is made for every claim."""

    job: str
    run: str
    slot: int
    token: str
    runner: str
    manual: bool = False
    retry: bool = False
    catch_up: bool = False


def run_id(slot: int, manual_tag: str | None = None) -> str:
    """The store's id of a run: every instance names a scheduled run by its slot alone."""
    return str(slot) if manual_tag is None else f"m{slot}-{manual_tag}"


@dataclass(frozen=True, slots=True, kw_only=True)
class JobPolicy:
    """What a strategy needs to know about a job besides its name."""

    lease_ms: int = 30_000
    max_attempts: int = 3
    overlap: bool = False
    history_size: int = 1000
    history_ttl_ms: int | None = None
    keep_ms: int = 3_600_000  # how long after its slot a run may still be claimed (late claims, catch-up)
    slot_gap_ms: int = 1000  # the least time between two of the job's slots (a minute without a seconds field)
    late_after_ms: int = 60_000  # jitter_ms + max_late_ms: a run is skipped once the store's clock is this far past it


class Strategy(Protocol):
    """How one winner is picked for each run. One module per strategy; one contract test suite for all."""

    name: str
    leases: bool
    # Whether a claim of a later slot makes the job's earlier slots unclaimable (stream-id: IDs only grow): the
    # scheduler then sends a job's claims in slot order, also its retries after an outage.
    claims_in_slot_order: bool
    scripts: tuple[Script, ...]  # loaded into the server's script cache at start

    def check_server(self, server: ServerInfo) -> None:
        """Raise UnsupportedStrategyError if the server cannot run this strategy. Called before any write."""
        ...

    async def prepare(self, store: Store, jobs: Sequence[str]) -> None:
        """Configure per-job server state (after the store format was checked). Called by start()."""
        ...

    async def claim(self, store: Store, requests: Sequence[tuple[RunRequest, JobPolicy]]) -> list[Claim | StoreError]:
        """Claim runs in one round trip where possible; a failed claim's error is returned in its place."""
        ...

    async def heartbeat(self, store: Store, request: RunRequest, policy: JobPolicy) -> int:
        """Extend the lease of the caller's attempt; lease ms left, 0 if refused (not the current token)."""
        ...

    async def finish(
        self, store: Store, request: RunRequest, claim: Claim, policy: JobPolicy, record: RunRecord
    ) -> bool:
        """Record how an attempt ended; False if the store refused (the attempt is no longer current). A try made
        again after the reply to an earlier one was lost is True if the earlier one recorded it."""
        ...

    async def release(self, store: Store, request: RunRequest) -> bool:
        """Give the caller's attempt's run back unfinished, for a backup to take over now as the next attempt;
        False if refused (not the current attempt) or if the strategy has no backups."""
        ...

    async def skip(self, store: Store, request: RunRequest, policy: JobPolicy, status: Status, message: str) -> bool:
        """Record a run that was not claimed (too late); False if the run already has an outcome."""
        ...

    async def catch_up_since(self, store: Store, job: str, now: int) -> int:
        """The moment (ms) from which the job's slots may be caught up: none before the job first asked, unless
        it ran before that. ``now`` where the strategy has no catch-up."""
        ...

    async def history(self, store: Store, job: str, limit: int) -> list[RunRecord]:
        """Attempts newest first."""
        ...

    async def records_at(self, store: Store, job: str, slot: int) -> list[RunRecord]:
        """The attempts recorded at ``slot`` (a scheduled run's, and any manual run's begun at that ms)."""
        ...


async def read_history(store: Store, job: str, results_key: str, limit: int) -> list[RunRecord]:
    members = as_list(await store.execute("ZREVRANGE", results_key, 0, limit - 1))
    return [decode_record(job, as_text(member)) for member in members]


async def read_records_at(store: Store, job: str, results_key: str, slot: int) -> list[RunRecord]:
    members = as_list(await store.execute("ZRANGEBYSCORE", results_key, result_score(slot, 0), result_score(slot, 99)))
    return [decode_record(job, as_text(member)) for member in members]


def fence_of(entry_id: str) -> int:
    """A number that grows with stream entry ids ("<ms>-<seq>"), for claim-only strategies' fencing."""
    ms, _, seq = entry_id.partition("-")
    return int(ms) * 1000 + int(seq or 0)
