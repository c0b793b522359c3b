"""Redis 8.6's idempotent XADD (IDMP), emulated on top of the embedded store.

fakeredis 2.41 accepts ``XADD … IDMP`` but gets it wrong (no expiry, no size limit, XCFGSET does not clear). This
connection wrapper answers ``XADD … IDMP``, ``XCFGSET`` and the IDMP fields of ``XINFO STREAM`` the way Redis
8.6.3 does (``src/t_stream.c``), and passes everything else through:

- per stream, per producer id, a map of idempotent id → the ID of the entry it created, in insertion order;
- a repeat returns the original entry's ID without writing, whether or not that entry still exists;
- a map holds at most ``IDMP-MAXSIZE`` ids per producer (the oldest goes), and forgets an id once its entry's ID
  is ``IDMP-DURATION`` seconds old (Redis does this in serverCron, once a second; here, when the map is read,
  the earliest moment the server may);
- ``XCFGSET`` needs an existing stream, checks 1..86400 s and 1..10000, and clears every map when it changes a
  value (not when it sets the same one); new streams start at 100 s and 100 ids.

fakeredis runs a script's ``redis.call`` itself, past this wrapper: the scripts of anarchon's that send IDMP commands,
the idmp strategy's configure, skip claim and trim, are answered here, step by step as their Lua does them.

The state is part of the dataset: :class:`IdmpState` is snapshotted and restored with it across a failover.
"""

from __future__ import annotations

import asyncio
import copy
import re
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from anarchon._config import IDMP_MAX_DURATION_S
from anarchon._errors import StoreError, StoreReplyError
from anarchon._job import IDMP_MAX_SIZE
from anarchon._store import Command, Connection, Reply, Script, ServerInfo, as_list
from anarchon._strategies.idmp import CONFIGURE, SKIP_CLAIM, TRIM_RUNS

DEFAULT_DURATION_S = 100
DEFAULT_MAXSIZE = 100
# The scripts answered here, by what EVALSHA or EVAL names them with.
ANSWERED_SCRIPTS = {key: script for script in (CONFIGURE, SKIP_CLAIM, TRIM_RUNS) for key in (script.sha, script.source)}
# The server's ranges, which anarchon's settings check too.
_XCFGSET_RANGES = {"IDMP-DURATION": (1, IDMP_MAX_DURATION_S, "seconds"), "IDMP-MAXSIZE": (1, IDMP_MAX_SIZE, "entries")}
_INTEGER = re.compile(r"-?(0|[1-9][0-9]*)")


def _integer(value: str) -> int | None:
    """A 64-bit integer as Redis reads one (no sign but "-", no spaces, no leading zeros), or None."""
    if not _INTEGER.fullmatch(value):
        return None
    number = int(value)
    return number if -(2**63) <= number < 2**63 else None


@dataclass
class StreamIdmp:
    duration_s: int = DEFAULT_DURATION_S
    maxsize: int = DEFAULT_MAXSIZE
    producers: dict[str, OrderedDict[str, str]] = field(default_factory=dict)
    added: int = 0
    duplicates: int = 0

    @property
    def tracked(self) -> int:
        """The idempotent ids it keeps, every producer's (XINFO's iids-tracked)."""
        return sum(len(ids) for ids in self.producers.values())

    def expire(self, now_ms: int) -> None:
        threshold = now_ms - self.duration_s * 1000
        for pid in list(self.producers):
            ids = self.producers[pid]
            while ids and int(next(iter(ids.values())).split("-")[0]) <= threshold:
                ids.popitem(last=False)
            if not ids:
                del self.producers[pid]


@dataclass
class IdmpState:
    streams: dict[str, StreamIdmp] = field(default_factory=dict)
    # The server runs one command at a time: a lookup and the insert it leads to are one step.
    lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False, compare=False)

    def copy(self) -> IdmpState:
        return IdmpState(copy.deepcopy(self.streams))


def text(arg: object) -> str:
    return arg.decode() if isinstance(arg, bytes) else str(arg)


class IdmpConnection:
    """Wraps a connection to the embedded store with Redis 8.6's IDMP semantics."""

    def __init__(self, inner: Connection, state: IdmpState) -> None:
        self.inner = inner
        self.state = state

    @staticmethod
    def _now_ms() -> int:
        return int(time.time() * 1000)  # the store's clock (virtual in a simulation)

    async def execute(self, command: Command) -> Reply:
        name = text(command[0]).upper()
        if name == "XADD":
            args = [text(a) for a in command]
            options = _xadd_options(args)
            if options.idmp_at:
                return await self._xadd_idmp(args, options)
        elif name == "XCFGSET":
            return await self._xcfgset([text(a) for a in command])
        elif name == "XINFO" and len(command) >= 3 and text(command[1]).upper() == "STREAM":
            return await self._xinfo(command)
        elif name in ("EVALSHA", "EVAL") and (script := ANSWERED_SCRIPTS.get(text(command[1]))) is not None:
            await self._as_cached(name, script)
            args = [text(a) for a in command[3:]]
            if script is CONFIGURE:
                return await self._configure(*args[:4])
            if script is SKIP_CLAIM:
                return await self._skip_claim(*args)
            return await self._trim_runs(*args[:3])
        return await self.inner.execute(command)

    async def _as_cached(self, name: str, script: Script) -> None:
        """What the store's script cache makes of a script answered here: EVALSHA of one it does not hold (after a
        restart, a failover, SCRIPT FLUSH) is refused NOSCRIPT, and EVAL caches it."""
        if name == "EVAL":
            await self.inner.execute(["SCRIPT", "LOAD", script.source])
        elif as_list(await self.inner.execute(["SCRIPT", "EXISTS", script.sha])) != [1]:
            raise StoreReplyError("NOSCRIPT No matching script. Please use EVAL.")

    async def execute_many(self, commands: Sequence[Command]) -> list[Reply | StoreError]:
        results: list[Reply | StoreError] = []
        for command in commands:  # one by one: IDMP commands must see the effects of the ones before them
            try:
                results.append(await self.execute(command))
            except StoreReplyError as error:
                results.append(error)
        return results

    async def server_info(self) -> ServerInfo:
        return await self.inner.server_info()

    async def close(self) -> None:
        await self.inner.close()

    async def _xadd_idmp(self, args: list[str], options: XaddOptions) -> Reply:
        if options.id_at >= len(args):
            raise StoreReplyError("ERR wrong number of arguments for 'xadd' command")
        if args[options.id_at] != "*":
            raise StoreReplyError("ERR syntax error, IDMP/IDMPAUTO can be used only with auto-generated IDs")
        async with self.state.lock:
            return await self._xadd_idmp_locked(args, options)

    async def _xadd_idmp_locked(self, args: list[str], options: XaddOptions) -> Reply:
        key, (pid, iid) = args[1], options.idmp
        if not await self.inner.execute(["EXISTS", key]):
            self.state.streams.pop(key, None)  # what a stream tracks goes with it (DEL, a flush, eviction)
            if options.nomkstream:
                return None
        stream = self.state.streams.get(key)
        if stream is not None:
            stream.expire(self._now_ms())
            known = stream.producers.get(pid)
            original = known.get(iid) if known is not None else None
            if original is not None:
                stream.duplicates += 1
                return original
        at = options.idmp_at
        plain = args[:at] + args[at + 3 :]  # the same XADD without IDMP pid iid
        entry_id = text(await self.inner.execute(plain))
        stream = self.state.streams.setdefault(key, StreamIdmp())
        ids = stream.producers.setdefault(pid, OrderedDict())
        ids[iid] = entry_id
        stream.added += 1
        if len(ids) > stream.maxsize:
            ids.popitem(last=False)
        return entry_id

    async def _xcfgset(self, args: list[str]) -> Reply:
        if len(args) < 2:
            raise StoreReplyError("ERR wrong number of arguments for 'xcfgset' command")
        key = args[1]
        kind = text(await self.inner.execute(["TYPE", key]))
        if kind == "none":
            raise StoreReplyError("ERR no such key")
        if kind != "stream":
            raise StoreReplyError("WRONGTYPE Operation against a key holding the wrong kind of value")
        # Read as Redis reads them, one name and value at a time, each checked as it comes.
        settings: dict[str, int] = {}
        for at in range(2, len(args), 2):
            name = args[at].upper()
            if name not in _XCFGSET_RANGES or at + 1 == len(args):
                raise StoreReplyError("ERR syntax error")
            if name in settings:
                raise StoreReplyError(f"ERR {name} specified multiple times")
            value = _integer(args[at + 1])
            if value is None:
                raise StoreReplyError("ERR value is not an integer or out of range")
            low, high, unit = _XCFGSET_RANGES[name]
            if not low <= value <= high:
                raise StoreReplyError(f"ERR {name} must be between {low} and {high} {unit}")
            settings[name] = value
        if not settings:
            raise StoreReplyError("ERR At least one parameter must be specified")
        duration, maxsize = settings.get("IDMP-DURATION"), settings.get("IDMP-MAXSIZE")
        stream = self.state.streams.setdefault(key, StreamIdmp())
        if duration is not None and duration != stream.duration_s:
            stream.duration_s = duration
            stream.producers.clear()
        if maxsize is not None and maxsize != stream.maxsize:
            stream.maxsize = maxsize
            stream.producers.clear()
        return "OK"

    async def _configure(self, key: str, duration: str, max_size: str, producer: str) -> Reply:
        """anarchon/_lua/idmp_configure.lua, one step for each of its commands."""
        async with self.state.lock:
            made = not await self.inner.execute(["EXISTS", key])
            if made:
                self.state.streams.pop(key, None)
                make = ["XADD", key, "IDMP", "anarchon:made", "1", "*", "created", "1"]
                entry = await self._xadd_idmp_locked(make, _xadd_options(make))
                await self.inner.execute(["XDEL", key, text(entry)])
            stream = self.state.streams.setdefault(key, StreamIdmp())
            old_duration, old_max_size = stream.duration_s, stream.maxsize
            wanted = (int(duration), int(max_size))
            if not made:  # never shorter, never smaller
                wanted = (max(wanted[0], old_duration), max(wanted[1], old_max_size))
            if (old_duration, old_max_size) == wanted:
                return [-1, *wanted]
            await self._xcfgset(["XCFGSET", key, "IDMP-DURATION", str(wanted[0]), "IDMP-MAXSIZE", str(wanted[1])])
            since = self._now_ms() - max(wanted[0], old_duration) * 1000 - 1000
            entries = await self.inner.execute(["XREVRANGE", key, "+", since, "COUNT", wanted[1]])
            copied: set[str] = set()
            for entry in reversed(as_list(entries)):
                fields = as_list(as_list(entry, 2)[1])
                names = [text(f) for f in fields[::2]]
                if "slot" in names and (slot := text(fields[2 * names.index("slot") + 1])) not in copied:
                    copied.add(slot)
                    add = ["XADD", key, "IDMP", producer, slot, "*", *(text(f) for f in fields)]
                    await self._xadd_idmp_locked(add, _xadd_options(add))
            return [len(copied), *wanted]

    async def _skip_claim(self, key: str, producer: str, slot: str, min_id: str, *fields: str) -> Reply:
        """anarchon/_lua/idmp_skip.lua, one step for each of its commands."""
        async with self.state.lock:
            if not await self.inner.execute(["EXISTS", key]):
                return None
            stream = self.state.streams.setdefault(key, StreamIdmp())
            stream.expire(self._now_ms())
            if stream.tracked >= stream.maxsize:
                return None
            duration_ms, now = stream.duration_s * 1000, self._now_ms()
            if now > int(slot) + duration_ms:
                return None
            since = max(0, int(slot) - duration_ms)
            until = min(int(slot), now - duration_ms + 1000)
            if until >= since:
                for entry in as_list(await self.inner.execute(["XRANGE", key, since, until])):
                    entry_id, entry_fields = as_list(entry, 2)
                    values = [text(value) for value in as_list(entry_fields)]
                    if "slot" in values[::2] and values[values[::2].index("slot") * 2 + 1] == slot:
                        return text(entry_id)
            add = ["XADD", key, "NOMKSTREAM", "IDMP", producer, slot, "MINID", "~", min_id, "*", *fields]
            return await self._xadd_idmp_locked(add, _xadd_options(add))

    async def _trim_runs(self, key: str, history_size: str, ttl_ms: str) -> Reply:
        """anarchon/_lua/idmp_trim.lua, one step for each of its commands."""
        async with self.state.lock:
            if not await self.inner.execute(["EXISTS", key]):
                return 0
            stream = self.state.streams.setdefault(key, StreamIdmp())
            now, kept_ms = self._now_ms(), 2 * stream.duration_s * 1000
            excess = int(text(await self.inner.execute(["XLEN", key]))) - max(int(history_size), stream.maxsize)
            if excess > 0:
                oldest = as_list(await self.inner.execute(["XRANGE", key, "-", now - kept_ms - 1, "COUNT", excess]))
                if oldest:
                    last_ms, last_seq = text(as_list(oldest[-1], 2)[0]).split("-")
                    await self.inner.execute(["XTRIM", key, "MINID", f"{last_ms}-{int(last_seq) + 1}"])
            if int(ttl_ms) > 0:
                await self.inner.execute(["XTRIM", key, "MINID", now - max(int(ttl_ms), kept_ms)])
            return await self.inner.execute(["XLEN", key])

    async def _xinfo(self, command: Command) -> Reply:
        reply = await self.inner.execute(command)
        if not isinstance(reply, list):
            return reply
        stream = self.state.streams.get(text(command[2]), StreamIdmp())
        stream.expire(self._now_ms())
        ours = {
            "idmp-duration": stream.duration_s,
            "idmp-maxsize": stream.maxsize,
            "pids-tracked": len(stream.producers),
            "iids-tracked": stream.tracked,
            "iids-added": stream.added,
            "iids-duplicates": stream.duplicates,
        }
        fields = dict(zip(reply[::2], reply[1::2], strict=True))
        fields.update(ours)
        return [item for pair in fields.items() for item in pair]


@dataclass(frozen=True)
class XaddOptions:
    id_at: int  # where the entry ID is
    idmp_at: int  # where IDMP is, followed by the producer id and the idempotent id (0: no IDMP)
    idmp: tuple[str, str]
    nomkstream: bool


def _xadd_options(args: list[str]) -> XaddOptions:
    """Where the options of ``XADD key [NOMKSTREAM] [IDMP pid iid] [MAXLEN|MINID [=|~] n [LIMIT c]] id …`` are, in
    any order, as Redis reads them: the first argument that is no option is the entry ID."""
    at, idmp_at, nomkstream = 2, 0, False
    while at < len(args):
        option = args[at].upper()
        if option == "NOMKSTREAM":
            nomkstream, at = True, at + 1
        elif option == "IDMP" and at + 2 < len(args):
            idmp_at, at = at, at + 3
        elif option in ("MAXLEN", "MINID"):
            at += 3 if args[at + 1 : at + 2] in (["="], ["~"]) else 2
        elif option == "LIMIT":
            at += 2
        else:
            break
    idmp = (args[idmp_at + 1], args[idmp_at + 2]) if idmp_at else ("", "")
    return XaddOptions(at, idmp_at, idmp, nomkstream)
