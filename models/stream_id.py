"""stream-id: ``XADD runs <slot>-0 …``; the server refuses an id not greater than the stream's last one.

The first claim of a slot wins and every later one loses, forever (trimming never lowers the last id). The
catch: once a later slot was claimed, an earlier one is refused too, so a late claim or a skewed clock misses
it. Tokens play no part in the XADD: a claim sent again loses against its own earlier entry. (The strategy then
reads the entry back when the claim is a retry after a lost answer, to recognise its own win; that read-back is
tested against real servers, in tests/reliability/test_lost_replies.py, not modelled here.)
"""

from __future__ import annotations

from dataclasses import dataclass

from anarchon._strategies import Claim

from .common import LOST, NO_ENTRY, EntryId, entry_fence, won


@dataclass(frozen=True, slots=True)
class StreamIdStore:
    last: EntryId = NO_ENTRY  # the runs stream's last id


def claim(store: StreamIdStore, slot: int) -> tuple[StreamIdStore, Claim]:
    entry_id = (slot, 0)
    if entry_id <= store.last:
        return store, LOST  # "equal or smaller than the target stream top item"
    return StreamIdStore(entry_id), won(entry_fence(entry_id))
