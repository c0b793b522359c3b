"""Replication to a replica: a log the simulator delivers after a lag or holds, and a failover drops the rest of.

Redis replicates what a write did, not the command that did it (a script's writes, not the script). The log
here keeps, after every command the instances send, what each key the command may have written holds then
(its DUMP, or nothing when it is gone) and, for streams with IDMP, the emulated IDMP state. A failover promotes
a replica that holds, in order, every entry delivered by then:

- an entry reaches the replica ``lag_s`` after it was written (the failover's ``lag_ms``);
- entries written while replication is held reach it when the hold ends, and are lost if the primary fails first.

The replica holds a prefix of the log, as a real one does: a link that breaks loses nothing for good, as the
replica resynchronises when it comes back (the primary's backlog replayed, or a full copy), so a broken link is a
hold. What the replica had not received when it is promoted is lost.

The replica needs no server of its own until it is promoted: its dataset is worked out from the log then.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from anarchon._errors import StoreError
from anarchon._store import Command, Connection, Reply, ServerInfo
from anarchon._strategies._claim_only import SERVER_TIME
from sim.idmp import IdmpState, StreamIdmp, text

# Commands that write nothing; every other command anarchon sends writes its first key, or, for scripts, the
# keys it declares. A command the log does not know stops the simulation rather than let the replica drift.
READS = frozenset({
    "DBSIZE", "DUMP", "EXISTS", "GET", "HGET", "HGETALL", "HMGET", "INFO", "KEYS", "MEMORY", "PING", "PTTL",
    "SCAN", "SCRIPT", "SMEMBERS", "TIME", "TYPE", "XINFO", "XLEN", "XRANGE", "XREVRANGE", "ZCARD", "ZRANGE",
    "ZRANGEBYSCORE", "ZREVRANGE", "ZSCORE",
})  # fmt: skip
WRITES_FIRST_KEY = frozenset({
    "DEL", "HDEL", "HSET", "SADD", "SET", "SREM", "XADD", "XCFGSET", "XDEL", "XTRIM", "ZADD", "ZREM",
    "ZREMRANGEBYRANK", "ZREMRANGEBYSCORE",
})  # fmt: skip


# Scripts that only read: what they declare is the key that routes them, not one they write.
READ_ONLY_SCRIPTS = frozenset({SERVER_TIME.sha, SERVER_TIME.source})


def written_keys(command: Command) -> list[str]:
    """The keys ``command`` may write."""
    name = text(command[0]).upper()
    if name in ("EVAL", "EVALSHA"):
        if text(command[1]) in READ_ONLY_SCRIPTS:
            return []
        return [text(key) for key in command[3 : 3 + int(command[2])]]
    if name in READS:
        return []
    if name in WRITES_FIRST_KEY:
        return [text(command[1])]
    raise ValueError(f"the replication log does not know which keys {name} writes")


@dataclass(frozen=True)
class KeyState:
    dumped: bytes
    expires_ms: int | None  # the store's clock, absolute


@dataclass
class Dataset:
    """What a replica holds: keys (absent: gone) and the IDMP state of streams."""

    keys: dict[str, KeyState] = field(default_factory=dict)
    idmp: dict[str, StreamIdmp] = field(default_factory=dict)


@dataclass(frozen=True)
class Entry:
    t: float  # true time of the write
    keys: dict[str, KeyState | None]
    idmp: dict[str, StreamIdmp | None]
    words: frozenset[str]  # the arguments of the commands that wrote it: a claim's token is one of them


class Replication:
    """The primary's replication log and the windows in which it was held."""

    def __init__(self, read_key: Callable[[str], KeyState | None], idmp: IdmpState) -> None:
        self._read_key = read_key  # reads the current primary, at once
        self._idmp = idmp
        self.base = Dataset()  # what the replica held when the log started (a full synchronisation)
        self.log: list[Entry] = []
        self.held: list[tuple[float, float]] = []

    @staticmethod
    def now() -> float:
        return asyncio.get_running_loop().time()

    def record(self, commands: Sequence[Command]) -> None:
        keys = list(dict.fromkeys(key for command in commands for key in written_keys(command)))
        if not keys:
            return
        streams = self._idmp.streams
        self.log.append(
            Entry(
                self.now(),
                {key: self._read_key(key) for key in keys},
                {key: copy.deepcopy(streams.get(key)) for key in keys},
                frozenset(text(word) for command in commands for word in command[1:]),
            )
        )

    def hold(self, start: float, end: float) -> None:
        self.held.append((start, end))

    def _delivered_at(self, entry: Entry, lag_s: float) -> float:
        return max([entry.t + lag_s, *(end for start, end in self.held if start <= entry.t < end)])

    def replica(self, lag_s: float) -> tuple[Dataset, list[Entry]]:
        """What the replica holds now, ``lag_s`` behind, and the entries whose writes it lacks (those it has not
        received: the log's entries from the first of them on, as entries reach it in order)."""
        now = self.now()
        dataset = Dataset(dict(self.base.keys), dict(self.base.idmp))
        for index, entry in enumerate(self.log):
            if self._delivered_at(entry, lag_s) > now:
                return dataset, self.log[index:]
            for key, state in entry.keys.items():
                if state is None:
                    dataset.keys.pop(key, None)
                else:
                    dataset.keys[key] = state
            for key, stream in entry.idmp.items():
                if stream is None:
                    dataset.idmp.pop(key, None)
                else:
                    dataset.idmp[key] = stream  # a copy made when it was logged, copied again when promoted
        return dataset, []

    def restart(self, base: Dataset) -> None:
        """A full synchronisation: the replica now holds ``base``; the log starts again."""
        self.base = base
        self.log.clear()


class ReplicatedConnection:
    """A store connection whose commands are written to the replication log as they run."""

    def __init__(self, inner: Connection, replication: Replication) -> None:
        self.inner = inner
        self.replication = replication

    async def execute(self, command: Command) -> Reply:
        try:
            return await self.inner.execute(command)
        finally:
            self.replication.record([command])  # also after an error: a script may have written before it

    async def execute_many(self, commands: Sequence[Command]) -> list[Reply | StoreError]:
        try:
            return await self.inner.execute_many(commands)
        finally:
            self.replication.record(commands)

    async def server_info(self) -> ServerInfo:
        return await self.inner.server_info()

    async def close(self) -> None:
        await self.inner.close()
