"""idmp: ``XADD runs IDMP <job> <slot> * …`` on Redis 8.6, then the entry read back to compare tokens.

The server remembers, per producer (the job), each idempotent id (the slot) with the id of the entry it created,
in insertion order, at most ``max_size`` of them (the oldest goes), and forgets one once its entry id is
``duration`` old. A repeat gets the original entry's id, whose token tells the claimer whether it won.

Redis forgets from its cron, once a second; the model forgets at the claim, the earliest the server may.
``MAXLEN ~`` trimming is left out: the stream keeps at least ``max_size`` entries, as many as the server remembers
ids, so it never removes the entry of an id the server still knows. A late claim of a run whose entry is gone all
the same loses: the contract suite checks that on the server
(``test_idmp_a_late_claim_of_a_run_whose_entry_is_gone_loses``).
"""

from __future__ import annotations

from dataclasses import dataclass

from anarchon._strategies import Claim

from .common import LOST, NO_ENTRY, EntryId, entry_fence, next_entry_id, won


@dataclass(frozen=True, slots=True)
class IdmpStore:
    tracked: tuple[tuple[int, EntryId, str], ...] = ()  # oldest first: (slot, entry id, the entry's token)
    last: EntryId = NO_ENTRY  # the runs stream's last id


def claim(
    store: IdmpStore, slot: int, token: str, now: int, duration_ms: int, max_size: int
) -> tuple[IdmpStore, Claim]:
    tracked = tuple(t for t in store.tracked if t[1][0] > now - duration_ms)
    for tracked_slot, entry_id, entry_token in tracked:
        if tracked_slot == slot:
            return IdmpStore(tracked, store.last), won(entry_fence(entry_id)) if entry_token == token else LOST
    entry_id = next_entry_id(store.last, now)
    tracked = (*tracked, (slot, entry_id, token))[-max_size:]
    return IdmpStore(tracked, entry_id), won(entry_fence(entry_id))
