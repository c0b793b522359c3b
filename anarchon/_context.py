"""What a job function receives about the run it is executing."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from datetime import datetime
from zoneinfo import ZoneInfo


class LeaseLostEvent(asyncio.Event):
    """The event behind :attr:`RunContext.lease_is_lost`. It remembers whether the job saw it set: a sync job
    that returns just after its interruption gave up if it had looked, and otherwise ran to its end."""

    def __init__(self) -> None:
        super().__init__()
        self.seen_set = False

    def is_set(self) -> bool:
        if super().is_set():
            self.seen_set = True
            return True
        return False


_UTC = ZoneInfo("UTC")


@dataclass(frozen=True, slots=True, kw_only=True)
class RunContext:
    """One attempt of one run, as seen by the job function.

    ``slot`` is the scheduled time in epoch ms (the same on every instance); :attr:`scheduled_at` is that time in
    the job's ``timezone``, the zone its cron fields are read in; ``fence`` grows with every attempt
    the store accepts for this job, so a downstream system can refuse writes from an older attempt. (Under the
    claim-only strategies it grows among the job's scheduled runs, from their entries' ids; a manual run takes
    its fence from the job's manual stream, which is not ordered against the scheduled runs.) ``lease_lost`` is
    set, and the job cancelled, when this instance can no longer be sure it holds the run (lease strategy: a
    backup took over, or the store was unreachable past the lease end), or when stop() stops waiting for it; a
    job running in a thread cannot be cancelled and should check :attr:`lease_is_lost` between steps.
    """

    job: str
    slot: int
    attempt: int
    token: str
    fence: int
    manual: bool
    timezone: ZoneInfo = _UTC
    lease_lost: LeaseLostEvent = field(default_factory=LeaseLostEvent, repr=False)

    @property
    def scheduled_at(self) -> datetime:
        """The slot, in the job's time zone: a job at "0 9 * * *" in Europe/Berlin sees 09:00 there."""
        return datetime.fromtimestamp(self.slot / 1000, tz=self.timezone)

    @property
    def lease_is_lost(self) -> bool:
        return self.lease_lost.is_set()
