"""What the strategy models share: stream entry ids and the answers.

Every model operation takes a store state (a frozen, hashable value) and the server's clock ``now`` (ms), and
returns the next state with the answer the strategy object returns: an anarchon ``Claim``, parsed the way the
strategy parses the server's reply. Nothing is mutated, so the explorer can hash and deduplicate states.
"""

from __future__ import annotations

from typing import TypeAlias

from anarchon._strategies import Claim, Outcome

EntryId: TypeAlias = tuple[int, int]
"""A stream entry id ``<ms>-<seq>``; tuples compare the way the server compares ids."""

NO_ENTRY: EntryId = (0, 0)  # the last id of a stream that never had an entry

LOST = Claim(Outcome.LOST)


def next_entry_id(last: EntryId, now: int) -> EntryId:
    """The id ``XADD … *`` generates: the server's ms, or the next sequence number when the stream's last id is
    in the same ms or later (a server never generates an id below the last one)."""
    return (now, 0) if now > last[0] else (last[0], last[1] + 1)


def entry_fence(entry: EntryId) -> int:
    """The fence the claim-only strategies derive from an entry id (anarchon's ``fence_of``)."""
    return entry[0] * 1000 + entry[1]


def won(fence: int) -> Claim:
    """A claim-only win: attempt 1 and the fence of the entry that holds the claim."""
    return Claim(Outcome.WON, 1, fence)
