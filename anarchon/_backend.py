"""RedisBackend and ValkeyBackend: where the store is, which strategy picks winners, and the key prefix.

The type parameter records whether the strategy gives leases (:class:`Leased`) or only claims
(:class:`ClaimOnly`), so that a :class:`~anarchon.Scheduler` can refuse lease options at type-check time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncIterator, Hashable, Mapping, Sequence
from typing import Any, Generic, Protocol, TypedDict, TypeVar, overload
from urllib.parse import unquote, urlsplit, urlunsplit

from ._adapters import ACL_KEYS_HINT, RedisPyAsync, adapt
from ._config import (
    STRATEGY_NAMES,
    VALKEY_STRATEGY_NAMES,
    ClaimOnlyStrategy,
    LeaseStrategy,
    StrategyConfig,
    ValkeyClaimOnlyStrategy,
    is_finite,
    parse_strategy,
    shown,
)
from ._errors import (
    ConfigError,
    ConfigTypeError,
    SchedulerStateError,
    StoreError,
    StoreFormatError,
    StoreReplyError,
    StoreUnavailableError,
    UnknownOptionError,
)
from ._keys import STORE_FORMAT, KeySpace, check_prefix
from ._store import Connection, Reply, Script, ServerInfo, Store, as_list, as_map, as_text
from ._strategies import Strategy, make_strategy

FORMAT = Script.load("format")
log = logging.getLogger("anarchon")
KEY_CHECK_JOBS = 16  # jobs whose keys start() tries for access, until one's answer: each a node that may be down
DEFAULT_URL = "redis://localhost:6379/0"
DEFAULT_TIMEOUT_S = 10.0  # for connections anarchon opens; a URL's query or the options dict can change it


class Leased:
    """Type marker: the backend's strategy (``lease``) gives the scheduler leases."""


class ClaimOnly:
    """Type marker: the backend's strategy only decides who runs each slot (no lease options)."""


M = TypeVar("M", Leased, ClaimOnly)


class RedisOptions(TypedDict, total=False):
    """Connection options for a client anarchon opens itself (redis-py, RESP2)."""

    host: str
    port: int
    db: int
    username: str | None
    password: str | None
    ssl: bool
    ssl_ca_certs: str | None
    ssl_certfile: str | None
    ssl_keyfile: str | None
    ssl_check_hostname: bool
    socket_timeout: float
    socket_connect_timeout: float
    client_name: str | None


_OPTION_TYPES: dict[str, type | tuple[type, ...]] = {
    "host": str,
    "port": int,
    "db": int,
    "username": str,
    "password": str,
    "ssl": bool,
    "ssl_ca_certs": str,
    "ssl_certfile": str,
    "ssl_keyfile": str,
    "ssl_check_hostname": bool,
    "socket_timeout": (int, float),
    "socket_connect_timeout": (int, float),
    "client_name": str,
}

# Settings whose None means "not set", as for redis-py: {"password": os.environ.get("REDIS_PASSWORD")}.
_UNSET_BY_NONE = ("username", "password", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "client_name")


class SupportsExecuteCommand(Protocol):
    """redis-py, valkey-py and fakeredis clients (sync, asyncio, cluster)."""

    def execute_command(self, *args: Any, **options: Any) -> Any: ...


class SupportsCustomCommand(Protocol):
    """Valkey GLIDE clients."""

    def custom_command(self, command_args: Any, /) -> Any: ...


class SupportsSend(Protocol):
    """Any client with ``send(command, args)`` returning the reply (or an awaitable of it)."""

    def send(self, command: str, args: list[str], /) -> Any: ...


ConnectionOption = str | RedisOptions | SupportsExecuteCommand | SupportsCustomCommand | SupportsSend


class RedisBackend(Generic[M]):
    """Claims runs in Redis 5+ (or Valkey) with one of four strategies; ``lease`` is the default."""

    _connection_option = "redis"
    _allowed_strategies: tuple[str, ...] = STRATEGY_NAMES

    @overload
    def __init__(
        self: RedisBackend[Leased],
        *,
        redis: ConnectionOption | None = None,
        strategy: LeaseStrategy = "lease",
        prefix: str = "cron:",
    ) -> None: ...

    @overload
    def __init__(
        self: RedisBackend[ClaimOnly],
        *,
        redis: ConnectionOption | None = None,
        strategy: ClaimOnlyStrategy,
        prefix: str = "cron:",
    ) -> None: ...

    def __init__(
        self, *, redis: object = None, strategy: object = "lease", prefix: object = "cron:", **unknown: object
    ) -> None:
        self._configure(redis, strategy, prefix, unknown)

    def _configure(self, connection: object, strategy: object, prefix: object, unknown: dict[str, object]) -> None:
        where = type(self).__name__
        for option in unknown:
            hint = ""
            if option in ("redis", "valkey"):
                hint = f"{where} takes its connection as {self._connection_option}="
            elif option in ("window_ms", "duration_sec", "max_size"):
                hint = f'strategy settings go inside the strategy: strategy={{"name": …, "{option}": …}}'
            raise UnknownOptionError(option, where, (self._connection_option, "strategy", "prefix"), hint)
        self.config: StrategyConfig = parse_strategy(strategy, self._allowed_strategies, where)
        self.keys = KeySpace(check_prefix(prefix))
        self.strategy: Strategy = make_strategy(self.config, self.keys)
        self._spec = _connection_spec(self._connection_option, connection)
        self._store: Store | None = None
        self._starting: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None  # see _start_lock
        self.server: ServerInfo | None = None
        # The started scheduler it serves. One at a time: stopping either of two would close the other's store.
        self.scheduler: object | None = None

    @property
    def leases(self) -> bool:
        return self.config.leases

    @property
    def started(self) -> bool:
        """Whether the backend's connection is open (between start() and stop())."""
        return self._store is not None

    @property
    def store(self) -> Store:
        if self._store is None:
            raise SchedulerStateError("the backend is not started: call start() (or use the scheduler)")
        return self._store

    def lane(self, job: str) -> Hashable:
        """The store node the job's keys are on (see :meth:`Store.lane`); None where the store is one node."""
        if not self.store.sharded:  # asked for every claim: no keys built for nothing
            return None
        return self.store.lane(self.keys.lease(job).state if self.leases else self.keys.claim(job).runs)

    async def start(self, jobs: Sequence[str] = ()) -> None:
        """Connect, detect the server, check the store format and prepare the strategy for ``jobs``."""
        async with self._start_lock():
            if self._store is not None:
                return
            store = _open(self._spec)
            try:
                self.server = await store.server_info()
                self.strategy.check_server(self.server)
                # Every strategy's scripts read the server's clock, but a lease claim that wins need not: a user
                # refused TIME would start, run its first run, and then have its heartbeats and result refused.
                await store.execute("TIME")
                await _check_format(store, self.keys.format)
                for job in jobs[:KEY_CHECK_JOBS]:  # the first whose keys answer (a cluster node may be down)
                    keys = self.keys.lease(job) if self.leases else self.keys.claim(job)
                    if await _check_key_access(store, keys.all(), self.keys.prefix):
                        break
                await _warn_of_other_strategies(store, self.keys, jobs, self.leases)
                if not self.leases:
                    await _warn_of_other_claim_only_strategies(store, self.keys, jobs, self.strategy.name, self.server)
                await store.load(self.strategy.scripts)  # before prepare's scripts, not answered NOSCRIPT
                await self.strategy.prepare(store, jobs)
            except BaseException:
                await store.close()
                raise
            self._store = store

    @contextlib.asynccontextmanager
    async def reading(self) -> AsyncIterator[Store]:
        """The store to read from: once started, the backend's own connection; before that, a connection of its
        own for the read, closed after it (a store whose format is newer than this code reads is refused, and
        nothing is written: a store with no format yet is one nobody wrote to)."""
        if self._store is not None:
            yield self._store
            return
        store = _open(self._spec)
        try:
            stored = await store.execute("GET", self.keys.format)
            if stored is not None:
                _refuse_newer_format(self.keys.format, stored)
            yield store
        finally:
            await store.close()

    def _start_lock(self) -> asyncio.Lock:
        """Two start() at once open one connection. One lock per event loop: a lock serves the loop it was first
        awaited on, and a backend may be started again on another (asyncio.run, a scheduler thread)."""
        loop = asyncio.get_running_loop()
        if self._starting is None or self._starting[0] is not loop:
            self._starting = (loop, asyncio.Lock())
        return self._starting[1]

    async def stop(self) -> None:
        """Close the connection if anarchon opened it; a client passed in is left open. Called while start()
        runs, it waits for the start to end, then closes."""
        async with self._start_lock():
            store, self._store = self._store, None
        if store is not None:
            await store.close()

    def drop(self) -> None:
        """Forget the connection without closing it: the event loop it was opened on has closed, and nothing can
        be sent or closed through it (its sockets close as it is collected). The next start() opens another."""
        self._store = None
        self.scheduler = None

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self._connection_option}={_describe(self._spec)}, "
            f"strategy={self.config!r}, prefix={self.keys.prefix!r})"
        )


class ValkeyBackend(RedisBackend[M]):
    """A RedisBackend for Valkey: the connection option is ``valkey``, and there is no ``idmp`` strategy."""

    _connection_option = "valkey"
    _allowed_strategies = VALKEY_STRATEGY_NAMES

    @overload
    def __init__(
        self: ValkeyBackend[Leased],
        *,
        valkey: ConnectionOption | None = None,
        strategy: LeaseStrategy = "lease",
        prefix: str = "cron:",
    ) -> None: ...

    @overload
    def __init__(
        self: ValkeyBackend[ClaimOnly],
        *,
        valkey: ConnectionOption | None = None,
        strategy: ValkeyClaimOnlyStrategy,
        prefix: str = "cron:",
    ) -> None: ...

    def __init__(
        self,
        *,
        valkey: object = None,
        strategy: object = "lease",
        prefix: object = "cron:",
        **unknown: object,
    ) -> None:
        self._configure(valkey, strategy, prefix, unknown)


# --- connections -------------------------------------------------------------------------------------------


def _connection_spec(option: str, value: object) -> str | dict[str, Any] | Connection:
    """Validate the connection option now, so a bad one fails when the backend is created."""
    if value is None:
        return DEFAULT_URL
    if isinstance(value, str):
        _check_url(option, value)
        return value
    if isinstance(value, Mapping):
        options = dict(value)
        for key, item in options.items():
            if key not in _OPTION_TYPES:
                raise UnknownOptionError(f"{option}.{key}", f"the {option} options", _OPTION_TYPES)
            expected = _OPTION_TYPES[key]
            if item is None and key in _UNSET_BY_NONE:
                continue
            if (isinstance(item, bool) and expected is not bool) or not isinstance(item, expected):
                raise ConfigTypeError(f"{option}.{key}", f"has type {type(item).__name__}", _type_name(expected))
            problem = _value_problem(key, item)
            if problem:
                raise ConfigError(f"{option}.{key}", problem, _VALUE_RULES[key])
        return options
    try:
        return adapt(value)
    except ConfigTypeError as error:
        raise ConfigTypeError(option, error.problem, error.allowed) from None


_URL_RULE = "redis://[user:password@]host[:port][/db][?option=value], rediss://… (TLS) or unix://path"
_VALUE_RULES = {
    "port": "1..65535",
    "db": "0..2147483647 (below the server's `databases` setting, 16 by default)",
    "socket_timeout": "a finite number of seconds above 0",
    "socket_connect_timeout": "a finite number of seconds above 0",
    "health_check_interval": "a finite number of seconds, 0 (none) or more",
}


def _value_problem(key: str, value: object) -> str | None:
    """What is wrong with a connection setting whose type is right (None: nothing)."""
    if not isinstance(value, int | float) or key not in _VALUE_RULES:
        return None
    if key == "port":
        ok = 1 <= value <= 65_535
    elif key == "db":
        ok = 0 <= value <= 2**31 - 1  # what the server's SELECT reads
    elif key == "health_check_interval":  # redis-py takes a negative one, then fails at the first command
        ok = value >= 0 and is_finite(value)
    else:
        ok = value > 0 and is_finite(value)
    return None if ok else f"{shown(value)} is out of range"


def _check_url(option: str, url: str) -> None:
    """Let redis-py read the URL now (without connecting), so that a bad one fails here and not at start()."""
    import redis.asyncio

    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError as error:
        raise ConfigError(option, f"the URL cannot be read ({error})", _URL_RULE) from None
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise ConfigError(option, f"URL scheme {parts.scheme!r} is not supported", "redis://, rediss://, unix://")
    if parts.scheme != "unix" and "@" in parts.path + parts.query + parts.fragment:
        # A password with a "/", "?" or "#" ends the host part early: the rest of it would be read as the port or
        # the database, and quoted in the message. Nothing of the URL is quoted.
        raise ConfigError(
            option, "the URL has an '@' past its host part (a user or password holding '/', '?' or '#'?)",
            "those characters percent-encoded in the user and password (%2F, %3F, %23), and '@' elsewhere (%40)",
        )  # fmt: skip
    try:
        pool = redis.asyncio.ConnectionPool.from_url(url, **_client_settings())
        pool.make_connection()  # type: ignore[no-untyped-call]  # unknown query options are refused here
    except Exception as error:  # ValueError (port, db, values), TypeError (unknown option), RedisError (TLS flags)
        text = str(error)
        for secret in {password, unquote(password)} if password else ():  # as written, and as redis-py reads it
            text = text.replace(secret, "***")
        raise ConfigError(option, f"the URL cannot be used ({text})", _URL_RULE) from None
    if parts.scheme != "unix":  # what redis-py reads silently as something else: port 0 as 6379, database 0
        database = unquote(parts.path).strip("/")
        if database and not database.isdigit():
            raise ConfigError(
                option, f"the URL's database {database!r} is not a database number", f"db {_VALUE_RULES['db']}"
            )
        if parts.port == 0:
            raise ConfigError(option, "the URL's port: 0 is out of range", f"port {_VALUE_RULES['port']}")
    if str(pool.connection_kwargs.get("protocol", 2)) != "2":
        raise ConfigError(option, "the URL's protocol: anarchon's own connections speak RESP2", "protocol 2, or none")
    for key, value in pool.connection_kwargs.items():
        problem = _value_problem(key, value)
        if problem:
            raise ConfigError(option, f"the URL's {key}: {problem}", f"{key} {_VALUE_RULES[key]}")


def _type_name(expected: type | tuple[type, ...]) -> str:
    types = expected if isinstance(expected, tuple) else (expected,)
    return " or ".join(t.__name__ for t in types)


def _open(spec: str | dict[str, Any] | Connection) -> Store:
    if isinstance(spec, str | dict):
        import redis.asyncio

        settings = _client_settings()
        if isinstance(spec, str):
            client = redis.asyncio.Redis.from_url(spec, **settings)  # the URL's query wins
        else:
            client = redis.asyncio.Redis(**{**settings, **spec})
        return Store(RedisPyAsync(client), owned=True)
    return Store(spec, owned=False)


def _client_settings() -> dict[str, Any]:
    """How anarchon opens its own connections; a URL's query or the options dict may change the timeouts.

    RESP2: Redis 5 refuses HELLO 3, and every reply shape anarchon reads is RESP2's. Timeouts: a store that stops
    answering must surface as an error (retried, logged), never as a scheduler that hangs. No client retries
    (redis-py's default for clients built from options is ten, each waiting a timeout): a command fails after one
    timeout, and the scheduler retries what is safe to retry (claims with their tokens, results).
    """
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    return {
        "protocol": 2,
        "socket_timeout": DEFAULT_TIMEOUT_S,
        "socket_connect_timeout": DEFAULT_TIMEOUT_S,
        "retry": Retry(NoBackoff(), 0),
    }


_QUERY_PASSWORD = re.compile(r"([?&]password=)[^&#]*")


def _describe(spec: str | dict[str, Any] | Connection) -> str:
    """The connection for reprs and logs, with any password masked."""
    if isinstance(spec, str):
        parts = urlsplit(spec)
        if parts.password is not None:
            host = parts.netloc.rpartition("@")[2]
            spec = urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))
        return repr(_QUERY_PASSWORD.sub(r"\1***", spec))  # unix://path?password=… is the usual form there
    if isinstance(spec, dict):
        return repr({k: ("***" if k == "password" else v) for k, v in spec.items()})
    client = getattr(spec, "client", spec)
    return f"<{type(client).__module__}.{type(client).__name__}>"


async def _check_key_access(store: Store, keys: Sequence[str], prefix: str) -> bool:
    """An ACL user whose key patterns miss a job's keys (the lease keys begin with "{", for their hash tag) would
    start, then have every claim refused and retried for ever. One job's keys are tried at start instead: jobs'
    keys differ only by the job's name. False when they could not be reached (their cluster node is down)."""
    try:
        replies = await store.execute_many([("EXISTS", key) for key in keys])
    except StoreUnavailableError:
        return False
    for key, reply in zip(keys, replies, strict=True):
        if isinstance(reply, StoreReplyError) and reply.reply.startswith("NOPERM"):
            raise StoreReplyError(
                f"{reply.reply.removesuffix(ACL_KEYS_HINT)} ({key}): allow this user the prefix's keys in both forms "
                "anarchon uses: "
                f"~{prefix}* ~{{{prefix}*"
            )
        if isinstance(reply, StoreReplyError):
            raise reply
    return not any(isinstance(reply, StoreUnavailableError) for reply in replies)


async def _warn_of_other_strategies(store: Store, keys: KeySpace, jobs: Sequence[str], leases: bool) -> None:
    """Instances that share a prefix must share a strategy: lease keeps a job's runs in keys of its own, the
    claim-only strategies in others, and instances of each would claim and run every slot, once each. Said (not
    refused: the keys outlive the instances that wrote them) when a job's keys of the other kind are there."""
    # The claim-only strategies' keys have no hash tag: one EXISTS each (a cluster would refuse them together).
    others = [(job, key) for job in jobs for key in _written_by_the_others(keys, job, leases)]
    if not others:
        return
    try:
        replies = await store.execute_many([("EXISTS", key) for _, key in others])
    except StoreError:
        return  # the key check above has said what it could: nothing more to learn here
    found = list(dict.fromkeys(job for (job, _), reply in zip(others, replies, strict=True) if reply == 1))
    if found:
        other = "a claim-only strategy (stream-id, idmp or script)" if leases else "the lease strategy"
        log.warning(
            "%d jobs (%s) have keys of %s under the prefix %r: instances that still run it would run each of their "
            "slots once more beside these. Give each strategy a prefix of its own (switching strategies takes a new "
            "prefix)", len(found), ", ".join(found[:5]) + (", …" if len(found) > 5 else ""), other, keys.prefix,
        )  # fmt: skip


# Per claim-only strategy, the others whose claims it can tell in a job's runs stream.
_TELLS_CLAIMS_OF = {"stream-id": "script or idmp", "idmp": "stream-id or script", "script": "idmp"}


async def _warn_of_other_claim_only_strategies(
    store: Store, keys: KeySpace, jobs: Sequence[str], strategy: str, server: ServerInfo
) -> None:
    """The claim-only strategies share a job's runs stream, but none sees all of another's claims there: idmp sees
    only those added with IDMP, and the others none of its; stream-id's entry for a slot goes in only above every
    entry there, so that a script claim made early (its instance's clock ahead) leaves the slot to stream-id as
    well. Instances of two of them would run some slots once each. Said when a job's stream shows the others'
    entries: the server counts a stream's entries and those added with IDMP (every one of a stream idmp made,
    see idmp_configure.lua), and stream-id's entries alone have their slot as their ID. Script cannot tell
    stream-id's entries from its own made at the slot's very ms."""
    if strategy == "script" and not server.has_idmp:
        return
    try:
        replies = await store.execute_many([("XINFO", "STREAM", keys.claim(job).runs) for job in jobs])
    except StoreError:
        return
    found = []
    for job, reply in zip(jobs, replies, strict=True):
        if isinstance(reply, StoreError):
            continue  # no stream yet ("no such key"), or its node is out of reach: nothing to learn
        info = as_map(reply)
        if server.has_idmp:
            added, with_idmp = int(as_text(info["entries-added"])), int(as_text(info["iids-added"]))
            if (added > with_idmp) if strategy == "idmp" else with_idmp > 0:
                found.append(job)
                continue
        if strategy == "stream-id" and any(
            entry is not None and _not_at_its_slot(entry) for entry in (info.get("first-entry"), info.get("last-entry"))
        ):
            found.append(job)
    if found:
        log.warning(
            "%d jobs (%s) have runs claimed by %s under the prefix %r: claim-only strategies do not see all of each "
            "other's claims, and instances of each would run some slots once each. Give each strategy a prefix of "
            "its own", len(found), ", ".join(found[:5]) + (", …" if len(found) > 5 else ""),
            _TELLS_CLAIMS_OF[strategy], keys.prefix,
        )  # fmt: skip


def _not_at_its_slot(entry: Reply) -> bool:
    """Whether a runs entry's ID is other than its slot's, as stream-id writes every one."""
    entry_id, fields = as_list(entry, 2)
    return as_text(entry_id) != f"{as_text(as_map(fields).get('slot', ''))}-0"


def _written_by_the_others(keys: KeySpace, job: str, leases: bool) -> tuple[str, ...]:
    """The keys the other kind of strategy writes for a job's first claim, scheduled or manual."""
    if leases:
        claim = keys.claim_unkept(job)
        return claim.runs, claim.results
    return (keys.lease(job).state,)


async def _check_format(store: Store, key: str) -> None:
    _refuse_newer_format(key, await store.run(FORMAT, (key,), (STORE_FORMAT,)))


def _refuse_newer_format(key: str, stored: Reply) -> None:
    text = as_text(stored)
    if not (text.isascii() and text.isdigit()) or int(text) > STORE_FORMAT:  # "²" is a digit to isdigit()
        raise StoreFormatError(key, text, STORE_FORMAT)
