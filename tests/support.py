"""Helpers of the tests that run schedulers on a store: an execution ledger kept outside the store, backends on
any target, and waiting for something to happen."""

from __future__ import annotations

import asyncio
import inspect
import itertools
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from glide import (
    GlideClient,
    GlideClientConfiguration,
    GlideClusterClient,
    GlideClusterClientConfiguration,
    NodeAddress,
    ProtocolVersion,
)

from anarchon import RedisBackend, RunContext, ValkeyBackend
from anarchon._store import Command, Connection, Reply, Script, ServerInfo
from sim.run import simulate
from sim.scenario import Scenario
from sim.servers import RunningServer

VIRTUAL_SEEDS = (1, 2, 3)


def assert_virtual_verdicts(scenario: Scenario, strategy: str, expected: Mapping[str, str]) -> None:
    """``scenario`` under ``strategy`` in virtual time, with each of VIRTUAL_SEEDS: each checker gets its verdict."""
    for seed in VIRTUAL_SEEDS:
        outcome = simulate(scenario, strategy, seed)
        departures = outcome.departures(expected)
        assert not departures, "\n".join([*departures, f"replay: {outcome.replay_command()}"])


def runs_script(command: Sequence[Any], script: Script) -> bool:
    """Whether ``command`` runs ``script``: EVALSHA, or EVAL (after NOSCRIPT)."""
    return len(command) > 1 and str(command[1]) in (script.sha, script.source)


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def second_from_now(seconds: int) -> str:
    """A cron expression (seconds field first) that fires once a minute, ``seconds`` from now."""
    return f"{(int(time.time()) + seconds) % 60} * * * * *"


async def eventually(condition: Callable[[], bool | Awaitable[bool]], cap_s: float) -> None:
    """Poll until ``condition()`` holds (awaited, if it is a coroutine function), for at most ``cap_s`` seconds; the
    assertions after it say what was missing if it never did."""
    for _ in range(int(cap_s * 10)):
        holds = condition()
        if await holds if inspect.isawaitable(holds) else holds:
            return
        await asyncio.sleep(0.1)


def backend_for(target: str, connection: Any, strategy: Any = "lease", prefix: str = "cron:") -> RedisBackend[Any]:
    """ValkeyBackend on a Valkey target (``valkey-9``), RedisBackend elsewhere."""
    if target.startswith("valkey"):
        return ValkeyBackend(valkey=connection, strategy=strategy, prefix=prefix)
    return RedisBackend(redis=connection, strategy=strategy, prefix=prefix)


@dataclass
class Execution:
    instance: str
    job: str
    slot: int
    attempt: int
    manual: bool
    started_ms: int  # wall clock of the test process, the same for every instance
    ended_ms: int | None = None  # None: cancelled or still running


@dataclass
class Ledger:
    """Every execution of a job function, kept outside the store."""

    executions: list[Execution] = field(default_factory=list)

    def job(
        self, instance: str, seconds: float = 0.0, before: Callable[[RunContext], Awaitable[None]] | None = None
    ) -> Callable[[RunContext], Awaitable[None]]:
        async def work(run: RunContext) -> None:
            execution = Execution(instance, run.job, run.slot, run.attempt, run.manual, now_ms())
            self.executions.append(execution)
            if before is not None:
                await before(run)
            if seconds:
                await asyncio.sleep(seconds)
            execution.ended_ms = now_ms()

        return work

    def of(self, job: str | None = None) -> list[Execution]:
        """Scheduled (not manual) executions, of one job or of all."""
        return [e for e in self.executions if not e.manual and (job is None or e.job == job)]

    def slots(self, job: str | None = None) -> Counter[int]:
        return Counter(e.slot for e in self.of(job))

    def by_slot(self, job: str) -> dict[int, list[Execution]]:
        slots: dict[int, list[Execution]] = defaultdict(list)
        for execution in self.of(job):
            slots[execution.slot].append(execution)
        return slots


def jobs_on_every_shard(cluster: RunningServer, key_of: Callable[[str], str], per_shard: int) -> list[str]:
    """Job names whose key ``key_of(job)`` lives on each primary of the cluster, ``per_shard`` per primary, taken
    in turn (names that differ in one character hash to nearby slots, mostly on one primary)."""
    chosen: dict[tuple[str, int], list[str]] = {shard: [] for shard in cluster.shards}
    for job in (f"job{index}" for index in itertools.count()):
        on_shard = chosen[cluster.shard_of(key_of(job))]
        if len(on_shard) < per_shard:
            on_shard.append(job)
        if all(len(jobs) == per_shard for jobs in chosen.values()):
            return [job for turn in zip(*chosen.values(), strict=True) for job in turn]
    raise AssertionError("unreachable")


class Recording:
    """A connection that keeps every command sent through it (the seam every client adapter implements)."""

    def __init__(self, inner: Connection) -> None:
        self.inner = inner
        self.sent: list[Command] = []

    async def execute(self, command: Command) -> Reply:
        self.sent.append(command)
        return await self.inner.execute(command)

    async def execute_many(self, commands: Sequence[Command]) -> list[Any]:
        self.sent.extend(commands)
        return await self.inner.execute_many(commands)

    async def server_info(self) -> ServerInfo:
        return await self.inner.server_info()

    async def close(self) -> None:
        await self.inner.close()


def glide(
    *, cluster: bool, protocol: ProtocolVersion, request_timeout_ms: int | None = None
) -> Callable[[RunningServer], Any]:
    """A factory of GLIDE clients (standalone or cluster) speaking ``protocol``; GLIDE's request timeout (250 ms)
    unless ``request_timeout_ms`` is given."""
    client, configuration = (GlideClusterClient, GlideClusterClientConfiguration) if cluster else (
        GlideClient, GlideClientConfiguration,
    )  # fmt: skip

    async def make(server: RunningServer) -> Any:
        address = NodeAddress(server.host, server.port)
        return await client.create(configuration([address], protocol=protocol, request_timeout=request_timeout_ms))

    return make


async def close_client(client: Any) -> None:
    """Close a client of any kind: ``aclose()`` (redis-py asyncio), else ``close()``, awaited where it must be."""
    for name in ("aclose", "close"):
        method = getattr(client, name, None)
        if method is not None:
            result = method()
            if inspect.isawaitable(result):
                await result
            return
