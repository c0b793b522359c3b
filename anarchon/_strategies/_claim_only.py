"""What the three claim-only strategies share: manual runs, results and history.

They only decide who runs each scheduled run; a manual run (``run_now``) always runs where it was asked for and
is appended to the job's ``manual`` stream. Results are written by the instance that ran the attempt, with its
own clock for start and end.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from .._errors import StoreError
from .._keys import KeySpace
from .._records import RunRecord, Status, encode_record, result_score
from .._store import Command, Reply, Script, ScriptCall, ServerInfo, Store, as_list, as_text
from ._base import Claim, JobPolicy, Outcome, RunRequest, fence_of, read_history, read_records_at

TRIM_STREAM = Script.load("stream_trim")
SERVER_TIME = Script.load("server_time")


class ClaimOnlyStrategy:
    name: str
    leases = False
    claims_in_slot_order = False
    scripts: tuple[Script, ...] = (TRIM_STREAM, SERVER_TIME)
    # How long after its slot the store still knows a run was claimed (None: ever). Also a claim made before the
    # slot (an instance's clock ahead): a skip's claim looks that far back before the slot for one.
    remembers_ms: int | None = None
    runs_aged_by_ttl = True  # False where the claim script ages the runs stream itself

    def __init__(self, keys: KeySpace) -> None:
        self.keys = keys

    def check_server(self, server: ServerInfo) -> None:
        return None  # Redis 5+ and Valkey

    async def prepare(self, store: Store, jobs: Sequence[str]) -> None:
        for job in jobs:
            self.keys.claim(job)  # cached: built now rather than during the first burst of claims

    async def claim(self, store: Store, requests: Sequence[tuple[RunRequest, JobPolicy]]) -> list[Claim | StoreError]:
        manual = [i for i, (request, _) in enumerate(requests) if request.manual]
        scheduled = [i for i, (request, _) in enumerate(requests) if not request.manual]
        results: list[Claim | StoreError] = [Claim(Outcome.LOST)] * len(requests)
        for i, claim in zip(
            scheduled, await self.claim_scheduled(store, [requests[i] for i in scheduled]), strict=True
        ):
            results[i] = claim
        for i, claim in zip(manual, await self.claim_manual(store, [requests[i] for i in manual]), strict=True):
            results[i] = claim
        return results

    async def claim_scheduled(
        self, store: Store, requests: Sequence[tuple[RunRequest, JobPolicy]]
    ) -> list[Claim | StoreError]:
        raise NotImplementedError

    async def claim_manual(
        self, store: Store, requests: Sequence[tuple[RunRequest, JobPolicy]]
    ) -> list[Claim | StoreError]:
        commands = [
            (
                "XADD", self.keys.claim(r.job).manual, "MAXLEN", "~", policy.history_size, "*",
                "slot", r.slot, "token", r.token, "runner", r.runner,
            )
            for r, policy in requests
        ]  # fmt: skip
        replies = await store.execute_many(commands)
        return [
            reply if isinstance(reply, StoreError) else Claim(Outcome.WON, 1, fence_of(as_text(reply)))
            for reply in replies
        ]

    async def heartbeat(self, store: Store, request: RunRequest, policy: JobPolicy) -> int:
        return 0  # no leases: nothing to extend

    async def release(self, store: Store, request: RunRequest) -> bool:
        return False  # no backups to take a run over

    async def catch_up_since(self, store: Store, job: str, now: int) -> int:
        return now  # no catch-up

    async def finish(
        self, store: Store, request: RunRequest, claim: Claim, policy: JobPolicy, record: RunRecord
    ) -> bool:
        await self._record(store, record, policy)
        return True

    async def skip(self, store: Store, request: RunRequest, policy: JobPolicy, status: Status, message: str) -> bool:
        """Record the skip of a run that the store's clock also sees as late and that no instance claimed: the run
        is claimed for the skip first. An instance whose clock ran ahead then skips no run the others are about
        to run, and a late instance records no skip beside the run that another one ran. Past what the store
        remembers (``remembers_ms``) the claim could win again although the run ran: no skip is recorded."""
        time = await store.run(SERVER_TIME, [self.keys.claim(request.job).runs], [])
        seconds, micros = (int(as_text(part)) for part in as_list(time, 2))
        now = seconds * 1000 + micros // 1000
        if now <= request.slot + policy.late_after_ms:
            return False
        if self.remembers_ms is not None and now > request.slot + self.remembers_ms:
            return False
        # Written without runner and token, so the same skip reported by several instances is stored once.
        record = RunRecord(
            job=request.job, run=request.run, slot=request.slot, attempt=1, status=status, runner="",
            token="", fence=0, manual=False, started=request.slot, ended=request.slot, message=message,
        )  # fmt: skip
        claim = await self.claim_for_skip(store, request, policy)
        if isinstance(claim, StoreError):
            raise claim
        if claim.outcome is not Outcome.WON:
            return await self.record_unclaimable(store, record, policy)
        # Won although the run ran, where the store forgot it early (idmp keeps at most max_size ids per job, so
        # a job whose runs come often forgets one sooner than duration_sec): its result says so.
        score = result_score(request.slot, 0)
        results = self.keys.claim(request.job).results
        if as_list(await store.execute("ZRANGEBYSCORE", results, score, score + 99, "LIMIT", 0, 1)):
            return False
        return await self._record(store, record, policy)

    async def claim_for_skip(self, store: Store, request: RunRequest, policy: JobPolicy) -> Claim | StoreError:
        """Claim a late run for the record of its skip: won only where no instance claimed it."""
        [claim] = await self.claim_scheduled(store, [(request, policy)])
        return claim

    async def record_unclaimable(self, store: Store, record: RunRecord, policy: JobPolicy) -> bool:
        """Record the skip of a late run whose claim for the skip lost, where the store shows that no instance
        claimed it and none can any more. Here it cannot tell: a lost claim is another instance's claim."""
        return False

    async def _record(self, store: Store, record: RunRecord, policy: JobPolicy) -> bool:
        key = self.keys.claim(record.job).results
        score = result_score(record.slot, record.attempt)
        add = ("ZADD", key, score, encode_record(record))
        added, *_ = await store.execute_many([add, *self._trims(record, policy)])
        if isinstance(added, StoreError):
            raise added
        await self._trim_streams(store, record, policy)
        return added == 1

    def _trims(self, record: RunRecord, policy: JobPolicy) -> list[Command]:
        """The commands that trim the job's results once ``record`` is added."""
        key = self.keys.claim(record.job).results
        commands: list[Command] = [("ZREMRANGEBYRANK", key, 0, -(policy.history_size + 1))]
        if policy.history_ttl_ms:
            cutoff = result_score(record.ended - policy.history_ttl_ms, 0)
            commands.append(("ZREMRANGEBYSCORE", key, "-inf", f"({cutoff}"))
        return commands

    async def _trim_streams(self, store: Store, record: RunRecord, policy: JobPolicy) -> None:
        if trims := self.stream_trims(record, policy):
            with contextlib.suppress(StoreError):  # the record is stored; the next one's trim does this one's
                await store.run_many(trims)

    def stream_trims(self, record: RunRecord, policy: JobPolicy) -> list[ScriptCall]:
        """The scripts that trim the job's streams once ``record`` is stored: those ``history_ttl_ms`` ages."""
        if not policy.history_ttl_ms:
            return []
        streams = self.streams_aged_by_ttl(record.job, policy)
        return [ScriptCall(TRIM_STREAM, (key,), (record.ended - kept,)) for key, kept in streams]

    def streams_aged_by_ttl(self, job: str, policy: JobPolicy) -> list[tuple[str, int]]:
        """The job's streams that ``history_ttl_ms`` trims, each with how long it keeps its entries: the runs
        stream also as long as a claim may read a run's entry back (:meth:`runs_read_back_ms`)."""
        keys = self.keys.claim(job)
        ttl_ms = policy.history_ttl_ms or 0
        streams = [(keys.manual, ttl_ms)]
        if self.runs_aged_by_ttl:
            streams.append((keys.runs, max(ttl_ms, self.runs_read_back_ms(policy))))
        return streams

    def runs_read_back_ms(self, policy: JobPolicy) -> int:
        """How long after its slot a claim may read a run's entry back: a retry whose answer was lost may come
        as long as any late claim (``keep_ms``)."""
        return policy.keep_ms

    async def history(self, store: Store, job: str, limit: int) -> list[RunRecord]:
        return await read_history(store, job, self.keys.claim(job).results, limit)

    async def records_at(self, store: Store, job: str, slot: int) -> list[RunRecord]:
        return await read_records_at(store, job, self.keys.claim(job).results, slot)


def entry_token(entry: Reply) -> str | None:
    """The token of the one stream entry an XRANGE of a single id answered, None when it found none."""
    found = as_list(entry)  # [[id, [field, value, …]]], or []
    fields = as_list(as_list(found[0], 2)[1]) if found else []
    token = dict(zip(fields[::2], fields[1::2], strict=True)).get("token")
    return None if token is None else as_text(token)
