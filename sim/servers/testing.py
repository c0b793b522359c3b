"""What the test suite's `server` fixture yields, and the per-session pool of real servers behind it.

The fixtures themselves live in the repository's root `conftest.py`; this module holds the typed pieces so
that tests can annotate with them (`def test_x(server: ServerUnderTest)`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import fakeredis
import redis
import redis.asyncio

from sim.servers._api import available_targets, backend_for, start_server
from sim.servers._errors import ServerError
from sim.servers._ops import pings
from sim.servers._running import RunningServer
from sim.servers._targets import FAKE, TARGETS, installed

FAKE_VERSION = (7, 0)

__all__ = ["FAKE_VERSION", "ServerPool", "ServerUnderTest", "describe", "flush", "resolve_selection"]


class ServerUnderTest:
    """One store for one test: a real server (flushed before the test) or a fresh in-process FakeServer.

    Clients made through `client()` / `async_client()` are closed by the fixture after the test.
    """

    def __init__(
        self,
        *,
        target: str,
        version: str,
        running: RunningServer | None = None,
        fake_server: fakeredis.FakeServer | None = None,
    ) -> None:
        if (running is None) == (fake_server is None):
            raise ValueError("give exactly one of `running` and `fake_server`")
        self.target = target
        self.version = version
        self.running = running
        self.fake_server = fake_server
        self._clients: list[redis.Redis] = []
        self._async_clients: list[redis.asyncio.Redis] = []

    @classmethod
    def fake(cls) -> ServerUnderTest:
        fake_server = fakeredis.FakeServer(version=FAKE_VERSION, server_type="redis")
        return cls(target=FAKE, version=".".join(map(str, FAKE_VERSION)), fake_server=fake_server)

    @classmethod
    def real(cls, running: RunningServer) -> ServerUnderTest:
        return cls(target=running.target, version=running.version, running=running)

    def __repr__(self) -> str:
        where = "in-process" if self.running is None else self.running.url()
        return f"ServerUnderTest({self.target} {self.version}, {where})"

    @property
    def is_fake(self) -> bool:
        return self.running is None

    @property
    def is_valkey(self) -> bool:
        return self.running is not None and self.running.is_valkey

    @property
    def version_info(self) -> tuple[int, ...]:
        return tuple(int(part) for part in self.version.split("."))

    def _real(self) -> RunningServer:
        if self.running is None:
            raise TypeError(f"{self.target} is the in-process store: it has no host, port or URL")
        return self.running

    @property
    def host(self) -> str:
        return self._real().host

    @property
    def port(self) -> int:
        return self._real().port

    def url(self, db: int = 0) -> str:
        return self._real().url(db)

    def client(self, **kwargs: Any) -> redis.Redis:
        """A sync redis-py client (RESP2), or fakeredis.FakeRedis on the FakeServer; closed after the test."""
        made: redis.Redis
        if self.fake_server is not None:
            made = fakeredis.FakeRedis(server=self.fake_server, **kwargs)
        else:
            made = self._real().client(**kwargs)
        self._clients.append(made)
        return made

    def async_client(self, **kwargs: Any) -> redis.asyncio.Redis:
        """An asyncio redis-py client (RESP2), or FakeAsyncRedis on the FakeServer; closed after the test."""
        made: redis.asyncio.Redis
        if self.fake_server is not None:
            made = fakeredis.FakeAsyncRedis(server=self.fake_server, **kwargs)
        else:
            made = self._real().async_client(**kwargs)
        self._async_clients.append(made)
        return made

    async def aclose(self) -> None:
        """Close every client handed out (the fixture does this after the test)."""
        clients, self._clients = self._clients, []
        async_clients, self._async_clients = self._async_clients, []
        for async_client in async_clients:
            await async_client.aclose()
        for client in clients:
            client.close()


def flush(server: RunningServer) -> None:
    """Empty a real server (every primary of a cluster) between tests: data, cached scripts and (7.0+) function
    libraries."""
    for host, port in server.shards or ((server.host, server.port),):
        client = redis.Redis(host=host, port=port, protocol=2, socket_timeout=10)
        try:
            client.flushall()
            client.script_flush()
            if server.version_info[0] >= 7 or server.is_valkey:
                client.function_flush()
        finally:
            client.close()


class ServerPool:
    """Real servers shared by one test session (one process per target and shape, started on first use)."""

    def __init__(self) -> None:
        self._stack = contextlib.ExitStack()
        self._servers: dict[tuple[str, bool, bool], RunningServer] = {}

    def get(self, target: str, *, replica: bool = False, cluster: bool = False) -> RunningServer:
        """The session's server of this target and shape; revived if a test left it stopped or paused."""
        key = (target, replica, cluster)
        server = self._servers.get(key)
        if server is None:
            server = self._stack.enter_context(start_server(target, replica=replica, cluster=cluster))
            self._servers[key] = server
        for node in (server, server.replica):
            if node is not None:
                _revive(node)
        return server

    def fresh(self, target: str) -> ServerUnderTest:
        """The session's plain server of `target`, flushed."""
        server = self.get(target)
        flush(server)
        return ServerUnderTest.real(server)

    def close(self) -> None:
        self._stack.close()
        self._servers.clear()


def _answers(server: RunningServer) -> bool:
    try:
        return pings(server.host, server.port)
    except redis.RedisError:
        return False


def _revive(server: RunningServer) -> None:
    if _answers(server):
        return
    if server.control.running:
        server.resume()  # left paused
        if _answers(server):
            return
    server.restart()


def resolve_selection(option: str | None) -> tuple[str, ...]:
    """The targets a test run covers: `fake` plus every available target, or exactly those named.

    Raises ValueError for an unknown name or a named target that cannot run here (and says why).
    """
    if option is None:
        try:
            return (FAKE, *available_targets())
        except ServerError as exc:
            raise ValueError(str(exc)) from exc
    names = [name.strip() for name in option.split(",") if name.strip()]
    if not names:
        raise ValueError(f"--servers names no target; choose from {', '.join((FAKE, *TARGETS))}")
    unknown = [name for name in names if name != FAKE and name not in TARGETS]
    if unknown:
        known = ", ".join((FAKE, *TARGETS))
        raise ValueError(f"unknown server target(s) {', '.join(unknown)}; known: {known}")
    problems = []
    for name in names:
        if name == FAKE:
            continue
        try:
            backend_for(name)
        except ServerError as exc:
            problems.append(str(exc))
    if problems:
        raise ValueError("cannot run the requested servers:\n  " + "\n  ".join(problems))
    return tuple(dict.fromkeys(names))


def describe(targets: Sequence[str]) -> str:
    """One line for pytest's header: each target with its version and where it runs from."""
    parts = []
    for target in targets:
        if target == FAKE:
            version = ".".join(map(str, FAKE_VERSION))
            parts.append(f"fake (fakeredis {fakeredis.__version__}, version {version})")
            continue
        found = installed(target, verify=False)
        if backend_for(target) == "local" and found is not None:
            parts.append(f"{target} ({found.version} local)")
        else:
            parts.append(f"{target} (docker)")
    return "servers: " + ", ".join(parts)
