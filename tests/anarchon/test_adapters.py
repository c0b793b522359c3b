"""Every recognised client drives the same backend against a real server: redis-py and valkey-py (asyncio, sync,
cluster), Valkey GLIDE (standalone and cluster), and plain ``send(command, args)`` objects (async or not, over
redis-py or over a client of their own whose server errors are its own exceptions, raised or returned)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import inspect
import itertools
import logging
import tempfile
import threading
import time
import warnings
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import fakeredis
import pytest
import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.backoff
import redis.cluster
import redis.retry
import valkey
import valkey.asyncio
import valkey.asyncio.cluster
import valkey.cluster
import valkey.exceptions
from glide import (
    CircuitBreakerError,
    ProtocolVersion,
    RequestError,
)
from redis._parsers import _AsyncHiredisParser, _AsyncRESP2Parser, _HiredisParser, _RESP2Parser
from redis.crc import key_slot

from anarchon import (
    ConfigTypeError,
    RedisBackend,
    RunRecord,
    Scheduler,
    SchedulerStateError,
    StoreError,
    StoreReplyError,
    StoreUnavailableError,
    ValkeyBackend,
)
from anarchon._adapters import RedisPyAsync, RedisPyCluster, SendAdapter, _same_primaries, adapt, pack, translate
from anarchon._keys import KeySpace
from anarchon._store import CLOSE_WAIT_S, Command, Connection, Reply, Script, ScriptCall, ServerInfo, Store
from anarchon._strategies import Claim, JobPolicy, Outcome, RunRequest
from anarchon._strategies.lease import LeaseStrategy
from anarchon._strategies.stream_id import StreamIdStrategy
from sim.servers import RunningServer, start_server
from sim.servers.testing import ServerPool, ServerUnderTest, flush
from tests.support import close_client, eventually, glide, jobs_on_every_shard

SLOT = 1_700_000_000_000


class SendClient:
    """The smallest client anarchon accepts: ``send(command, args)`` returning the reply."""

    def __init__(self, server: RunningServer) -> None:
        self.client = redis.asyncio.Redis(host=server.host, port=server.port, protocol=2)
        self.sent: list[str] = []

    async def send(self, command: str, args: list[str]) -> Any:
        self.sent.append(command)
        return await self.client.execute_command(command.encode(), *args)

    async def close(self) -> None:
        await self.client.aclose()


class SyncSendClient:
    """``send`` as a plain function returning the reply itself (a blocking redis-py client underneath)."""

    def __init__(self, server: RunningServer) -> None:
        self.client = redis.Redis(host=server.host, port=server.port, protocol=2)

    def send(self, command: str, args: list[str]) -> Any:
        return self.client.execute_command(command.encode(), *args)

    def close(self) -> None:
        self.client.close()


class RespError(Exception):
    """How a client of its own reports a server error: its own class, the server's reply text as message."""


class RespSendClient:
    """A minimal RESP2 client that is neither redis-py nor valkey-py: a server error comes back as a RespError,
    raised or returned as the reply."""

    def __init__(self, server: RunningServer, *, raise_errors: bool) -> None:
        self.address = (server.host, server.port)
        self.raise_errors = raise_errors
        self.streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self.lock = asyncio.Lock()

    async def send(self, command: str, args: list[str]) -> Any:
        async with self.lock:
            if self.streams is None:
                self.streams = await asyncio.open_connection(*self.address)
            reader, writer = self.streams
            parts = [command, *args]
            writer.write(b"*%d\r\n" % len(parts))
            for part in parts:
                data = part.encode()
                writer.write(b"$%d\r\n%b\r\n" % (len(data), data))
            await writer.drain()
            reply = await self.read(reader)
        if isinstance(reply, RespError) and self.raise_errors:
            raise reply
        return reply

    async def read(self, reader: asyncio.StreamReader) -> Any:
        line = (await reader.readline())[:-2]
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest.decode()
        if kind == b"-":
            return RespError(rest.decode())
        if kind == b":":
            return int(rest)
        if kind == b"$":
            return None if int(rest) < 0 else (await reader.readexactly(int(rest) + 2))[:-2]
        if kind == b"*":
            return None if int(rest) < 0 else [await self.read(reader) for _ in range(int(rest))]
        raise AssertionError(f"cannot read {line!r}")

    async def close(self) -> None:
        if self.streams is not None:
            self.streams[1].close()
            await self.streams[1].wait_closed()


ClientOnServer = tuple[str, Any, RunningServer]  # the client's name in CLIENTS, the client, its server
CLIENTS: dict[str, tuple[bool, Callable[[RunningServer], Any]]] = {  # name: (cluster server?, factory)
    "redis-py-asyncio": (False, lambda s: redis.asyncio.Redis(host=s.host, port=s.port, protocol=2)),
    "redis-py-sync": (False, lambda s: redis.Redis(host=s.host, port=s.port, protocol=2)),
    # redis-py reads replies with hiredis where it is installed (as in the dev set), else with its own parser.
    "redis-py-asyncio-python-parser": (
        False,
        lambda s: redis.asyncio.Redis.from_url(s.url(), protocol=2, parser_class=_AsyncRESP2Parser),
    ),
    "redis-py-sync-python-parser": (
        False,
        lambda s: redis.Redis.from_url(s.url(), protocol=2, parser_class=_RESP2Parser),
    ),
    "valkey-py-asyncio": (False, lambda s: valkey.asyncio.Valkey(host=s.host, port=s.port, protocol=2)),
    "valkey-py-sync": (False, lambda s: valkey.Valkey(host=s.host, port=s.port, protocol=2)),
    "glide": (False, glide(cluster=False, protocol=ProtocolVersion.RESP2)),
    "send": (False, SendClient),
    "send-sync": (False, SyncSendClient),
    "send-own-errors-raised": (False, lambda s: RespSendClient(s, raise_errors=True)),
    "send-own-errors-returned": (False, lambda s: RespSendClient(s, raise_errors=False)),
    "redis-py-asyncio-cluster": (
        True,
        lambda s: redis.asyncio.cluster.RedisCluster(host=s.host, port=s.port, protocol=2),
    ),
    "redis-py-sync-cluster": (True, lambda s: redis.cluster.RedisCluster(host=s.host, port=s.port, protocol=2)),
    "valkey-py-asyncio-cluster": (
        True,
        lambda s: valkey.asyncio.cluster.ValkeyCluster(host=s.host, port=s.port, protocol=2),
    ),
    "valkey-py-sync-cluster": (True, lambda s: valkey.cluster.ValkeyCluster(host=s.host, port=s.port, protocol=2)),
    "glide-cluster": (True, glide(cluster=True, protocol=ProtocolVersion.RESP2)),
    # RESP3, the default of redis-py 8 and GLIDE: maps where RESP2 sends flat arrays (Redis 6 and later).
    "redis-py-asyncio-resp3": (False, lambda s: redis.asyncio.Redis(host=s.host, port=s.port, protocol=3)),
    "redis-py-sync-resp3": (False, lambda s: redis.Redis(host=s.host, port=s.port, protocol=3)),
    "glide-resp3": (False, glide(cluster=False, protocol=ProtocolVersion.RESP3)),
    "redis-py-asyncio-cluster-resp3": (
        True,
        lambda s: redis.asyncio.cluster.RedisCluster(host=s.host, port=s.port, protocol=3),
    ),
    "glide-cluster-resp3": (True, glide(cluster=True, protocol=ProtocolVersion.RESP3)),
}


# The resharding and failover tests start servers of their own: they run with the RESP2 cluster clients only (the
# RESP3 ones, whose replies differ only in shape, run the strategy and cluster batch tests).
RESP2_CLUSTER_CLIENTS = [name for name, (cluster, _) in CLIENTS.items() if cluster and not name.endswith("-resp3")]


async def _client(name: str, running: RunningServer) -> Any:
    """A new client of CLIENTS[name] on the server (an asyncio cluster client awaited: it reads the map of slots)."""
    if name.endswith("-resp3") and running.target == "redis-5":
        pytest.skip("RESP3 needs Redis 6 or later (HELLO 3); redis-5 speaks RESP2 only")
    made = CLIENTS[name][1](running)
    return await made if inspect.isawaitable(made) else made


@contextlib.asynccontextmanager
async def _opened(name: str, real_server: ServerUnderTest, server_pool: ServerPool) -> AsyncIterator[ClientOnServer]:
    cluster = CLIENTS[name][0]
    running = server_pool.get(real_server.target, cluster=True) if cluster else real_server.running
    assert running is not None
    if cluster:
        flush(running)
    client = await _client(name, running)
    try:
        yield name, client, running
    finally:
        await close_client(client)


@pytest.fixture(params=list(CLIENTS))
async def client_on_server(
    request: pytest.FixtureRequest, real_server: ServerUnderTest, server_pool: ServerPool
) -> AsyncIterator[ClientOnServer]:
    async with _opened(request.param, real_server, server_pool) as opened:
        yield opened


@pytest.fixture(params=[name for name, (cluster, _) in CLIENTS.items() if cluster])
async def cluster_client(
    request: pytest.FixtureRequest, real_server: ServerUnderTest, server_pool: ServerPool
) -> AsyncIterator[ClientOnServer]:
    async with _opened(request.param, real_server, server_pool) as opened:
        yield opened


def test_a_command_is_packed_as_resp_bulk_strings_whatever_its_arguments() -> None:
    """ASCII text and ints take a faster path than bytes, floats and other text: the bytes must come out alike
    (a length counted in characters would cut a non-ASCII argument short)."""
    assert pack(("SET", "k", 10, -1)) == b"*4\r\n$3\r\nSET\r\n$1\r\nk\r\n$2\r\n10\r\n$2\r\n-1\r\n"
    assert pack(("SET", "\u00e9", b"\xff\r\n", 1.5, True)) == (
        b"*5\r\n$3\r\nSET\r\n$2\r\n\xc3\xa9\r\n$3\r\n\xff\r\n\r\n$3\r\n1.5\r\n$4\r\nTrue\r\n"
    )
    assert (
        pack(("SET", "k", "\u00e9t\u00e9")) == b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$5\r\n\xc3\xa9t\xc3\xa9\r\n"
    )  # text only
    assert pack(("PING",)) == b"*1\r\n$4\r\nPING\r\n"


async def test_both_reply_parsers_of_redis_py_are_covered() -> None:
    """The default redis-py clients read replies with hiredis (in the dev set, as ``anarchon[hiredis]`` installs
    it); the *-python-parser clients with redis-py's own parser, which apps without hiredis use."""
    assert redis.asyncio.connection.DefaultParser is _AsyncHiredisParser
    assert redis.connection.DefaultParser is _HiredisParser
    stand_in = cast(RunningServer, type("Unreachable", (), {"url": lambda self: "redis://127.0.0.1:1"})())
    own_async = CLIENTS["redis-py-asyncio-python-parser"][1](stand_in)
    own_sync = CLIENTS["redis-py-sync-python-parser"][1](stand_in)
    try:
        assert own_async.connection_pool.connection_kwargs["parser_class"] is _AsyncRESP2Parser
        assert own_sync.connection_pool.connection_kwargs["parser_class"] is _RESP2Parser
    finally:
        await own_async.aclose()
        own_sync.close()


def req(slot: int, token: str) -> RunRequest:
    return RunRequest("sync", str(slot), slot, token, f"runner-{token}")


async def test_every_client_drives_the_lease_strategy(client_on_server: ClientOnServer) -> None:
    name, client, running = client_on_server
    backend = RedisBackend(redis=client, prefix=f"{name}:")
    await backend.start(["sync"])
    assert backend.server is not None
    assert backend.server.kind == ("valkey" if running.is_valkey else "redis")
    assert ".".join(map(str, backend.server.version)) == running.version
    store, strategy = backend.store, backend.strategy
    policy = JobPolicy(lease_ms=5_000, overlap=True)

    # A batch of claims in one round trip, answered in order.
    claims = await strategy.claim(store, [(req(SLOT, "a"), policy), (req(SLOT + 1000, "a"), policy)])
    assert [c.outcome for c in claims if isinstance(c, Claim)] == [Outcome.WON, Outcome.WON]
    [backup] = await strategy.claim(store, [(req(SLOT, "b"), policy)])
    assert isinstance(backup, Claim)
    assert backup.outcome is Outcome.RUNNING
    first = claims[0]
    assert isinstance(first, Claim)

    # Scripts evicted or lost (a restart, a promoted replica): reloaded without the caller noticing.
    await store.execute("SCRIPT", "FLUSH")
    assert await strategy.heartbeat(store, req(SLOT, "a"), policy) == 5_000
    await store.execute("SCRIPT", "FLUSH")
    [again] = await strategy.claim(store, [(req(SLOT, "c"), policy)])
    assert isinstance(again, Claim)
    assert again.outcome is Outcome.RUNNING

    record = RunRecord(
        job="sync", run=str(SLOT), slot=SLOT, attempt=1, status="ok", runner="runner-a", token="a",
        fence=first.fence, manual=False, started=SLOT, ended=SLOT + 5,
    )  # fmt: skip
    assert await strategy.finish(store, req(SLOT, "a"), first, policy, record)
    [history] = await strategy.history(store, "sync", 5)
    assert (history.slot, history.status, history.token) == (SLOT, "ok", "a")

    await backend.stop()  # the client was passed in: it stays open
    with pytest.raises(StoreUnavailableError, match="closed"):  # though the backend's store sends nothing more
        await store.execute("PING")
    again = Store(adapt(client), owned=False)
    assert await RedisBackend(redis=client, prefix=f"{name}:").strategy.history(again, "sync", 1)


@contextlib.contextmanager
def _info_refused_to_default_user(running: RunningServer) -> Iterator[None]:
    """The default user (every client of these tests) refused INFO on each primary, for the block."""
    shards = running.shards or ((running.host, running.port),)
    admins = [redis.Redis(host=host, port=port, protocol=2) for host, port in shards]
    try:
        for admin in admins:
            admin.execute_command("ACL", "SETUSER", "default", "-info")
        yield
    finally:
        for admin in admins:
            admin.execute_command("ACL", "SETUSER", "default", "+@all")
            admin.close()


async def test_a_user_refused_info_is_detected_through_hello(client_on_server: ClientOnServer) -> None:
    """INFO is in the ACL category @dangerous, which locked-down users lack: the server is then read from HELLO
    (which no ACL refuses)."""
    name, client, running = client_on_server
    if running.target == "redis-5":
        pytest.skip("Redis 5 has no ACL: every client may send INFO (one without INFO is tested below)")
    with _info_refused_to_default_user(running):
        backend = RedisBackend(redis=client, prefix=f"{name}:")
        await backend.start(["sync"])
        assert backend.server is not None
        assert backend.server.kind == ("valkey" if running.is_valkey else "redis")
        assert ".".join(map(str, backend.server.version)) == running.version
        [claim] = await backend.strategy.claim(backend.store, [(req(SLOT, "a"), JobPolicy(lease_ms=5_000))])
        assert isinstance(claim, Claim)
        assert claim.outcome is Outcome.WON
        await backend.stop()


async def test_a_resp3_client_starts_where_the_server_speaks_it_and_is_told_to_speak_resp2_where_not(
    real_server: ServerUnderTest,
) -> None:
    """redis-py 8 opens a RESP3 connection with HELLO 3, which Redis 5 does not know: every command fails, and the
    start says what to change (it said to allow the user INFO or HELLO, an ACL matter Redis 5 does not have)."""
    running = real_server.running
    client = redis.asyncio.Redis(host=running.host, port=running.port, protocol=3)
    backend = RedisBackend(redis=client)
    try:
        if running.target == "redis-5":
            with pytest.raises(StoreReplyError, match=r"speaks RESP3 .*create the client with protocol=2"):
                await backend.start(["sync"])
        else:
            await backend.start(["sync"])
            assert backend.server is not None
            assert ".".join(map(str, backend.server.version)) == running.version
            await backend.stop()
    finally:
        await client.aclose()


@pytest.mark.parametrize("strategy", ["lease", "stream-id"])
async def test_an_acl_user_without_the_lease_keys_pattern_is_refused_at_start(
    real_server: ServerUnderTest, strategy: str
) -> None:
    """Lease keys begin with "{" (their hash tag): a user allowed only ``~cron:*`` used to start, then have every
    claim refused and retried for ever. The start is refused, naming the patterns to allow; the claim-only
    strategies' keys are all ``cron:…``."""
    running = real_server.running
    if running.target == "redis-5":
        pytest.skip("Redis 5 has no ACL")
    admin = real_server.client()
    admin.execute_command("ACL", "SETUSER", "narrow", "reset", "on", ">pw", "~cron:*", "+@all")
    try:
        scheduler = Scheduler(
            RedisBackend(redis=f"redis://narrow:pw@{running.host}:{running.port}/0", strategy=strategy)
        )
        scheduler.add_job("sync", "0 0 1 1 *", lambda: None)
        if strategy == "lease":
            with pytest.raises(StoreReplyError, match=r"^NOPERM .*\(\{cron:sync\}:state\).* ~cron:\* ~\{cron:\*$"):
                await scheduler.start()
            assert not scheduler.backend.started
            return
        async with scheduler:
            assert (await scheduler.run_now("sync")).status == "ok"
    finally:
        admin.execute_command("ACL", "DELUSER", "narrow")


@pytest.mark.parametrize("strategy", ["lease", "stream-id"])
async def test_an_acl_user_refused_time_is_refused_at_start(real_server: ServerUnderTest, strategy: str) -> None:
    """A lease claim that wins reads no clock: a user refused TIME started, ran its first run, then had its
    heartbeats and its result refused (the run left holding the job), and every later claim. The start is
    refused, saying what to allow, before anything is written."""
    running = real_server.running
    if running.target == "redis-5":
        pytest.skip("Redis 5 has no ACL")
    admin = real_server.client()
    admin.execute_command("ACL", "SETUSER", "timeless", "reset", "on", ">pw", "~*", "+@all", "-time")
    try:
        url = f"redis://timeless:pw@{running.host}:{running.port}/0"
        scheduler = Scheduler(RedisBackend(redis=url, strategy=strategy, prefix="timeless:"))
        scheduler.add_job("sync", "0 0 1 1 *", lambda: None)
        with pytest.raises(StoreReplyError, match=r"^NOPERM .*'time'.* \+info \+time, as README"):
            await scheduler.start()
        assert not scheduler.backend.started
        assert admin.keys("*timeless:*") == []
    finally:
        admin.execute_command("ACL", "DELUSER", "timeless")


class InfoRenamed(SendClient):
    """A client of a server where INFO was renamed away (``rename-command``, a hardening older than ACLs): its
    INFO reaches the server under a name the server does not know."""

    async def send(self, command: str, args: list[str]) -> Any:
        return await super().send("INFO_RENAMED" if command == "INFO" else command, args)


async def test_a_server_without_info_is_read_from_hello_or_says_what_to_allow(real_server: ServerUnderTest) -> None:
    """Redis 6.2+ and Valkey are read from HELLO; Redis 5 has no HELLO, and the start fails saying so, having
    written nothing."""
    client = InfoRenamed(real_server.running)
    backend = RedisBackend(redis=client, prefix="renamed:")
    try:
        if real_server.target == "redis-5":
            with pytest.raises(StoreReplyError, match=r"^ERR unknown command .INFO.*; ERR unknown command .HELLO"):
                await backend.start(["sync"])
            assert not backend.started
            assert client.sent == ["INFO_RENAMED", "HELLO"]
            assert real_server.client().keys("renamed:*") == []
            return
        await backend.start(["sync"])
        running = real_server.running
        assert str(backend.server) == f"{'Valkey' if running.is_valkey else 'Redis'} {running.version}"
        await backend.stop()
    finally:
        await client.close()


@pytest.mark.parametrize("strategy", ["stream-id", "script", "idmp"])
async def test_every_client_drives_the_claim_only_strategies(
    client_on_server: ClientOnServer, strategy: str, caplog: pytest.LogCaptureFixture
) -> None:
    name, client, running = client_on_server
    if strategy == "idmp" and (running.is_valkey or running.version_info[:2] < (8, 6)):
        pytest.skip(f"idmp needs XADD IDMP (Redis 8.6 or later); {running.target} has none")
    policy = JobPolicy(history_size=100)
    claims = []
    # Two instances, one after the other: the second starts on a job stream that holds entries (it reads XINFO
    # STREAM, a map under RESP3, for claims of other strategies, and idmp its settings), and reads the first one's
    # entry back to lose.
    for token in ("a", "b"):
        backend = RedisBackend(redis=client, prefix=f"{name}:", strategy=strategy)
        await backend.start(["sync"])
        [claim] = await backend.strategy.claim(backend.store, [(req(SLOT, token), policy)])
        assert isinstance(claim, Claim), claim
        claims.append(claim)
        if claim.outcome is Outcome.WON:
            record = RunRecord(
                job="sync", run=str(SLOT), slot=SLOT, attempt=1, status="ok", runner=f"runner-{token}", token=token,
                fence=claim.fence, manual=False, started=SLOT, ended=SLOT + 5,
            )  # fmt: skip
            assert await backend.strategy.finish(backend.store, req(SLOT, token), claim, policy, record)
        history = await backend.strategy.history(backend.store, "sync", 5)
        await backend.stop()
    assert [c.outcome for c in claims] == [Outcome.WON, Outcome.LOST]
    assert [(h.slot, h.status, h.token) for h in history] == [(SLOT, "ok", "a")]
    assert [r.getMessage() for r in caplog.records if r.module == "_backend"] == []  # its own claims, not another's


async def test_every_cluster_client_queues_commands_per_primary(cluster_client: ClientOnServer) -> None:
    """Once started, the store's lanes (one queue per node) are the cluster's primaries: keys on one primary share
    a lane, keys on two do not. GLIDE keeps its map of slots to itself: anarchon reads one for it."""
    name, client, running = cluster_client
    backend = RedisBackend(redis=client, prefix=f"{name}:")
    await backend.start(["sync"])
    keys = [f"{{k{index}}}" for index in range(300)]
    lanes = {key: backend.store.lane(key) for key in keys}
    assert None not in lanes.values()
    assert len({(running.shard_of(key), lanes[key]) for key in keys}) == len(running.shards) == 3
    assert len(set(lanes.values())) == 3
    await backend.stop()


async def test_start_caches_the_scripts_on_every_primary(cluster_client: ClientOnServer) -> None:
    """So that the first claims of a burst are not answered NOSCRIPT by the primaries that were not asked."""
    name, client, running = cluster_client
    backend = RedisBackend(redis=client, prefix=f"{name}:")
    await backend.start(["sync"])
    shas = [script.sha for script in backend.strategy.scripts]
    for node in running.shards:
        admin = redis.Redis(*node, protocol=2)
        try:
            assert admin.script_exists(*shas) == [True] * len(shas), node
        finally:
            admin.close()
    await backend.stop()


class _CountedRoundTrips:
    """A connection that counts what it sends: one command, or a pipeline."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.round_trips = 0

    def lane(self, key: Any) -> Any:
        return self.inner.lane(key)

    async def execute(self, command: Command) -> Reply:
        self.round_trips += 1
        return cast(Reply, await self.inner.execute(command))

    async def execute_many(self, commands: Sequence[Command]) -> list[Reply | StoreError]:
        self.round_trips += 1
        return cast(list[Reply | StoreError], await self.inner.execute_many(commands))

    async def server_info(self) -> ServerInfo:
        return cast(ServerInfo, await self.inner.server_info())

    async def close(self) -> None:
        await self.inner.close()


async def test_a_cluster_whose_primaries_all_lost_their_scripts_loads_them_once_per_primary(
    cluster_client: ClientOnServer,
) -> None:
    """After a restart, or failovers, the primaries answer a batch of claims NOSCRIPT. The script is loaded with
    one EVAL on each primary, and the other calls go again by SHA, a pipeline per primary: 9 round trips for
    300 calls on 3 primaries, not one call at a time (about 200 before)."""
    name, client, running = cluster_client
    counted = _CountedRoundTrips(adapt(client))
    store = Store(counted, owned=False)
    source = "return ARGV[1]"
    script = Script("echo", source, hashlib.sha1(source.encode()).hexdigest())
    calls = [ScriptCall(script, [f"{name}:job{i}"], [str(i)]) for i in range(300)]
    assert len({running.shard_of(call.keys[0]) for call in calls}) == 3
    await store.execute_many([("SCRIPT", "FLUSH")])  # every primary
    counted.round_trips = 0
    assert await store.run_many(calls) == [str(i) for i in range(300)]
    assert counted.round_trips == 9  # NOSCRIPT from each, an EVAL on each, the rest again by SHA on each
    counted.round_trips = 0
    assert await store.run_many(calls) == [str(i) for i in range(300)]
    assert counted.round_trips == 3


async def test_a_cluster_batch_spans_every_primary_in_order_on_one_connection_each(
    cluster_client: ClientOnServer,
) -> None:
    """A batch of claims of jobs that live on all three primaries: each node gets its commands in one pipeline,
    in the batch's order (stream-id: a run claimed after a later run of its job is lost), and a second batch
    opens no new connection."""
    name, client, running = cluster_client
    jobs = jobs_on_every_shard(running, lambda job: KeySpace(f"{name}:").claim(job).runs, 3)
    backend = RedisBackend(redis=client, strategy="stream-id", prefix=f"{name}:")
    await backend.start(jobs)

    def batch(first: int) -> list[tuple[RunRequest, JobPolicy]]:
        slots = [first + 1000 * step for step in range(20)]
        return [(RunRequest(job, str(slot), slot, "t", "r"), JobPolicy()) for slot in slots for job in jobs]

    claims = await backend.strategy.claim(backend.store, batch(SLOT))
    assert {c.outcome for c in claims if isinstance(c, Claim)} == {Outcome.WON}
    assert len(claims) == 20 * len(jobs)
    admins = [redis.Redis(*node, protocol=2) for node in running.shards]
    try:
        received = [admin.info("stats")["total_connections_received"] for admin in admins]
        later = await backend.strategy.claim(backend.store, batch(SLOT + 20_000))
        assert [admin.info("stats")["total_connections_received"] for admin in admins] == received
    finally:
        for admin in admins:
            admin.close()
    assert {c.outcome for c in later if isinstance(c, Claim)} == {Outcome.WON}
    # Out of order within a job: the earlier run, claimed second, is lost on whichever node holds the job.
    late = await backend.strategy.claim(
        backend.store,
        [
            (RunRequest(job, str(slot), slot, "t", "r"), JobPolicy())
            for job in jobs
            for slot in (SLOT + 50_000, SLOT + 45_000)
        ],
    )
    assert [c.outcome for c in late if isinstance(c, Claim)] == [Outcome.WON, Outcome.LOST] * len(jobs)
    await backend.stop()


@pytest.mark.parametrize("name", [name for name in RESP2_CLUSTER_CLIENTS if not name.startswith("glide")])
async def test_a_node_that_refuses_its_whole_pipeline_does_not_lose_the_other_nodes_replies(
    real_server: ServerUnderTest, server_pool: ServerPool, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Claims won on two primaries stand when the third fails its part of the batch with an error (here one
    injected where a client would raise it): each of its claims answers with the error, in its place."""
    running = server_pool.get(real_server.target, cluster=True)
    client = await _client(name, running)
    jobs = jobs_on_every_shard(running, lambda job: KeySpace(f"{name}:").lease(job).state, 1)
    backend = RedisBackend(redis=client, prefix=f"{name}:")
    await backend.start(jobs)
    adapter = backend.store.connection
    assert isinstance(adapter, RedisPyCluster)
    pipeline = adapter._pipeline
    refusing = running.shards[1]

    async def refused_on_one_node(node: Any, commands: Any) -> Any:
        if (node.host, node.port) == refusing:
            raise StoreReplyError("NOAUTH Authentication required.")
        return await pipeline(node, commands)

    monkeypatch.setattr(adapter, "_pipeline", refused_on_one_node)
    try:
        claims = await backend.strategy.claim(
            backend.store, [(RunRequest(job, str(SLOT), SLOT, "t", "r"), JobPolicy()) for job in jobs]
        )
    finally:
        await backend.stop()
        await close_client(client)
    on_refusing = [running.shard_of(KeySpace(f"{name}:").lease(job).state) == refusing for job in jobs]
    assert [isinstance(claim, StoreReplyError) for claim in claims] == on_refusing
    assert [claim.outcome for claim in claims if isinstance(claim, Claim)] == [Outcome.WON] * 2


@contextlib.asynccontextmanager
async def _lease_job_on_the_first_primary(
    name: str, running: RunningServer
) -> AsyncIterator[tuple[RedisBackend[Any], str]]:
    """A started lease backend on a new client of CLIENTS[name], and a job whose keys live on the cluster's first
    primary (none of them exists yet)."""
    client = await _client(name, running)
    backend = RedisBackend(redis=client)
    [job, *_] = jobs_on_every_shard(running, lambda job: KeySpace().lease(job).state, 1)
    await backend.start([job])
    try:
        yield backend, job
    finally:
        await backend.stop()
        await close_client(client)


async def _claim(backend: RedisBackend[Any], job: str, token: str) -> Claim | StoreError:
    [answer] = await backend.strategy.claim(
        backend.store, [(RunRequest(job, str(SLOT), SLOT, token, "r"), JobPolicy())]
    )
    return answer


@pytest.mark.parametrize("name", RESP2_CLUSTER_CLIENTS)
async def test_a_claim_answered_moved_is_sent_to_the_slots_new_owner(real_target: str, name: str) -> None:
    """A job's slot changes hands (as in a resharding) after the client read the cluster's map: the claim sent by
    the old map is answered MOVED, the map is read again and the claim is won on the new owner."""
    with start_server(real_target, cluster=True) as running:
        async with _lease_job_on_the_first_primary(name, running) as (backend, job):
            source, target, slot = running.shards[0], running.shards[1], key_slot(KeySpace().lease(job).state.encode())
            _move_empty_slot(running, slot, source, target)  # empty: the job's keys do not exist yet
            claim = await _claim(backend, job, "a")
            assert isinstance(claim, Claim)
            assert claim.outcome is Outcome.WON
            on_target = redis.Redis(*target, protocol=2)
            try:
                assert on_target.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) > 0
            finally:
                on_target.close()


@pytest.mark.parametrize("name", RESP2_CLUSTER_CLIENTS)
async def test_claims_and_results_answered_ask_take_effect_where_the_keys_moved(real_target: str, name: str) -> None:
    """Mid-resharding: a stream-id job's slot is being moved and its runs stream already was, so the old owner
    answers ASK. Its claims go to the new owner (after ASKING) and act on the moved stream, in the batch's order: a
    newer run is won there, the older one after it is lost; the batch's claims of jobs on other primaries are won
    as usual. (A lease job's five keys take a migration together: until they are all on one side, its claims are
    answered TRYAGAIN and sent again.)"""
    with start_server(real_target, cluster=True) as running:
        client = await _client(name, running)
        keys = KeySpace("ask:")
        job, *others = jobs_on_every_shard(running, lambda job: keys.claim(job).runs, 1)
        backend = RedisBackend(redis=client, strategy="stream-id", prefix="ask:")
        await backend.start([job, *others])
        try:

            async def claim(*runs: tuple[str, int]) -> list[Claim | StoreError]:
                requests = [(RunRequest(job, str(slot), slot, "t", "r"), JobPolicy()) for job, slot in runs]
                return await backend.strategy.claim(backend.store, requests)

            assert all(isinstance(answer, Claim) for answer in await claim((job, SLOT)))
            source, target, slot = running.shards[0], running.shards[1], key_slot(keys.claim(job).runs.encode())
            _move_keys_of_slot(running, slot, source, target, [keys.claim(job).runs])
            newer, older = SLOT + 2000, SLOT + 1000
            answers = await claim((job, newer), (others[0], newer), (job, older), (others[1], newer))
            outcomes = [answer.outcome if isinstance(answer, Claim) else answer for answer in answers]
            assert outcomes == [Outcome.WON, Outcome.WON, Outcome.LOST, Outcome.WON]
            on_target = redis.Redis(*target, protocol=2, single_connection_client=True)
            try:
                on_target.execute_command("ASKING")  # the slot is still the source's: a read needs it too
                entries = on_target.xrange(keys.claim(job).runs)
                assert [int(fields[b"slot"]) for _, fields in entries] == [SLOT, newer]
            finally:
                on_target.close()
        finally:
            await backend.stop()
            await close_client(client)


def _move_keys_of_slot(
    running: RunningServer, slot: int, source: tuple[str, int], target: tuple[str, int], keys: Sequence[str]
) -> None:
    """Start moving a slot from one primary to another as a resharding does, and move these keys of it; the slot
    stays in migration (the source still owns it)."""
    nodes = {node: redis.Redis(*node, protocol=2, decode_responses=True) for node in (source, target)}
    try:
        source_id = nodes[source].execute_command("CLUSTER", "MYID")
        nodes[target].execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
        target_id = nodes[target].execute_command("CLUSTER", "MYID")
        nodes[source].execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
        nodes[source].execute_command("MIGRATE", *target, "", 0, 5000, "KEYS", *keys)
        assert nodes[source].execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) == 0
    finally:
        for client in nodes.values():
            client.close()


def _move_empty_slot(running: RunningServer, slot: int, source: tuple[str, int], target: tuple[str, int]) -> None:
    """Hand an empty slot from one primary to another the way a resharding does, tell every primary, and return
    once every node, the replica too, maps the slot to its new owner: a client that reads the map from any of them
    then reads the new one."""
    nodes = {node: redis.Redis(*node, protocol=2, decode_responses=True) for node in running.shards}
    try:
        target_id = nodes[target].execute_command("CLUSTER", "MYID")
        nodes[target].execute_command(
            "CLUSTER", "SETSLOT", slot, "IMPORTING", nodes[source].execute_command("CLUSTER", "MYID")
        )
        nodes[source].execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
        for node in (target, source, *(n for n in running.shards if n not in (source, target))):
            nodes[node].execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)
        every_node = [
            (host, int(port.split("@")[0]))
            for line in nodes[target].execute_command("CLUSTER", "NODES").splitlines()
            for host, _, port in [line.split()[1].rpartition(":")]
        ]
        for node in every_node:
            _wait_until_owner(node, slot, target)
    finally:
        for client in nodes.values():
            client.close()


def _wait_until_owner(node: tuple[str, int], slot: int, owner: tuple[str, int]) -> None:
    """Until ``node``'s map of slots gives ``slot`` to ``owner`` (a replica learns of a move by gossip)."""
    client = redis.Redis(*node, protocol=2, decode_responses=True)
    try:
        for _ in range(300):  # gossip on a loaded machine (four test workers on two cores) took over 5 s
            for first, last, primary, *_ in client.execute_command("CLUSTER", "SLOTS"):
                if int(first) <= slot <= int(last) and int(primary[1]) == owner[1]:
                    return
            time.sleep(0.05)
        raise AssertionError(f"{node} still maps slot {slot} elsewhere after 15 s")
    finally:
        client.close()


@pytest.mark.parametrize("cluster_class", [redis.asyncio.cluster.RedisCluster, valkey.asyncio.cluster.ValkeyCluster])
async def test_batches_cut_short_give_their_cluster_connections_back(real_target: str, cluster_class: Any) -> None:
    """Batches to a node whose replies do not come in time (cancelled by the caller's deadline), more of them than
    the client may open connections: each gives its connection back (closed: its replies were not read), and
    the node's next commands go out on a new one. valkey-py's own node pipeline kept each, and then every command
    to that node failed, with the node up and answering."""
    with start_server(real_target, cluster=True) as running:
        client = cluster_class(host=running.host, port=running.port, protocol=2, max_connections=2)
        await client.initialize()
        connection = adapt(client)
        try:
            for _ in range(3):
                # The BLPOP would answer in 30 s: a loop held up past its own 0.1 s still times out (at 1 s, a
                # stalled machine once saw the batch done by then, and wait_for return its replies).
                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(connection.execute_many([("BLPOP", "{k}list", 30), ("GET", "{k}")]), 0.1)
            assert await connection.execute_many([("SET", "{k}", "v"), ("GET", "{k}")]) == ["OK", "v"]
        finally:
            await connection.close()


@pytest.mark.parametrize("name", RESP2_CLUSTER_CLIENTS)
async def test_claims_reach_the_promoted_replica_after_a_cluster_failover(real_target: str, name: str) -> None:
    """The primary that holds a job dies; its replica is voted primary. The cluster's map is read again and the
    claims find the new primary, where the run it had replicated is still held: another instance's claim of it
    is answered "running"."""
    # A node is failed after a second without an answer (the servers' default here is 5 s): a quicker failover.
    quick = ["--cluster-node-timeout", "1000"]
    with start_server(real_target, cluster=True, replica=True, extra_args=quick) as running:
        assert running.replica is not None
        async with _lease_job_on_the_first_primary(name, running) as (backend, job):
            won = await _claim(backend, job, "a")
            assert isinstance(won, Claim)
            assert won.outcome is Outcome.WON
            state = KeySpace().lease(job).state
            replica = running.replica.client(single_connection_client=True)
            try:
                replica.execute_command("READONLY")  # a cluster replica answers reads of its primary's slots
                await eventually(lambda: replica.exists(state) == 1, 30)
                assert replica.exists(state) == 1  # the claim reached the replica
                running.control.kill()
                await eventually(lambda: replica.info("replication")["role"] == "master", 30)
                assert replica.info("replication")["role"] == "master"
            finally:
                replica.close()
            answer: Claim | StoreError | None = None
            for _ in range(40):  # until the map of slots is read again: a claim or two may find no node
                try:
                    answer = await _claim(backend, job, "b")
                except StoreUnavailableError as error:
                    answer = error
                if isinstance(answer, Claim):
                    break
                await asyncio.sleep(0.25)
            assert isinstance(answer, Claim)
            assert answer.outcome is Outcome.RUNNING


@pytest.mark.parametrize("strategy", ["lease", "idmp"])
@pytest.mark.parametrize("name", RESP2_CLUSTER_CLIENTS)
async def test_a_backend_starts_and_claims_while_a_primary_it_does_not_use_is_down(
    real_target: str, name: str, strategy: str
) -> None:
    """Scripts are cached on every primary at start; one that is down gets them from the first call that needs
    them. A job whose keys it holds, even the first registered, keeps no other job from starting: the key access
    check takes the first job that answers, and idmp configures the lost job's stream at its first claim."""
    partial = ["--cluster-require-full-coverage", "no"]
    with start_server(real_target, cluster=True, extra_args=partial) as running:
        if strategy == "idmp" and (running.is_valkey or running.version_info[:2] < (8, 6)):
            pytest.skip(f"idmp needs XADD IDMP (Redis 8.6 or later); {running.target} has none")
        lost = running.shards[0]
        prefix = next(p for p in (f"up{i}:" for i in itertools.count()) if running.shard_of(f"{p}format") != lost)
        keys = KeySpace(prefix)
        key = (lambda job: keys.lease(job).state) if strategy == "lease" else (lambda job: keys.claim(job).runs)
        on_lost, job = jobs_on_every_shard(running, key, 1)[:2]  # on the first primary, on the second
        client = await _client(name, running)  # it knows the cluster: its first node is the one to go
        running.control.kill()  # the first primary: no replica takes its slots over
        backend = RedisBackend(redis=client, strategy=strategy, prefix=prefix)
        try:
            await backend.start([on_lost, job])
            claim = await _claim(backend, job, "a")
        finally:
            await backend.stop()
            await close_client(client)
        assert isinstance(claim, Claim)
        assert claim.outcome is Outcome.WON


@pytest.mark.parametrize("name", RESP2_CLUSTER_CLIENTS)
async def test_while_a_primary_is_down_the_others_answer_their_part_of_a_batch(real_target: str, name: str) -> None:
    """A cluster that serves the slots it still covers (``cluster-require-full-coverage no``) loses a primary: a
    batch of claims is won on the primaries that are up, and only the claims of the lost primary's jobs come back
    unavailable, in their places, to be sent again. The map of slots those give is the one in hand: it is not read
    again, which would replace the client's nodes (valkey-py closes the connections of those it replaces, claims
    on their way to the primaries that answer included: a claim of theirs failed in about one run in four)."""
    partial = ["--cluster-require-full-coverage", "no"]
    with start_server(real_target, cluster=True, extra_args=partial) as running:
        client = await _client(name, running)
        jobs = jobs_on_every_shard(running, lambda job: KeySpace().lease(job).state, 2)
        backend = RedisBackend(redis=client)
        await backend.start(jobs)
        try:
            nodes = dict(client.nodes_manager.nodes_cache) if hasattr(client, "nodes_manager") else {}
            running.control.kill()  # the first primary: no replica takes its slots over
            lost = [running.shard_of(KeySpace().lease(job).state) == running.shards[0] for job in jobs]
            for step in range(3):  # again and again: the map of slots is read again in between
                slot = SLOT + step * 1000
                requests = [
                    (RunRequest(job, str(slot), slot, f"t{step}", "r"), JobPolicy(overlap=True)) for job in jobs
                ]
                claims = await backend.strategy.claim(backend.store, requests)
                if name == "glide-cluster":
                    # GLIDE refreshes its topology once it sees a node go, and a claim on a primary that answers
                    # may miss its request timeout (250 ms) meanwhile, on a loaded machine. The scheduler sends
                    # it again with its token, as here: it wins then.
                    again = [
                        i for i, claim in enumerate(claims) if isinstance(claim, StoreUnavailableError) and not lost[i]
                    ]
                    retried = [(requests[i][0]._replace(retry=True), requests[i][1]) for i in again]
                    for i, claim in zip(again, await backend.strategy.claim(backend.store, retried), strict=True):
                        claims[i] = claim
                assert [isinstance(claim, StoreUnavailableError) for claim in claims] == lost, claims
                assert all(claim.outcome is Outcome.WON for claim in claims if isinstance(claim, Claim))
            if nodes:
                assert all(client.nodes_manager.nodes_cache[name] is node for name, node in nodes.items())
        finally:
            await backend.stop()
            await close_client(client)


async def test_glide_while_a_primary_stops_answering_the_others_answer_their_part_of_a_batch(real_target: str) -> None:
    """A primary stops answering (SIGSTOP), short of the cluster's node timeout. GLIDE fails a batch whole when
    one of its nodes does not answer within its request timeout (250 ms by default; 2 s here, which a loaded
    machine cannot make a primary that answers miss), so anarchon sends it one batch per primary: a batch of
    claims is won on the primaries that answer, and only the stopped primary's claims come back unavailable, in
    their places. (The scheduler tests of a stopped primary run with redis-py and GLIDE.)"""
    with start_server(real_target, cluster=True, extra_args=["--cluster-node-timeout", "30000"]) as running:
        client = await glide(cluster=True, protocol=ProtocolVersion.RESP2, request_timeout_ms=2000)(running)
        jobs = jobs_on_every_shard(running, lambda job: KeySpace().lease(job).state, 2)
        backend = RedisBackend(redis=client)
        await backend.start(jobs)
        running.control.pause()
        try:
            requests = [(RunRequest(job, str(SLOT), SLOT, "t", "r"), JobPolicy()) for job in jobs]
            claims = await backend.strategy.claim(backend.store, requests)
            stopped = [running.shard_of(KeySpace().lease(job).state) == running.shards[0] for job in jobs]
            assert [isinstance(claim, StoreUnavailableError) for claim in claims] == stopped, claims
            assert all(claim.outcome is Outcome.WON for claim in claims if isinstance(claim, Claim))
        finally:
            running.control.resume()
            await backend.stop()
            await close_client(client)


async def test_glide_lanes_follow_a_resharding(real_target: str) -> None:
    """GLIDE follows MOVED without a word, so anarchon reads its map of slots again now and then (every
    MAP_MAX_AGE_S, a minute; a fifth of a second here): once a resharding gave a job's slot to another primary,
    the job's commands queue with that primary's. Until then they went with the old owner's, and would have been
    held up by it."""
    with start_server(real_target, cluster=True) as running:
        client = await _client("glide-cluster", running)
        keys = KeySpace()
        jobs = jobs_on_every_shard(running, lambda job: keys.lease(job).state, 1)
        [moved] = [job for job in jobs if running.shard_of(keys.lease(job).state) == running.shards[0]]
        [stays] = [job for job in jobs if running.shard_of(keys.lease(job).state) == running.shards[1]]
        backend = RedisBackend(redis=client)
        await backend.start(jobs)
        try:
            backend.store.connection.MAP_MAX_AGE_S = 0.2  # type: ignore[attr-defined]
            assert backend.lane(moved) != backend.lane(stays)
            _move_empty_slot(running, key_slot(keys.lease(moved).state.encode()), *running.shards[:2])
            for step in range(20):  # each claim may start a reading, which the claims do not wait for
                slot = SLOT + step * 1000
                policy = JobPolicy(overlap=True)
                requests = [(RunRequest(job, str(slot), slot, f"t{step}", "r"), policy) for job in jobs]
                claims = await backend.strategy.claim(backend.store, requests)
                assert all(isinstance(claim, Claim) and claim.outcome is Outcome.WON for claim in claims), claims
                if backend.lane(moved) == backend.lane(stays):
                    break
                await asyncio.sleep(0.1)
            assert backend.lane(moved) == backend.lane(stays)
        finally:
            await backend.stop()
            await close_client(client)


async def test_server_error_replies_are_translated(client_on_server: ClientOnServer) -> None:
    name, client, _ = client_on_server
    backend = RedisBackend(redis=client, strategy="stream-id", prefix=f"{name}:")
    await backend.start(["sync"])
    claims = await backend.strategy.claim(
        backend.store, [(req(SLOT + 1000, "a"), JobPolicy()), (req(SLOT, "b"), JobPolicy())]
    )
    assert [c.outcome for c in claims if isinstance(c, Claim)] == [Outcome.WON, Outcome.LOST]
    with pytest.raises(StoreReplyError) as caught:
        await backend.store.execute("XADD", f"{name}:sync:runs", f"{SLOT}-0", "f", "v")
    assert "equal or smaller" in caught.value.reply
    assert caught.value.reply.startswith("ERR")
    await backend.stop()


async def test_a_write_refused_for_now_is_an_unavailable_store_with_every_client(
    client_on_server: ClientOnServer,
) -> None:
    """NOREPLICAS (fewer replicas than min-replicas-to-write) did not run the write, and will pass: whatever the
    client, it is an unavailable store, retried, while WRONGTYPE is a reply, its code first."""
    name, client, running = client_on_server
    backend = RedisBackend(redis=client, prefix=f"{name}:")
    await backend.start(["sync"])
    key = f"{name}:refused"
    admins = [redis.Redis(*node, protocol=2) for node in running.shards or [(running.host, running.port)]]
    try:
        await backend.store.execute("RPUSH", key, "x")
        with pytest.raises(StoreReplyError) as wrong:
            await backend.store.execute("GET", key)
        for admin in admins:
            admin.config_set("min-replicas-to-write", 5)
        with pytest.raises(StoreUnavailableError) as refused:
            await backend.store.execute("SET", key, "v")
    finally:
        for admin in admins:
            admin.config_set("min-replicas-to-write", 0)
            admin.close()
        await backend.stop()
    assert wrong.value.reply.startswith("WRONGTYPE Operation against a key")
    assert "NOREPLICAS Not enough good replicas" in str(refused.value)


async def test_anarchon_opens_and_closes_its_own_connection(real_server: ServerUnderTest) -> None:
    backend = RedisBackend(redis=real_server.url(db=1))
    await backend.start(["sync"])
    admin = real_server.client(db=1)
    assert admin.exists("cron:format") == 1
    clients_before = len(admin.client_list())
    await backend.stop()
    for _ in range(50):  # the server notices the closed socket asynchronously
        if len(admin.client_list()) < clients_before:
            break
        await asyncio.sleep(0.02)
    assert len(admin.client_list()) < clients_before

    options = RedisBackend(redis={"host": real_server.host, "port": real_server.port, "db": 2})
    await options.start(["sync"])
    assert real_server.client(db=2).exists("cron:format") == 1
    await options.stop()


async def test_starts_at_once_open_one_connection_and_a_second_scheduler_start_is_refused(
    real_server: ServerUnderTest,
) -> None:
    admin = real_server.client()

    def opened() -> int:  # the backend's connections, by the name they give the server
        return sum(1 for client in admin.client_list() if client["name"] == "starts-at-once")

    backend = RedisBackend(redis=f"{real_server.url()}?client_name=starts-at-once")
    try:
        await asyncio.gather(backend.start(["sync"]), backend.start(["sync"]))
        assert opened() == 1
    finally:
        await backend.stop()
    await eventually(lambda: opened() == 0, 2)
    assert opened() == 0  # stop() closed the one connection: none leaked

    scheduler = Scheduler(RedisBackend(redis=real_server.url()))
    scheduler.add_job("sync", "0 0 1 1 *", lambda: None)
    outcomes = await asyncio.gather(scheduler.start(), scheduler.start(), return_exceptions=True)
    try:
        assert outcomes[0] is None
        assert isinstance(outcomes[1], SchedulerStateError)
    finally:
        await scheduler.stop()


def test_a_backend_starts_at_once_again_on_another_event_loop(real_server: ServerUnderTest) -> None:
    backend = RedisBackend(redis=real_server.url())

    async def twice() -> None:
        await asyncio.gather(backend.start(["sync"]), backend.start(["sync"]))
        assert backend.started
        await backend.stop()

    asyncio.run(twice())
    asyncio.run(twice())  # a lock bound to the first loop would refuse to be awaited here


@pytest.mark.parametrize(
    ("settings", "detected"),
    [
        ({}, "Redis 7"),  # fakeredis's default
        ({"version": (8, 6)}, "Redis 8.6"),
        ({"version": "8.6"}, "Redis 8.6"),
        ({"version": 6}, "Redis 6"),
        ({"server_type": "valkey", "version": (8, 0)}, "Valkey 8.0"),
        ({"server": fakeredis.FakeServer(version=(8, 6))}, "Redis 8.6"),
    ],
)
async def test_a_fakeredis_client_is_the_server_it_emulates(settings: dict[str, Any], detected: str) -> None:
    """fakeredis has no INFO: what it emulates comes from its FakeServer, or the client's own keywords."""
    backend = RedisBackend(redis=fakeredis.FakeAsyncRedis(**settings))
    await backend.start()
    assert str(backend.server) == detected
    await backend.stop()


def test_unrecognised_objects_are_refused() -> None:
    with pytest.raises(TypeError, match="send"):
        RedisBackend(redis=object())  # type: ignore[call-overload]


@pytest.mark.parametrize("cls", [redis.asyncio.Redis, redis.Redis, valkey.Valkey, redis.cluster.RedisCluster])
def test_a_client_class_given_for_a_client_is_a_config_type_error(cls: type) -> None:
    """The call's parentheses forgotten: refused when the backend is made, naming the option, not an
    AttributeError then (or at start, for the classes whose methods look like a client's)."""
    with pytest.raises(ConfigTypeError, match=rf"^redis: got the class .*{cls.__name__}") as refused:
        RedisBackend(redis=cls)
    assert refused.value.option == "redis"


def test_a_pipeline_given_for_a_client_is_a_config_type_error() -> None:
    """A pipeline answers every command with itself until execute(): taken for a client, start() read the store
    format from it and blamed another program for the prefix."""
    clients = [redis.asyncio.Redis(), redis.Redis(), valkey.asyncio.Valkey(), fakeredis.FakeAsyncRedis()]
    for client in clients:
        with pytest.raises(ConfigTypeError, match=r"^redis: got a pipeline .*the client it came from") as refused:
            RedisBackend(redis=client.pipeline())
        assert refused.value.option == "redis"
    with pytest.raises(ConfigTypeError, match=r"^valkey: got a pipeline") as refused:
        ValkeyBackend(valkey=valkey.Valkey().pipeline())
    assert refused.value.option == "valkey"


class Scripted:
    """A ``send`` client that answers every command with one value, raised or returned."""

    def __init__(self, answer: BaseException, *, raise_it: bool) -> None:
        self.answer = answer
        self.raise_it = raise_it

    def send(self, command: str, args: list[str]) -> Any:
        if self.raise_it:
            raise self.answer
        return self.answer


@pytest.mark.parametrize(
    ("error", "expected", "text"),
    [
        (redis.exceptions.ClusterDownError("The cluster is down"), StoreUnavailableError, "CLUSTERDOWN The"),
        (valkey.exceptions.ClusterDownError("The cluster is down"), StoreUnavailableError, "CLUSTERDOWN The"),
        (redis.exceptions.TryAgainError("Multiple keys request"), StoreUnavailableError, "TRYAGAIN Multiple"),
        (redis.exceptions.OutOfMemoryError("command not allowed when used memory"), StoreUnavailableError, "OOM com"),
        (redis.exceptions.ResponseError("MISCONF Redis is configured to save"), StoreUnavailableError, "MISCONF Redis"),
        (RequestError("An error was signalled by the server: - ClusterDown: down"), StoreUnavailableError, "CLUSTER"),
        (
            RequestError("BrokenPipe: Cluster: Failed to receive command response from internal sender. RecvError(())"),
            StoreUnavailableError,
            "BrokenPipe: Cluster",
        ),
        # GLIDE's texts as a redis-7 server's replies reach it: the code, a colon, the message.
        (RequestError("BUSY: Redis is busy running a script. You can only call"), StoreUnavailableError, "BUSY Redis"),
        (RequestError("NOREPLICAS: Not enough good replicas to write."), StoreUnavailableError, "NOREPLICAS Not"),
        (
            RequestError("WRONGTYPE: Operation against a key holding the wrong kind of value"),
            StoreReplyError,
            "WRONGTYPE Operation",
        ),
        (
            RequestError("An error was signalled by the server: - PermissionDenied: this user has no permissions"),
            StoreReplyError,
            "NOPERM this user",
        ),
        (CircuitBreakerError("the circuit breaker is open"), StoreUnavailableError, "circuit breaker"),
        (redis.exceptions.MovedError("3999 127.0.0.1:6381"), StoreReplyError, "MOVED 3999"),
        (redis.exceptions.ResponseError("CROSSSLOT Keys in request"), StoreReplyError, "CROSSSLOT Keys"),
    ],
    ids=[
        "redis-py-clusterdown",
        "valkey-py-clusterdown",
        "redis-py-tryagain",
        "redis-py-oom",
        "redis-py-misconf",
        "glide-clusterdown",
        "glide-node-gone",
        "glide-busy",
        "glide-noreplicas",
        "glide-wrongtype",
        "glide-noperm",
        "glide-circuit-breaker",
        "moved",
        "crossslot",
    ],
)
def test_a_refusal_for_now_is_an_unavailable_store_and_other_replies_are_replies(
    error: Exception, expected: type[StoreError], text: str
) -> None:
    """CLUSTERDOWN (a failed primary's slots waiting for its replica) and TRYAGAIN did not run the command and
    will pass: the scheduler then retries as it does for a store it cannot reach (a result is recorded later, a
    claim is sent again) instead of taking a server's answer."""
    translated = translate(error)
    assert type(translated) is expected
    assert text in str(translated)


@pytest.mark.parametrize("raise_it", [True, False], ids=["raised", "returned"])
@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        (RuntimeError("NOSCRIPT No matching script."), StoreReplyError),
        (RuntimeError("WRONGTYPE Operation against a key holding the wrong kind of value"), StoreReplyError),
        (ValueError("ERR"), StoreReplyError),
        (RuntimeError("MOVED 3999 127.0.0.1:6381"), StoreReplyError),
        (RuntimeError("LOADING Redis is loading the dataset in memory"), StoreUnavailableError),
        (RuntimeError("CLUSTERDOWN The cluster is down"), StoreUnavailableError),
        (RuntimeError("TRYAGAIN Multiple keys request during rehashing of slot"), StoreUnavailableError),
        (RuntimeError("BUSY Redis is busy running a script."), StoreUnavailableError),
        (RuntimeError("READONLY You can't write against a read only replica."), StoreUnavailableError),
        (RuntimeError("NOREPLICAS Not enough good replicas to write."), StoreUnavailableError),
        (RuntimeError("OOM command not allowed when used memory > 'maxmemory'."), StoreUnavailableError),
        (
            RuntimeError("ERR Error running script (call to f_0): @user_script:1: @user_script: 1: -READONLY You"),
            StoreUnavailableError,
        ),
        (RuntimeError("ERR Error running script (call to f_0): @user_script:1: -WRONGTYPE Operation"), StoreReplyError),
        (ConnectionResetError("connection reset by peer"), StoreUnavailableError),
        (RuntimeError("boom"), RuntimeError),
        (RuntimeError("NOSCRIPTED: not a code"), RuntimeError),
        (RuntimeError("error: ERR wrapped"), RuntimeError),
        (RuntimeError("err lower case"), RuntimeError),
    ],
)
async def test_send_clients_errors_are_read_by_their_server_error_code(
    answer: BaseException, expected: type[BaseException], raise_it: bool
) -> None:
    """A ``send`` client's own exception, raised or returned, is a server error reply only when its message is
    one (a Redis error code first); anything else reaches the caller unchanged."""
    connection = adapt(Scripted(answer, raise_it=raise_it))
    with pytest.raises(expected) as caught:
        await connection.execute(("EVALSHA", "0" * 40, 0))
    if isinstance(caught.value, StoreReplyError):
        assert caught.value.reply == str(answer)  # the server's text, its code first
        [in_place] = await connection.execute_many([("PING",)])  # in a batch, kept in its command's place
        assert isinstance(in_place, StoreReplyError)
    elif expected is RuntimeError:
        assert caught.value is answer


async def test_a_send_client_whose_client_parses_info_is_told_the_server(real_server: ServerUnderTest) -> None:
    """A ``send`` client that passes the command name on as a string: redis-py then parses INFO into a map of its
    fields. The server's kind and version are read from that too (the version was taken as 0, and idmp refused on
    Redis 8.6)."""
    running = real_server.running
    client = redis.asyncio.Redis(host=running.host, port=running.port, protocol=2)

    class Parsing:
        async def send(self, command: str, args: list[str]) -> Any:
            return await client.execute_command(command, *args)

    assert isinstance(await client.execute_command("INFO", "server"), dict)
    backend = RedisBackend(redis=Parsing(), prefix="parsing:")
    try:
        await backend.start(["sync"])
        assert str(backend.server) == f"{'Valkey' if running.is_valkey else 'Redis'} {running.version}"
        await backend.stop()
    finally:
        await client.aclose()


async def test_an_address_that_is_no_redis_fails_start_with_a_store_error() -> None:
    """What answers at the URL is not Redis (an HTTP server): redis-py cannot read its reply. start() raises a
    StoreUnavailableError saying so, not the client's own exception."""

    async def http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(100)
        writer.write(b"<html>400 Bad Request</html>\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(http, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    scheduler = Scheduler(RedisBackend(redis=f"redis://127.0.0.1:{port}/0"))
    scheduler.add_job("sync", "* * * * *", lambda: None)
    try:
        with pytest.raises(StoreUnavailableError, match="the store client failed: InvalidResponse"):
            await scheduler.start()
    finally:
        server.close()
        await server.wait_closed()


class _OneNodeDown:
    """The store seam of a cluster that lost one primary: commands on keys of ``down:`` come back unavailable, in
    their places in a batch, while the others are answered."""

    def __init__(self) -> None:
        self.batches: list[int] = []

    @staticmethod
    def _answer(command: Command) -> Reply | StoreError:
        if str(command[1]).startswith("down:"):
            return StoreUnavailableError("store unavailable: the node is down")
        return "OK" if command[0] == "SET" else f"{command[4]}"  # XADD …: the ID it was given

    async def execute(self, command: Command) -> Reply:
        await asyncio.sleep(0)  # a round trip: commands sent meanwhile wait for it
        answer = self._answer(command)
        if isinstance(answer, StoreError):
            raise answer
        return answer

    async def execute_many(self, commands: Sequence[Command]) -> list[Reply | StoreError]:
        self.batches.append(len(commands))
        return [self._answer(command) for command in commands]

    async def server_info(self) -> ServerInfo:
        return ServerInfo("redis", (7, 0))

    async def close(self) -> None:
        return None


async def test_a_server_that_refuses_for_now_is_an_unavailable_store(real_target: str) -> None:
    """READONLY (a primary demoted to a replica in a failover), NOREPLICAS (fewer replicas than
    min-replicas-to-write), BUSY (another client's script past the busy threshold), OOM (memory over maxmemory,
    noeviction) and MISCONF (a snapshot failed, stop-writes-on-bgsave-error): the write was not made and will be
    accepted later, so the claim is sent again, and a result too (as for a store out of reach), instead of taken
    as a 'no'. A result given up on would leave its run to a backup, to run again."""
    strategy = LeaseStrategy(KeySpace())

    async def claim_on(server: RunningServer, slot: int = SLOT) -> Claim | StoreError:
        request = [(RunRequest("job", str(slot), slot, "t", "r"), JobPolicy())]
        client = server.async_client()
        try:
            [answer] = await strategy.claim(Store(RedisPyAsync(client), owned=False), request)
            return answer
        finally:
            await client.aclose()

    with start_server(real_target, replica=True) as running:
        assert running.replica is not None
        refused = await claim_on(running.replica)
        assert isinstance(refused, StoreUnavailableError)
        assert "READONLY" in str(refused)

    # (Redis 5 checks min-replicas-to-write for commands only, not for the writes of a script.)
    with start_server(real_target, extra_args=["--min-replicas-to-write", "1"]) as running:
        client = running.async_client()
        try:
            with pytest.raises(StoreUnavailableError, match="NOREPLICAS"):
                await Store(RedisPyAsync(client), owned=False).execute("SET", "k", "v")
        finally:
            await client.aclose()

    with start_server(real_target, extra_args=["--lua-time-limit", "50"]) as running:
        spinner = running.async_client()
        try:
            spin = "local t = redis.call('TIME')[1] + 2 while tonumber(redis.call('TIME')[1]) < t do end return 1"
            spinning = asyncio.ensure_future(spinner.eval(spin, 0))  # another client's long script
            await asyncio.sleep(0.5)
            refused = await claim_on(running)
            assert isinstance(refused, StoreUnavailableError)
            assert "BUSY" in str(refused)
            assert await spinning == 1
        finally:
            await spinner.aclose()
        won = await claim_on(running)  # the script has ended: the same claim is won now
        assert isinstance(won, Claim)
        assert won.outcome is Outcome.WON

    with start_server(real_target) as running:
        admin = redis.Redis(running.host, running.port, protocol=2)
        try:
            admin.config_set("maxmemory", 1)
            refused = await claim_on(running)
            assert isinstance(refused, StoreUnavailableError)
            assert "OOM" in str(refused)
            admin.config_set("maxmemory", 0)
            won = await claim_on(running)
            assert isinstance(won, Claim)
            assert won.outcome is Outcome.WON
            _fail_a_snapshot(admin)
            refused = await claim_on(running, SLOT + 1000)  # a claim that writes (the last one, sent again, would not)
            assert isinstance(refused, StoreUnavailableError)
            assert "MISCONF" in str(refused)
        finally:
            admin.config_set("save", "")  # or stopping the server would try to save again
            admin.close()


def _fail_a_snapshot(admin: redis.Redis) -> None:
    """Make a snapshot fail, as a full disk would: the server then refuses writes (MISCONF) while it has save
    points and stop-writes-on-bgsave-error (the default). It writes snapshots in its working directory: that
    directory is removed (its files kept aside, and put back in a new one after) while the snapshot is made."""
    home = Path(admin.config_get("dir")["dir"])
    aside = Path(tempfile.mkdtemp())
    for file in home.iterdir():
        file.rename(aside / file.name)
    home.rmdir()
    try:
        admin.config_set("save", "3600 1")
        admin.bgsave()
        for _ in range(200):
            if admin.info("persistence")["rdb_last_bgsave_status"] == "err":
                return
            time.sleep(0.05)
        raise AssertionError("the snapshot did not fail")
    finally:
        home.mkdir()
        for file in aside.iterdir():
            file.rename(home / file.name)
        aside.rmdir()


async def test_a_wrong_password_is_the_servers_answer_not_an_outage(real_target: str) -> None:
    """redis-py raises a failed AUTH as a ConnectionError; a caller that retries start() on an unavailable store
    would retry a wrong password for ever. It is a StoreReplyError, said once as the credentials' refusal (not as
    INFO's and HELLO's, with advice on allowing this user either); a password of None is no password, and one the
    server has none to check against is the server's ERR."""
    refused = "(the store refused the connection's username or password)"
    with start_server(real_target) as running:
        backend = RedisBackend(redis={"host": running.host, "port": running.port, "password": "unset"})
        with pytest.raises(StoreReplyError) as caught:
            await backend.start()
        assert caught.value.reply.startswith("ERR ")
        assert caught.value.reply.endswith(refused)
        admin = running.client()
        admin.config_set("requirepass", "s3cr3t")
        admin.close()
        for password, code in (("wrong", "WRONGPASS"), (None, "NOAUTH")):
            backend = RedisBackend(redis={"host": running.host, "port": running.port, "password": password})
            with pytest.raises(StoreReplyError) as caught:
                await backend.start()
            assert caught.value.reply.startswith(f"{code} ")
            assert caught.value.reply.count(code) == 1
            assert caught.value.reply.endswith(refused)
        backend = RedisBackend(redis={"host": running.host, "port": running.port, "password": "s3cr3t"})
        await backend.start()
        assert backend.started
        await backend.stop()


@pytest.mark.parametrize("cluster_class", [redis.asyncio.cluster.RedisCluster, valkey.asyncio.cluster.ValkeyCluster])
async def test_a_wrong_password_to_a_cluster_is_the_servers_answer_not_an_outage(
    real_target: str, cluster_class: Any
) -> None:
    """As above, through an asyncio cluster client that had not read the cluster's map yet: its client raises the
    refusal as the cause of "cannot be connected"."""
    if real_target == "redis-5":
        pytest.skip("Redis 5 has no ACL users")
    with start_server(real_target, cluster=True) as running:
        for host, port in running.shards:
            admin = redis.Redis(host=host, port=port, protocol=2)
            admin.execute_command("ACL", "SETUSER", "u", "on", ">pw", "~*", "&*", "+@all")
            admin.close()
        client = cluster_class(host=running.host, port=running.port, username="u", password="wrong", protocol=2)
        with pytest.raises(StoreReplyError) as caught:
            await RedisBackend(redis=client).start()
        assert caught.value.reply.startswith("WRONGPASS ")
        await client.aclose()


async def test_a_user_refused_a_command_is_told_what_to_allow(real_target: str) -> None:
    """An ACL user without XADD: every claim's script is refused. The error says which permissions a scheduler's
    user needs (Redis 7 names no command)."""
    if real_target == "redis-5":
        pytest.skip("Redis 5 has no ACL users")
    with start_server(real_target) as running:
        admin = running.client()
        admin.execute_command(
            "ACL", "SETUSER", "cron", "on", ">pw", "~cron:*", "~{cron:*", "+@read", "+@write", "+@scripting",
            "+@connection", "+info", "+time", "-xadd",
        )  # fmt: skip
        admin.close()
        backend = RedisBackend(redis={"host": running.host, "port": running.port, "username": "cron", "password": "pw"})
        await backend.start(["sync"])
        try:
            [claim] = await backend.strategy.claim(
                backend.store, [(RunRequest("sync", "1000", 1000, "t", "a"), JobPolicy())]
            )
            assert isinstance(claim, StoreReplyError)
            assert claim.reply.endswith("+info +time, as README's Security section says)")
        finally:
            await backend.stop()


async def test_a_database_the_server_does_not_have_is_said_so(real_target: str) -> None:
    """The connection's SELECT fails before any command: said as the database number, not as INFO's and HELLO's
    refusal (which sends the reader to the user's permissions)."""
    with start_server(real_target) as running:
        for spec in ({"host": running.host, "port": running.port, "db": 16}, running.url(db=99)):
            with pytest.raises(StoreReplyError) as caught:
                await RedisBackend(redis=spec).start()  # type: ignore[call-overload]
            assert "the database number is beyond what the server has" in caught.value.reply
            assert "allow this user" not in caught.value.reply


async def test_a_node_out_of_reach_fails_only_its_commands_of_a_batch() -> None:
    """Commands sent together (the store pipelines those that wait for a reply in flight): only the callers
    whose command went to the lost node get StoreUnavailableError; a claim among them is not taken as won."""
    connection = _OneNodeDown()
    store = Store(connection, owned=False)
    sent = [asyncio.ensure_future(store.execute("SET", key, "v")) for key in ("up:1", "up:2", "down:1", "up:3")]
    assert await sent[0] == "OK"  # went out alone; the next three waited for it and went together
    assert connection.batches == [3]
    assert [await sent[1], await sent[3]] == ["OK", "OK"]
    with pytest.raises(StoreUnavailableError):
        await sent[2]

    strategy = StreamIdStrategy(KeySpace("down:"))
    claims = await strategy.claim(store, [(RunRequest("job", str(SLOT), SLOT, "t", "r"), JobPolicy())] * 2)
    assert [type(claim) for claim in claims] == [StoreUnavailableError] * 2


class _Held:
    """A connection whose commands wait until ``answer`` is set; it counts what reaches it."""

    def __init__(self) -> None:
        self.answer = asyncio.Event()
        self.received: list[Command] = []

    async def execute(self, command: Command) -> Reply:
        self.received.append(command)
        await self.answer.wait()
        return "OK"

    async def execute_many(self, commands: Sequence[Command]) -> list[Reply | StoreError]:
        return [await self.execute(command) for command in commands]

    async def server_info(self) -> ServerInfo:
        return ServerInfo("redis", (7, 0))

    async def close(self) -> None:
        return None


class _OneNodeHeld(_Held):
    """A cluster connection (``Sharded``) whose node for the keys that start with "x" does not answer until
    ``answer`` is set; the other node answers at once."""

    def lane(self, key: Any) -> str:
        return "x" if str(key).startswith("x") else "y"

    async def execute(self, command: Command) -> Reply:
        if self.lane(command[1]) == "y":
            self.received.append(command)
            return "OK"
        return await super().execute(command)

    async def execute_many(self, commands: Sequence[Command]) -> list[Reply | StoreError]:
        assert len({self.lane(command[1]) for command in commands}) == 1, "one pipeline per node"
        return await super().execute_many(commands)


async def test_on_a_cluster_a_node_that_does_not_answer_holds_up_only_its_own_commands() -> None:
    """Commands queue behind one in flight to the same node, not behind one to another node: a primary that
    stops answering must not hold up the finishes and claims of the jobs on the others. A batch goes to each node
    in a pipeline of its own, and the replies of the nodes that answer stand."""
    connection = _OneNodeHeld()
    store = Store(connection, owned=False)
    held = asyncio.ensure_future(store.execute("SET", "x1", "1"))
    await asyncio.sleep(0)
    queued = asyncio.ensure_future(store.execute("SET", "x2", "1"))
    assert await asyncio.wait_for(store.execute("SET", "y1", "1"), 1) == "OK"
    assert await asyncio.wait_for(store.execute_many([("SET", "y2", "1"), ("SET", "y3", "1")]), 1) == ["OK", "OK"]
    both = asyncio.ensure_future(store.execute_many([("SET", "y4", "1"), ("SET", "x3", "1"), ("SET", "y5", "1")]))
    for _ in range(5):
        await asyncio.sleep(0)
    assert [command[1] for command in connection.received] == ["x1", "y1", "y2", "y3", "y4", "y5", "x2"]
    assert not queued.done()
    assert not both.done()
    connection.answer.set()
    assert await asyncio.gather(held, queued, both) == ["OK", "OK", ["OK", "OK", "OK"]]
    assert [command[1] for command in connection.received][-2:] == ["x2", "x3"]  # the queued one in front


async def test_a_batch_to_several_nodes_cancelled_as_it_starts_leaves_no_coroutine_unawaited() -> None:
    """A batch to two nodes cancelled before its parts start: each part's pipeline is made as the part starts, so
    none is left never awaited (Python would warn of it, and the commands were never sent)."""
    connection = _OneNodeHeld()
    store = Store(connection, owned=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batch = asyncio.ensure_future(store.execute_many([("SET", "x1", "1"), ("SET", "y1", "1")]))
        await asyncio.sleep(0)
        batch.cancel()
        await asyncio.gather(batch, return_exceptions=True)
        gc.collect()
    assert [str(warning.message) for warning in caught] == []
    assert batch.cancelled()
    assert connection.received == []


async def _in_flight_and_queued(
    connection: Connection, *, owned: bool = False
) -> tuple[Store, asyncio.Future[Reply], asyncio.Future[Reply]]:
    """A store on ``connection`` with SET a in flight and SET b queued behind it."""
    store = Store(connection, owned=owned)
    in_flight = asyncio.ensure_future(store.execute("SET", "a", "1"))
    await asyncio.sleep(0)
    queued = asyncio.ensure_future(store.execute("SET", "b", "1"))
    await asyncio.sleep(0)
    return store, in_flight, queued


async def _batch_sent(store: Store) -> asyncio.Future[list[Reply | StoreError]]:
    """SET c and SET d sent together: the batch's caller starts its pipeline, which goes out (taking the queued
    command along, in front) while the command in flight waits."""
    batch = asyncio.ensure_future(store.execute_many([("SET", "c", "1"), ("SET", "d", "1")]))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    return batch


async def test_a_closed_store_sends_nothing_more() -> None:
    """Commands queued behind one in flight when the store closes fail, instead of going out afterwards (on a
    pool anarchon had closed, they would open a new connection after stop()); so does any command sent later."""
    connection = _Held()
    store, in_flight, queued = await _in_flight_and_queued(connection, owned=True)
    closing = asyncio.ensure_future(store.close())
    await asyncio.sleep(0)
    connection.answer.set()
    await asyncio.wait_for(closing, 1)
    assert await in_flight == "OK"
    with pytest.raises(StoreUnavailableError, match="closed"):
        await queued
    with pytest.raises(StoreUnavailableError, match="closed"):
        await store.execute("SET", "c", "1")
    assert [command[1] for command in connection.received] == ["a"]


class _HeldUntilClosed(_Held):
    """A held connection that says when it was closed; closing fails a command still on its way, as closing a
    client's sockets does."""

    def __init__(self) -> None:
        super().__init__()
        self.closed = asyncio.Event()

    async def execute(self, command: Command) -> Reply:
        self.received.append(command)
        answered = asyncio.ensure_future(self.answer.wait())
        await asyncio.wait([answered, asyncio.ensure_future(self.closed.wait())], return_when="FIRST_COMPLETED")
        if not answered.done():
            raise StoreUnavailableError("store unavailable: Connection closed by server.")
        return "OK"

    async def close(self) -> None:
        self.closed.set()


async def test_close_waits_for_a_command_that_went_out_at_once() -> None:
    """A command sent while nothing else was on its way goes out at once, not in a queued pipeline (an app's
    history() beside stop(), the store slow): close() delivers it as it does the pipelines, for CLOSE_WAIT_S at
    most, instead of closing the connection under it (a write that ran, its caller told the outcome is unknown)."""
    connection = _HeldUntilClosed()
    store = Store(connection, owned=True)
    sent = asyncio.ensure_future(store.execute("SET", "a", "1"))
    await asyncio.sleep(0)
    closing = asyncio.ensure_future(store.close())
    await asyncio.sleep(0.2)
    assert not closing.done()
    connection.answer.set()
    await asyncio.wait_for(closing, 1)
    assert await sent == "OK"
    assert connection.closed.is_set()


async def test_close_gives_up_on_a_command_that_went_out_at_once_to_a_silent_store() -> None:
    connection = _HeldUntilClosed()
    store = Store(connection, owned=True)
    sent = asyncio.ensure_future(store.execute("SET", "a", "1"))
    await asyncio.sleep(0)
    began = time.monotonic()
    await asyncio.wait_for(store.close(), CLOSE_WAIT_S + 1)
    assert time.monotonic() - began >= CLOSE_WAIT_S - 0.05
    with pytest.raises(StoreUnavailableError, match="closed"):
        await sent


async def test_a_queued_command_whose_caller_is_gone_is_not_sent() -> None:
    """Cancelled while it waited behind a command in flight (as stop() cancels what it gave up on), a command
    does not go out once that one is answered: nobody would read its reply."""
    connection = _Held()
    store, in_flight, queued = await _in_flight_and_queued(connection)
    queued.cancel()
    connection.answer.set()
    assert await in_flight == "OK"
    await asyncio.wait_for(store.close(), 1)
    assert [command[1] for command in connection.received] == ["a"]


async def test_close_does_not_wait_on_a_silent_store_for_callers_that_are_gone() -> None:
    """The command in flight cancelled, the one queued behind it goes out, and then its caller is cancelled too
    (stop() giving up on a store that does not answer): close() returns at once, not after the client's socket
    timeout (10 s by default) for a reply nobody would read."""
    connection = _Held()
    store, in_flight, queued = await _in_flight_and_queued(connection)
    in_flight.cancel()
    for _ in range(5):  # the delivery of the queued command starts once the one in flight has ended
        await asyncio.sleep(0)
    assert [command[1] for command in connection.received] == ["a", "b"]
    queued.cancel()
    await asyncio.wait_for(store.close(), 1)


async def test_close_does_not_wait_on_a_silent_store_for_a_batch_whose_callers_are_gone() -> None:
    """A batch takes the queued command along (the claims of a dispatcher round behind a heartbeat); the store does
    not answer, and stop() cancels the batch's caller and the queued command's: close() returns at once."""
    connection = _Held()
    store, in_flight, queued = await _in_flight_and_queued(connection)
    batch = await _batch_sent(store)
    assert [command[1] for command in connection.received] == ["a", "b"]
    for caller in (in_flight, queued, batch):
        caller.cancel()
    await asyncio.wait_for(store.close(), 1)
    assert [command[1] for command in connection.received] == ["a", "b"]


async def test_a_batch_whose_caller_is_gone_still_answers_the_queued_command() -> None:
    """Only the batch's caller is cancelled: the pipeline goes on for the command it took along."""
    connection = _Held()
    store, in_flight, queued = await _in_flight_and_queued(connection)
    batch = await _batch_sent(store)
    batch.cancel()
    connection.answer.set()
    assert [await in_flight, await queued] == ["OK", "OK"]
    await asyncio.wait_for(store.close(), 1)
    assert [command[1] for command in connection.received] == ["a", "b", "c", "d"]


async def test_a_batch_takes_the_commands_queued_before_it_along_in_front() -> None:
    """A batch goes out at once, beside the command in flight; the command queued behind that one leaves with the
    batch, ahead of it. Sent after it, a claim retried behind a slow reply would reach the store after a claim of
    the job's next slot (stream-id would refuse the earlier slot; lease would skip it as an overlap)."""
    connection = _Held()
    store, in_flight, queued = await _in_flight_and_queued(connection)
    batch = await _batch_sent(store)
    assert [command[1] for command in connection.received] == ["a", "b"]  # b first
    connection.answer.set()
    assert [await in_flight, await queued, await batch] == ["OK", "OK", ["OK", "OK"]]
    assert [command[1] for command in connection.received] == ["a", "b", "c", "d"]


async def test_a_batch_sent_as_the_reply_in_flight_comes_still_goes_behind_the_queued_command() -> None:
    """The in-flight reply and the batch's caller wake in one turn of the loop, the reply first: the queued
    command's delivery is scheduled but has not started when the batch goes out. It must still leave first."""
    connection = _Held()
    woken = asyncio.get_running_loop().create_future()
    store, in_flight, queued = await _in_flight_and_queued(connection)

    async def batch() -> list[Any]:
        await woken
        return await store.execute_many([("SET", "c", "1"), ("SET", "d", "1")])

    batched = asyncio.ensure_future(batch())
    await asyncio.sleep(0)
    connection.answer.set()  # a's reply, and in the same turn the batch's caller
    woken.set_result(None)
    assert await asyncio.gather(in_flight, queued, batched) == ["OK", "OK", ["OK", "OK"]]
    assert [command[1] for command in connection.received] == ["a", "b", "c", "d"]


async def test_a_cancelled_batch_leaves_the_commands_it_took_along_to_their_callers() -> None:
    connection = _Held()
    store, in_flight, queued = await _in_flight_and_queued(connection)
    batch = asyncio.ensure_future(store.execute_many([("SET", "c", "1"), ("SET", "d", "1")]))
    await asyncio.sleep(0)
    batch.cancel()  # say, a timeout around its caller
    connection.answer.set()
    assert await in_flight == "OK"
    assert await queued == "OK"  # not failed with the batch
    with pytest.raises(asyncio.CancelledError):
        await batch
    assert await store.execute("SET", "e", "1") == "OK"  # nothing is left counted in flight


async def test_a_batch_that_fails_fails_the_commands_it_took_along() -> None:
    class Down(_Held):
        async def execute_many(self, commands: Sequence[Command]) -> list[Reply | StoreError]:
            raise ConnectionResetError("reset by peer")

    connection = Down()
    store, in_flight, queued = await _in_flight_and_queued(connection)
    with pytest.raises(StoreUnavailableError, match="ConnectionResetError: reset by peer"):
        await store.execute_many([("SET", "c", "1"), ("SET", "d", "1")])
    with pytest.raises(StoreUnavailableError, match="ConnectionResetError: reset by peer"):
        await queued
    connection.answer.set()
    assert await in_flight == "OK"
    assert await store.execute("SET", "e", "1") == "OK"  # nothing is left counted in flight


class _StubNode:
    """A cluster node as a blocking redis-py cluster client holds it: a name and a plain client, whose pipeline
    answers each command with ``answer`` (a reply, or a redis-py exception for an error reply). A node that is
    down fails its whole pipeline."""

    def __init__(self, name: str, answer: Callable[[tuple[Any, ...]], Any], *, down: bool = False) -> None:
        self.name = name
        self.answer = answer
        self.down = down
        self.redis_connection = self
        self.received: list[tuple[Any, ...]] = []

    def pipeline(self, transaction: bool) -> _StubNode:
        self.batch: list[tuple[Any, ...]] = []
        return self

    def execute_command(self, *command: Any) -> None:
        self.batch.append(command)

    def execute(self, raise_on_error: bool) -> list[Any]:
        if self.down:
            raise redis.exceptions.ConnectionError(f"Error 111 connecting to {self.name}. Connection refused.")
        self.received += self.batch
        return [self.answer(command) for command in self.batch]


class _StubCluster:
    """What the cluster adapter reads of a blocking redis-py cluster client: the map from keys to nodes (``owners``
    now, ``owners_next`` once the map is read again), how often the map was read, and whether reading it fails."""

    def __init__(self, owners: dict[str, _StubNode], owners_next: dict[str, _StubNode] | None = None) -> None:
        self.owners = owners
        self.owners_next = owners_next if owners_next is not None else owners
        self.readings = 0
        self.reading_fails = False
        self.reading_waits_for: threading.Event | None = None  # a reading that takes a while (a node's timeout)
        self.nodes_manager = self

    @property
    def nodes_cache(self) -> dict[str, _StubNode]:
        return {node.name: node for node in self.owners.values()}

    def initialize(self) -> None:
        self.readings += 1
        if self.reading_waits_for is not None:
            self.reading_waits_for.wait(10)
        if self.reading_fails:
            raise redis.exceptions.RedisClusterException("Redis Cluster cannot be connected.")
        self.owners = self.owners_next

    def get_node_from_key(self, key: bytes | str) -> _StubNode:
        return self.owners[key.decode() if isinstance(key, bytes) else key]


def _ok(command: tuple[Any, ...]) -> str:
    return "OK"


def _moved(command: tuple[Any, ...]) -> Any:
    return redis.exceptions.ResponseError("MOVED 866 127.0.0.1:7002")


async def test_a_command_moved_where_no_node_answers_fails_alone() -> None:
    """A claim answered MOVED to a node that then cannot be reached comes back unavailable; the other commands of
    the batch ran on their nodes, and their replies stand."""
    up, old_owner, new_owner = _StubNode("up", _ok), _StubNode("old", _moved), _StubNode("new", _ok, down=True)
    cluster = _StubCluster({"a": up, "moving": old_owner}, {"a": up, "moving": new_owner})
    connection = RedisPyCluster(cluster, blocking=True)
    replies = await connection.execute_many([("SET", "a", "1"), ("SET", "moving", "1"), ("SET", "a", "2")])
    assert replies[0] == replies[2] == "OK"
    assert isinstance(replies[1], StoreUnavailableError)
    assert cluster.readings == 1


async def test_a_command_redirected_twice_is_unavailable_for_now() -> None:
    """While a slot changes hands, the map just read may still send a command to a node that no longer serves it:
    a second MOVED is not an answer to the command but a store that cannot serve it yet (retried later)."""
    up, old_owner = _StubNode("up", _ok), _StubNode("old", _moved)
    cluster = _StubCluster({"a": up, "moving": old_owner})
    connection = RedisPyCluster(cluster, blocking=True)
    replies = await connection.execute_many([("SET", "moving", "1"), ("SET", "a", "1")])
    assert isinstance(replies[0], StoreUnavailableError)
    assert "MOVED" in str(replies[0])
    assert replies[1] == "OK"
    assert len(old_owner.received) == 2  # sent once again after the map was read, not more
    assert cluster.readings == 1


async def test_while_a_node_is_down_the_map_is_read_at_most_once_per_interval() -> None:
    """Each reading of the map may wait for the lost node's connect timeout: while it stays down, batches go out by
    the map in hand, and the map is read again at most once per ``MAP_RENEWAL_S``."""
    up, lost = _StubNode("up", _ok), _StubNode("lost", _ok, down=True)
    cluster = _StubCluster({"a": up, "b": lost})
    connection = RedisPyCluster(cluster, blocking=True)
    batch = [("SET", "a", "1"), ("SET", "b", "1")]
    connection.MAP_RENEWAL_S = 3600
    for _ in range(5):
        replies = await connection.execute_many(batch)
        assert replies[0] == "OK"
        assert isinstance(replies[1], StoreUnavailableError)
    assert cluster.readings == 1  # after the first batch found the node down
    connection.MAP_RENEWAL_S = 0  # the interval has passed
    await connection.execute_many(batch)
    assert cluster.readings == 2
    lost.down = False
    for _ in range(3):
        assert await connection.execute_many(batch) == ["OK", "OK"]
    assert cluster.readings == 2  # not read while every node answers


async def test_commands_to_the_nodes_that_answer_do_not_wait_for_a_reading_of_the_map() -> None:
    """A node is down, and reading the map again takes a while (it may wait for that node's timeout): the batch
    that found the node down waits for the reading, a batch to a node that answers does not."""
    up, lost = _StubNode("up", _ok), _StubNode("lost", _ok, down=True)
    cluster = _StubCluster({"a": up, "b": lost})
    cluster.reading_waits_for = threading.Event()
    connection = RedisPyCluster(cluster, blocking=True)
    connection.MAP_RENEWAL_S = 0
    failed = asyncio.ensure_future(connection.execute_many([("SET", "b", "1")]))
    await eventually(lambda: cluster.readings == 1, 5)
    try:
        assert await asyncio.wait_for(connection.execute_many([("SET", "a", "1"), ("SET", "a", "2")]), 1) == [
            "OK",
            "OK",
        ]
        assert not failed.done()
    finally:
        cluster.reading_waits_for.set()
    with pytest.raises(StoreUnavailableError, match="lost"):
        await failed
    assert cluster.readings == 1  # the two batches did not read it once each


async def test_when_the_map_cannot_be_read_the_batch_goes_out_by_the_map_in_hand() -> None:
    """A node is down and reading the map again fails too: the nodes still up answer their part all the same."""
    up, lost = _StubNode("up", _ok), _StubNode("lost", _ok, down=True)
    cluster = _StubCluster({"a": up, "b": lost})
    cluster.reading_fails = True
    connection = RedisPyCluster(cluster, blocking=True)
    for _ in range(2):
        replies = await connection.execute_many([("SET", "a", "1"), ("SET", "b", "1")])
        assert replies[0] == "OK"
        assert isinstance(replies[1], StoreUnavailableError)
    assert cluster.readings == 1


async def test_a_client_without_a_map_reads_it_before_each_command_until_it_has_one() -> None:
    """An asyncio cluster client reads the map lazily: while no reading has succeeded, each command, keyless ones
    too, reads it again (no interval applies) and fails as unavailable when the reading does."""
    up = _StubNode("up", _ok)
    cluster = _StubCluster({}, {"a": up})
    cluster.reading_fails = True
    connection = RedisPyCluster(cluster, blocking=True)
    for command in (("SET", "a", "1"), ("PING",), ("SCRIPT", "LOAD", "return 1")):
        with pytest.raises(StoreUnavailableError):
            await connection.execute(command)
    assert cluster.readings == 3
    cluster.reading_fails = False
    assert await connection.execute(("SET", "a", "1")) == "OK"
    assert cluster.readings == 4


class _ScriptsLostThenStoreGone:
    """A store that lost its scripts (every EVALSHA answered NOSCRIPT), and is gone by the time they are sent again."""

    def __init__(self) -> None:
        self.batches = 0

    async def execute(self, command: Command) -> Reply:
        raise StoreUnavailableError("store unavailable: connection refused")

    async def execute_many(self, commands: Sequence[Command]) -> list[Reply | StoreError]:
        self.batches += 1
        if self.batches > 1:
            raise StoreUnavailableError("store unavailable: connection refused")
        return [StoreReplyError("NOSCRIPT No matching script.") for _ in commands]

    async def server_info(self) -> ServerInfo:
        return ServerInfo("redis", (7, 0))

    async def close(self) -> None:
        return None


async def test_scripts_sent_again_after_noscript_answer_in_place_when_the_store_is_gone() -> None:
    """A batch of claims answered NOSCRIPT is sent again with the scripts; when the store cannot be reached by then,
    each claim's answer is "unavailable" in its place (retried by the scheduler), not an exception for the batch."""
    store = Store(_ScriptsLostThenStoreGone(), owned=False)
    strategy = LeaseStrategy(KeySpace())
    requests = [(RunRequest(job, str(SLOT), SLOT, "t", "r"), JobPolicy()) for job in ("a", "b", "a")]
    claims = await strategy.claim(store, requests)
    assert [type(claim) for claim in claims] == [StoreUnavailableError] * 3
    [alone] = await strategy.claim(store, requests[:1])
    assert isinstance(alone, StoreUnavailableError)


@pytest.mark.parametrize(
    ("client", "warned"),
    [
        (lambda: valkey.Valkey(), True),  # valkey-py's sync client waits without limit unless told otherwise
        (lambda: redis.Redis(socket_timeout=None), True),
        (lambda: redis.Redis(), False),  # redis-py's default: 5 s
        (lambda: valkey.Valkey(socket_timeout=2), False),
    ],
    ids=["valkey-py-default", "redis-py-none", "redis-py-default", "valkey-py-2s"],
)
def test_a_client_without_a_socket_timeout_is_warned_of(
    client: Callable[[], Any], warned: bool, caplog: pytest.LogCaptureFixture
) -> None:
    made = client()
    with caplog.at_level(logging.WARNING, logger="anarchon"):
        adapt(made)
    made.close()
    said = [line for line in caplog.messages if "socket_timeout" in line]
    assert ["has no socket_timeout" in line for line in said] == ([True] if warned else [])


@pytest.mark.parametrize(
    ("client", "warned"),
    [
        (lambda: redis.Redis(socket_timeout=1), True),  # redis-py 8 retries ten times, with backoff: about 15 s
        (lambda: redis.Redis(socket_timeout=1, retry=None), False),
        (lambda: valkey.Valkey(socket_timeout=1), False),  # valkey-py's sync client does not retry
        (lambda: redis.asyncio.Redis(socket_timeout=1), True),  # its pool makes connections through its policy
        (lambda: redis.asyncio.Redis(socket_timeout=1, retry=None), False),
        (lambda: redis.asyncio.Redis(socket_timeout=1, single_connection_client=True), True),
        (lambda: redis.Redis(socket_timeout=1, retry=redis.retry.Retry(redis.backoff.NoBackoff(), -1)), True),
    ],
    ids=[
        "redis-py-sync",
        "redis-py-sync-no-retry",
        "valkey-py-sync",
        "redis-py-async",
        "redis-py-async-no-retry",
        "redis-py-async-single",
        "redis-py-sync-for-ever",
    ],
)
def test_a_client_whose_commands_it_retries_itself_is_warned_of(
    client: Callable[[], Any], warned: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Its retry policy sends a command that gets no answer again (or makes a connection again), after each socket
    timeout: a store that stops answering fails the command after many of them (15.6 s with socket_timeout 1 on
    redis-7, paused)."""
    made = client()
    with caplog.at_level(logging.WARNING, logger="anarchon"):
        adapt(made)
    said = [line for line in caplog.messages if "retry policy" in line]
    assert len(said) == (1 if warned else 0)
    if warned:
        assert said[0].endswith("(create the client with retry=None)")


@pytest.mark.parametrize(
    ("reply", "hint"),
    [
        ("NOPERM User cron has no permissions to run the 'xadd' command", "+@scripting"),
        (
            "ERR The user executing the script can't run this command or subcommand script: 1f0e, on @user_script:67.",
            "+@scripting",
        ),
        ("NOPERM No permissions to access a key", "~{cron:*"),
        ("ERR ACL failure in script: No permissions to access a key script: 1f0e, on @user_script:9.", "~{cron:*"),
    ],
    ids=["command", "command-in-a-script", "key", "key-in-a-script"],
)
def test_a_refusal_by_the_users_acl_says_what_to_allow(reply: str, hint: str) -> None:
    error = translate(redis.exceptions.ResponseError(reply))
    assert isinstance(error, StoreReplyError)
    assert error.reply.startswith(reply)
    assert hint in error.reply.removeprefix(reply)


class _ScriptsLost(_ScriptsLostThenStoreGone):
    """A store that lost its scripts: EVALSHA is answered NOSCRIPT until an EVAL loads the script. It keeps the
    keys of the EVALs it ran, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.loaded: set[str] = set()
        self.evals: list[str] = []

    async def execute(self, command: Command) -> Reply:
        [reply] = await self.execute_many([command])
        if isinstance(reply, StoreError):
            raise reply
        return reply

    async def execute_many(self, commands: Sequence[Command]) -> list[Reply | StoreError]:
        replies: list[Reply | StoreError] = []
        for name, script, _, key in commands:
            if name == "EVAL":
                self.loaded.add(str(script))
                self.evals.append(str(key))
            replies.append(key if name == "EVAL" or script in self.loaded else StoreReplyError("NOSCRIPT No script"))
        return replies


async def test_scripts_lost_are_loaded_again_in_the_batchs_order() -> None:
    """After a script flush, the first call of each script is sent again with EVAL: in the order the batch gave,
    so that a job's earlier command does not reach the store after its later one."""
    connection = _ScriptsLost()
    store = Store(connection, owned=False)
    first, second = (Script(name, name, name) for name in ("first", "second"))  # source and sha alike: the stub's key
    calls = [ScriptCall(first, ["a"], []), ScriptCall(second, ["b"], []), ScriptCall(second, ["c"], [])]
    replies = await store.run_many(calls)
    assert connection.evals == ["a", "b"]
    assert replies == ["a", "b", "c"]


@pytest.mark.parametrize("single_connection", [False, True], ids=["pooled", "single-connection"])
async def test_redis_py_asyncio_batches_keep_error_replies_in_place(
    real_server: ServerUnderTest, single_connection: bool
) -> None:
    client = redis.asyncio.Redis(
        host=real_server.host, port=real_server.port, protocol=2, single_connection_client=single_connection
    )
    connection = RedisPyAsync(client)
    try:
        replies = await connection.execute_many(
            [("SET", "adapter:k", "é 1"), ("INCR", "adapter:k"), ("GET", "adapter:k"), ("PING",)]
        )
        assert replies[0] == "OK"
        assert isinstance(replies[1], StoreReplyError)
        assert replies[1].reply.startswith("ERR value is not an integer")
        assert replies[2:] == ["é 1", "PONG"]
        with pytest.raises(StoreReplyError):
            await connection.execute(("INCR", "adapter:k"))
        assert await connection.execute(("ECHO", 12.5)) == "12.5"
        # A refusal for now (TRYAGAIN: redis-py raises it as it reads it) stays in its place too, and the replies
        # after it are read: none is left on the connection for the client's next command.
        refusal = ("EVAL", "return redis.error_reply('TRYAGAIN the slot is moving')", 0)
        replies = await connection.execute_many([refusal, ("ECHO", "after")])
        assert isinstance(replies[0], StoreUnavailableError)
        assert "TRYAGAIN the slot is moving" in str(replies[0])
        assert replies[1:] == ["after"]
        assert await connection.execute(("ECHO", "next")) == "next"
    finally:
        await client.aclose()


async def test_send_client_batches_keep_refusals_in_place_and_stop_when_the_store_is_gone(
    real_server: ServerUnderTest,
) -> None:
    """A ``send`` client's batch goes one command after another. A refusal for now (TRYAGAIN) stays in its place,
    and the commands after it are sent (they ran: their replies stand). A connection that fails stops the batch:
    the commands left are not sent, and each is answered unavailable; those before keep their replies."""
    client = SendClient(real_server.running)
    connection = SendAdapter(client)
    key = "adapter:send-batch"
    try:
        refusal = ("EVAL", "return redis.error_reply('TRYAGAIN the slot is moving')", 0)
        replies = await connection.execute_many([("DEL", key), ("INCR", key), refusal, ("INCR", key)])
        assert replies[:2] == [0, 1]
        assert isinstance(replies[2], StoreUnavailableError)
        assert "TRYAGAIN the slot is moving" in str(replies[2])
        assert replies[3] == 2

        async def failing(command: str, args: list[str]) -> Any:
            if command == "ECHO":  # redis-py's LOADING, its code taken off the message: a refusal for now too
                raise redis.exceptions.BusyLoadingError("Redis is loading the dataset in memory")
            if command == "PING":
                raise ConnectionError("Connection reset by peer")
            return await SendClient.send(client, command, args)

        client.send = failing  # type: ignore[method-assign]
        client.sent.clear()
        replies = await connection.execute_many([("INCR", key), ("ECHO", "x"), ("INCR", key)])
        assert (replies[0], replies[2]) == (3, 4)
        assert isinstance(replies[1], StoreUnavailableError)
        assert "LOADING" in str(replies[1])
        client.sent.clear()
        replies = await connection.execute_many([("INCR", key), ("PING",), ("INCR", key)])
        assert replies[0] == 5
        assert [type(reply) for reply in replies[1:]] == [StoreUnavailableError] * 2
        assert client.sent == ["INCR"]  # the INCR after the failed PING was not sent
        assert await client.client.get(key) == b"5"
    finally:
        await client.close()


async def test_a_command_cancelled_while_waiting_leaves_no_reply_behind(real_server: ServerUnderTest) -> None:
    """The connection of a cancelled command is closed, never returned to the pool with its reply unread: the
    next command on the client gets its own reply, not the late one."""
    client = redis.asyncio.Redis(host=real_server.host, port=real_server.port, protocol=2)
    connection = RedisPyAsync(client)
    try:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(connection.execute_many([("PING",), ("BLPOP", "adapter:empty", 30)]), 0.1)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(connection.execute(("BLPOP", "adapter:empty", 30)), 0.1)
        # From Python 3.12 on, asyncio closes the socket of a cancelled read a loop turn or more after the
        # cancellation: until then the server still holds its BLPOP (which would wait 30 s, past this wait).
        watcher = real_server.client()
        await eventually(lambda: watcher.info("clients")["blocked_clients"] == 0, cap_s=5)
        watcher.rpush("adapter:empty", "late")  # would answer a BLPOP still waiting
        assert await connection.execute(("ECHO", "mine")) == "mine"
        assert await connection.execute_many([("ECHO", "a"), ("ECHO", "b")]) == ["a", "b"]
        assert await connection.execute(("LLEN", "adapter:empty")) == 1  # no BLPOP was left to take it
    finally:
        await client.aclose()


async def test_a_batch_waits_as_long_as_replies_keep_coming_and_no_longer(real_server: ServerUnderTest) -> None:
    """The socket timeout bounds the wait for each next reply of a batch, not the batch as a whole."""
    client = redis.asyncio.Redis(host=real_server.host, port=real_server.port, protocol=2, socket_timeout=1.6)
    connection = RedisPyAsync(client)
    try:
        # Three blocking pops of 1 s each: 3 s in all, but a reply every second.
        slow = [("BLPOP", "adapter:none", 1)] * 3
        assert await connection.execute_many([*slow, ("ECHO", "done")]) == [None, None, None, "done"]
        # A pop that blocks past the timeout: the batch fails as unreachable, and nothing of it is left behind.
        with pytest.raises(StoreUnavailableError):  # before the pop answers, which it would after 5 s
            await connection.execute_many([("PING",), ("BLPOP", "adapter:none", 5)])
        assert await connection.execute(("ECHO", "next")) == "next"
    finally:
        await client.aclose()


def test_a_map_of_slots_is_kept_only_when_every_slot_has_the_primary_the_cluster_gives_it() -> None:
    """While a node is down, the map in hand is kept when CLUSTER SLOTS, from a node that answers, gives every slot
    the same primary: also a slot inside a range, whose owner changed and changed back (a resharding the client
    saw half of), and not when the cluster covers other slots."""
    a, b = SimpleNamespace(name="10.0.0.1:7000"), SimpleNamespace(name="10.0.0.2:7000")
    ranges = [[0, 8191, ["10.0.0.1", 7000, "id-a"]], [8192, 16383, ["", 7000, "id-b"]]]  # "": the node asked

    def same(slots: dict[int, list[Any]], reply: Any = ranges) -> bool:
        return _same_primaries(slots, reply, "10.0.0.2", lambda host, port: (host, port))

    in_hand = {slot: [a if slot < 8192 else b] for slot in range(16384)}
    assert same(in_hand)
    assert not same({**in_hand, 12_000: [a]})  # one slot inside b's range still given to a
    assert not same(in_hand, ranges[:1])  # the cluster no longer covers b's slots
    with pytest.raises(KeyError):
        same({slot: nodes for slot, nodes in in_hand.items() if slot != 100})  # the map has no node for a slot
