"""stream-id: XADD with the run's slot as the explicit entry ID; the server's refusal is the lost claim.

The server refuses an ID that is not greater than the stream's last one, so only the first XADD of a slot
succeeds, and runs are remembered forever (IDs only grow, also after trimming). The catch: once a later slot
was claimed, an earlier one can no longer be (a late claim, or a skewed clock, misses it).
"""

from __future__ import annotations

from collections.abc import Sequence

from .._errors import StoreError, StoreReplyError
from .._store import Store
from ._base import Claim, JobPolicy, Outcome, RunRequest, fence_of
from ._claim_only import ClaimOnlyStrategy

ID_NOT_GREATER = "equal or smaller than the target stream top item"


class StreamIdStrategy(ClaimOnlyStrategy):
    name = "stream-id"

    async def claim_scheduled(
        self, store: Store, requests: Sequence[tuple[RunRequest, JobPolicy]]
    ) -> list[Claim | StoreError]:
        commands = [
            (
                "XADD", self.keys.claim(r.job).runs, "MAXLEN", "~", policy.history_size, f"{r.slot}-0",
                "slot", r.slot, "token", r.token, "runner", r.runner,
            )
            for r, policy in requests
        ]  # fmt: skip
        claims: list[Claim | StoreError] = []
        for (request, _), reply in zip(requests, await store.execute_many(commands), strict=True):
            if isinstance(reply, StoreError):
                lost = isinstance(reply, StoreReplyError) and ID_NOT_GREATER in reply.reply
                claims.append(Claim(Outcome.LOST) if lost else reply)
            else:
                claims.append(Claim(Outcome.WON, 1, fence_of(f"{request.slot}-0")))  # the ID it was written at
        return claims
