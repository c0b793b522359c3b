"""lease: Lua scripts keep each run's attempt, token and lease end in the job's state hash.

The only strategy with leases: the winner heartbeats, backups take over an expired lease with attempt + 1 up
to ``max_attempts``, a live run blocks another (overlap protection), and the state is kept for as long as a late
claim or a catch-up could ask for the run. Lease ends come from the server's ``TIME`` inside the scripts.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from .._errors import StoreError
from .._keys import KeySpace
from .._records import RunRecord, Status
from .._store import Reply, Script, ScriptCall, ServerInfo, Store, as_text
from ._base import OUTCOMES, Claim, JobPolicy, RunRequest, read_history, read_records_at

CLAIM = Script.load("lease_claim")
HEARTBEAT = Script.load("lease_heartbeat")
FINISH = Script.load("lease_finish")
RELEASE = Script.load("lease_release")
SKIP = Script.load("lease_skip")
SINCE = Script.load("lease_since")


def _overlap(policy: JobPolicy, request: RunRequest) -> str:
    """The claim script's overlap argument: allowed, forbidden, or forbidden and waited out (a catch-up's claim)."""
    if policy.overlap:
        return "1"
    return "wait" if request.catch_up else "0"


def _trim_args(policy: JobPolicy) -> tuple[int, int, int]:
    return (policy.history_size, policy.keep_ms, policy.history_ttl_ms or 0)


def _parse_claim(reply: Reply | StoreError) -> Claim | StoreError:
    if isinstance(reply, StoreError):
        return reply
    answer, attempt, fence, left, *given_up = as_text(reply).split(" ")
    return Claim(OUTCOMES[answer], int(attempt), int(fence), max(0, int(left)), bool(given_up))


class LeaseStrategy:
    name = "lease"
    leases = True
    claims_in_slot_order = False
    scripts: tuple[Script, ...] = (CLAIM, HEARTBEAT, FINISH, RELEASE, SKIP, SINCE)

    def __init__(self, keys: KeySpace) -> None:
        self.keys = keys
        # Each job's five keys in the scripts' order, built once: every claim, heartbeat and finish sends them.
        # Plain tuples of strings, which the garbage collector stops tracking: a scheduler may hold thousands.
        self._job_keys: dict[str, tuple[str, ...]] = {}

    def check_server(self, server: ServerInfo) -> None:
        return None  # Redis 5+ and Valkey

    async def prepare(self, store: Store, jobs: Sequence[str]) -> None:
        for job in jobs:
            self.job_keys(job)  # built now rather than during the first burst of claims

    def job_keys(self, job: str) -> tuple[str, ...]:
        keys = self._job_keys.get(job)
        if keys is None:
            keys = self._job_keys[job] = self.keys.lease(job).all()
        return keys

    def claim_call(self, request: RunRequest, policy: JobPolicy) -> ScriptCall:
        # The run id carries the slot and whether the run is manual (see RunRequest).
        max_attempts = 1 if request.manual else policy.max_attempts  # a manual run is not retried by backups
        args = (request.run, request.token, request.runner, policy.lease_ms, max_attempts, _overlap(policy, request),
                *_trim_args(policy))  # fmt: skip
        return ScriptCall(CLAIM, self.job_keys(request.job), args)

    async def claim(self, store: Store, requests: Sequence[tuple[RunRequest, JobPolicy]]) -> list[Claim | StoreError]:
        replies = await store.run_many([self.claim_call(request, policy) for request, policy in requests])
        return [_parse_claim(reply) for reply in replies]

    async def heartbeat(self, store: Store, request: RunRequest, policy: JobPolicy) -> int:
        keys = self.job_keys(request.job)
        reply = await store.run(HEARTBEAT, keys, (request.run, request.token, policy.lease_ms))
        return int(as_text(reply))

    async def finish(
        self, store: Store, request: RunRequest, claim: Claim, policy: JobPolicy, record: RunRecord
    ) -> bool:
        keys = self.job_keys(request.job)
        message = "null" if record.message is None else json.dumps(record.message)
        args = (request.run, request.token, record.status, message, *_trim_args(policy))
        return await store.run(FINISH, keys, args) == 1

    async def release(self, store: Store, request: RunRequest) -> bool:
        return await store.run(RELEASE, self.job_keys(request.job), (request.run, request.token)) == 1

    async def skip(self, store: Store, request: RunRequest, policy: JobPolicy, status: Status, message: str) -> bool:
        keys = self.job_keys(request.job)
        args = (request.run, request.token, request.runner, status, json.dumps(message))
        return await store.run(SKIP, keys, (*args, *_trim_args(policy), policy.late_after_ms)) == 1

    async def catch_up_since(self, store: Store, job: str, now: int) -> int:
        return int(as_text(await store.run(SINCE, (self.keys.lease(job).state,), (now,))))

    async def history(self, store: Store, job: str, limit: int) -> list[RunRecord]:
        return await read_history(store, job, self.keys.lease(job).results, limit)

    async def records_at(self, store: Store, job: str, slot: int) -> list[RunRecord]:
        return await read_records_at(store, job, self.keys.lease(job).results, slot)
