"""The one narrow seam under anarchon: send a command, send a batch, close.

Every client adapter (redis-py, valkey-py, GLIDE, fakeredis, ``send(command, args)`` objects) and the
simulator's store implement :class:`Connection`. Replies come back in RESP2 shape with bytes decoded to ``str``;
server error replies become :class:`StoreReplyError` and unreachable stores :class:`StoreUnavailableError`, so
nothing above this module knows which client is in use.

:class:`Store` adds what every strategy needs on top: Lua scripts run by SHA with a transparent reload on
``NOSCRIPT`` (scripts are not replicated to a promoted replica, and servers evict cached scripts), batches of
script calls in one round trip, and server detection.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from collections.abc import Awaitable, Callable, Coroutine, Hashable, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any, Literal, NamedTuple, Protocol, TypeAlias

from ._errors import StoreError, StoreReplyError, StoreUnavailableError

Arg: TypeAlias = str | int | float | bytes
Reply: TypeAlias = int | str | list["Reply"] | None
Command: TypeAlias = Sequence[Arg]


@dataclass(frozen=True, slots=True)
class ServerInfo:
    """What the store is: Redis or Valkey, and which version (Valkey's own version, not its Redis alias)."""

    kind: Literal["redis", "valkey"]
    version: tuple[int, ...]

    def at_least(self, *version: int) -> bool:
        return self.version >= version

    @property
    def has_idmp(self) -> bool:
        """Whether the server has idempotent XADD (IDMP): Redis 8.6 and later; Valkey has none."""
        return self.kind == "redis" and self.at_least(8, 6)

    def __str__(self) -> str:
        name = "Redis" if self.kind == "redis" else "Valkey"
        return f"{name} {'.'.join(map(str, self.version))}"


def parse_info(reply: Reply) -> ServerInfo:
    """Read ``INFO server``: its text, or the map of its fields that a ``send`` client may hand back (what its own
    client made of the reply: redis-py parses it, given the command name as a string), which decode() flattens to
    [field, value, …]. Valkey reports ``redis_version:7.2.4`` beside its own ``valkey_version``."""
    if isinstance(reply, list) and reply and len(reply) % 2 == 0 and ":" not in str(reply[0]):
        fields = {key: str(value) for key, value in as_map(reply).items()}
    else:  # the text; from a cluster client, one per node, alike (as_text takes the first)
        fields = {}
        for line in as_text(reply).splitlines():
            key, sep, value = line.partition(":")
            if sep:
                fields[key.strip()] = value.strip()
    if "valkey_version" in fields or fields.get("server_name") == "valkey":
        return ServerInfo("valkey", _version(fields.get("valkey_version", fields.get("redis_version", "0"))))
    return ServerInfo("redis", _version(fields.get("redis_version", "0")))


def as_map(reply: Reply | StoreError) -> dict[str, Reply]:
    """A map sent flat, as RESP2 sends one (and decode() flattens RESP3's): key, value, key, value…"""
    flat = as_list(reply)
    return {as_text(key): value for key, value in zip(flat[::2], flat[1::2], strict=True)}


def parse_hello(reply: Reply) -> ServerInfo:
    """Read ``HELLO``'s answer: server, its name, version, its version… (a flat array in RESP2 and once decoded;
    cluster clients send it to one node)."""
    pairs = as_map(reply)
    server, version = pairs.get("server"), pairs.get("version")
    if not isinstance(server, str) or not isinstance(version, str):
        raise StoreError(f"unexpected reply from the store to HELLO: {reply!r:.200}")
    return ServerInfo("valkey" if server == "valkey" else "redis", _version(version))


async def detect_server(execute: Callable[[Command], Awaitable[Reply]]) -> ServerInfo:
    """What the server is, from ``INFO server``. Where that is refused (INFO is in the ACL category @dangerous,
    which locked-down users lack, or it was renamed away), from ``HELLO`` without arguments (Redis 6.2 and later,
    Valkey), which answers as INFO would and leaves the connection's protocol as it is."""
    try:
        return parse_info(await execute(["INFO", "server"]))
    except StoreReplyError as refused:
        if refused.reply.startswith(("WRONGPASS", "NOAUTH")) or "password" in refused.reply.lower():
            # Refused as the connection opened, before any command: HELLO would be refused the same way.
            raise StoreReplyError(
                f"{refused.reply} (the store refused the connection's username or password)"
            ) from None
        info_refused = refused
    try:
        return parse_hello(await execute(["HELLO"]))
    except StoreReplyError as refused:
        if "HELLO" in info_refused.reply and "HELLO" in refused.reply:
            # The client opened its connection with HELLO 3 (redis-py 8 does by default), which a server before
            # Redis 6 does not know: every command fails with it.
            raise StoreReplyError(
                f"{info_refused.reply}: the client speaks RESP3 (HELLO 3), which this server (before Redis 6) does "
                "not know; create the client with protocol=2"
            ) from None
        if "DB index is out of range" in info_refused.reply:  # the connection's SELECT, before any command
            raise StoreReplyError(
                f"{info_refused.reply}: the database number is beyond what the server has (its `databases` "
                "setting; 16 by default: 0..15)"
            ) from None
        raise StoreReplyError(
            f"{info_refused.reply} (to INFO server); {refused.reply} (to HELLO): anarchon reads the server's kind "
            "and version with either; allow this user one of them"
        ) from None


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


class Connection(Protocol):
    """What anarchon needs from a client. Implementations translate their exceptions at this seam."""

    async def execute(self, command: Command) -> Reply:
        """Send one command; raise StoreReplyError for an error reply, StoreUnavailableError if unreachable."""
        ...

    async def execute_many(self, commands: Sequence[Command]) -> list[Reply | StoreError]:
        """Send commands in one round trip where the client can (not a transaction). Error replies are
        returned in place, so one failing command does not hide the others' results; so is a
        StoreUnavailableError for commands that did not run for now (a cluster node out of reach, TRYAGAIN).
        When the store cannot be reached at all, StoreUnavailableError may be raised instead."""
        ...

    async def server_info(self) -> ServerInfo:
        """Detect the server (``INFO server`` on real servers)."""
        ...

    async def close(self) -> None:
        """Release the client. Called only for connections anarchon opened itself."""
        ...


class Sharded(Protocol):
    """A connection to a store of several nodes (a cluster) says which node a key goes to, so that :class:`Store`
    queues commands per node: a node that stops answering then holds up only the commands sent to it."""

    def lane(self, key: Arg | None) -> Hashable:
        """The node ``key`` goes to (``None``: a command without a key); any value that compares equal for one
        node. Read from the client's map in hand: a map out of date only groups commands less well."""
        ...


def command_name(command: Command) -> str:
    return str(command[0]).upper() if not isinstance(command[0], bytes) else command[0].decode().upper()


def command_key(command: Command) -> Arg | None:
    """The key a command is routed by, or None for a command without one."""
    name = command_name(command)
    if name in ("EVAL", "EVALSHA"):
        return command[3] if int(command[2]) > 0 else None
    if name == "XINFO":  # XINFO STREAM key: a subcommand first
        return command[2] if len(command) > 2 else None
    return command[1] if len(command) > 1 and name not in ("CLUSTER", "INFO", "PING", "SCRIPT", "TIME") else None


@dataclass(frozen=True, slots=True)
class Script:
    """A Lua script shipped in ``anarchon/_lua``; every file starts with its KEYS / ARGV / return header."""

    name: str
    source: str
    sha: str

    @classmethod
    def load(cls, name: str) -> Script:
        """Load ``_lua/<name>.lua``; a line ``-- include: <other>`` in it stands for ``_lua/<other>.lua`` (shared
        local functions: a script sent to Redis cannot include another)."""
        source = _with_includes(name)
        return cls(name, source, hashlib.sha1(source.encode()).hexdigest())


_INCLUDE = re.compile(r"^-- include: (\w+)$", re.MULTILINE)
# How long close() waits for commands on their way (an app's history() during an outage, say) before their
# callers are told the outcome is unknown.
CLOSE_WAIT_S = 1.0


def _with_includes(name: str) -> str:
    """``_lua/<name>.lua`` with its includes pasted in, theirs too."""
    return _INCLUDE.sub(lambda line: _with_includes(line[1]), _lua_source(name))


def _lua_source(name: str) -> str:
    return resources.files("anarchon").joinpath("_lua", f"{name}.lua").read_text(encoding="utf-8")


class ScriptCall(NamedTuple):
    """One script to run. A named tuple: one is made per claim, and a tuple is built faster than a frozen
    dataclass."""

    script: Script
    keys: Sequence[str]
    args: Sequence[Arg]

    def evalsha(self) -> list[Arg]:
        return ["EVALSHA", self.script.sha, len(self.keys), *self.keys, *self.args]

    def eval(self) -> list[Arg]:
        return ["EVAL", self.script.source, len(self.keys), *self.keys, *self.args]


def as_list(reply: Reply | StoreError, length: int | None = None) -> list[Reply]:
    """A reply that must be an array (of ``length`` items); anything else means a store anarchon cannot read."""
    if isinstance(reply, StoreError):
        raise reply
    if not isinstance(reply, list) or (length is not None and len(reply) != length):
        raise StoreError(f"unexpected reply from the store: {reply!r:.200}")
    return reply


def as_text(reply: Reply | StoreError) -> str:
    if isinstance(reply, str):
        return reply
    if isinstance(reply, StoreError):
        raise reply
    if isinstance(reply, list) and reply:  # a multi-node reply (cluster clients): every node answers alike
        return as_text(reply[0])
    if not isinstance(reply, str | int):
        raise StoreError(f"unexpected reply from the store: {reply!r:.200}")
    return str(reply)


def is_noscript(reply: object) -> bool:
    return isinstance(reply, StoreReplyError) and reply.reply.startswith("NOSCRIPT")


class _Lane:
    """The commands to one node: how many deliveries are in flight to it, and the commands waiting for them."""

    __slots__ = ("in_flight", "pending")

    def __init__(self) -> None:
        self.in_flight = 0
        self.pending: list[tuple[Command, asyncio.Future[Reply]]] = []


class Store:
    """A connection plus script handling and automatic pipelining.

    When nothing is in flight a command goes out at once. While commands are in flight, new ones queue and
    leave together, in one round trip, as soon as the store has answered: a burst of claims, the finishes of
    jobs that ended together, the heartbeats of many long jobs each cost one pipeline on one connection instead
    of one connection per concurrent command. On a cluster (a :class:`Sharded` connection) this holds per node:
    a node that stops answering holds up the commands queued for it, not those for the others.
    ``owned`` connections are closed by :meth:`close`, others never.
    """

    def __init__(self, connection: Connection, *, owned: bool) -> None:
        self.connection = connection
        self.owned = owned
        self._lane_of: Callable[[Arg | None], Hashable] | None = getattr(connection, "lane", None)
        self._only = _Lane()  # every command's, unless the connection is sharded
        self._lanes: dict[Hashable, _Lane] = {}
        self._deliveries: set[asyncio.Future[list[Reply | StoreError]]] = set()
        self._closed = False
        self._quiet: asyncio.Future[None] | None = None  # close()'s wait for every command on its way

    @property
    def sharded(self) -> bool:
        return self._lane_of is not None

    def lane(self, key: Arg) -> Hashable:
        """Which node ``key`` goes to, as far as the connection says (None: one node for all)."""
        return None if self._lane_of is None else self._lane_of(key)

    def _lane(self, command: Command) -> _Lane:
        if self._lane_of is None:
            return self._only
        name = self._lane_of(command_key(command))
        lane = self._lanes.get(name)
        if lane is None:
            lane = self._lanes[name] = _Lane()
        return lane

    # execute and run hand back their inner coroutine instead of awaiting it in one of their own: a burst keeps
    # thousands of commands waiting at once, and each coroutine less is less for the garbage collector to walk.
    def execute(self, *command: Arg) -> Coroutine[Any, Any, Reply]:
        return self._send(command)

    async def execute_many(self, commands: Sequence[Command]) -> list[Reply | StoreError]:
        """Send commands together; an error reply (or a node out of reach) is returned in its command's place.

        A batch goes out at once, beside whatever is in flight (the claim lanes of a burst run side by side).
        Commands queued before it leave with it, in front: a claim retried behind a slow reply must not reach the
        store after a claim of the job's next slot sent later. That pipeline is a task of its own, which settles
        their callers whatever becomes of this one's (cancelled, it leaves the pipeline to finish). On a cluster
        the batch leaves as one pipeline per node, each in its node's lane."""
        if len(commands) == 1:
            return [await _kept(self._send(commands[0]))]
        if not commands:
            return []
        self._check_open()
        if self._lane_of is None:
            return await self._batch(self._only, commands)
        by_lane: dict[_Lane, list[int]] = {}
        for index, command in enumerate(commands):
            by_lane.setdefault(self._lane(command), []).append(index)
        if len(by_lane) == 1:
            return await self._batch(next(iter(by_lane)), commands)

        async def send_part(lane: _Lane, indexes: list[int]) -> list[Reply | StoreError]:
            # Its batch is made here, not before: a part cancelled before it starts leaves no coroutine unawaited.
            return await each_or_failed(len(indexes), self._batch(lane, [commands[i] for i in indexes]))

        # A node out of reach answers each of its commands so; the other parts' replies stand (they ran).
        parts = await asyncio.gather(*(send_part(lane, indexes) for lane, indexes in by_lane.items()))
        replies: list[Reply | StoreError] = [None] * len(commands)
        for indexes, part in zip(by_lane.values(), parts, strict=True):
            for index, reply in zip(indexes, part, strict=True):
                replies[index] = reply
        return replies

    async def _batch(self, lane: _Lane, commands: Sequence[Command]) -> list[Reply | StoreError]:
        lane.in_flight += 1
        if lane.pending:
            caller: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            pipeline = asyncio.ensure_future(self._deliver(lane, commands, caller))
            self._deliveries.add(pipeline)
            pipeline.add_done_callback(self._delivered)
            try:
                return await asyncio.shield(pipeline)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if pipeline.cancelled() and task is not None and not task.cancelling():
                    # close() gave up on it, not this caller's canceller: the caller goes on, told so
                    raise StoreUnavailableError("the connection closed with the command on its way") from None
                caller.cancel()  # gone as well: once every caller of the pipeline is, it ends
                raise
        try:
            return await self.connection.execute_many(commands)
        except StoreError:
            raise
        except Exception as error:
            raise _unknown_outcome(error) from error
        finally:
            self._done(lane)

    def run(self, script: Script, keys: Sequence[str], args: Sequence[Arg]) -> Coroutine[Any, Any, Reply]:
        return self._run(ScriptCall(script, keys, args))

    async def _run(self, call: ScriptCall) -> Reply:
        try:
            return await self._send(call.evalsha())
        except StoreReplyError as error:
            if not is_noscript(error):
                raise
        # NOSCRIPT: the script did not run. EVAL runs it and caches it for the next EVALSHA.
        return await self._send(call.eval())

    async def run_many(self, calls: Sequence[ScriptCall]) -> list[Reply | StoreError]:
        """Run scripts by SHA; a call answered NOSCRIPT did not run, and is resent with EVAL (which caches it).
        As with :meth:`execute_many`, a store error comes back in its call's place, except that a batch of
        several calls may raise StoreUnavailableError when the store could not be reached at all."""
        if len(calls) == 1:
            return [await _kept(self._run(calls[0]))]
        replies = await self.execute_many([call.evalsha() for call in calls])
        missing = [i for i, reply in enumerate(replies) if is_noscript(reply)]
        if missing:
            # (A single command answered NOSCRIPT meanwhile sends its EVAL on its own, and may reach the store
            # after these: after a script flush, claims of two slots can arrive in either order. The lease claim
            # skips one as an overlap either way; stream-id refuses the earlier.)
            # One EVAL per script and node loads it there; the other calls go again by SHA (a batch of ten thousand
            # claims does not send the source ten thousand times, nor, on a cluster whose primaries all lost their
            # scripts, one call at a time). A node that still lacks it gets EVAL. The replies already in stand
            # whatever happens to these.
            first_of = {(calls[i].script.sha, self._call_lane(calls[i])): i for i in reversed(missing)}
            loaders = sorted(first_of.values())  # in the batch's order
            for i, reply in zip(loaders, await self._kept_many([calls[i].eval() for i in loaders]), strict=True):
                replies[i] = reply
            loaded = set(loaders)
            rest = [i for i in missing if i not in loaded]
            again = await self._kept_many([calls[i].evalsha() for i in rest])
            for i, reply in zip(rest, again, strict=True):
                if is_noscript(reply):
                    reply = await _kept(self._run(calls[i]))
                replies[i] = reply
        return replies

    def _call_lane(self, call: ScriptCall) -> Hashable:
        """The node a script call goes to (None: one node for all)."""
        return self.lane(call.keys[0]) if call.keys else None

    async def _kept_many(self, commands: Sequence[Command]) -> list[Reply | StoreError]:
        """:meth:`execute_many`, with a store that could not be reached at all answering each command so."""
        return await each_or_failed(len(commands), self.execute_many(commands))

    async def _send(self, command: Command) -> Reply:
        self._check_open()
        lane = self._lane(command)
        if lane.in_flight or lane.pending:
            future: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
            lane.pending.append((command, future))
            return await future
        lane.in_flight += 1
        try:
            return await self.connection.execute(command)
        except StoreError:
            raise
        except Exception as error:
            raise _unknown_outcome(error) from error
        finally:
            self._done(lane)

    def _check_open(self) -> None:
        if self._closed:
            raise StoreUnavailableError("the store connection is closed")

    def _done(self, lane: _Lane) -> None:
        lane.in_flight -= 1
        if not lane.in_flight and lane.pending:
            lane.in_flight += 1
            delivery = asyncio.ensure_future(self._deliver(lane))
            self._deliveries.add(delivery)
            delivery.add_done_callback(self._delivered)
        if self._quiet is not None and not self._quiet.done() and not self._busy():
            self._quiet.set_result(None)

    def _busy(self) -> bool:
        """Whether a command is on its way: sent at once, or in a delivery."""
        return any(lane.in_flight for lane in (self._only, *self._lanes.values()))

    async def _deliver(
        self, lane: _Lane, batch: Sequence[Command] = (), batch_caller: asyncio.Future[None] | None = None
    ) -> list[Reply | StoreError]:
        """Send the lane's queued commands, as they are when it starts (a batch sent before it may have taken them
        along), then ``batch``; settle the queued commands' callers and return the batch's replies. A queued command
        whose caller is gone (cancelled) is not sent; a delivery ends once all its callers are gone (as stop()
        cancels them; ``batch_caller`` is cancelled when the batch's is), instead of waiting on for a store that may
        not answer."""
        waiting = [(command, future) for command, future in lane.pending if not future.done()]
        lane.pending = []
        callers = [future for _, future in waiting] + ([batch_caller] if batch_caller is not None else [])
        if callers:
            _cancel_when_all_cancelled(asyncio.current_task(), callers)
        if self._closed and waiting:  # sent now, they would open a new connection behind close()'s back
            _fail(waiting, StoreUnavailableError("the store connection was closed"))
            waiting = []
        commands = [*(command for command, _ in waiting), *batch]
        replies: list[Reply | StoreError] = []
        try:
            if len(commands) == 1:  # a plain command costs less than a pipeline of one
                replies = [await _kept(self.connection.execute(commands[0]))]
            elif commands:
                replies = await self.connection.execute_many(commands)
        except BaseException as error:
            _fail(waiting, error)
            if not batch and isinstance(error, Exception):
                return []  # its callers have it
            if isinstance(error, Exception) and not isinstance(error, StoreError):
                raise _unknown_outcome(error) from error
            raise
        finally:
            self._done(lane)
        _settle(waiting, replies[: len(waiting)])
        return replies[len(waiting) :]

    def _delivered(self, delivery: asyncio.Future[list[Reply | StoreError]]) -> None:
        self._deliveries.discard(delivery)
        if not delivery.cancelled():
            delivery.exception()  # handed to its callers already; a batch's caller may be gone (cancelled)

    async def load(self, scripts: Sequence[Script]) -> None:
        """Cache scripts on the server ahead of use, so that a first burst is not answered NOSCRIPT. One that could
        not be loaded (a cluster node out of reach) is loaded by its first call instead."""
        await self._kept_many([("SCRIPT", "LOAD", script.source) for script in scripts])

    async def server_info(self) -> ServerInfo:
        try:
            return await self.connection.server_info()
        except StoreError:
            raise
        except Exception as error:  # e.g. what answered is no Redis: its client cannot read the reply
            raise _unknown_outcome(error) from error

    async def close(self) -> None:
        """Deliver what is on its way, for CLOSE_WAIT_S at most (then its callers learn that the outcome is
        unknown: a store that stopped answering does not hold the close up), fail what still waits (nothing is
        sent after this), close an owned connection. What is on its way: commands that went out at once (their
        lane was idle), as well as the pipelines of commands that queued."""
        self._closed = True
        if self._busy():
            self._quiet = asyncio.get_running_loop().create_future()
            await asyncio.wait([self._quiet], timeout=CLOSE_WAIT_S)
            late = set(self._deliveries)
            for delivery in late:
                delivery.cancel()
            if late:
                await asyncio.wait(late)
        if self.owned:
            await self.connection.close()  # a command that went out at once and is still on its way fails


def _settle(waiting: Sequence[tuple[Command, asyncio.Future[Reply]]], replies: Sequence[Reply | StoreError]) -> None:
    """Hand each queued command's caller its reply (a store error raised)."""
    for (_, future), reply in zip(waiting, replies, strict=True):
        if future.done():  # its caller was cancelled
            continue
        if isinstance(reply, StoreError):
            future.set_exception(reply)
        else:
            future.set_result(reply)


def _cancel_when_all_cancelled(task: asyncio.Future[Any] | None, futures: Sequence[asyncio.Future[Any]]) -> None:
    """Cancel ``task`` once every one of ``futures`` is cancelled."""
    left = len(futures)

    def ended(future: asyncio.Future[Any]) -> None:
        nonlocal left
        if future.cancelled():
            left -= 1
            if not left and task is not None and not task.done():
                task.cancel()

    for future in futures:
        future.add_done_callback(ended)


def _fail(waiting: Sequence[tuple[Command, asyncio.Future[Reply]]], error: BaseException) -> None:
    """Every queued command's caller learns what happened to the delivery; one cancelled mid-way has an unknown
    outcome."""
    failure = error if isinstance(error, StoreError) else None
    if failure is None and isinstance(error, Exception):
        failure = _unknown_outcome(error)
    for _, future in waiting:
        if not future.done():
            future.set_exception(failure or StoreUnavailableError("the command was cancelled"))


def _unknown_outcome(error: Exception) -> StoreUnavailableError:
    """A client's exception that no adapter translated (a protocol error, a bug in a ``send`` client) leaves the
    command's outcome unknown, as a dropped connection does: the scheduler retries what is safe to retry, and its
    loops go on instead of ending on an exception they cannot know."""
    return StoreUnavailableError(f"the store client failed: {type(error).__name__}: {error}")


async def each_or_failed(count: int, answers: Awaitable[list[Reply | StoreError]]) -> list[Reply | StoreError]:
    """The answers to ``count`` commands sent together, or, when their node could not be reached (or refused the
    whole pipeline), its StoreError as each one's answer: the commands of a batch sent to other nodes keep theirs,
    claims won there among them."""
    try:
        return await answers
    except StoreError as error:
        return [error] * count


async def _kept(reply: Awaitable[Reply]) -> Reply | StoreError:
    """The reply, or the store error it raised, as a value: a batch's answer for one command."""
    try:
        return await reply
    except StoreError as error:
        return error
