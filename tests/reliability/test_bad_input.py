"""Bad input is refused when the object is created, with an AnarchonError; valid input is accepted.

The named cases extend tests/anarchon/test_config.py where it has gaps. The fuzz calls every constructor and
option (RedisBackend, ValkeyBackend, Scheduler, add_job and the job decorator) with option names and values of
arbitrary types and checks that nothing but an AnarchonError escapes: no TypeError, ValueError, KeyError,
AttributeError or OSError that is not also an AnarchonError.
"""

from __future__ import annotations

import math
import random
import string
import zoneinfo
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from anarchon import (
    AnarchonError,
    ConfigError,
    ConfigTypeError,
    RedisBackend,
    RunContext,
    Scheduler,
    SystemClock,
    UnknownOptionError,
    ValkeyBackend,
)

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def noop() -> None:
    pass


async def takes_run(run: RunContext) -> None:
    pass


class CallableObject:
    def __call__(self) -> None:
        pass


# --- named cases the existing suite does not cover ---------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "option"),
    [
        (lambda: RedisBackend(redis="redis://[::1"), "redis"),
        (lambda: RedisBackend(redis="redis://cache:99999/0"), "redis"),
        (lambda: RedisBackend(redis="redis://cache:port/0"), "redis"),
        (lambda: RedisBackend(redis="redis://cache:6379/0?socket_timeout=soon"), "redis"),
        (lambda: RedisBackend(redis="redis://cache:6379/0?db=first"), "redis"),
        (lambda: RedisBackend(redis="redis://cache:6379/0?socket_timeout=-1"), "redis"),
        (lambda: RedisBackend(redis="redis://cache:6379/0?retries=3"), "redis"),
        (lambda: RedisBackend(redis="redis://cache:0/0"), "redis"),
        (lambda: RedisBackend(redis="redis://cache:6379/first"), "redis"),
        (lambda: RedisBackend(redis="redis://cache:6379/0?protocol=3"), "redis"),
        (lambda: ValkeyBackend(valkey="redis://cache:6379/0?ssl_ca_certs=/x&sssl=1"), "valkey"),
        (lambda: RedisBackend(redis={"port": 70_000}), "redis.port"),
        (lambda: RedisBackend(redis={"port": -1}), "redis.port"),
        (lambda: RedisBackend(redis={"db": -1}), "redis.db"),
        (lambda: RedisBackend(redis={"socket_timeout": -2.0}), "redis.socket_timeout"),
        (lambda: RedisBackend(redis={"socket_timeout": math.inf}), "redis.socket_timeout"),
        (lambda: RedisBackend(redis={"socket_connect_timeout": math.nan}), "redis.socket_connect_timeout"),
        (lambda: ValkeyBackend(valkey=object()), "valkey"),
        (lambda: Scheduler(random="seeded"), "random"),
        (lambda: Scheduler(random=random.Random, instance_id="a"), "random"),
        (lambda: Scheduler(instance_id="x" * 10_000), "instance_id"),
        (lambda: Scheduler(instance_id="{a}"), "instance_id"),
        (lambda: Scheduler(on_run_end="print"), "on_run_end"),
        (lambda: Scheduler(lease_ms=10**30), "lease_ms"),
        (lambda: Scheduler(history_ttl_ms=-1), "history_ttl_ms"),
    ],
)
def test_bad_construction_is_refused_at_once(make: Any, option: str) -> None:
    with pytest.raises(ConfigError) as caught:
        make()
    assert caught.value.option == option


@pytest.mark.parametrize(
    ("cron", "options", "option"),
    [
        ("* * * * *", {"timezone": "Europe"}, "timezone"),  # a folder of the zone database, not a zone
        ("* * * * *", {"timezone": "Europe/" + "x" * 300}, "timezone"),  # longer than a file name can be
        ("* * * * *", {"timezone": ""}, "timezone"),
        ("* * * * *", {"timezone": None}, "timezone"),
        ("* * * * *", {"jitter_ms": 10**40}, "jitter_ms"),
        ("* * * * *", {"max_late_ms": -1}, "max_late_ms"),
        ("* * * * *", {"catch_up_ms": -60_000}, "catch_up_ms"),
        ("* * * * *", {"max_attempts": True}, "max_attempts"),
        ("* * * * *", {"max_late_ms": 1e3}, "max_late_ms"),
        ("* * * * *", {"Timezone": "UTC"}, "Timezone"),
        ("*/0 * * * *", {}, "cron"),
        ("* * * * * * * *", {}, "cron"),
        ("", {}, "cron"),
        ("* * * * *\n* * * * *", {}, "cron"),
        (b"* * * * *", {}, "cron"),
        ("99 * * * * *", {}, "cron"),
    ],
)
def test_bad_job_options_are_refused_when_added(cron: Any, options: dict[str, Any], option: str) -> None:
    scheduler = Scheduler()
    with pytest.raises(ConfigError) as caught:
        scheduler.add_job("job", cron, noop, **options)
    assert caught.value.option == option
    assert scheduler.jobs == ()


@pytest.mark.parametrize("name", ["a}b", "{job", "a\rb", "tab\there", "x" * 201, "ünïcode", None, 7, b"job"])
def test_bad_job_names_are_refused_by_the_decorator_too(name: Any) -> None:
    scheduler = Scheduler()
    with pytest.raises(ConfigError) as caught:
        scheduler.job(name, "* * * * *")(noop)
    assert caught.value.option == "name"


def test_a_duplicate_job_name_keeps_the_first_job() -> None:
    scheduler = Scheduler()
    scheduler.add_job("sync", "* * * * *", noop)
    with pytest.raises(ConfigError):
        scheduler.job("sync", "0 * * * *")(noop)
    assert scheduler.jobs == ("sync",)
    assert scheduler._jobs["sync"].schedule.expression == "* * * * *"


# --- the fuzz ----------------------------------------------------------------------------------------------

# Values that mean something to some option, or that broke something once.
SPECIAL = (
    "lease", "script", "idmp", "stream-id", "UTC", "Europe", "* * * * *", "* * * * * *", "redis://x",
    "rediss://u:p@h:1/0", "redis://[::1", "unix:///tmp/s", "cron:", "{", "}", "\n", "\x00", object(), noop, takes_run,
    CallableObject(), print, int, SystemClock(), random.Random(1), math.nan, math.inf, -math.inf,
)  # fmt: skip
leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(),
    st.text(max_size=30),
    st.binary(max_size=10),
    st.integers(10_000, 10_001).map(lambda n: "x" * n),  # 10 kB names
    st.sampled_from(SPECIAL),
)
values = st.recursive(
    leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.tuples(inner, inner),
        st.dictionaries(
            st.one_of(st.text(max_size=12), st.sampled_from(["name", "window_ms", "host", "port"])), inner, max_size=3
        ),
        st.frozensets(st.integers(), max_size=2),
    ),
    max_leaves=6,
)
option_names = st.one_of(
    st.text(min_size=1, max_size=15),
    st.sampled_from(["lease_ms", "window_ms", "timezone", "prefix", "redis", "valkey", "overlap"]),
)


def strategies_like() -> st.SearchStrategy[Any]:
    settings_ = st.dictionaries(
        st.sampled_from(["name", "window_ms", "duration_sec", "max_size", "other"]),
        st.one_of(st.sampled_from(["lease", "stream-id", "idmp", "script"]), st.integers(-5, 100_000_000), values),
        max_size=3,
    )
    return st.one_of(st.sampled_from(["lease", "stream-id", "idmp", "script", "paxos"]), settings_, values)


def urls() -> st.SearchStrategy[str]:
    scheme = st.sampled_from(["redis", "rediss", "unix", "http", ""])
    host = st.one_of(st.sampled_from(["cache", "127.0.0.1", "[::1]", "[::1", "u:p@cache", ""]), st.text(max_size=8))
    port = st.one_of(st.just(""), st.integers(-5, 70_000).map(lambda p: f":{p}"), st.text(max_size=5).map(":".__add__))
    path = st.one_of(st.just(""), st.integers(-2, 20).map(lambda d: f"/{d}"), st.text(max_size=5).map("/".__add__))
    query_key = st.sampled_from(["socket_timeout", "db", "ssl_cert_reqs", "health_check_interval", "bogus", "protocol"])
    query_value = st.one_of(st.text(max_size=5), st.integers(-3, 100).map(str), st.sampled_from(["1.5", "nan", "inf"]))
    query = st.lists(st.tuples(query_key, query_value), max_size=2).map(
        lambda pairs: "?" + "&".join(f"{k}={v}" for k, v in pairs) if pairs else ""
    )
    return st.builds(
        lambda *parts: f"{parts[0]}://{parts[1]}{parts[2]}{parts[3]}{parts[4]}", scheme, host, port, path, query
    )


def connection_options() -> st.SearchStrategy[dict[Any, Any]]:
    keys = st.sampled_from(
        ["host", "port", "db", "username", "password", "ssl", "ssl_ca_certs", "ssl_check_hostname", "socket_timeout",
         "socket_connect_timeout", "client_name", "retry", "decode_responses"]
    )  # fmt: skip
    return st.dictionaries(st.one_of(keys, st.text(max_size=8), st.integers()), values, max_size=4)


connections = st.one_of(urls(), connection_options(), values)
prefixes = st.one_of(st.from_regex(r"[A-Za-z0-9_.\-/@+=:]{0,12}", fullmatch=True), values)


def expect_anarchon_error_or_success(make: Any) -> Any:
    try:
        return make()
    except AnarchonError:
        return None


@FUZZ
@given(
    kind=st.sampled_from([RedisBackend, ValkeyBackend]),
    connection=connections,
    strategy=strategies_like(),
    prefix=prefixes,
    extra=st.dictionaries(option_names, values, max_size=2),
    given_options=st.sets(st.sampled_from(["connection", "strategy", "prefix"])),
)
def test_backends_raise_nothing_but_anarchon_errors(
    kind: Any, connection: Any, strategy: Any, prefix: Any, extra: dict[str, Any], given_options: set[str]
) -> None:
    options = dict(extra)
    connection_option = "redis" if kind is RedisBackend else "valkey"
    for name, value in (("connection", connection), ("strategy", strategy), ("prefix", prefix)):
        if name in given_options:
            options[connection_option if name == "connection" else name] = value
    backend = expect_anarchon_error_or_success(lambda: kind(**options))
    if backend is not None:
        repr(backend)


@FUZZ
@given(kind=st.sampled_from([RedisBackend, ValkeyBackend]), connection=st.one_of(urls(), connection_options()))
def test_connection_urls_and_options_raise_nothing_but_anarchon_errors(kind: Any, connection: Any) -> None:
    option = "redis" if kind is RedisBackend else "valkey"
    backend = expect_anarchon_error_or_success(lambda: kind(**{option: connection}))
    if backend is not None:
        repr(backend)


@FUZZ
@given(
    options=st.dictionaries(
        st.one_of(
            st.sampled_from(
                [
                    "lease_ms",
                    "heartbeat_ms",
                    "history_size",
                    "history_ttl_ms",
                    "clock",
                    "instance_id",
                    "random",
                    "on_run_start",
                    "on_run_end",
                    "backend",
                ]
            ),
            option_names,
        ),
        st.one_of(values, st.integers(1, 100_000)),
        max_size=4,
    ),
    claim_only=st.booleans(),
)
def test_schedulers_raise_nothing_but_anarchon_errors(options: dict[str, Any], claim_only: bool) -> None:
    if "backend" not in options and claim_only:
        options["backend"] = RedisBackend(strategy="script")
    scheduler = expect_anarchon_error_or_success(lambda: Scheduler(**options))
    if scheduler is not None:
        repr(scheduler)


JOB_OPTIONS = ["overlap", "max_attempts", "catch_up_ms", "jitter_ms", "max_late_ms", "timezone"]
cron_fields = st.one_of(
    st.sampled_from(
        ["*", "*/5", "0", "1-5", "5-1", "*/0", "L", "W", "1W", "5L", "MON-FRI", "JAN", "?", "1#2", ",", "-"]
    ),
    st.integers(-1, 100).map(str),
    st.text(alphabet="*/-,0123456789LW#?", min_size=1, max_size=5),
)
crons = st.one_of(
    st.lists(cron_fields, min_size=4, max_size=7).map(" ".join),
    st.text(max_size=20),
    values,
)
functions = st.one_of(st.sampled_from([noop, takes_run, CallableObject(), print, len, int, lambda *a: None]), values)
job_options = st.dictionaries(
    # name, cron or func given twice is Python's own TypeError, raised before anarchon sees the call
    st.one_of(st.sampled_from(JOB_OPTIONS), option_names.filter(lambda n: n not in ("name", "cron", "func"))),
    st.one_of(values, st.integers(-10, 10**9), st.sampled_from(["UTC", "Europe/Berlin", "Europe", "Mars/Base"])),
    max_size=3,
)
names = st.one_of(st.from_regex(r"[A-Za-z0-9_.\-/@+=]{1,12}", fullmatch=True), values)


@FUZZ
@given(
    strategy=st.sampled_from(["lease", "stream-id", {"name": "script", "window_ms": 90_000}]),
    name=names,
    cron=crons,
    func=functions,
    options=job_options,
    decorator=st.booleans(),
)
def test_jobs_raise_nothing_but_anarchon_errors(
    strategy: Any, name: Any, cron: Any, func: Any, options: dict[str, Any], decorator: bool
) -> None:
    scheduler: Scheduler[Any] = Scheduler(RedisBackend(strategy=strategy))
    if decorator:
        expect_anarchon_error_or_success(lambda: scheduler.job(name, cron, **options)(func))
    else:
        expect_anarchon_error_or_success(lambda: scheduler.add_job(name, cron, func, **options))
    assert len(scheduler.jobs) <= 1


# --- valid input is accepted -------------------------------------------------------------------------------

# Where the zone database has them, "localtime" and "posixrules" name the machine's own zone, which is refused
ZONES = sorted(zoneinfo.available_timezones() - {"localtime", "posixrules"})
valid_names = st.from_regex(r"[A-Za-z0-9_.\-/@+=]{1,200}", fullmatch=True)
valid_prefixes = st.from_regex(r"[A-Za-z0-9_.\-/@+=:]{0,100}", fullmatch=True)


def valid_crons() -> st.SearchStrategy[str]:
    def field(low: int, high: int) -> st.SearchStrategy[str]:
        number = st.integers(low, high).map(str)
        span = st.tuples(st.integers(low, high), st.integers(low, high)).map(lambda t: f"{min(t)}-{max(t)}")
        step = st.integers(1, high - low + 1).map(lambda n: f"*/{n}")
        return st.one_of(st.just("*"), number, span, step)

    five = st.tuples(field(0, 59), field(0, 23), st.just("*"), field(1, 12), field(0, 6)).map(" ".join)
    six = st.tuples(field(0, 59), five).map(" ".join)
    return st.one_of(five, six)


def valid_urls() -> st.SearchStrategy[str]:
    user = st.one_of(st.just(""), st.from_regex(r"[a-z]{1,6}:[A-Za-z0-9]{1,8}@", fullmatch=True))
    host = st.sampled_from(["localhost", "127.0.0.1", "cache.internal", "[::1]"])
    port = st.one_of(st.just(""), st.integers(1, 65_535).map(lambda p: f":{p}"))
    db = st.one_of(st.just(""), st.integers(0, 15).map(lambda d: f"/{d}"))
    query = st.one_of(st.just(""), st.floats(0.1, 60).map(lambda t: f"?socket_timeout={t:.2f}"))
    scheme = st.sampled_from(["redis", "rediss"])
    return st.builds(lambda *p: "{}://{}{}{}{}{}".format(*p), scheme, user, host, port, db, query)


valid_options = st.fixed_dictionaries(
    {},
    optional={
        "host": st.sampled_from(["localhost", "cache"]),
        "port": st.integers(1, 65_535),
        "db": st.integers(0, 15),
        "username": st.text(string.ascii_letters, min_size=1, max_size=8),
        "password": st.text(min_size=1, max_size=20),
        "ssl": st.booleans(),
        "socket_timeout": st.floats(0.01, 3600),
        "socket_connect_timeout": st.integers(1, 60),
        "client_name": st.text(string.ascii_letters, min_size=1, max_size=8),
    },
)


@FUZZ
@given(
    kind=st.sampled_from([RedisBackend, ValkeyBackend]),
    connection=st.one_of(st.none(), valid_urls(), valid_options),
    strategy=st.sampled_from(
        [
            "lease",
            "stream-id",
            "script",
            {"name": "lease"},
            {"name": "stream-id"},
            {"name": "script", "window_ms": 3_600_000},
        ]
    ),
    prefix=valid_prefixes,
    lease_ms=st.integers(10, 86_400_000),
    history_size=st.integers(1, 1_000_000),
    name=valid_names,
    cron=valid_crons(),
    timezone=st.sampled_from(ZONES),
    jitter_ms=st.integers(0, 99_999),
    max_late_ms=st.integers(1_000, 200_000),  # with jitter_ms, within the script strategy's default window
    lease_job_options=st.fixed_dictionaries(
        {},
        optional={
            "overlap": st.booleans(),
            "max_attempts": st.integers(1, 100),
            "catch_up_ms": st.integers(0, 2_592_000_000),
        },
    ),
)
def test_valid_input_is_accepted(
    kind: Any,
    connection: Any,
    strategy: Any,
    prefix: str,
    lease_ms: int,
    history_size: int,
    name: str,
    cron: str,
    timezone: str,
    jitter_ms: int,
    max_late_ms: int,
    lease_job_options: dict[str, Any],
) -> None:
    backend = kind(**{"redis" if kind is RedisBackend else "valkey": connection}, strategy=strategy, prefix=prefix)
    leases = backend.leases
    scheduler: Scheduler[Any] = (
        Scheduler(backend, lease_ms=lease_ms, heartbeat_ms=max(1, lease_ms // 2), history_size=history_size)
        if leases
        else Scheduler(backend, history_size=history_size)
    )
    if backend.config.name == "stream-id":
        jitter_ms %= 1000  # less than any two slots are apart: stream-id refuses a jitter that could reorder claims
    options: dict[str, Any] = {"timezone": timezone, "jitter_ms": jitter_ms, "max_late_ms": max_late_ms}
    if leases:
        options.update(lease_job_options)
    scheduler.add_job(name, cron, noop, **options)
    assert scheduler.jobs == (name,)
    slot = scheduler._jobs[name].schedule.next_after(1_700_000_000_000)
    assert slot is not None
    assert slot > 1_700_000_000_000


def test_errors_name_the_option_and_keep_the_builtin_kinds() -> None:
    """The fuzz proves the root; these pin the builtins callers catch."""
    with pytest.raises(TypeError):
        Scheduler().add_job("a", "* * * * *", noop, retries=3)
    with pytest.raises(UnknownOptionError):
        Scheduler().add_job("a", "* * * * *", noop, retries=3)
    with pytest.raises(ConfigTypeError):
        Scheduler(random="seeded")
    with pytest.raises(ValueError, match="timezone"):
        Scheduler().add_job("a", "* * * * *", noop, timezone="Europe")
