"""idmp: Redis 8.6's idempotent XADD; the job is the producer id and the run's slot the idempotent id.

The server keeps the first entry for an idempotent id and answers repeats with that entry's ID, without an
error, so every claimer reads the entry back and compares tokens. A run is remembered for ``duration_sec`` (and
up to ``max_size`` runs per job); a claim arriving later than that wins again. The stream keeps at least as many
entries as the server remembers ids (its IDMP-MAXSIZE, which may be another deploy's, larger than ``max_size``):
a retried claim that read back nothing would be told "lost" although its first try won. A deploy that lengthens
``duration_sec`` or raises ``max_size`` makes the server forget every run it remembers (XCFGSET clears them):
the stream's runs are then added again, copied, in the same script. A stream never gets a shorter duration or a
smaller size than it has: an instance of another deploy may still claim a run as late as its own, longer
duration allows.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from .._config import IDMP_MAX_DURATION_S
from .._errors import StoreError, StoreUnavailableError, UnsupportedStrategyError
from .._keys import KeySpace
from .._records import RunRecord
from .._store import Command, Reply, Script, ScriptCall, ServerInfo, Store, as_list, as_text
from ._base import Claim, JobPolicy, Outcome, RunRequest, fence_of
from ._claim_only import ClaimOnlyStrategy, entry_token

OTHER_STRATEGIES = ("lease", "stream-id", "script")
CONFIGURE = Script.load("idmp_configure")
SKIP_CLAIM = Script.load("idmp_skip")
TRIM_RUNS = Script.load("idmp_trim")
log = logging.getLogger("anarchon")
# A job's stream's settings are read again once its claims reach slots this much later than the last time: a
# stream made again (a store that lost its data) by an instance of a deploy with shorter settings, or set shorter
# by hand, gets this instance's settings back (configured again), under which it may claim late.
CHECK_AGAIN_MS = 300_000


class IdmpStrategy(ClaimOnlyStrategy):
    name = "idmp"
    scripts: tuple[Script, ...] = (*ClaimOnlyStrategy.scripts, CONFIGURE, SKIP_CLAIM, TRIM_RUNS)
    runs_aged_by_ttl = False  # idmp_trim.lua ages them, by the stream's own duration

    def __init__(self, keys: KeySpace, duration_sec: int, max_size: int) -> None:
        super().__init__(keys)
        self.duration_sec = duration_sec
        self.remembers_ms = duration_sec * 1000
        self.max_size = max_size
        # Each job's stream is configured once per process, before the job's first claim, whether the job was
        # registered before start or after it. Concurrent first claims share one configuration: a second
        # XCFGSET after a claim's XADD would clear the id that claim registered.
        self._configured: dict[str, asyncio.Future[None]] = {}
        self._check_at: dict[str, int] = {}  # the slot from which a job's claims read its stream's settings again

    def check_server(self, server: ServerInfo) -> None:
        if not server.has_idmp:
            raise UnsupportedStrategyError(self.name, str(server), OTHER_STRATEGIES)

    async def prepare(self, store: Store, jobs: Sequence[str]) -> None:
        for error in (await self._configure_once(store, jobs)).values():
            # A job whose cluster node is out of reach is configured by its first claim, as a stream that
            # vanished is: the jobs on the other nodes start.
            if not isinstance(error, StoreUnavailableError):
                raise error

    async def _configure_once(self, store: Store, jobs: Sequence[str]) -> dict[str, StoreError]:
        """Configure the jobs' streams that are neither configured nor on their way, together (see
        _start_configuring), and wait for every one's; the errors of those that failed, by job."""
        waiting: dict[str, asyncio.Future[None]] = {}
        for job in jobs:
            if (configuring := self._configuring(job)) is not None:
                waiting[job] = configuring
        waiting.update(self._start_configuring(store, [job for job in jobs if job not in waiting]))
        failed: dict[str, StoreError] = {}
        for job, configuring in waiting.items():
            try:
                await asyncio.shield(configuring)
            except StoreError as error:
                failed[job] = error
        return failed

    def _configuring(self, job: str) -> asyncio.Future[None] | None:
        """The job's configuration, done or on its way; None where there is none, or it failed."""
        configuring = self._configured.get(job)
        if configuring is None or (configuring.done() and (configuring.cancelled() or configuring.exception())):
            return None
        return configuring

    def _start_configuring(self, store: Store, jobs: Sequence[str]) -> dict[str, asyncio.Future[None]]:
        """Configure the jobs' streams in one pipeline: one after the other, start() waited a round trip per job
        (seconds for thousands), and a timeout per job of a cluster node that did not answer. Each job's claims
        wait for its own configuration before their XADD (see claim_scheduled). One that fails is forgotten,
        whoever waited for it or none did: the job's next claim configures it again."""
        if not jobs:
            return {}
        batch = asyncio.ensure_future(self._configure(store, jobs))
        started: dict[str, asyncio.Future[None]] = {}
        for index, job in enumerate(jobs):
            configuring = self._configured[job] = started[job] = asyncio.ensure_future(_part(batch, index))

            def forget_a_failure(done: asyncio.Future[None], job: str = job) -> None:
                failed = done.cancelled() or done.exception() is not None  # read: never "not retrieved"
                if failed and self._configured.get(job) is done:
                    del self._configured[job]

            configuring.add_done_callback(forget_a_failure)
        return started

    async def _configure(self, store: Store, jobs: Sequence[str]) -> list[StoreError | None]:
        """Give each job's stream this duration and size where it has shorter or smaller ones (XCFGSET then clears
        what the server tracks), keeping the runs it remembered remembered (see idmp_configure.lua). Each job's
        error, or None."""
        runs = [self.keys.claim(job).runs for job in jobs]
        calls = [
            ScriptCall(CONFIGURE, (key,), (self.duration_sec, self.max_size, job))
            for key, job in zip(runs, jobs, strict=True)
        ]
        outcomes: list[StoreError | None] = []
        for key, reply in zip(runs, await store.run_many(calls), strict=True):
            try:
                again, duration_sec, max_size = (int(as_text(part)) for part in as_list(reply, 3))
            except StoreError as error:
                outcomes.append(error)
                continue
            outcomes.append(None)
            if again > 0:
                log.warning(
                    "idmp: the stream %s had shorter IDMP settings (another deploy's), now duration_sec=%d, "
                    "max_size=%d; its %d latest runs copied so that it still remembers them",
                    key, duration_sec, max_size, again,
                )  # fmt: skip
            if (duration_sec, max_size) != (self.duration_sec, self.max_size):
                log.warning(
                    "idmp: the stream %s keeps duration_sec=%d, max_size=%d (an instance asked for them: another "
                    "deploy's, or an earlier one's) instead of this instance's %d and %d: a stream's settings are "
                    "never lowered, as an instance with those may still claim runs as late as they allow (lowering "
                    "them takes XCFGSET by hand, once none runs)",
                    key, duration_sec, max_size, self.duration_sec, self.max_size,
                )  # fmt: skip
        return outcomes

    async def claim_scheduled(
        self, store: Store, requests: Sequence[tuple[RunRequest, JobPolicy]]
    ) -> list[Claim | StoreError]:
        unconfigured = dict.fromkeys(  # in the requests' order: the same batch configures alike every time
            r.job for r, _ in requests if (configuring := self._configuring(r.job)) is None or not configuring.done()
        )
        # Jobs registered after start, or whose configuration failed before. One that fails again is not claimed:
        # claimed without the job's duration, a late claim could win again.
        failed = await self._configure_once(store, list(unconfigured))
        if failed:
            rest = iter(await self.claim_scheduled(store, [(r, p) for r, p in requests if r.job not in failed]))
            return [failed[r.job] if r.job in failed else next(rest) for r, _ in requests]
        # NOMKSTREAM: a stream that is gone (a store restarted without its data, flushed, or evicted) is not made
        # again by the claim with the server's default duration (100 s), under which a late claim would win again.
        adds = [
            (
                "XADD", self.keys.claim(r.job).runs, "NOMKSTREAM", "IDMP", r.job, r.slot,
                "MINID", "~", claim_min_id(r), "*", "slot", r.slot, "token", r.token,
                "runner", r.runner,
            )
            for r, policy in requests
        ]  # fmt: skip
        ids = await store.execute_many(adds)
        if None in ids:
            ids = await self._add_to_vanished(store, [r.job for r, _ in requests], adds, ids)
        return await self._read_back(store, [r for r, _ in requests], ids)

    async def _read_back(
        self, store: Store, requests: Sequence[RunRequest], ids: Sequence[Reply | StoreError]
    ) -> list[Claim | StoreError]:
        """Each request's claim, from the entry its XADD IDMP answered: won where that entry holds its token. Read
        with the settings of the streams due to be checked again (see CHECK_AGAIN_MS), in the same round trip."""
        reads: list[Command] = [
            ("XRANGE", self.keys.claim(r.job).runs, as_text(entry_id), as_text(entry_id))
            for r, entry_id in zip(requests, ids, strict=True)
            if not isinstance(entry_id, StoreError)
        ]
        checked = self._due_for_a_check(requests)
        replies = await store.execute_many(
            [*reads, *(("XINFO", "STREAM", self.keys.claim(job).runs) for job in checked)]
        )
        for job, info in zip(checked, replies[len(reads) :], strict=True):
            if isinstance(info, StoreUnavailableError):
                self._check_at[job] = 0  # checked with the job's next claim
            elif self._settings_fall_short(job, info):
                # Configured again from now, its claims waiting for it: a late claim of this run must find it
                # remembered (the script copies the runs the stream remembers, this claim's too, back in). The
                # claims of this batch are answered meanwhile: runs won are not held up.
                self._start_configuring(store, [job])
        entries = iter(replies[: len(reads)])
        claims: list[Claim | StoreError] = []
        for request, entry_id in zip(requests, ids, strict=True):
            if isinstance(entry_id, StoreError):
                claims.append(entry_id)
                continue
            entry = next(entries)
            if isinstance(entry, StoreError):
                claims.append(entry)
                continue
            won = entry_token(entry) == request.token  # None when the original entry was trimmed: not ours
            claims.append(Claim(Outcome.WON, 1, fence_of(as_text(entry_id))) if won else Claim(Outcome.LOST))
        return claims

    def _due_for_a_check(self, requests: Sequence[RunRequest]) -> list[str]:
        """The jobs among ``requests`` whose streams' settings are due to be read again: once their claims reach
        slots CHECK_AGAIN_MS past the last time."""
        due = []
        for r in requests:
            check_at = self._check_at.setdefault(r.job, r.slot + CHECK_AGAIN_MS)
            if r.slot >= check_at:
                self._check_at[r.job] = r.slot + CHECK_AGAIN_MS
                due.append(r.job)
        return list(dict.fromkeys(due))

    def _settings_fall_short(self, job: str, info: Reply | StoreError) -> bool:
        """Whether the job's stream has shorter or smaller settings than this instance's (made again, after the
        store lost its data, by an instance of a deploy with shorter ones, or set by hand): late claims this
        instance may send must find their runs remembered."""
        if isinstance(info, StoreError):
            return False  # refused (an ACL without XINFO, say): checked again in five minutes of slots
        fields = as_list(info)
        settings = dict(zip((as_text(name) for name in fields[::2]), fields[1::2], strict=True))
        duration, size = (int(as_text(settings.get(name, 0))) for name in ("idmp-duration", "idmp-maxsize"))
        configured = self._configuring(job)
        return (duration < self.duration_sec or size < self.max_size) and configured is not None and configured.done()

    async def claim_for_skip(self, store: Store, request: RunRequest, policy: JobPolicy) -> Claim | StoreError:
        """A skip comes after the run's late span, when later runs' ids may have pushed the run's own out (up to
        ``max_size`` per job): its claim would then win a run that ran, or is running, and its new id would push
        out another run's, whose late claim would win that one again. Claimed (idmp_skip.lua) only while the
        server keeps fewer ids than it may; otherwise lost (no skip recorded: whether the run was claimed cannot
        be told)."""
        runs = self.keys.claim(request.job).runs
        fields = ("slot", request.slot, "token", request.token, "runner", request.runner)
        try:
            entry_id = await store.run(SKIP_CLAIM, (runs,), (request.job, request.slot, claim_min_id(request), *fields))
        except StoreError as error:
            return error
        if entry_id is None:
            return Claim(Outcome.LOST)
        [claim] = await self._read_back(store, [request], [entry_id])
        return claim

    def stream_trims(self, record: RunRecord, policy: JobPolicy) -> list[ScriptCall]:
        """The runs stream trimmed to what the stream's own settings need kept (see idmp_trim.lua), after every
        record; the manual stream as ``history_ttl_ms`` ages it."""
        runs = self.keys.claim(record.job).runs
        trim = ScriptCall(TRIM_RUNS, (runs,), (policy.history_size, policy.history_ttl_ms or 0))
        return [trim, *super().stream_trims(record, policy)]

    async def _add_to_vanished(
        self, store: Store, jobs: Sequence[str], adds: Sequence[Command], ids: Sequence[Reply | StoreError]
    ) -> list[Reply | StoreError]:
        """The claims whose XADD found no stream (``ids`` None) added once more, to the stream made and configured
        again. A stream gone once more is an unavailable store for those claims: the caller tries again later."""
        ids = list(ids)
        vanished = [i for i, entry_id in enumerate(ids) if entry_id is None]
        remade = list(dict.fromkeys(jobs[i] for i in vanished))
        for job in remade:
            self._configured.pop(job, None)
        failed = await self._configure_once(store, remade)
        again = [i for i in vanished if jobs[i] not in failed]
        for i, entry_id in zip(again, await store.execute_many([adds[i] for i in again]), strict=True):
            ids[i] = entry_id
        gone = StoreUnavailableError("store unavailable: the job's runs stream vanished twice during its claim")
        for i in vanished:
            if jobs[i] in failed:
                ids[i] = failed[jobs[i]]
            elif ids[i] is None:
                ids[i] = gone
        return ids


async def _part(batch: asyncio.Future[list[StoreError | None]], index: int) -> None:
    """The outcome of one job's configuration in a batch of them: raises its error."""
    error = (await asyncio.shield(batch))[index]
    if error is not None:
        raise error


def claim_min_id(request: RunRequest) -> int:
    """What a claim's XADD trims of the runs stream: entries three days older than its slot. Each record trims
    the stream (idmp_trim.lua); this bounds one whose runs are never recorded (their instances die). It never
    takes an entry of the last two IDMP durations, which a late skip's claim looks through (idmp_skip.lua), even
    for an instance whose clock runs up to a day ahead."""
    return request.slot - 3 * IDMP_MAX_DURATION_S * 1000
