"""Bad input fails when the object is created, with an AnarchonError naming the option and what is allowed."""

from __future__ import annotations

import asyncio
import datetime
import re
import socket
import zoneinfo
from pathlib import Path
from typing import Any

import fakeredis
import pytest

from anarchon import (
    AnarchonError,
    ConfigError,
    ConfigTypeError,
    RedisBackend,
    Scheduler,
    SchedulerStateError,
    SystemClock,
    UnknownOptionError,
    ValkeyBackend,
)
from anarchon._job import _densest_window


def claim_only() -> RedisBackend[Any]:
    return RedisBackend(strategy="stream-id")


@pytest.mark.parametrize(
    ("make", "option", "allowed"),
    [
        (lambda: RedisBackend(prefx="x:"), "prefx", "prefix"),
        (lambda: RedisBackend(strategy={"name": "lease", "window_ms": 1}), "strategy.window_ms", "none"),
        (lambda: RedisBackend(strategy={"name": "script", "duration_sec": 5}), "strategy.duration_sec", "window_ms"),
        (lambda: RedisBackend(strategy={"name": "idmp", "duration_sec": 0}), "strategy.duration_sec", "1..86400"),
        (lambda: RedisBackend(strategy={"name": "idmp", "duration_sec": 86_401}), "strategy.duration_sec", "1..86400"),
        (lambda: RedisBackend(strategy={"name": "idmp", "max_size": 10_001}), "strategy.max_size", "1..10000"),
        (lambda: RedisBackend(strategy={"name": "idmp", "max_size": 0}), "strategy.max_size", "1..10000"),
        (lambda: RedisBackend(strategy={"name": "script", "window_ms": 0}), "strategy.window_ms", "1.."),
        (lambda: RedisBackend(strategy="paxos"), "strategy", "'lease'"),
        (lambda: RedisBackend(strategy={"window_ms": 5}), "strategy", "'lease'"),
        (lambda: ValkeyBackend(strategy="idmp"), "strategy", "'script'"),
        (lambda: ValkeyBackend(strategy={"name": "idmp"}), "strategy", "'script'"),
        (lambda: ValkeyBackend(redis="redis://x"), "redis", "valkey"),
        (lambda: RedisBackend(redis="http://cache:6379"), "redis", "rediss://"),
        (lambda: RedisBackend(redis={"hots": "cache"}), "redis.hots", "host"),
        (lambda: RedisBackend(redis={"port": "6379"}), "redis.port", "int"),
        (lambda: RedisBackend(redis=object()), "redis", "send(command, args)"),
        (lambda: RedisBackend(prefix="a{b}:"), "prefix", "no braces"),
        (lambda: RedisBackend(prefix="a b"), "prefix", "no braces"),
        (lambda: Scheduler(claim_only(), lease_ms=1000), "lease_ms", 'strategy="lease"'),
        (lambda: Scheduler(claim_only(), heartbeat_ms=1000), "heartbeat_ms", 'strategy="lease"'),
        (lambda: Scheduler(lease_ms=-5), "lease_ms", "10..86400000"),
        (lambda: Scheduler(lease_ms=1000, heartbeat_ms=1000), "heartbeat_ms", "1..500 (500 is half of lease_ms)"),
        (lambda: Scheduler(lease_ms=1000, heartbeat_ms=501), "heartbeat_ms", "1..500 (500 is half of lease_ms)"),
        (lambda: Scheduler(clock=SystemClock), "clock", "an instance"),
        (lambda: Scheduler(history_size=0), "history_size", "1..1000000"),
        (lambda: Scheduler(history_ttl_ms=0), "history_ttl_ms", "1.."),
        (lambda: Scheduler(instance_id="a\nb"), "instance_id", "no braces"),
        (lambda: Scheduler(leas_ms=5), "leas_ms", "lease_ms"),
        (lambda: Scheduler(backend="redis://x"), "backend", "RedisBackend"),
        (lambda: Scheduler(clock=123), "clock", "wall_ms"),
    ],
)
def test_bad_construction_names_option_and_allowed(make: Any, option: str, allowed: str) -> None:
    with pytest.raises(ConfigError) as caught:
        make()
    assert caught.value.option == option
    assert allowed in caught.value.allowed
    assert option in str(caught.value)


def noop() -> None:
    pass


def _zone_read_from_file() -> zoneinfo.ZoneInfo:
    """Europe/Berlin as a ZoneInfo read from its file: it has no key, the name other instances would need."""
    for folder in zoneinfo.TZPATH:
        if (path := Path(folder, "Europe", "Berlin")).exists():
            with path.open("rb") as file:
                return zoneinfo.ZoneInfo.from_file(file)
    import tzdata  # type: ignore[import-untyped]  # where the system has no zone files, the package holds them

    with (Path(tzdata.__file__).parent / "zoneinfo" / "Europe" / "Berlin").open("rb") as file:
        return zoneinfo.ZoneInfo.from_file(file)


@pytest.mark.parametrize(
    ("name", "cron", "func", "options", "option"),
    [
        ("a", "61 * * * *", noop, {}, "cron"),
        ("a", "* * *", noop, {}, "cron"),
        ("a", "* * * * * * *", noop, {}, "cron"),
        ("a", "0 0 30 2 *", noop, {}, "cron"),
        ("a", 5, noop, {}, "cron"),
        ("a", "* * * * *", noop, {"timezone": "Mars/Olympus"}, "timezone"),
        ("a", "* * * * *", noop, {"timezone": "localtime"}, "timezone"),  # each machine's own zone
        ("a", "* * * * *", noop, {"timezone": "posixrules"}, "timezone"),
        ("a", "* * * * *", noop, {"timezone": _zone_read_from_file()}, "timezone"),  # no name
        ("a", "* * * * *", noop, {"timezone": datetime.UTC}, "timezone"),  # not a ZoneInfo
        ("a", "* * * * *", noop, {"timezone": "Europe"}, "timezone"),  # a directory of zones, not a zone
        ("a", "* * * * *", noop, {"timezone": "x" * 300}, "timezone"),  # longer than a file name may be
        ("a", "* * * * *", noop, {"jitter_ms": -1}, "jitter_ms"),
        ("a", "* * * * *", noop, {"max_late_ms": 10**12}, "max_late_ms"),
        ("a", "* * * * *", noop, {"max_late_ms": 0}, "max_late_ms"),
        ("a", "* * * * *", noop, {"max_late_ms": 999}, "max_late_ms"),
        ("a", "* * * * *", noop, {"max_attempts": 0}, "max_attempts"),
        ("a", "* * * * *", noop, {"catch_up_ms": 1.5}, "catch_up_ms"),
        ("a", "* * * * *", noop, {"overlap": "yes"}, "overlap"),
        ("a", "* * * * *", noop, {"retries": 3}, "retries"),
        ("a{b}", "* * * * *", noop, {}, "name"),
        ("a\nb", "* * * * *", noop, {}, "name"),
        ("x" * 10_000, "* * * * *", noop, {}, "name"),
        ("", "* * * * *", noop, {}, "name"),
        ("a:b", "* * * * *", noop, {}, "name"),
        ("a", "* * * * *", "not callable", {}, "func"),
    ],
)
def test_bad_jobs_are_refused_when_added(name: Any, cron: Any, func: Any, options: Any, option: str) -> None:
    scheduler = Scheduler()
    with pytest.raises(ConfigError) as caught:
        scheduler.add_job(name, cron, func, **options)
    assert caught.value.option == option
    assert scheduler.jobs == ()


@pytest.mark.parametrize(
    ("make", "option"),
    [
        (lambda: Scheduler().add_job(123, "* * * * *", noop), "name"),  # type: ignore[arg-type]
        (lambda: Scheduler(instance_id=7), "instance_id"),  # type: ignore[arg-type]
        (lambda: RedisBackend(prefix=None), "prefix"),  # type: ignore[call-overload]
        (lambda: Scheduler().add_job("a", 5, noop), "cron"),  # type: ignore[arg-type]
    ],
)
def test_a_value_of_the_wrong_kind_is_a_type_error(make: Any, option: str) -> None:
    with pytest.raises(ConfigTypeError) as caught:
        make()
    assert isinstance(caught.value, TypeError)
    assert caught.value.option == option


def takes_two(run: Any, other: Any) -> None:
    pass


def takes_a_keyword(*, run: Any) -> None:
    pass


def a_generator(run: Any) -> Any:
    yield


async def an_async_generator(run: Any) -> Any:
    yield


@pytest.mark.parametrize(
    ("function", "why"),
    [
        (a_generator, "a_generator is a generator function"),
        (an_async_generator, "an_async_generator is a generator function"),
        (takes_two, "takes_two cannot be called with the RunContext: missing a required argument: 'other'"),
        # Python's own words for what is missing, which Python 3.13 made more precise.
        (
            takes_a_keyword,
            "takes_a_keyword cannot be called with no argument: missing a required (keyword-only )?argument: 'run'",
        ),
    ],
)
def test_a_function_a_run_could_not_call_or_would_not_run_is_refused_when_added(function: Any, why: str) -> None:
    # Added, a generator's runs would be recorded ok with its body never run; the others would fail every run.
    scheduler = Scheduler()
    with pytest.raises(ConfigTypeError, match="func") as caught:
        scheduler.add_job("a", "* * * * *", function)
    assert re.search(
        f"job 'a': {why}; allowed: a function or coroutine function taking the RunContext", str(caught.value)
    )
    assert scheduler.jobs == ()


def test_functions_with_optional_parameters_and_callable_objects_are_jobs() -> None:
    class Job:
        async def __call__(self, run: Any, retries: int = 3) -> None:
            pass

    scheduler = Scheduler()
    scheduler.add_job("object", "* * * * *", Job())
    scheduler.add_job("defaults", "* * * * *", lambda run=None, *more: None)
    scheduler.add_job("builtin", "* * * * *", print)  # no signature to check: called with the context
    assert scheduler.jobs == ("object", "defaults", "builtin")


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_class_whose_instances_are_callable_is_refused_as_a_job(asynchronous: bool) -> None:
    """Called, the class makes an instance and runs nothing (with an async __call__, every run failed)."""

    class Cleanup:
        def __call__(self) -> None:
            pass

    class AsyncCleanup:
        async def __call__(self) -> None:
            pass

    job = AsyncCleanup if asynchronous else Cleanup
    with pytest.raises(ConfigTypeError, match="is a class whose instances are callable: pass one") as caught:
        Scheduler().add_job("cleanup", "* * * * *", job)
    assert caught.value.option == "func"
    Scheduler().add_job("cleanup", "* * * * *", job())


def test_duplicate_job_names_are_refused() -> None:
    scheduler = Scheduler()
    scheduler.add_job("sync", "* * * * *", noop)
    with pytest.raises(ConfigError, match="already registered"):
        scheduler.add_job("sync", "*/5 * * * *", noop)


@pytest.mark.parametrize("option", ["overlap", "max_attempts", "catch_up_ms"])
def test_lease_job_options_are_refused_with_claim_only_strategies(option: str) -> None:
    scheduler: Any = Scheduler(claim_only())
    with pytest.raises(ConfigError, match="lease option") as caught:
        scheduler.add_job("a", "* * * * *", noop, **{option: 1 if option != "overlap" else True})
    assert caught.value.option == option


def test_stream_id_refuses_a_jitter_that_could_claim_a_later_slot_first() -> None:
    """stream-id takes a run's claim only while no later slot was claimed: with a jitter as long as the time
    between two slots, a later slot's claim could come first, and the earlier slot would never run."""
    scheduler = Scheduler(RedisBackend(strategy="stream-id"))
    scheduler.add_job("ok", "*/10 * * * * *", noop, jitter_ms=9_999)
    scheduler.add_job("daily", "0 9 * * *", noop, jitter_ms=3_600_000)
    for name, cron, jitter in (("tens", "*/10 * * * * *", 10_000), ("pair", "0,5 9 * * *", 400_000)):
        with pytest.raises(ConfigError) as caught:
            scheduler.add_job(name, cron, noop, jitter_ms=jitter)
        assert caught.value.option == "jitter_ms"
    assert "less than 300000 ms" in str(caught.value)
    assert scheduler.jobs == ("ok", "daily")
    # Where clocks go forward, a skipped time's run comes at the jump: 03:00, then 03:30 (Berlin), or 02:30,
    # then 03:00 (Lord Howe Island, half an hour forward from 02:00), on one day of the year.
    scheduler.add_job("hourly", "0 * * * *", noop, jitter_ms=40 * 60_000, timezone="Europe/Berlin")
    for name, cron, zone in (("half", "30 * * * *", "Europe/Berlin"), ("howe", "0 * * * *", "Australia/Lord_Howe")):
        with pytest.raises(ConfigError, match="less than 1800000 ms") as caught:
            scheduler.add_job(name, cron, noop, jitter_ms=40 * 60_000, timezone=zone)
        assert caught.value.option == "jitter_ms"
    assert scheduler.jobs == ("ok", "daily", "hourly")
    Scheduler(RedisBackend(strategy="script")).add_job("tens", "*/10 * * * * *", noop, jitter_ms=10_000)


@pytest.mark.parametrize(
    ("strategy", "setting", "unit"),
    [
        ({"name": "script", "window_ms": 60_000}, "strategy.window_ms", "60000 ms"),
        ({"name": "idmp", "duration_sec": 60}, "strategy.duration_sec", "60 s"),  # in the setting's own unit
    ],
)
def test_forgetful_strategies_must_outlast_the_latest_claim(strategy: Any, setting: str, unit: str) -> None:
    scheduler = Scheduler(RedisBackend(strategy=strategy))
    scheduler.add_job("ok", "* * * * *", noop, jitter_ms=10_000, max_late_ms=40_000)
    with pytest.raises(ConfigError) as caught:
        scheduler.add_job("late", "* * * * *", noop, jitter_ms=10_000, max_late_ms=50_000)
    assert caught.value.option == setting
    assert f"{setting}: {unit} is not longer than job 'late''s jitter_ms + max_late_ms (60000 ms)" in str(caught.value)
    assert caught.value.allowed == f"more than {unit}, or a smaller jitter_ms / max_late_ms"


class FixedClock:
    """A wall clock stopped at one moment: the idmp size check samples the slots after registration."""

    def __init__(self, wall_ms: int) -> None:
        self.now = wall_ms

    def wall_ms(self) -> int:
        return self.now

    def monotonic(self) -> float:
        return 0.0

    async def sleep(self, seconds: float) -> None:
        return None


NOON = 1_700_049_600_000  # 2023-11-15T12:00:00Z


def idmp_scheduler(max_size: int, duration_sec: int = 86_400) -> Scheduler[Any]:
    backend = RedisBackend(strategy={"name": "idmp", "duration_sec": duration_sec, "max_size": max_size})
    return Scheduler(backend, clock=FixedClock(NOON + 30_000))


@pytest.mark.parametrize(
    ("cron", "max_late_ms", "crowd"),
    [
        ("* * * * * *", 100_000, 101),  # every second: a 100 s window holds its first slot and 100 more
        ("*/5 * * * *", 3_600_000, 13),  # every 5 minutes, claimed up to an hour late
        # Every second in minutes 59 and 0: the densest window starts at a minute 59, not at the day's first slot.
        ("* 59,0 * * * *", 119_000, 120),
    ],
)
def test_idmp_max_size_must_hold_every_run_a_late_claim_can_still_ask_for(
    cron: str, max_late_ms: int, crowd: int
) -> None:
    """Redis keeps the last max_size ids per producer (the job): with more of the job's slots than that within
    jitter_ms + max_late_ms, a slot's id could be evicted before its last claim, which would then win again."""
    refusing = idmp_scheduler(crowd - 1)
    with pytest.raises(ConfigError) as caught:
        refusing.add_job("dense", cron, noop, max_late_ms=max_late_ms)
    assert caught.value.option == "strategy.max_size"
    assert f"has {crowd} runs within {max_late_ms} ms" in str(caught.value)
    assert f"remembers only the last {crowd - 1} runs" in str(caught.value)
    assert caught.value.allowed.startswith(f"{crowd}..10000")
    assert refusing.jobs == ()
    accepting = idmp_scheduler(crowd)  # the slot's own id and crowd - 1 later ones: nothing is evicted
    accepting.add_job("dense", cron, noop, max_late_ms=max_late_ms)
    assert accepting.jobs == ("dense",)


def test_idmp_max_size_refusal_says_when_no_max_size_is_enough() -> None:
    scheduler = idmp_scheduler(10_000)
    with pytest.raises(ConfigError) as caught:
        scheduler.add_job("dense", "* * * * * *", noop, jitter_ms=1_000, max_late_ms=3 * 3_600_000)
    assert caught.value.option == "strategy.max_size"
    assert "more than 10000 runs within 10801000 ms" in str(caught.value)
    assert "another strategy" in caught.value.allowed
    scheduler.add_job("sparse", "*/5 * * * * *", noop, jitter_ms=1_000, max_late_ms=3 * 3_600_000)  # 2,161 runs


def test_idmp_max_size_check_reads_a_schedule_once_and_only_when_it_could_be_too_dense() -> None:
    """Registering ten thousand jobs stays cheap: equal schedules share one reading of their slots, and a
    window too short to hold more than max_size slots, even one a second, needs none."""
    _densest_window.cache_clear()
    scheduler = idmp_scheduler(100)
    for i in range(10_000):  # 301 minutes could hold 302 slots; every 5 minutes they hold 61
        scheduler.add_job(f"job{i}", "*/5 * * * *", noop, max_late_ms=5 * 3_600_000 + 60_000)
    scheduler.add_job("every-second", "* * * * * *", noop, max_late_ms=99_000)  # at most 100 slots
    assert len(scheduler.jobs) == 10_001
    assert _densest_window.cache_info().misses == 1


def test_errors_share_one_root_and_mix_in_builtins() -> None:
    with pytest.raises(ValueError, match="max_size") as value_error:
        RedisBackend(strategy={"name": "idmp", "max_size": 0})
    with pytest.raises(TypeError, match="prefx") as type_error:
        RedisBackend(prefx="x")
    for error in (value_error.value, type_error.value):
        assert isinstance(error, AnarchonError)
    assert isinstance(type_error.value, UnknownOptionError)
    with pytest.raises(ConfigTypeError):
        RedisBackend(strategy={"name": "idmp", "max_size": True})


def test_a_setting_of_another_strategy_says_whose_it_is() -> None:
    with pytest.raises(UnknownOptionError, match="setting of 'script'"):
        RedisBackend(strategy={"name": "lease", "window_ms": 1})
    with pytest.raises(UnknownOptionError, match="inside the strategy"):
        RedisBackend(window_ms=1)


@pytest.mark.parametrize(
    ("connection", "hidden"),
    [
        ("rediss://alice:s3cr3t-pw@cache:6380/1", "s3cr3t-pw"),
        ({"host": "cache", "password": "s3cr3t-pw"}, "s3cr3t-pw"),
        ("unix:///run/redis.sock?db=1&password=s3cr3t-pw", "s3cr3t-pw"),  # the usual form for a socket
        ("redis://cache:6379/0?password=s3cr3t-pw&client_name=app", "s3cr3t-pw"),
    ],
)
def test_passwords_never_appear_in_reprs(connection: Any, hidden: str) -> None:
    backend = RedisBackend(redis=connection)
    assert hidden not in repr(backend)
    assert "***" in repr(backend)
    assert hidden not in repr(Scheduler(backend))


def test_unset_connection_settings_may_be_none() -> None:
    # {"password": os.environ.get("REDIS_PASSWORD")}, as redis-py takes it: None is no password.
    backend = RedisBackend(redis={"host": "cache", "username": None, "password": None, "client_name": None})
    assert "cache" in repr(backend)
    with pytest.raises(ConfigTypeError, match=r"redis\.port"):
        RedisBackend(redis={"host": "cache", "port": None})  # type: ignore[typeddict-item]


def test_strategy_settings_keep_their_defaults() -> None:
    assert RedisBackend(strategy="idmp").config == RedisBackend(strategy={"name": "idmp"}).config
    config = RedisBackend(strategy={"name": "idmp", "duration_sec": 900, "max_size": 5_000}).config
    assert (config.duration_sec, config.max_size) == (900, 5_000)  # type: ignore[union-attr]
    assert RedisBackend(strategy="script").config.window_ms == 300_000  # type: ignore[union-attr]


def test_scheduler_defaults_heartbeat_a_third_of_the_lease_and_keep_runs_as_long_as_a_claim_may_come() -> None:
    """heartbeat_ms defaults to lease_ms // 3. The store keeps a finished run for as long as an instance may still
    claim it: max(jitter_ms + max_late_ms, catch_up_ms) + lease_ms × max_attempts, and 60 s for clock differences
    (shorter, and a late backup would find the run gone and run it again)."""
    scheduler = Scheduler(lease_ms=2_000)
    assert scheduler.heartbeat_ms == 666
    scheduler.add_job("late", "* * * * * *", noop, jitter_ms=1_000, max_late_ms=5_000, max_attempts=3)
    scheduler.add_job("catching-up", "* * * * * *", noop, catch_up_ms=600_000, max_attempts=2)
    assert scheduler._policies["late"].keep_ms == 1_000 + 5_000 + 2_000 * 3 + 60_000
    assert scheduler._policies["catching-up"].keep_ms == 600_000 + 2_000 * 2 + 60_000


def test_recognised_clients_are_adapted() -> None:
    client = fakeredis.FakeAsyncRedis()
    assert RedisBackend(redis=client).leases
    assert not ValkeyBackend(valkey=client, strategy="script").leases

    class Sender:
        def send(self, command: str, args: list[str]) -> object:
            return None

    RedisBackend(redis=Sender())


def a_generator_hook(run: Any) -> Any:
    yield


@pytest.mark.parametrize(
    ("hooks", "option", "why"),
    [
        ({"on_run_start": lambda: None}, "on_run_start", "cannot be called with the RunContext: too many"),
        ({"on_run_end": lambda run: None}, "on_run_end", "cannot be called with the RunContext and the RunRecord"),
        ({"on_run_end": a_generator_hook}, "on_run_end", "a_generator_hook is a generator function"),
        ({"on_run_start": "print"}, "on_run_start", "got str"),
    ],
)
def test_a_hook_that_a_run_could_not_call_is_refused_when_given(hooks: Any, option: str, why: str) -> None:
    """Accepted, it would fail at every run, seen only in the log (a generator's body would never run)."""
    with pytest.raises(ConfigTypeError) as caught:
        Scheduler(**hooks)
    assert caught.value.option == option
    assert why in str(caught.value)


def test_hooks_sync_or_async_with_optional_parameters_are_accepted() -> None:
    async def on_end(run: Any, record: Any, extra: int = 0) -> None:
        pass

    scheduler = Scheduler(on_run_start=lambda run, *rest: None, on_run_end=on_end)
    assert scheduler.on_run_end is on_end


def test_a_database_number_beyond_what_select_reads_is_refused() -> None:
    with pytest.raises(ConfigError) as caught:
        RedisBackend(redis={"db": 2**31})
    assert caught.value.option == "redis.db"


@pytest.mark.parametrize("database", ["-1", "first"])
def test_a_url_whose_database_is_no_database_number_says_which_are(database: str) -> None:
    with pytest.raises(ConfigError) as caught:
        RedisBackend(redis=f"redis://cache:6379/{database}")
    assert caught.value.option == "redis"
    assert f"the URL's database {database!r} is not a database number" in str(caught.value)
    assert caught.value.allowed.startswith("db ")


def test_a_url_whose_health_check_interval_is_negative_is_refused() -> None:
    """redis-py takes it, then fails at the first command with an error that points elsewhere."""
    with pytest.raises(ConfigError) as caught:
        RedisBackend(redis="redis://cache:6379/0?health_check_interval=-5")
    assert caught.value.option == "redis"
    assert "health_check_interval" in str(caught.value)
    assert caught.value.allowed == "health_check_interval a finite number of seconds, 0 (none) or more"
    RedisBackend(redis="redis://cache:6379/0?health_check_interval=0")  # none: allowed


async def test_run_in_async_code_says_what_to_use_instead() -> None:
    with pytest.raises(SchedulerStateError, match="async with scheduler"):
        Scheduler().run()


@pytest.mark.parametrize("digits", [401, 5001])  # 5,001: more than Python writes as text (4,300 by default)
@pytest.mark.parametrize(
    ("make", "option"),
    [
        (lambda n: RedisBackend(redis={"socket_timeout": n}), "redis.socket_timeout"),
        (lambda n: RedisBackend(redis={"socket_connect_timeout": n}), "redis.socket_connect_timeout"),
        (lambda n: RedisBackend(redis={"port": n}), "redis.port"),
        (lambda n: RedisBackend(strategy={"name": "script", "window_ms": n}), "strategy.window_ms"),
        (lambda n: Scheduler(lease_ms=n), "lease_ms"),
        (lambda n: Scheduler().add_job("a", "* * * * *", noop, jitter_ms=n), "jitter_ms"),
        (lambda n: asyncio.run(Scheduler().stop(n)), "timeout"),
        (lambda n: Scheduler().run(stop_timeout=n), "stop_timeout"),
    ],
)
def test_a_number_too_large_for_a_float_is_refused_by_name(make: Any, option: str, digits: int) -> None:
    with pytest.raises(ConfigError) as caught:
        make(10 ** (digits - 1))
    assert caught.value.option == option
    assert f"an integer of about {digits} digits" in str(caught.value)  # not the digits themselves


@pytest.mark.parametrize(
    ("cron", "options", "option", "error_type"),
    [
        ("0 9 * * *", {"timezone": "Europe/Berln"}, "timezone", ConfigError),
        ("0 9 * * 8", {}, "cron", ConfigError),
        ("0 9 * * *", {"jitter_ms": -1}, "jitter_ms", ConfigError),
        ("0 9 * * *", {"max_attempts": "3"}, "max_attempts", ConfigTypeError),
        ("0 9 * * *", {"max_atempts": 3}, "max_atempts", UnknownOptionError),
    ],
)
def test_a_bad_job_is_named_in_the_error(
    cron: str, options: dict[str, Any], option: str, error_type: type[ConfigError]
) -> None:
    """Jobs added in a loop from a config file: the error says which one, and keeps its type and fields."""
    scheduler = Scheduler()
    with pytest.raises(error_type) as caught:
        scheduler.add_job("nightly-report", cron, noop, **options)
    assert caught.value.option == option
    assert str(caught.value).count("job 'nightly-report'") == 1, str(caught.value)


def test_a_long_bad_job_name_is_cut_short_in_the_error() -> None:
    name = "report-" * 500 + "{shard}"
    with pytest.raises(ConfigError) as caught:
        Scheduler().add_job(name, "0 9 * * *", noop)
    assert caught.value.option == "name"
    assert len(str(caught.value)) < 400, str(caught.value)
    assert f"({len(name)} characters)" in str(caught.value)  # the name's, without the quotes


def test_a_lease_only_option_of_a_job_on_another_strategy_names_the_job() -> None:
    with pytest.raises(ConfigError) as caught:
        Scheduler(claim_only()).add_job("nightly-report", "0 9 * * *", noop, max_attempts=3)
    assert caught.value.option == "max_attempts"
    assert str(caught.value).startswith("job 'nightly-report': max_attempts:"), str(caught.value)


@pytest.mark.parametrize("call", ["run_now", "history"])
def test_a_job_name_that_is_not_a_string_is_a_type_error(call: str) -> None:
    scheduler = Scheduler()
    scheduler.add_job("a", "* * * * *", noop)
    with pytest.raises(ConfigTypeError) as caught:
        asyncio.run(getattr(scheduler, call)(["a"]))
    assert caught.value.option == "name"


@pytest.mark.parametrize(
    ("cron", "why"),
    [
        ("0 0 30 2 *", "never matches: no month of its month field has those days"),
        ("0 0 31 4,6 *", "never matches: no month of its month field has those days"),
        ("0 0 32 2 *", "is not valid (Bad day-of-month)"),
        ("0 0 * 13 *", "is not valid (Bad month)"),  # not "never matches": the month itself is out of range
        ("0 0 31 4,13 *", "is not valid (Bad month)"),
        ("@hourly", "macros such as @hourly are not supported"),
        ("0 9 * *", "has 4 fields"),
        ("daily", "has 1 field;"),
        (
            "*/90 * * * *",
            "the step /90 of its minute field is longer than the field's 60 values, and would match once per hour",
        ),
        ("0 */48 * * *", "the step /48 of its hour field is longer than the field's 24 values"),
        ("0 0 */45 * *", "the step /45 of its day of month field is longer than the field's 31 values"),
        ("0 0 1 1-12/13 *", "the step /13 of its month field is longer than the field's 12 values"),
        ("0 0 * * 1,2/8", "the step /8 of its weekday field is longer than the field's 7 values"),
        ("*/61 * * * * *", "the step /61 of its second field is longer than the field's 60 values"),
    ],
)
def test_a_cron_expression_that_cannot_mean_what_it_says_is_refused(cron: str, why: str) -> None:
    with pytest.raises(ConfigError, match="cron") as caught:
        Scheduler().add_job("a", cron, noop)
    assert why in str(caught.value)


def test_steps_as_long_as_their_field_are_kept() -> None:
    """*/60 minutes is hourly, */24 hours daily: what was meant, and what cron does."""
    scheduler = Scheduler()
    for number, cron in enumerate(["*/60 * * * *", "0 */24 * * *", "0 0 1 */12 *", "*/60 * * * * *", "*/45 * * * *"]):
        scheduler.add_job(f"job{number}", cron, noop)
    assert len(scheduler.jobs) == 5


def test_a_host_name_an_instance_id_may_not_hold_still_makes_a_default_id(monkeypatch: pytest.MonkeyPatch) -> None:
    for host in ("Jörg PC {1}", "x" * 300, "é"):
        monkeypatch.setattr(socket, "gethostname", lambda host=host: host)
        instance_id = Scheduler().instance_id
        assert re.fullmatch(r"[A-Za-z0-9_.\-]{1,200}", instance_id), instance_id
    monkeypatch.setattr(socket, "gethostname", lambda: "Jörg PC {1}")
    assert Scheduler().instance_id.startswith("J-rg-PC--1--")
