"""Slots as pure functions of time, including both daylight saving transitions."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from cronsim import CronSim
from hypothesis import given, settings
from hypothesis import strategies as st

from anarchon._cron import CronSchedule

BERLIN = ZoneInfo("Europe/Berlin")
NEW_YORK = ZoneInfo("America/New_York")
LORD_HOWE = ZoneInfo("Australia/Lord_Howe")  # clocks go forward at 02:00 to 02:30, back at 02:00 to 01:30


def ms(year: int, month: int, day: int, hour: int = 0, minute: int = 0, tz: ZoneInfo = BERLIN, fold: int = 0) -> int:
    return int(datetime(year, month, day, hour, minute, tzinfo=tz, fold=fold).timestamp() * 1000)


def local(slots: list[int], tz: ZoneInfo = BERLIN) -> list[str]:
    return [datetime.fromtimestamp(s / 1000, tz).strftime("%m-%d %H:%M %Z") for s in slots]


def slots(expression: str, start: int, hours: float, tz: ZoneInfo = BERLIN) -> list[int]:
    return list(CronSchedule(expression, tz).slots_between(start, start + int(hours * 3_600_000)))


def test_five_and_six_fields() -> None:
    assert slots("*/10 * * * * *", 0, 1 / 60, ZoneInfo("UTC")) == [10_000, 20_000, 30_000, 40_000, 50_000, 60_000]
    assert slots("*/20 * * * *", 0, 1, ZoneInfo("UTC")) == [1_200_000, 2_400_000, 3_600_000]


def test_next_after_is_strict_and_ignores_milliseconds_within_a_slot() -> None:
    every_second = CronSchedule("* * * * * *")
    assert every_second.next_after(10_000) == 11_000
    assert every_second.next_after(10_999) == 11_000
    assert every_second.next_after(9_999) == 10_000


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        # The daily run at 02:30 falls in the skipped hour: it runs at 03:00, once.
        ("30 2 * * *", ["03-29 03:00 CEST", "03-30 02:30 CEST"]),
        # Several times in the skipped hour: one run at 03:00 (Debian's cron would drop all four).
        ("*/15 2 * * *", ["03-29 03:00 CEST", "03-30 02:00 CEST", "03-30 02:15 CEST"]),
        # A time right after the jump is not doubled.
        ("0 3 * * *", ["03-29 03:00 CEST", "03-30 03:00 CEST"]),
        # A time in the skipped hour and one at the jump: one run at 03:00, named by its instant, stands for both.
        ("0 2,3 * * *", ["03-29 03:00 CEST", "03-30 02:00 CEST", "03-30 03:00 CEST"]),
    ],
)
def test_clocks_going_forward_lose_no_run(expression: str, expected: list[str]) -> None:
    assert local(slots(expression, ms(2026, 3, 29), 28.3))[: len(expected)] == expected


def test_frequent_jobs_skip_only_the_hour_that_does_not_exist() -> None:
    found = local(slots("*/30 * * * *", ms(2026, 3, 29, 1), 2.1))
    assert found == ["03-29 01:30 CET", "03-29 03:00 CEST", "03-29 03:30 CEST", "03-29 04:00 CEST"]


@pytest.mark.parametrize("expression", ["30 2 * * *", "0 30 2 * * *", "15 30 2 * * *"])
def test_clocks_going_back_do_not_run_a_fixed_time_twice(expression: str) -> None:
    found = slots(expression, ms(2026, 10, 24, 12), 48)
    assert local(found) == ["10-25 02:30 CEST", "10-26 02:30 CET"]


@pytest.mark.parametrize("expression", ["*/30 * * * *", "0 */30 * * * *"])
def test_clocks_going_back_keep_frequent_jobs_going_through_both_passes(expression: str) -> None:
    found = slots(expression, ms(2026, 10, 25, 1, 45), 2)
    assert local(found) == ["10-25 02:00 CEST", "10-25 02:30 CEST", "10-25 02:00 CET", "10-25 02:30 CET"]
    assert found == sorted(set(found))  # distinct instants, half an hour apart
    assert {b - a for a, b in itertools.pairwise(found)} == {1_800_000}


def test_new_york_transitions() -> None:
    spring = slots("30 2 * * *", ms(2026, 3, 8, tz=NEW_YORK), 24, NEW_YORK)
    assert local(spring, NEW_YORK) == ["03-08 03:00 EDT"]
    autumn = slots("30 1 * * *", ms(2026, 11, 1, tz=NEW_YORK), 24, NEW_YORK)
    assert local(autumn, NEW_YORK) == ["11-01 01:30 EDT"]


def test_a_yearly_run_in_the_gap_is_kept() -> None:
    found = slots("30 2 29 3 *", ms(2026, 3, 1), 24 * 400)
    assert local(found) == ["03-29 03:00 CEST", "03-29 02:30 CEST"]  # 2026 in the gap, 2027 on time


@pytest.mark.parametrize(
    ("expression", "start", "expected"),
    [
        # Hours away from the change, on the day clocks go forward half an hour: no day lost.
        ("0 0 9 * * *", ms(2024, 10, 5, 10, tz=LORD_HOWE), ["10-06 09:00 +11", "10-07 09:00 +11"]),
        ("*/30 23 * * *", ms(2024, 10, 5, 23, 10, tz=LORD_HOWE), ["10-05 23:30 +1030", "10-06 23:00 +11"]),
        (
            "0 * * * *",
            ms(2024, 10, 6, 0, 30, tz=LORD_HOWE),
            ["10-06 01:00 +1030", "10-06 02:30 +11", "10-06 03:00 +11"],
        ),
        # The day clocks go back half an hour (01:30-02:00 repeated): 02:00 and after come once.
        ("*/15 2 * * *", ms(2024, 4, 6, 12, tz=LORD_HOWE), ["04-07 02:00 +1030", "04-07 02:15 +1030"]),
        ("0 */2 * * *", ms(2024, 4, 7, 0, 30, tz=LORD_HOWE), ["04-07 02:00 +1030", "04-07 04:00 +1030"]),
    ],
)
def test_half_hour_changes_lose_no_run(expression: str, start: int, expected: list[str]) -> None:
    found = list(itertools.islice(CronSchedule(expression, LORD_HOWE).slots_between(start, start + 3 * 86_400_000), 3))
    assert local(found, LORD_HOWE)[: len(expected)] == expected


@pytest.mark.parametrize(
    ("expression", "zone", "slot"),
    [
        ("59 59 23 * * *", "America/Santiago", "2025-09-06T23:59:59-04:00"),  # clocks go forward at midnight
        ("59 59 * * * *", "Australia/Lord_Howe", "2025-10-05T01:59:59+10:30"),
        ("59 59 1 * * *", "Europe/Berlin", "2025-03-30T01:59:59+01:00"),
        ("59 59 2 * * *", "Europe/Berlin", "2025-10-26T02:59:59+02:00"),  # clocks go back at 03:00 CEST
    ],
)
def test_a_clock_change_right_after_a_slot_is_not_passed_by(expression: str, zone: str, slot: str) -> None:
    """Each slot asks for the next one (the cached path): the change a second after this slot must be seen there,
    as by a fresh start and by the rules."""
    schedule, tz = CronSchedule(expression, ZoneInfo(zone)), ZoneInfo(zone)
    start = int(datetime.fromisoformat(slot).timestamp() * 1000)
    end = start + 36 * 3_600_000
    assert schedule.next_after(start - 1) == start
    in_order = local(list(schedule.slots_between(start - 1, end)), tz)
    assert in_order == local(list(CronSchedule(expression, tz).slots_between(start - 1, end)), tz)  # fresh
    assert in_order == local(list(rule_slots(expression, tz, start - 1, end)), tz)


def rule_slots(expression: str, zone: ZoneInfo, start: int, end: int) -> Iterator[int]:
    """The slots in ``(start, end]`` by the module's rules, instant by instant (minutes, or seconds with six
    fields): an instant whose wall time matches, unless it is a fixed-time job's second pass through a repeated
    hour; and the instant clocks go forward, if a wall time they skip matches."""
    fields = expression.split()
    step = timedelta(seconds=1 if len(fields) == 6 else 60)
    fixed_time = not any(part.startswith("*") for part in fields[-5:-3])
    first_wall = datetime.fromtimestamp(start / 1000, UTC).replace(tzinfo=None) - timedelta(days=1)
    matching = set(
        itertools.takewhile(lambda wall: wall < first_wall + timedelta(days=3), CronSim(expression, first_wall))
    )
    step_ms = step // timedelta(milliseconds=1)
    for t in range(start // step_ms * step_ms + step_ms, end + 1, step_ms):
        moment = datetime.fromtimestamp(t / 1000, zone)
        wall = moment.replace(tzinfo=None)
        jump = moment.utcoffset() - datetime.fromtimestamp((t - step_ms) / 1000, zone).utcoffset()  # type: ignore[operator]
        skipped = {wall - jump + step * i for i in range(jump // step)}
        repeated = moment.replace(fold=0).timestamp() * 1000 != t
        if skipped & matching or (wall in matching and not (fixed_time and repeated)):
            yield t


@pytest.mark.parametrize(
    ("zone", "day"),
    [("Australia/Lord_Howe", (2024, 10, 6)), ("Australia/Lord_Howe", (2024, 4, 7)), ("Europe/Berlin", (2024, 3, 31)),
     ("Europe/Berlin", (2024, 10, 27)), ("America/Sao_Paulo", (2018, 11, 4)), ("Asia/Gaza", (2023, 10, 28))],
)  # fmt: skip
@pytest.mark.parametrize(
    "expression",
    [
        "30 2 * * *",
        "*/15 2 * * *",
        "0 * * * *",
        "*/20 1-3 * * *",
        "0 9 * * *",
        "0 0 9 * * *",
        "*/30 23 * * *",
        "0 */10 1,2 * * *",
    ],
)
def test_slots_follow_the_rules_on_days_clocks_change(zone: str, day: tuple[int, int, int], expression: str) -> None:
    tz = ZoneInfo(zone)
    start = int(datetime(*day, tzinfo=tz).timestamp() * 1000) - 3_600_000
    end = start + 26 * 3_600_000
    schedule = CronSchedule(expression, tz)
    from_day_before = [s for s in schedule.slots_between(start - 86_400_000, end) if s > start]  # the cached path
    assert local(from_day_before, tz) == local(list(rule_slots(expression, tz, start, end)), tz)
    assert list(CronSchedule(expression, tz).slots_between(start, end)) == from_day_before  # a fresh start


@settings(deadline=None, max_examples=60)  # correctness only; speed is measured by the benchmarks
@given(
    expression=st.sampled_from(["*/7 * * * *", "0 */3 * * *", "15 2 * * *", "*/20 2,3 * * 0", "0 0 1 * *"]),
    start=st.integers(min_value=ms(2025, 1, 1, tz=ZoneInfo("UTC")), max_value=ms(2028, 1, 1, tz=ZoneInfo("UTC"))),
    zone=st.sampled_from(["Europe/Berlin", "America/New_York", "Australia/Lord_Howe", "UTC"]),
)
def test_slots_strictly_increase_and_match_next_after(expression: str, start: int, zone: str) -> None:
    schedule = CronSchedule(expression, ZoneInfo(zone))
    found = list(schedule.slots_between(start, start + 10 * 86_400_000))
    assert found == sorted(set(found))
    assert all(s % 1000 == 0 for s in found)
    if found:
        assert schedule.next_after(start) == found[0]
        assert schedule.next_after(found[-1] - 1) == found[-1]


def test_slots_do_not_depend_on_the_machine_time_zone(monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    reference = slots("0 9 * * 1-5", ms(2026, 6, 1), 24 * 7)
    monkeypatch.setenv("TZ", "Asia/Kolkata")
    time.tzset()
    try:
        assert slots("0 9 * * 1-5", ms(2026, 6, 1), 24 * 7) == reference
    finally:
        monkeypatch.undo()
        time.tzset()
    assert datetime.fromtimestamp(reference[0] / 1000, UTC).hour == 7  # 09:00 CEST
