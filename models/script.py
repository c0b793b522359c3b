"""script: script_claim.lua scans the job's runs stream within ``window_ms`` and appends a claim if absent.

A run is remembered while its entry is younger than the window: a claim that arrives later finds nothing and
wins again. A late skip's claim looks back to the window before the slot (an early claim, by an instance whose
clock ran ahead, is older than the window before the skip), and claims nothing once the slot is more than the
window past. Trimming deletes only entries older than the window whose slots are too (or that were made more than
the window before their slot), so it never changes an answer; it is modelled because it is part of the script.
"""

from __future__ import annotations

from dataclasses import dataclass

from anarchon._strategies import Claim, JobPolicy

from .common import LOST, NO_ENTRY, EntryId, entry_fence, next_entry_id, won


@dataclass(frozen=True, slots=True)
class ScriptStore:
    entries: tuple[tuple[EntryId, int, str], ...] = ()  # the runs stream, oldest first: (id, slot, token)
    last: EntryId = NO_ENTRY  # the last id generated: deleting entries never lowers it


def claim(
    store: ScriptStore, slot: int, token: str, now: int, window_ms: int, policy: JobPolicy, *, for_skip: bool = False
) -> tuple[ScriptStore, Claim]:
    oldest = now - window_ms
    if for_skip and slot < oldest:  # too late to tell: nothing is claimed
        return store, LOST
    scan_from = slot - window_ms if for_skip else oldest
    for entry_id, entry_slot, entry_token in reversed(store.entries):  # XREVRANGE runs + <scan_from>
        if entry_id[0] < scan_from:
            break
        if entry_slot == slot:
            return store, won(entry_fence(entry_id)) if entry_token == token else LOST
    entry_id = next_entry_id(store.last, now)
    entries = (*store.entries, (entry_id, slot, token))
    # XRANGE runs - <cutoff - 1> COUNT n, each deleted: at most n entries from ms before the cutoff.
    excess = len(entries) - policy.history_size
    if excess > 0:
        entries = _delete_before(entries, oldest, min(excess, 100), window_ms)
    if policy.history_ttl_ms:
        entries = _delete_before(entries, min(oldest, now - policy.history_ttl_ms), 100, window_ms)
    return ScriptStore(entries, entry_id), won(entry_fence(entry_id))


def _delete_before(
    entries: tuple[tuple[EntryId, int, str], ...], cutoff: int, count: int, window_ms: int
) -> tuple[tuple[EntryId, int, str], ...]:
    read = [entry for entry in entries if entry[0][0] < cutoff][:count]  # XRANGE runs - <cutoff - 1> COUNT count
    # An early claim whose slot is in the window stays, if made no more than window_ms before its slot.
    doomed = {entry for entry in read if entry[1] < cutoff or entry[0][0] < entry[1] - window_ms}
    return tuple(entry for entry in entries if entry not in doomed)
