"""A store under test (fake or a real server of the matrix) that makes backends on fresh connections; one run's
request, claim and record, as the strategy tests make them."""

from __future__ import annotations

import asyncio
from typing import Any

import fakeredis
import redis.asyncio

from anarchon import RedisBackend, RunRecord, ValkeyBackend
from anarchon._adapters import RedisPyAsync, adapt
from anarchon._store import Reply, Store
from anarchon._strategies import Claim, JobPolicy, RunRequest
from sim.links import Link

SLOT = 1_700_000_000_000  # a slot long past, for runs named by a string


def request(run: int | str, token: str, *, job: str = "sync", manual: bool = False) -> RunRequest:
    slot = run if isinstance(run, int) else SLOT
    return RunRequest(job, str(run), slot, token, f"runner-{token}", manual)


async def claim_one(backend: RedisBackend[Any], req: RunRequest, policy: JobPolicy) -> Claim:
    [result] = await backend.strategy.claim(backend.store, [(req, policy)])
    assert isinstance(result, Claim), result
    return result


def record(req: RunRequest, claim: Claim, status: Any = "ok", message: str | None = None) -> RunRecord:
    return RunRecord(
        job=req.job, run=req.run, slot=req.slot, attempt=claim.attempt, status=status, runner=req.runner,
        token=req.token, fence=claim.fence, manual=req.manual, started=req.slot, ended=req.slot + 1, message=message,
    )  # fmt: skip


async def server_ms(store: Store) -> int:
    """The server's clock (TIME), in ms."""
    seconds, micros = await store.execute("TIME")  # type: ignore[misc]
    return int(seconds) * 1000 + int(micros) // 1000


# The idmp settings trimmed_after_claims_sent_together expects: ids remembered 1 s, 10 per job
IDMP_TRIMMED_QUICKLY = {"duration_sec": 1, "max_size": 10}


async def trimmed_after_claims_sent_together(backend: RedisBackend[Any]) -> int:
    """Length of job sync's runs stream after 40 claims sent in one batch (their entries share a ms or two), 2.5 s
    (past two durations), then a run claimed and recorded, whose trim keeps history_size 10 of its entries."""
    policy = JobPolicy(history_size=10, keep_ms=1000)
    now = await server_ms(backend.store)
    batch = [(request(now - 100_000 + i * 1000, f"t{i}"), policy) for i in range(40)]
    assert all(isinstance(c, Claim) for c in await backend.strategy.claim(backend.store, batch))
    await asyncio.sleep(2.5)
    later = request(now + 1000, "later")
    claim = await claim_one(backend, later, policy)
    assert await backend.strategy.finish(backend.store, later, claim, policy, record(later, claim))
    length: Reply = await backend.store.execute("XLEN", "cron:sync:runs")
    return int(length)  # type: ignore[arg-type]


class StoreTarget:
    """One store under test: `fake` (fakeredis) or a real server of the matrix."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.name: str = server.target
        self.is_fake: bool = server.is_fake
        self.is_valkey = self.name.startswith("valkey") or (
            self.is_fake and getattr(server.fake_server, "server_type", "redis") == "valkey"
        )
        self.describe = f"version {server.version}"
        version = tuple(int(p) for p in str(server.version).split(".")[:2])
        self.supports_idmp = not self.is_fake and not self.is_valkey and version >= (8, 6)
        self._clients: list[Any] = []
        self._backends: list[RedisBackend[Any]] = []
        self.admin = Store(RedisPyAsync(self.new_client()), owned=False)

    def new_client(self) -> Any:
        """A fresh asyncio client with its own connection pool (RESP2)."""
        if self.is_fake:
            client: Any = fakeredis.FakeAsyncRedis(server=self.server.fake_server)
        else:
            client = redis.asyncio.Redis.from_url(self.server.url(), protocol=2)
        self._clients.append(client)
        return client

    def backend(
        self, strategy: Any = "lease", prefix: str = "cron:", *, as_redis: bool = False, connection: Any = None
    ) -> RedisBackend[Any]:
        """A backend on a fresh connection (or ``connection``): ValkeyBackend on Valkey unless ``as_redis``."""
        backend: RedisBackend[Any]
        connection = self.new_client() if connection is None else connection
        if self.is_valkey and not as_redis:
            backend = ValkeyBackend(valkey=connection, strategy=strategy, prefix=prefix)
        else:
            backend = RedisBackend(redis=connection, strategy=strategy, prefix=prefix)
        self._backends.append(backend)
        return backend

    def linked_backend(
        self, strategy: Any = "lease", prefix: str = "cron:", name: str = "link"
    ) -> tuple[RedisBackend[Any], Link]:
        """A backend whose connection the test can cut (see sim.links.Link)."""
        link = Link(adapt(self.new_client()), name)
        return self.backend(strategy, prefix, connection=link), link

    async def started_backend(self, strategy: Any = "lease", prefix: str = "cron:") -> RedisBackend[Any]:
        backend = self.backend(strategy, prefix)
        await backend.start(["sync"])
        return backend

    async def raw(self, *command: Any) -> Any:
        reply: Reply = await self.admin.execute(*command)
        return reply

    async def server_ms(self) -> int:
        return await server_ms(self.admin)

    async def close(self) -> None:
        for backend in self._backends:
            await backend.stop()
        for client in self._clients:
            await client.aclose()
