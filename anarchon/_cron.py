"""Cron schedules as pure functions of time: which slots fall after a moment, or between two.

Parsing and matching are cronsim's (5 fields, or 6 with seconds first). Slots are epoch milliseconds, so every
instance computes the same slot whatever its clock and its local time zone.

Daylight saving time, in the job's ``timezone``:
- clocks go forward: if any of a job's times fall in the skipped hour, the job runs once at the first instant
  after the jump (its run is late, never lost); where that instant is one of the job's times too, that one run
  stands for both, as a run is named by its instant;
- clocks go back: a run at a fixed time in the repeated hour runs once, on the first pass; a job that fires
  every minute or every few minutes keeps firing through both passes, as wall time keeps going for it.
The second rule is Debian cron's (and cronsim's); the first is stricter than Debian's, which drops the skipped
times of jobs like ``*/15 2 * * *``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError

from ._errors import ConfigError, ConfigTypeError

DAY_MS = 86_400_000
CRON_RULE = 'five fields "min hour day month weekday", or six with seconds first, e.g. "*/5 * * * *"'


# Names of the zone database that stand for the machine's own setting: instances on machines set to different
# zones would compute different slots for one job, and each run its own.
_MACHINE_ZONES = ("localtime", "posixrules")
_ZONE_RULE = 'an IANA name like "Europe/Berlin", or ZoneInfo("Europe/Berlin")'


def load_timezone(name: object) -> ZoneInfo:
    """The zone of a job's ``timezone`` option: an IANA name, or a ZoneInfo made from one."""
    if isinstance(name, ZoneInfo):
        if name.key is None:  # made from a file: other instances cannot be told which zone it is
            raise ConfigError("timezone", "a ZoneInfo read from a file has no IANA name", _ZONE_RULE)
        name = name.key
    if not isinstance(name, str):
        got = type(name).__name__
        raise ConfigTypeError("timezone", f"must be a string or a ZoneInfo, got {got}", _ZONE_RULE)
    if name in _MACHINE_ZONES:
        raise ConfigError("timezone", f"{name!r} is whatever zone each machine is set to", _ZONE_RULE)
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError) as error:  # OSError: a folder of the database, a long name
        raise ConfigError("timezone", f"unknown time zone {name!r}", _ZONE_RULE) from error


def _valid_in_some_month(fields: list[str]) -> bool:
    """Whether an expression cronsim refuses is valid but for its months: days no month it names has (30 Feb)."""
    month = len(fields) - 2
    try:
        CronSim(" ".join([*fields[:month], "*", fields[-1]]), datetime(1970, 1, 1))  # valid but for its months
        CronSim(" ".join([*fields[: month - 1], "*", *fields[month:]]), datetime(1970, 1, 1))  # and its months valid
    except CronSimError:
        return False
    return fields[month] != "*"


# Each field's name, how many values it has, and what it counts within; seconds first (not in five fields).
_FIELDS = (
    ("second", 60, "minute"), ("minute", 60, "hour"), ("hour", 24, "day"), ("day of month", 31, "month"),
    ("month", 12, "year"), ("weekday", 7, "week"),
)  # fmt: skip


def _check_steps(expression: str, fields: list[str]) -> None:
    """Refuse a step longer than its field, such as ``*/90`` minutes: cron (cronsim too) matches only the range's
    first value then, once an hour, where every 90 minutes was meant."""
    for text, (name, span, within) in zip(fields, _FIELDS[6 - len(fields) :], strict=True):
        for part in text.split(","):
            step = part.partition("/")[2]
            if step and int(step) > span:
                raise ConfigError(
                    "cron",
                    f"{expression!r}: the step /{step} of its {name} field is longer than the field's {span} "
                    f"values, and would match once per {within}",
                    f"{CRON_RULE}, with steps no longer than their field",
                )


@dataclass(slots=True)
class _Cursor:
    """Where the last cronsim iteration stopped: no match lies in ``(low, pending)``."""

    matches: Iterator[int]
    low: int
    pending: int | None


@dataclass(frozen=True, slots=True)
class CronSchedule:
    expression: str
    timezone: ZoneInfo = field(default_factory=lambda: ZoneInfo("UTC"))
    # Building a cronsim iterator costs far more than stepping one; consecutive queries (the common case: each
    # slot asks for the next) reuse it. A cache, not state: results never depend on it.
    _cursor: list[_Cursor] = field(default_factory=list, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.expression, str):
            raise ConfigTypeError("cron", f"must be a string, got {type(self.expression).__name__}", CRON_RULE)
        fields = self.expression.split()
        if self.expression.strip().startswith("@"):
            raise ConfigError("cron", f"{self.expression!r}: macros such as @hourly are not supported", CRON_RULE)
        if len(fields) not in (5, 6):
            count = f"{len(fields)} field" + ("" if len(fields) == 1 else "s")
            raise ConfigError("cron", f"{self.expression!r} has {count}", CRON_RULE)
        try:
            next(iter(CronSim(self.expression, datetime(1970, 1, 1))))  # wall times: zones aside, it parses and matches
        except CronSimError as error:
            if _valid_in_some_month(fields):
                raise ConfigError("cron", f"{self.expression!r} never matches: no month of its month field has "
                                          "those days", CRON_RULE) from error  # fmt: skip
            raise ConfigError("cron", f"{self.expression!r} is not valid ({error})", CRON_RULE) from error
        except StopIteration as error:
            raise ConfigError("cron", f"{self.expression!r} never matches", CRON_RULE) from error
        _check_steps(self.expression, fields)

    @property
    def has_seconds(self) -> bool:
        return len(self.expression.split()) == 6

    @property
    def min_gap_ms(self) -> int:
        """Two slots are at least this far apart: a second, or a minute without a seconds field."""
        return 1000 if self.has_seconds else 60_000

    def _iterate(self, after_ms: int) -> Iterator[int]:
        """The instants (epoch ms) after ``after_ms`` whose wall time in the zone matches, oldest first: the
        repeated hour's second pass only for jobs whose minute or hour field is a wildcard (see the rules above).
        Wall times that clocks going forward skip are not among them; :meth:`compute_next_after` adds the jump.

        cronsim matches naive wall times here, one stretch of constant UTC offset at a time. Given an aware
        datetime it steps in hours and days of absolute time instead, which after a change of half an hour
        (Lord Howe Island) lands on the half hour and passes the job's hour by, losing that day's run."""
        first_pass_only = not any(part.startswith("*") for part in self.expression.split()[-5:-3])
        low = after_ms // 1000 * 1000 + 1000  # the first whole second after after_ms: a stretch starts there
        while True:
            offset_ms = self._offset_ms(low)
            wall = datetime.fromtimestamp((low + offset_ms) // 1000 - 1, tz=UTC).replace(tzinfo=None)
            known = low  # an instant of this stretch: the offset holds from it up to the next match checked
            for moment in CronSim(self.expression, wall):  # strictly after `wall`: from low's wall time on
                slot = int(moment.replace(tzinfo=UTC).timestamp()) * 1000 - offset_ms
                change = offset_change(self.timezone, known, slot)
                if change is not None:  # the stretch ends before this match: go on from the new offset
                    low = change
                    break
                known = slot
                if not (first_pass_only and self._repeated(slot)):
                    yield slot
            else:
                return

    def next_after(self, after_ms: int) -> int | None:
        """The first slot strictly after ``after_ms`` (None if the expression never matches again)."""
        return _next_after(self, after_ms)

    def compute_next_after(self, after_ms: int) -> int | None:
        candidate = self._next_match(after_ms)
        horizon = candidate if candidate is not None else after_ms + 366 * DAY_MS
        for jump_ms, first_skipped, first_after in self._forward_jumps(after_ms, horizon):
            if self._matches_local(first_skipped, first_after):
                return jump_ms
        return candidate

    def _next_match(self, after_ms: int) -> int | None:
        cursor = self._cursor[0] if self._cursor else None
        if (
            cursor is None
            or after_ms < cursor.low
            or (cursor.pending is not None and after_ms - cursor.pending > DAY_MS)
        ):
            matches = self._iterate(after_ms)
            cursor = _Cursor(matches, after_ms, next(matches, None))
            self._cursor[:] = [cursor]
        while cursor.pending is not None and cursor.pending <= after_ms:
            cursor.pending = next(cursor.matches, None)
        cursor.low = after_ms
        return cursor.pending

    def _offset(self, ms: int) -> timedelta:
        return utc_offset(self.timezone, ms)

    def _offset_ms(self, ms: int) -> int:
        return self._offset(ms) // timedelta(milliseconds=1)

    def _repeated(self, slot_ms: int) -> bool:
        """Whether the wall time at ``slot_ms`` came before (the second pass of an hour that clocks going back
        repeat)."""
        moment = datetime.fromtimestamp(slot_ms // 1000, tz=self.timezone)
        return moment.replace(fold=0).timestamp() * 1000 != slot_ms

    def _forward_jumps(self, start_ms: int, end_ms: int) -> Iterator[tuple[int, datetime, datetime]]:
        """Clocks going forward in ``(start_ms, end_ms]``: (instant, first skipped and first real local time)."""
        for change in _changes(self.timezone, start_ms, end_ms):
            before, after = self._offset(change - 1000), self._offset(change)
            if after > before:
                wall = datetime.fromtimestamp(change // 1000, tz=UTC).replace(tzinfo=None)
                yield change, wall + before, wall + after

    def offset_changes(self, start_ms: int, end_ms: int) -> tuple[int, ...]:
        """The instants in ``(start_ms, end_ms]`` where the zone's clocks change (forward or back)."""
        return _offset_changes(self.timezone, start_ms, end_ms)

    def _matches_local(self, start: datetime, end: datetime) -> bool:
        """Whether the expression matches a wall time in ``[start, end)``, time zones aside."""
        moment = next(iter(CronSim(self.expression, start - timedelta(seconds=1))), None)
        return moment is not None and moment < end

    def slots_between(self, start_ms: int, end_ms: int) -> Iterator[int]:
        """Slots in ``(start_ms, end_ms]``, oldest first."""
        slot = self.next_after(start_ms)
        while slot is not None and slot <= end_ms:
            yield slot
            slot = self.next_after(slot)


def utc_offset(zone: ZoneInfo, ms: int) -> timedelta:
    return datetime.fromtimestamp(ms / 1000, tz=zone).utcoffset() or timedelta(0)


def offset_change(zone: ZoneInfo, start_ms: int, end_ms: int) -> int | None:
    """The first whole second in ``(start_ms, end_ms]`` with another UTC offset than ``start_ms``'s (None if there
    is none)."""
    low, offset = start_ms, utc_offset(zone, start_ms)
    while low < end_ms:
        high = min(low + DAY_MS // 4, end_ms)  # zones change offset at most a few times a year
        if utc_offset(zone, high) != offset:
            a, b = low, high  # offset(a) is the old one, offset(b) a new one; close in on the instant
            while b - a > 1000:
                middle = (a + b) // 2
                a, b = (middle, b) if utc_offset(zone, middle) == offset else (a, middle)
            return b // 1000 * 1000
        low = high
    return None


def _changes(zone: ZoneInfo, start_ms: int, end_ms: int) -> Iterator[int]:
    while (change := offset_change(zone, start_ms, end_ms)) is not None:
        yield change
        start_ms = change


@functools.lru_cache(maxsize=256)
def _offset_changes(zone: ZoneInfo, start_ms: int, end_ms: int) -> tuple[int, ...]:
    return tuple(_changes(zone, start_ms, end_ms))


@functools.lru_cache(maxsize=16_384)
def _next_after(schedule: CronSchedule, after_ms: int) -> int | None:
    # Equal schedules (same expression and zone) share answers: a thousand jobs on "0 * * * *", or the same
    # job on every simulated instance, compute each slot once.
    return schedule.compute_next_after(after_ms)
