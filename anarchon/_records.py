"""What the store remembers about each attempt of a run, as returned by ``Scheduler.history``."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Literal, TypeAlias

Status: TypeAlias = Literal["ok", "error", "interrupted", "skipped-late", "skipped-overlap"]
STATUSES: tuple[Status, ...] = ("ok", "error", "interrupted", "skipped-late", "skipped-overlap")


@dataclass(frozen=True, slots=True, kw_only=True)
class RunRecord:
    """One attempt of one run of a job.

    ``slot`` is the scheduled time (epoch ms), the same on every instance; ``run`` identifies the run in the
    store (the slot for scheduled runs, ``m<ms>-<first 8 characters of the token>`` for manual ones). Times are
    epoch ms. In ``history()``: the server's clock under the lease strategy, the recording instance's clock under
    the claim-only strategies. A ``skipped-late`` record of a claim-only strategy has no runner or token and
    starts and ends at its slot: every instance that finds the run late writes the same record, stored once.
    The record ``run_now()`` returns and ``on_run_end`` receives is the running instance's own, on its clock (a
    ``run_now`` that lease skipped for overlap returns the store's, as ``history()`` reads it).
    """

    job: str
    run: str
    slot: int
    attempt: int
    status: Status
    runner: str
    token: str
    fence: int
    manual: bool
    started: int
    ended: int
    message: str | None = None

    @property
    def duration_ms(self) -> int:
        return self.ended - self.started


def encode_record(record: RunRecord) -> str:
    """The JSON member stored in a job's results sorted set (the lease scripts write the same shape)."""
    fields = asdict(record)
    del fields["job"]  # the key says which job
    return json.dumps(fields, separators=(",", ":"))


def decode_record(job: str, member: str) -> RunRecord:
    fields = json.loads(member)
    return RunRecord(job=job, **fields)


def result_score(slot: int, attempt: int) -> int:
    """Newest slot first, then the highest attempt (the lease scripts build the same number as text)."""
    return slot * 100 + min(attempt, 99)
