"""idmp: Redis 8.6's idempotent XADD; the job is the producer id and the run's slot the idempotent id.

The server keeps the first entry for an idempotent id and answers repeats with that entry's ID, without an
error, so every claimer reads the entry back and compares tokens. A run is remembered for ``duration_sec`` (and
up to ``max_size`` runs per job); a claim arriving later than that wins again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from .._errors import StoreError, StoreReplyError, UnsupportedStrategyError
from .._keys import KeySpace
from .._store import ServerInfo, Store, as_list, as_text
from ._base import Claim, JobPolicy, Outcome, RunRequest, fence_of
from ._claim_only import ClaimOnlyStrategy, entry_token

OTHER_STRATEGIES = ("lease", "stream-id", "script")


class IdmpStrategy(ClaimOnlyStrategy):
    name = "idmp"

    def __init__(self, keys: KeySpace, duration_sec: int, max_size: int) -> None:
        super().__init__(keys)
        self.duration_sec = duration_sec
        self.remembers_ms = duration_sec * 1000
        self.max_size = max_size
        # Each job's stream is configured once per process, before the job's first claim, whether the job was
        # registered before start or after it. Concurrent first claims share one configuration: a second
        # XCFGSET after a claim's XADD would clear the id that claim registered.
        self._configured: dict[str, asyncio.Future[None]] = {}

    def runs_read_back_ms(self, policy: JobPolicy) -> int:
        return self.duration_sec * 1000  # every claim reads back the entry its IDMP id names, while it is known

    def check_server(self, server: ServerInfo) -> None:
        if server.kind != "redis" or not server.at_least(8, 6):
            raise UnsupportedStrategyError(self.name, str(server), OTHER_STRATEGIES)

    async def prepare(self, store: Store, jobs: Sequence[str]) -> None:
        for job in jobs:
            await self._configure_once(store, job)

    async def _configure_once(self, store: Store, job: str) -> None:
        configuring = self._configured.get(job)
        if configuring is None:
            configuring = self._configured[job] = asyncio.ensure_future(
                self.configure(store, self.keys.claim(job).runs)
            )
        try:
            await asyncio.shield(configuring)
        except BaseException:
            if configuring.done() and (configuring.cancelled() or configuring.exception() is not None):
                self._configured.pop(job, None)  # the next claim tries again
            raise

    async def configure(self, store: Store, key: str) -> None:
        """Set the stream's IDMP duration and size, only when they differ: XCFGSET clears what it tracks."""
        try:
            reply = await store.execute("XINFO", "STREAM", key)
        except StoreReplyError as error:
            if "no such key" not in error.reply:
                raise
            # XCFGSET needs the stream to exist; this makes it, empty.
            await store.execute("XADD", key, "MAXLEN", 0, "*", "created", 1)
            reply = await store.execute("XINFO", "STREAM", key)
        fields = as_list(reply)
        info = dict(zip(fields[::2], fields[1::2], strict=True))
        wanted = {"idmp-duration": self.duration_sec, "idmp-maxsize": self.max_size}
        if any(str(info.get(name)) != str(value) for name, value in wanted.items()):
            await store.execute("XCFGSET", key, "IDMP-DURATION", self.duration_sec, "IDMP-MAXSIZE", self.max_size)

    async def claim_scheduled(
        self, store: Store, requests: Sequence[tuple[RunRequest, JobPolicy]]
    ) -> list[Claim | StoreError]:
        unconfigured = dict.fromkeys(  # in the requests' order: the same batch configures alike every time
            r.job for r, _ in requests if r.job not in self._configured or not self._configured[r.job].done()
        )
        failed: dict[str, StoreError] = {}
        for job in unconfigured:  # a job registered after start, or whose configuration failed before
            try:
                await self._configure_once(store, job)
            except StoreError as error:
                failed[job] = error  # claimed without the job's duration, a late claim could win again
        if failed:
            rest = iter(await self.claim_scheduled(store, [(r, p) for r, p in requests if r.job not in failed]))
            return [failed[r.job] if r.job in failed else next(rest) for r, _ in requests]
        adds = [
            (
                "XADD", self.keys.claim(r.job).runs, "IDMP", r.job, r.slot, "MAXLEN", "~", policy.history_size,
                "*", "slot", r.slot, "token", r.token, "runner", r.runner,
            )
            for r, policy in requests
        ]  # fmt: skip
        ids = await store.execute_many(adds)
        reads = [
            ("XRANGE", self.keys.claim(r.job).runs, as_text(entry_id), as_text(entry_id))
            for (r, _), entry_id in zip(requests, ids, strict=True)
            if not isinstance(entry_id, StoreError)
        ]
        entries = iter(await store.execute_many(reads))
        claims: list[Claim | StoreError] = []
        for (request, _), entry_id in zip(requests, ids, strict=True):
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
