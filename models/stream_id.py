"""stream-id: ``XADD runs <slot>-0 …``; the server refuses an id not greater than the stream's last one.

The first claim of a slot wins and every later one loses, forever (trimming never lowers the last id). The
catch: once a later slot was claimed, an earlier one is refused too, so a late claim or a skewed clock misses
it. Tokens play no part in the XADD: a claim sent again loses against its own earlier entry. So a claim that is
refused reads the slot's entry back (it may be a retry whose first answer was lost, or a copy the client sent
again), and its own token there is its first try's win. Trimming is left out: the claims keep every entry a
claim may read back (those of the last ``keep_ms``), and more than a test makes.
"""

from __future__ import annotations

from dataclasses import dataclass

from anarchon._strategies import Claim

from .common import LOST, NO_ENTRY, EntryId, entry_fence, won


@dataclass(frozen=True, slots=True)
class StreamIdStore:
    last: EntryId = NO_ENTRY  # the runs stream's last id
    tokens: tuple[tuple[int, str], ...] = ()  # the token of each slot's entry, oldest first


def claim(store: StreamIdStore, slot: int, token: str) -> tuple[StreamIdStore, Claim]:
    entry_id = (slot, 0)
    if entry_id <= store.last:  # "equal or smaller than the target stream top item"
        if (slot, token) in store.tokens:  # XRANGE runs <slot>-0 <slot>-0: its own entry
            return store, won(entry_fence(entry_id))
        return store, LOST
    return StreamIdStore(entry_id, (*store.tokens, (slot, token))), won(entry_fence(entry_id))
