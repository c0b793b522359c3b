"""stream-id: XADD with the run's slot as the explicit entry ID; the server's refusal is the lost claim.

The server refuses an ID that is not greater than the stream's last one, so only the first XADD of a slot
succeeds, and runs are remembered forever (IDs only grow, also after trimming). A claim that is refused reads
the slot's entry back, to tell its own win from another instance's: its own first try may have written it (a
retried claim whose answer was lost, or a client that sent the XADD again after a timeout, as redis-py's default
retry does). The catch: once a later slot
was claimed, an earlier one can no longer be (a late claim, or a skewed clock, misses it). A late run's skip is
recorded all the same when no entry holds its slot and one before it is still there: nobody claimed it.

Each claim trims the stream to ``history_size`` entries plus as many as the job has slots in its keep period: a
retried claim may read back any entry of the last ``keep_ms``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from .._errors import StoreError, StoreReplyError
from .._records import RunRecord, encode_record
from .._store import Reply, Script, Store, as_list, as_text
from ._base import Claim, JobPolicy, Outcome, RunRequest, fence_of
from ._claim_only import ClaimOnlyStrategy, entry_token

ID_NOT_GREATER = "equal or smaller than the target stream top item"
SKIP = Script.load("stream_id_skip")


class StreamIdStrategy(ClaimOnlyStrategy):
    name = "stream-id"
    claims_in_slot_order = True
    scripts: tuple[Script, ...] = (*ClaimOnlyStrategy.scripts, SKIP)

    async def claim_scheduled(
        self, store: Store, requests: Sequence[tuple[RunRequest, JobPolicy]]
    ) -> list[Claim | StoreError]:
        commands = [
            (
                "XADD", self.keys.claim(r.job).runs, "MAXLEN", "~", runs_kept(policy), f"{r.slot}-0",
                "slot", r.slot, "token", r.token, "runner", r.runner,
            )
            for r, policy in requests
        ]  # fmt: skip
        replies = await store.execute_many(commands)
        refused = [_refused(reply) for reply in replies]
        # A claim may be refused because its own first try wrote the entry (that answer was lost, or the client
        # sent the XADD again itself): it reads the entry back, and its token there is a win. Winners cost no read.
        rereads = [i for i in range(len(requests)) if refused[i]]
        try:
            tokens = await self._tokens_at(store, [requests[i][0] for i in rereads])
        except StoreError as error:  # only these claims are retried again: the others have their answers
            tokens = [error] * len(rereads)
        owners = dict(zip(rereads, tokens, strict=True))
        claims: list[Claim | StoreError] = []
        for i, ((request, _), reply) in enumerate(zip(requests, replies, strict=True)):
            owner = owners.get(i)
            if isinstance(owner, StoreError):
                claims.append(owner)  # tried again later
            elif refused[i] and owner != request.token:
                claims.append(Claim(Outcome.LOST))
            elif isinstance(reply, StoreError) and not refused[i]:
                claims.append(reply)
            else:  # written now, or by this retry's own first try: at the slot's ID
                claims.append(Claim(Outcome.WON, 1, fence_of(f"{request.slot}-0")))
        return claims

    async def _tokens_at(self, store: Store, requests: Sequence[RunRequest]) -> list[str | StoreError | None]:
        """The token of each request's slot entry: None when there is none, the error when it cannot be read."""
        if not requests:
            return []
        reads = [("XRANGE", self.keys.claim(r.job).runs, f"{r.slot}-0", f"{r.slot}-0") for r in requests]
        entries = await store.execute_many(reads)
        return [entry if isinstance(entry, StoreError) else entry_token(entry) for entry in entries]

    async def record_unclaimable(self, store: Store, record: RunRecord, policy: JobPolicy) -> bool:
        """After a stall longer than the gap between slots, the next slot's claim reaches the store before a
        missed slot's skip, and the stream refuses the missed slot's id: if no entry holds it and one before it
        is still there (trimmed or lost, whether it was claimed cannot be told), nobody claimed it and nobody can.
        Recorded by a script that adds it only where the slot has no result, so that several instances reporting
        it store one (the stream is read before: on a cluster it is in another slot than the results)."""
        keys = self.keys.claim(record.job)
        slot_id = f"{record.slot}-0"
        at_or_before = as_list(await store.execute("XREVRANGE", keys.runs, slot_id, "-", "COUNT", 1))
        if not at_or_before or as_text(as_list(at_or_before[0], 2)[0]) == slot_id:
            return False
        recorded = await store.run(SKIP, (keys.results,), (record.slot, encode_record(record))) == 1
        if recorded:
            with contextlib.suppress(StoreError):  # the record is stored; the next one's trim does this one's
                await store.execute_many(self._trims(record, policy))
                await self._trim_streams(store, record, policy)
        return recorded


def runs_kept(policy: JobPolicy) -> int:
    """The entries each claim keeps: the last ``history_size``, and every one a retried claim may read back."""
    return policy.history_size + policy.keep_ms // policy.slot_gap_ms + 1


def _refused(reply: Reply | StoreError) -> bool:
    """Whether the server refused the XADD because the stream already holds this slot's ID or a later one."""
    return isinstance(reply, StoreReplyError) and ID_NOT_GREATER in reply.reply
