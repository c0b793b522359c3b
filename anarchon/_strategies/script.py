"""script: a Lua script scans the job's recent entries for the run and appends a claim only if absent.

It works on every server, and remembers a run for ``window_ms``: a claim that arrives later than that (a very
late instance, a long pause) finds nothing and wins again.
"""

from __future__ import annotations

from collections.abc import Sequence

from .._errors import StoreError
from .._keys import KeySpace
from .._store import Script, ScriptCall, Store, as_list, as_text
from ._base import Claim, JobPolicy, Outcome, RunRequest, fence_of
from ._claim_only import ClaimOnlyStrategy

CLAIM = Script.load("script_claim")


class ScriptStrategy(ClaimOnlyStrategy):
    name = "script"
    scripts: tuple[Script, ...] = (CLAIM, *ClaimOnlyStrategy.scripts)
    runs_aged_by_ttl = False  # the claim script ages them, keeping its window

    def __init__(self, keys: KeySpace, window_ms: int) -> None:
        super().__init__(keys)
        self.window_ms = self.remembers_ms = window_ms

    async def claim_scheduled(
        self, store: Store, requests: Sequence[tuple[RunRequest, JobPolicy]]
    ) -> list[Claim | StoreError]:
        return await self._claim(store, requests)

    async def claim_for_skip(self, store: Store, request: RunRequest, policy: JobPolicy) -> Claim | StoreError:
        [claim] = await self._claim(store, [(request, policy)], for_skip=True)
        return claim

    async def _claim(
        self, store: Store, requests: Sequence[tuple[RunRequest, JobPolicy]], *, for_skip: bool = False
    ) -> list[Claim | StoreError]:
        mode = ("skip",) if for_skip else ()
        calls = [
            ScriptCall(
                CLAIM,
                (self.keys.claim(r.job).runs,),
                (r.slot, r.token, r.runner, self.window_ms, policy.history_size, policy.history_ttl_ms or 0, *mode),
            )
            for r, policy in requests
        ]
        claims: list[Claim | StoreError] = []
        for reply in await store.run_many(calls):
            if isinstance(reply, StoreError):
                claims.append(reply)
                continue
            answer, entry_id = (as_text(item) for item in as_list(reply, 2))
            won = answer == "won"
            claims.append(Claim(Outcome.WON, 1, fence_of(entry_id)) if won else Claim(Outcome.LOST))
        return claims
