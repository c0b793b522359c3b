"""Client adapters: every supported client behind the :class:`~anarchon._store.Connection` seam.

Recognised: redis-py and valkey-py (sync, asyncio and cluster clients; fakeredis is a redis-py client), Valkey
GLIDE (standalone and cluster), and any object with ``send(command, args)`` returning the reply (or an
awaitable of it). Replies are normalised to RESP2 shape with ``str`` for bulk strings, and each client's
exceptions are translated here into :class:`StoreReplyError` / :class:`StoreUnavailableError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import math
import re
import sys
from collections.abc import Awaitable, Callable, Hashable, Iterator, Sequence
from typing import Any, TypeVar, cast

from redis.crc import key_slot

from ._errors import ConfigTypeError, StoreError, StoreReplyError, StoreUnavailableError
from ._store import (
    Arg,
    Command,
    Connection,
    Reply,
    ServerInfo,
    as_list,
    as_text,
    command_key,
    command_name,
    detect_server,
    each_or_failed,
)

T = TypeVar("T")
log = logging.getLogger("anarchon")

# redis-py and GLIDE strip the error code from the server's reply and encode it in an exception class (redis-py)
# or an error kind in the message (GLIDE: "An error was signalled by the server: - NoScriptError: No matching…").
_CODES = {
    "NoScriptError": "NOSCRIPT",
    "ReadOnlyError": "READONLY",
    "ReadOnly": "READONLY",
    "ExecAbortError": "EXECABORT",
    "BusyLoadingError": "LOADING",
    "OutOfMemoryError": "OOM",
    "NoPermissionError": "NOPERM",
    "PermissionDenied": "NOPERM",
    "AskError": "ASK",
    "Ask": "ASK",
    "MovedError": "MOVED",
    "Moved": "MOVED",
    "TryAgainError": "TRYAGAIN",
    "TryAgain": "TRYAGAIN",
    "ClusterDownError": "CLUSTERDOWN",
    "ClusterDown": "CLUSTERDOWN",
    "ClusterCrossSlotError": "CROSSSLOT",
    "CrossSlot": "CROSSSLOT",
    "MasterDownError": "MASTERDOWN",
    "MasterDown": "MASTERDOWN",
}
# SlotNotCoveredError: a cluster client's map has no node for a key's slot (yet). GLIDE's CircuitBreakerError
# (it refuses requests for a while after failures) and RdmaError (a transfer that failed) did not reach the server.
_UNAVAILABLE = (
    "ConnectionError", "TimeoutError", "ClosingError", "MaxConnectionsError", "SlotNotCoveredError",
    "CircuitBreakerError", "RdmaError",
)  # fmt: skip
# Replies that refuse a command for now without running it: the store is unavailable rather than saying no. A
# cluster answers CLUSTERDOWN while a failed primary's slots wait for its replica, TRYAGAIN while a slot moves; a
# server answers BUSY while another client's script runs, READONLY when it was demoted to a replica (failover),
# NOREPLICAS while fewer replicas than min-replicas-to-write are connected, OOM while its memory is over maxmemory
# (noeviction), MISCONF while it cannot save a snapshot (stop-writes-on-bgsave-error). A write refused so was not
# made: a claim or a finish sent again later is the right answer, as for a store that cannot be reached.
_UNAVAILABLE_PREFIX = "store unavailable: "
_UNAVAILABLE_CODES = (
    "LOADING", "CLUSTERDOWN", "TRYAGAIN", "MASTERDOWN", "BUSY", "READONLY", "NOREPLICAS", "OOM", "MISCONF",
)  # fmt: skip
# Redis 5 hands a script the error of its redis.call inside its own: "ERR Error running script (call to f_…):
# @user_script:1: @user_script: 1: -READONLY You can't write…". The script stopped at that call.
_SCRIPT_CALL_CODE = re.compile(r"ERR Error running script .*?: -([A-Z]+) ")
_CODE_WORD = re.compile(r"[A-Z]{3,} ")  # WRONGTYPE Operation…, but not IDMP-DURATION must…
_GLIDE_KIND = re.compile(r"- (\w+): (.*)", re.DOTALL)
_GLIDE_CODE = re.compile(r"([A-Z]+): (.*)", re.DOTALL)  # a reply GLIDE passes on as "BUSY: Redis is busy…"
# GLIDE's own failures to reach a node, named by the I/O error's kind ("BrokenPipe: Cluster: Failed to receive
# command response…" when a cluster node goes down mid-batch): no reply came, the store is unavailable.
_GLIDE_IO_ERROR = re.compile(
    r"(BrokenPipe|ConnectionRefused|ConnectionReset|ConnectionAborted|NotConnected|TimedOut|UnexpectedEof|IoError): "
)


def _class_names(error: BaseException) -> list[str]:
    return [cls.__name__ for cls in type(error).__mro__]


def _reply_text(kinds: list[str], text: str) -> str:
    """The server's error reply as the server sent it: with its code (NOSCRIPT, ERR, WRONGTYPE…) first."""
    code = next((_CODES[kind] for kind in kinds if kind in _CODES), None)
    if code:
        return text if text.startswith(code) else f"{code} {text}"
    return text if _CODE_WORD.match(text) else f"ERR {text}"


def translate(error: BaseException) -> StoreError | None:
    """Map a client's exception to anarchon's store errors; None if it is not a store error."""
    if isinstance(error, StoreError):
        return error
    names = _class_names(error)
    if "AuthenticationError" in names:  # a ConnectionError to redis-py, but a wrong password is no outage
        text = str(error)
        return StoreReplyError(text if text.startswith(("WRONGPASS ", "NOAUTH ")) else f"{_auth_code(text)} {text}")
    if "BusyLoadingError" in names:  # redis-py's LOADING reply, its code taken off: a refusal for now
        return _reply_error(f"LOADING {error}")
    if any(name in _UNAVAILABLE for name in names) or isinstance(error, OSError | asyncio.TimeoutError):
        return StoreUnavailableError(f"{_UNAVAILABLE_PREFIX}{str(error) or 'no reply in time'}")
    if "ResponseError" in names:  # redis-py, valkey-py, fakeredis
        return _reply_error(_reply_text(names, str(error)))
    if "RequestError" in names or "ExecAbortError" in names:  # GLIDE
        match = _GLIDE_KIND.search(str(error))
        kind, text = (match.group(1), match.group(2)) if match else ("", str(error))
        text = text.strip()
        if _GLIDE_IO_ERROR.match(text):
            return StoreUnavailableError(f"store unavailable: {text}")
        if coded := _GLIDE_CODE.fullmatch(text):
            text = f"{coded.group(1)} {coded.group(2)}"
        return _reply_error(_reply_text([kind], text))
    return None


def _auth_code(text: str) -> str:
    """The code of the reply redis-py turned into an AuthenticationError without it: a password the server has
    none to check against (Redis 5: "Client sent AUTH, but no password is set"; 6+: "AUTH <password> called
    without any password configured …") is an ERR, as the server sent it."""
    lowered = text.lower()
    if "required" in lowered:
        return "NOAUTH"
    return "ERR" if "no password" in lowered or "without any password" in lowered else "WRONGPASS"


def _code_of(text: str) -> str:
    """An error reply's code: its first word, or that of the redis.call error a script's error wraps."""
    wrapped = _SCRIPT_CALL_CODE.match(text)
    return wrapped.group(1) if wrapped else text.split(" ", 1)[0]


def _refused_for_now(error: StoreUnavailableError) -> bool:
    """Whether the store answered, with a refusal for now (as :func:`_reply_error` words it), not out of reach."""
    return _code_of(str(error).removeprefix(_UNAVAILABLE_PREFIX)) in _UNAVAILABLE_CODES


def _reply_error(text: str) -> StoreError:
    """A server's error reply, its code first: StoreReplyError, or StoreUnavailableError for a refusal for now."""
    code = _code_of(text)
    if code in _UNAVAILABLE_CODES:
        return StoreUnavailableError(_UNAVAILABLE_PREFIX + text)
    if code == "NOPERM" or any(refusal in text for refusal in _ACL_REFUSALS_IN_SCRIPTS):
        refused_keys = "access" in text and "key" in text  # Redis 6.2: "… to access one of the keys used …"
        return StoreReplyError(text + (ACL_KEYS_HINT if refused_keys else _ACL_COMMANDS_HINT))
    return StoreReplyError(text)


# How a script's redis.call that the user may not run is refused: Redis 7+ (which names no command), Valkey
_ACL_REFUSALS_IN_SCRIPTS = ("The user executing the script can't run this command", "ACL failure in script")
_ACL_COMMANDS_HINT = (
    " (the store's user may not run a command anarchon sends: give it +@read +@write +@scripting +@connection "
    "+info +time, as README's Security section says)"
)
ACL_KEYS_HINT = (
    " (the store's user may not use the keys of the backend's prefix: give it their patterns, ~cron:* ~{cron:* for "
    "the default prefix, as README's Security section says)"
)


def decode(reply: Any) -> Reply:
    if isinstance(reply, bytes | bytearray | memoryview):
        return bytes(reply).decode("utf-8", "surrogateescape")
    if isinstance(reply, list | tuple):
        return [decode(item) for item in reply]
    if isinstance(reply, BaseException):
        raise reply
    if reply is None or isinstance(reply, int | str):
        return reply
    if isinstance(reply, float):  # RESP2 has no doubles; only some clients turn replies into floats
        return repr(reply)
    if isinstance(reply, dict):  # a RESP3 map: flat, as RESP2 sends it
        return [decode(item) for pair in reply.items() for item in pair]
    return str(reply)


def decode_in_place(reply: Any) -> Reply | StoreError:
    """Decode one reply of a batch, keeping store errors as values instead of raising them: error replies, and
    refusals for now (TRYAGAIN for one slot that is moving) or a lost connection that a client put in place."""
    if isinstance(reply, BaseException):
        translated = translate(reply)
        if translated is None:
            raise reply
        return translated
    return decode(reply)


async def _guard(awaitable: Awaitable[T], translator: Callable[[BaseException], StoreError | None] = translate) -> T:
    try:
        return await awaitable
    except Exception as error:
        translated = translator(error)
        if translated is None or translated is error:
            raise
        raise translated from error


def _wire_name(command: Command) -> list[Any]:
    # redis-py parses some replies (INFO, XRANGE, TIME…) through callbacks looked up by command name; a bytes
    # name skips that lookup, so every client hands back the server's raw reply.
    name, *rest = command
    return [name.encode() if isinstance(name, str) else name, *rest]


def _any_node_answers(command: Command) -> bool:
    """Whether a command has no key, and is answered alike by any node (SCRIPT goes to every primary)."""
    return command_key(command) is None and command_name(command) != "SCRIPT"


class RedisPyAsync:
    """redis-py / valkey-py / fakeredis asyncio clients (``redis.asyncio.Redis``).

    Commands travel on connections borrowed from the client's own pool, so its address, TLS, credentials,
    database and timeouts apply, but anarchon packs them and reads the replies itself: redis-py's per-command
    path (argument encoding, retry wrapper, observability hooks, pipeline objects) costs more client time than a
    claim script costs the server. The client's retry policy is not used; the scheduler retries what is safe to
    retry (see ``_client_settings``). A client with one dedicated connection (``single_connection_client``) goes
    through ``execute_command``, which guards that connection with the client's lock.
    """

    def __init__(self, client: Any) -> None:
        self.client = client
        self._pool: Any = None if getattr(client, "single_connection_client", False) else client.connection_pool
        self._borrow_args = _borrow_args(self._pool)

    async def execute(self, command: Command) -> Reply:
        if self._pool is None:
            try:
                reply = await self.client.execute_command(*_wire_name(command))
            except Exception as error:
                raise translate(error) or error from error
            return decode(reply)
        [reply] = await self._exchange((command,))
        return decode(reply)  # raises an error reply

    async def execute_many(self, commands: Sequence[Command]) -> list[Reply | StoreError]:
        if self._pool is None:
            pipe = self.client.pipeline(transaction=False)
            for command in commands:
                pipe.execute_command(*_wire_name(command))
            replies = await _guard(pipe.execute(raise_on_error=False))
            return [decode_in_place(reply) for reply in replies]
        return [decode_in_place(reply) for reply in await self._exchange(commands)]

    async def _exchange(self, commands: Sequence[Command]) -> list[Any]:
        """Write the commands at once on one borrowed connection, then read one reply each (error replies as
        values). redis-py closes a connection whose write or read fails or is cancelled, so none goes back to the
        pool with replies still unread."""
        pool = self._pool
        connection = await _guard(pool.get_connection(*self._borrow_args))
        try:
            return await _guard(_talk(connection, commands))
        finally:
            await pool.release(connection)

    async def server_info(self) -> ServerInfo:
        fake = fake_server_info(self.client)
        return fake or await detect_server(self.execute)

    async def close(self) -> None:
        await self.client.aclose(close_connection_pool=True)  # also a pool given to the client (see fork)

    def fork(self) -> RedisPyAsync:
        """A new client with the same settings and its own pool, for another thread's event loop."""
        pool = self.client.connection_pool
        twin = pool.__class__(connection_class=pool.connection_class, **pool.connection_kwargs)
        return RedisPyAsync(self.client.__class__(connection_pool=twin))


def pack(command: Command) -> bytes:
    """One command as the server reads it: a RESP array of bulk strings (ints and floats in decimal).

    A command of ASCII text and ints (every claim, heartbeat and finish) is formatted as one string and encoded
    once, a third faster than encoding each argument: a claim sends seventeen."""
    parts = [f"*{len(command)}\r\n"]
    for arg in command:
        if type(arg) is int:
            arg = str(arg)
        elif type(arg) is not str:
            return _pack_any(command)
        parts.append(f"${len(arg)}\r\n{arg}\r\n")  # len counts characters: bytes only while the text is ASCII
    text = "".join(parts)
    return text.encode() if text.isascii() else _pack_any(command)


def _pack_any(command: Command) -> bytes:
    parts = [b"*%d\r\n" % len(command)]
    for arg in command:
        data = arg if isinstance(arg, bytes) else (arg if isinstance(arg, str) else str(arg)).encode()
        parts.append(b"$%d\r\n%b\r\n" % (len(data), data))
    return b"".join(parts)


def _borrow_args(pool: Any) -> tuple[str, ...]:
    """What ``pool.get_connection`` needs: valkey-py and redis-py before 5.3 require a command name (unused
    since), later redis-py versions warn when given one."""
    if pool is None:
        return ()
    parameter = inspect.signature(pool.get_connection).parameters.get("command_name")
    return ("EVALSHA",) if parameter is not None and parameter.default is inspect.Parameter.empty else ()


async def _talk(connection: Any, commands: Sequence[Command]) -> list[Any]:
    """Send the commands in one write and read their replies.

    The connection's socket timeout still bounds the wait for each next reply, but through one deadline that is
    moved on as replies come in (at most every quarter of the timeout): redis-py's timeout per read (a timer set
    and cancelled for every reply) costs more than parsing a short reply. ``math.inf`` asks redis-py 8.1 for no
    timer of its own; older redis-py and valkey-py set one that never fires.
    """
    limit: float | None = connection.socket_timeout
    if limit is None:
        await connection.send_packed_command(b"".join(map(pack, commands)))
        return [await _read_reply(connection, None) for _ in commands]
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(limit) as deadline:
        await connection.send_packed_command(b"".join(map(pack, commands)))
        replies = []
        renew_at = loop.time() + limit / 4
        for _ in commands:
            replies.append(await _read_reply(connection, math.inf))
            now = loop.time()
            if now >= renew_at:
                deadline.reschedule(now + limit)
                renew_at = now + limit / 4
        return replies


async def _read_reply(connection: Any, timeout: float | None) -> Any:
    try:
        return await connection.read_response(timeout=timeout)
    except Exception as error:
        translated = translate(error)
        # An error reply (MASTERDOWN too) was read in full: kept in place, the batch's next replies are read.
        if translated is not None and "ResponseError" in _class_names(error):
            return translated
        raise translated or error from error


class RedisPySync:
    """redis-py / valkey-py blocking clients: each call runs in a worker thread, never on the event loop."""

    def __init__(self, client: Any) -> None:
        self.client = client

    async def execute(self, command: Command) -> Reply:
        return decode(await _guard(asyncio.to_thread(self.client.execute_command, *_wire_name(command))))

    async def execute_many(self, commands: Sequence[Command]) -> list[Reply | StoreError]:
        def run() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for command in commands:
                pipe.execute_command(*_wire_name(command))
            return cast(list[Any], pipe.execute(raise_on_error=False))

        return [decode_in_place(reply) for reply in await _guard(asyncio.to_thread(run))]

    async def server_info(self) -> ServerInfo:
        fake = fake_server_info(self.client)
        return fake or await detect_server(self.execute)

    async def close(self) -> None:
        await asyncio.to_thread(self.client.close)


class RedisPyCluster:
    """redis-py / valkey-py cluster clients. Each command goes to the node that owns its key, through that
    node's own connection: the cluster client's routing needs ``str`` command names (see ``_wire_name``).
    ``SCRIPT`` goes to every primary, as each has a script cache of its own; other keyless commands to any node.

    The client's map of which node owns which slots is read, not its command path (and its recovery), so the map
    is renewed here: before the first command when the client has none yet (an asyncio client reads it lazily);
    when a node answers MOVED (then those commands are sent again); and after a node could not be reached, as
    its replica may have taken its slots over, by the batch that found it so, at most once per ``MAP_RENEWAL_S``.
    A reading may wait for the lost node's connect or socket timeout: the nodes still up go on answering their
    part meanwhile, by the map in hand, and keep it should the reading fail.
    """

    MAP_RENEWAL_S = 1.0

    def __init__(self, client: Any, *, blocking: bool) -> None:
        self.client = client
        self.blocking = blocking
        self._map_read_at = -math.inf  # event loop time the last reading ended
        self._reading: asyncio.Future[None] | None = None

    def _has_map(self) -> bool:
        return bool(self.client.nodes_manager.nodes_cache)

    def _nodes(self, command: Command) -> list[Any]:
        key = command_key(command)
        if key is not None:
            return [self.client.get_node_from_key(key)]
        if command_name(command) == "SCRIPT":
            return list(self.client.get_primaries())
        return [self.client.get_random_node()]

    def lane(self, key: Arg | None) -> Hashable:
        """The name of the node the map in hand gives ``key`` to (:class:`Sharded`); None without a key or a map."""
        if key is None or not self._has_map():
            return None
        try:
            return self.client.get_node_from_key(key).name  # type: ignore[no-any-return]
        except Exception:  # no node for the key's slot in the map (yet): sent as one, and answered so
            return None

    def _node_client(self, node: Any) -> Any:
        # A sync ClusterNode wraps a plain client: redis_connection, or valkey-py's valkey_connection.
        return node.redis_connection if hasattr(node, "redis_connection") else node.valkey_connection

    async def execute(self, command: Command) -> Reply:
        [reply] = await self.execute_many([command])
        return decode(reply)  # raises an error reply

    async def execute_many(self, commands: Sequence[Command]) -> list[Reply | StoreError]:
        """One pipeline per node, all nodes at once. Within a node the batch's order holds, so a job's commands
        (its keys share a slot) run in the order given: a later run's claim never overtakes an earlier one's.
        A command whose node cannot be reached comes back StoreUnavailableError in its place."""
        if not self._has_map():
            await self._renew_map()  # raises when no node answers
        unreachable: set[str] = set()  # the names of the nodes that could not be reached
        try:
            replies = await self._send(commands, unreachable)
        except StoreUnavailableError:
            await self._renew_after_failure(unreachable)
            raise
        moved = [i for i, reply in enumerate(replies) if _redirection(reply) == "MOVED"]
        if moved:  # not run: their slots have another owner now
            await self._follow_moved(commands, replies, moved)
        asked: dict[str, list[int]] = {}  # "host:port" of a node: the commands it was named for
        for index, reply in enumerate(replies):
            if isinstance(reply, StoreReplyError) and _redirection(reply) == "ASK":  # ASK <slot> <host>:<port>
                asked.setdefault(reply.reply.split(" ")[2], []).append(index)
        if asked:  # not run: their keys are moving to another node, which serves them after ASKING
            await self._ask(commands, replies, asked)
        for index, reply in enumerate(replies):
            # Redirected again (after a MOVED, or an ASK): the slots are still changing hands; sent again later.
            if _redirection(reply):
                replies[index] = StoreUnavailableError(f"store unavailable: redirected again: {reply}")
        if any(isinstance(reply, StoreUnavailableError) for reply in replies):
            await self._renew_after_failure(unreachable)
        return replies

    async def _renew_after_failure(self, unreachable: set[str]) -> None:
        """A node could not be reached (a replica may be taking its slots over), or slots are still changing hands:
        the map is read again, at most once per ``MAP_RENEWAL_S``, unless a node that answers gives the same one (a
        primary down with no replica to take over changes nothing, however long it stays down). The batch that
        failed waits for the reading (its commands are sent again later in any case); batches whose nodes answer
        never wait for one, which may take the lost node's connect or socket timeout. A reading that fails leaves
        the map in hand."""
        if self._renewal_due():
            if await self._map_holds(unreachable):
                self._map_read_at = asyncio.get_running_loop().time()
                return
            with contextlib.suppress(StoreUnavailableError):
                await self._renew_map()

    async def _map_holds(self, unreachable: set[str]) -> bool:
        """Whether the first node that answers ``CLUSTER SLOTS``, of those not found unreachable, gives every slot the
        primary the map in hand gives it, and no other slots (:func:`_same_primaries`). A reading replaces every
        node of the client's map, and valkey-py closes the connections of the nodes it replaces, pipelines on their
        way included: on the nodes that answer, claims would fail for nothing, each time a batch to a lost node
        reads."""
        manager = self.client.nodes_manager
        try:
            for node in [node for name, node in manager.nodes_cache.items() if name not in unreachable]:
                [ranges] = await each_or_failed(1, self._pipeline(node, [("CLUSTER", "SLOTS")]))
                if not isinstance(ranges, StoreError):
                    return _same_primaries(manager.slots_cache, ranges, node.host, manager.remap_host_port)
        except Exception:  # a reply it cannot read, a slot the map in hand has no node for: read the map
            return False
        return False

    def _renewal_due(self) -> bool:
        return not self._has_map() or asyncio.get_running_loop().time() - self._map_read_at >= self.MAP_RENEWAL_S

    async def _follow_moved(
        self, commands: Sequence[Command], replies: list[Reply | StoreError], moved: list[int]
    ) -> None:
        """Read the map again and send the commands answered MOVED to their slots' new owners. If that fails,
        only they come back unavailable: the other commands of the batch ran, and their replies stand."""
        try:
            await self._renew_map()
            again = await self._send([commands[i] for i in moved])
        except StoreUnavailableError as error:
            again = [error] * len(moved)
        for index, reply in zip(moved, again, strict=True):
            replies[index] = reply

    async def _ask(
        self, commands: Sequence[Command], replies: list[Reply | StoreError], asked: dict[str, list[int]]
    ) -> None:
        """Send the commands to the node named by their ASK, each after an ``ASKING`` (which lets the next
        command of the connection into a slot the node is importing), and keep their replies."""

        async def on(address: str, indexes: list[int]) -> None:
            answers: list[Reply | StoreError]
            node = self._node_at(address)
            if node is None:
                answers = [StoreUnavailableError(f"store unavailable: no node {address} in the map")] * len(indexes)
            else:
                asking = [part for index in indexes for part in (("ASKING",), commands[index])]
                answers = (await each_or_failed(len(asking), self._pipeline(node, asking)))[1::2]
            for index, answer in zip(indexes, answers, strict=True):
                replies[index] = answer

        await asyncio.gather(*(on(address, indexes) for address, indexes in asked.items()))

    def _node_at(self, address: str) -> Any | None:
        """The map's node at the "host:port" a server named (through the client's address remapping), if any."""
        host, _, port = address.rpartition(":")
        try:
            host, number = self.client.nodes_manager.remap_host_port(host, int(port))
            return self.client.get_node(host=host, port=number)
        except Exception:  # no number for a port; an empty host (redis-py raises DataError); a name that won't resolve
            return None

    async def _renew_map(self) -> None:
        """Read the map of slots again. One reading at a time: batches to several nodes at once (see Store) that fail
        together share it; two readings at once would each replace the client's nodes, and the nodes one of them
        made would never be closed."""
        if self._reading is None or self._reading.done():  # done: cancelled before it began (a loop shut down)
            self._reading = asyncio.ensure_future(self._read_map())
            self._reading.add_done_callback(_retrieved)
        await asyncio.shield(self._reading)

    async def _read_map(self) -> None:
        manager = self.client.nodes_manager
        try:
            if self.blocking:
                await asyncio.to_thread(manager.initialize)
            elif manager.nodes_cache:
                await manager.initialize()
            else:
                await self.client.initialize()  # the first time, the client sets itself up too
        except Exception as error:  # no node answered, or the nodes' maps do not cover every slot yet
            # A node that refused the connection's username or password is no outage (see translate): said as the
            # server's answer when the map is first read (start); a later reading that fails keeps the map in hand.
            refused = translate(error.__cause__) if error.__cause__ is not None else None
            if isinstance(refused, StoreReplyError) and not self._has_map():
                raise refused from error
            raise StoreUnavailableError(f"store unavailable: the cluster's map of slots is unknown: {error}") from error
        finally:
            self._map_read_at = asyncio.get_running_loop().time()
            self._reading = None

    async def _send(self, commands: Sequence[Command], unreachable: set[str] | None = None) -> list[Reply | StoreError]:
        """Each command to its node, one pipeline per node; ``unreachable`` gathers the nodes that were not."""
        nodes: dict[str, tuple[Any, list[int]]] = {}
        replies: list[Reply | StoreError] = [None] * len(commands)
        for index, command in enumerate(commands):
            try:
                targets = self._nodes(command)
            except Exception as error:
                translated = translate(error)  # SlotNotCoveredError: the map has no node for the key's slot (yet)
                if translated is None:
                    raise
                replies[index] = translated
                continue
            for node in targets:
                nodes.setdefault(node.name, (node, []))[1].append(index)

        async def on(node: Any, indexes: list[int]) -> None:
            answers = await each_or_failed(len(indexes), self._pipeline(node, [commands[i] for i in indexes]))
            if unreachable is not None and any(isinstance(answer, StoreUnavailableError) for answer in answers):
                unreachable.add(node.name)
            for index, reply in zip(indexes, answers, strict=True):
                if isinstance(reply, StoreUnavailableError) and _any_node_answers(commands[index]):
                    reply = await self._elsewhere(commands[index], node, reply)
                # A command sent to every primary answers with an error when any of them gave one.
                if not isinstance(replies[index], StoreError):
                    replies[index] = reply

        await asyncio.gather(*(on(node, indexes) for node, indexes in nodes.values()))
        unavailable = [reply for reply in replies if isinstance(reply, StoreUnavailableError)]
        if unavailable and len(unavailable) == len(replies):
            raise unavailable[0]
        return replies

    async def _elsewhere(self, command: Command, tried: Any, error: StoreUnavailableError) -> Reply | StoreError:
        """A command any node answers (INFO, TIME), sent to the other nodes in turn when its node could not be
        reached: a node that is down must not fail a start that the others can serve."""
        for node in self.client.get_nodes():
            if node.name != tried.name:
                [reply] = await each_or_failed(1, self._pipeline(node, [command]))
                if not isinstance(reply, StoreUnavailableError):
                    return reply
        return error

    async def _pipeline(self, node: Any, commands: Sequence[Command]) -> list[Reply | StoreError]:
        if self.blocking:
            return await RedisPySync(self._node_client(node)).execute_many(commands)
        # The node's own pipeline (one connection, one write), as the cluster client's pipelines use it; its
        # module's PipelineCommand (redis-py's or valkey-py's) carries each command and receives its reply.
        command_class = sys.modules[type(node).__module__].PipelineCommand
        sent = [command_class(index, *_wire_name(command)) for index, command in enumerate(commands)]
        await _guard(node.execute_pipeline(sent) if hasattr(node, "release") else _lending(node, sent))
        return [decode_in_place(command.result) for command in sent]

    async def server_info(self) -> ServerInfo:
        return await detect_server(self.execute)

    async def close(self) -> None:
        if self._reading is not None:  # it would build a map of the closed client's, with connections of its own
            self._reading.cancel()
            await asyncio.wait([self._reading])
        if self.blocking:
            await asyncio.to_thread(self.client.close)
        else:
            await self.client.aclose()


async def _lending(node: Any, sent: Sequence[Any]) -> None:
    """A cluster node's pipeline as valkey-py's ``ClusterNode.execute_pipeline`` runs it, but with the connection
    given back to the node whatever happens. valkey-py (6.2) gives it back only when every reply was read: a
    write to a node that is down, or a read cut short by a deadline, kept it, and after ``max_connections`` such
    batches every command to that node failed, also once it was up again. (redis-py's nodes have ``release`` and
    give it back themselves.) The connection closes itself when its write or read fails or is cancelled, so none
    goes back with replies unread."""
    connection = node.acquire_connection()
    try:
        await connection.send_packed_command(connection.pack_commands(command.args for command in sent), False)
        for command in sent:
            try:
                command.result = await node.parse_response(connection, command.args[0], **command.kwargs)
            except Exception as error:  # an error reply; or a lost connection, which fails the rest too
                command.result = error
    finally:
        node._free.append(connection)


class Glide:
    """Valkey GLIDE ``GlideClient`` and ``GlideClusterClient`` (GLIDE routes keyed commands itself)."""

    def __init__(self, client: Any, *, cluster: bool) -> None:
        self.client = client
        self.cluster = cluster

    async def execute(self, command: Command) -> Reply:
        sent = self.client.custom_command([_encode(arg) for arg in command])
        return decode(self._resp2_shape(command, await _guard(sent, _translate_glide)))

    async def execute_many(self, commands: Sequence[Command]) -> list[Reply | StoreError]:
        import glide

        # Not atomic: a cluster pipeline may span slots; GLIDE splits it per node and answers in the batch's order.
        batch = glide.ClusterBatch(is_atomic=False) if self.cluster else glide.Batch(is_atomic=False)
        for command in commands:
            batch.custom_command([_encode(arg) for arg in command])
        replies = await _guard(self.client.exec(batch, raise_on_error=False)) or []  # typed as possibly None
        decoded = [
            decode_in_place(self._resp2_shape(command, reply)) for command, reply in zip(commands, replies, strict=True)
        ]
        return [_unfollowed(reply) if isinstance(reply, StoreError) else reply for reply in decoded]

    def _resp2_shape(self, command: Command, reply: Any) -> Any:
        """GLIDE reshapes some replies whichever protocol it speaks: stream entries come as {id: [[field, value],
        …]}, and a cluster client answers a command it sent to every node with {node address: reply} (HELLO
        goes to one node, and comes as a map of its fields). Back to what the server sends under RESP2 (other
        maps, such as XINFO's and HELLO's, decode() flattens)."""
        if not isinstance(reply, dict):
            return reply
        name = command_name(command)
        if name in ("XRANGE", "XREVRANGE"):
            return [[entry_id, [item for pair in fields for item in pair]] for entry_id, fields in reply.items()]
        if self.cluster and command_key(command) is None and name != "HELLO":
            return list(reply.values())
        return reply

    async def server_info(self) -> ServerInfo:
        return await detect_server(self.execute)

    async def close(self) -> None:
        await _guard(self.client.close())


CLUSTER_SLOTS = 16384


class GlideCluster(Glide):
    """Valkey GLIDE ``GlideClusterClient``, with a lane per primary (:class:`Sharded`). GLIDE routes each command
    itself, but answers a batch only once every node of it has, and fails it whole when one has not within
    its request timeout: a primary that stops answering would time out every batch, the claims of jobs on the
    primaries that answer included. So a batch goes out as one GLIDE batch per primary, by a map of slots read
    here with ``CLUSTER SLOTS`` (GLIDE keeps its own to itself, and follows MOVED without a word): before the
    first command, then in the background every ``MAP_MAX_AGE_S`` (a resharding) and after a command found a node
    out of reach (a failover), at most once per ``MAP_RENEWAL_S``. A map out of date, or one that could not be
    read, only groups commands less well: GLIDE still sends each command to the node that owns it."""

    MAP_RENEWAL_S = 1.0
    MAP_MAX_AGE_S = 60.0

    def __init__(self, client: Any) -> None:
        super().__init__(client, cluster=True)
        self._primaries: list[str] | None = None  # each slot's primary (its node ID), by slot number
        self._map_read_at = -math.inf  # event loop time the last reading ended
        self._reading: asyncio.Future[None] | None = None
        self._unread_said = False  # a map that cannot be read is logged once

    def lane(self, key: Arg | None) -> Hashable:
        """The ID of the primary the map in hand gives ``key``'s slot to; None without a key or a map."""
        if key is None or self._primaries is None:
            return None
        return self._primaries[key_slot(key if isinstance(key, bytes) else str(key).encode())]

    async def execute(self, command: Command) -> Reply:
        await self._map_in_hand()
        try:
            return await super().execute(command)
        except StoreUnavailableError:
            self._renew_map()
            raise

    async def execute_many(self, commands: Sequence[Command]) -> list[Reply | StoreError]:
        await self._map_in_hand()
        try:
            replies = await super().execute_many(commands)
        except StoreUnavailableError:
            self._renew_map()
            raise
        if any(isinstance(reply, StoreUnavailableError) for reply in replies):
            self._renew_map()
        return replies

    async def server_info(self) -> ServerInfo:
        await self._map_in_hand()  # at start: the first batch of claims already goes out per primary
        return await super().server_info()

    async def close(self) -> None:
        if self._reading is not None:
            self._reading.cancel()
        await super().close()

    async def _map_in_hand(self) -> None:
        """Wait for a first map (a reading at most once per ``MAP_RENEWAL_S`` while none could be read); start
        a reading in the background when the map in hand is older than ``MAP_MAX_AGE_S``."""
        if self._primaries is None:
            self._renew_map()
            if self._reading is not None and not self._reading.done():
                await asyncio.shield(self._reading)
        elif asyncio.get_running_loop().time() - self._map_read_at >= self.MAP_MAX_AGE_S:
            self._renew_map()

    def _renew_map(self) -> None:
        """Start reading the map of slots, unless a reading is on its way or one ended less than
        ``MAP_RENEWAL_S`` ago. Commands do not wait for it: it may go to the node that does not answer."""
        if self._reading is not None and not self._reading.done():
            return
        if asyncio.get_running_loop().time() - self._map_read_at < self.MAP_RENEWAL_S:
            return
        self._reading = asyncio.ensure_future(self._read_map())
        self._reading.add_done_callback(_retrieved)

    async def _read_map(self) -> None:
        try:
            primaries = [""] * CLUSTER_SLOTS
            for first, last, primary in _slot_ranges(await super().execute(("CLUSTER", "SLOTS"))):
                primaries[first : last + 1] = [as_text(primary[2])] * (last - first + 1)  # its node ID
            self._primaries = primaries
        except (StoreError, IndexError, ValueError) as error:  # no answer, refused, or a reply it cannot read
            if self._primaries is None and not self._unread_said:
                self._unread_said = True
                log.warning("the cluster's map of slots could not be read (%s): commands go out in one queue, and "
                            "a primary that stops answering holds up every job's", error)  # fmt: skip
            else:
                log.debug("the cluster's map of slots was not read again: %s", error)
        finally:
            self._map_read_at = asyncio.get_running_loop().time()


def _retrieved(reading: asyncio.Future[None]) -> None:
    """Its callers have what it raised; should all of them have gone (cancelled), it is not left unretrieved."""
    if not reading.cancelled():
        reading.exception()


def _unfollowed(error: StoreError) -> StoreError:
    """GLIDE follows MOVED and ASK itself: one it hands back names a node it could not reach (a primary that is
    down still owns its slots in the other nodes' maps). The command did not run there; the store is unavailable."""
    if isinstance(error, StoreReplyError) and _redirection(error):
        return StoreUnavailableError(f"store unavailable: cannot reach the node of {error.reply.split(';')[0]!r}")
    return error


def _translate_glide(error: BaseException) -> StoreError | None:
    translated = translate(error)
    return None if translated is None else _unfollowed(translated)


def _slot_ranges(ranges: Reply) -> Iterator[tuple[int, int, list[Reply]]]:
    """A ``CLUSTER SLOTS`` reply's ranges: first slot, last slot, and the primary's fields (host, port, node ID…)."""
    for entry in as_list(ranges):  # [first slot, last slot, [host, port, …] of the primary, replicas…]
        fields = as_list(entry)
        yield int(as_text(fields[0])), int(as_text(fields[1])), as_list(fields[2])


def _same_primaries(
    slots: dict[int, list[Any]], ranges: Reply, host_asked: str, remap: Callable[[str, int], tuple[str, int]]
) -> bool:
    """Whether a ``CLUSTER SLOTS`` reply gives every slot the primary that a cluster client's map in hand
    (``slots``: each slot's nodes, primary first) gives it, and no other slots. Raises KeyError for a slot the map
    has no node for."""
    covered = 0
    for first, last, primary in _slot_ranges(ranges):
        host, port = as_text(primary[0]) or host_asked, int(as_text(primary[1]))  # "": the node asked
        name = "{}:{}".format(*remap(host, port))
        if any(slots[slot][0].name != name for slot in range(first, last + 1)):
            return False
        covered += last - first + 1
    return covered == len(slots)


def _redirection(reply: Reply | StoreError) -> str | None:
    """ "MOVED" or "ASK" when a cluster node answered that the command's keys are served elsewhere."""
    if isinstance(reply, StoreReplyError):
        code = reply.reply.split(" ", 1)[0]
        if code in ("MOVED", "ASK"):
            return code
    return None


# The codes Redis and Valkey start their error replies with. A ``send`` client may report a server error as an
# exception of its own, raised or returned, carrying the reply's text: one that starts with one of these codes
# is read as that reply (LOADING, like redis-py's BusyLoadingError, as an unreachable store).
_SERVER_CODES = frozenset(
    (
        "ERR", "WRONGTYPE", "NOSCRIPT", "BUSY", "BUSYKEY", "BUSYGROUP", "NOGROUP", "NOAUTH", "WRONGPASS",
        "NOPERM", "READONLY", "MASTERDOWN", "MISCONF", "OOM", "EXECABORT", "NOREPLICAS", "NOTBUSY", "UNKILLABLE",
        "MOVED", "ASK", "TRYAGAIN", "CROSSSLOT", "CLUSTERDOWN", "NOPROTO", "UNBLOCKED", "LOADING",
    )
)  # fmt: skip


def translate_send_error(error: BaseException) -> StoreError | None:
    """:func:`translate`, and for a ``send`` client also any exception whose message is a server error reply
    (it starts with a code of ``_SERVER_CODES`` followed by a space or nothing)."""
    translated = translate(error)
    if translated is not None:
        return translated
    text = str(error)
    code = text.split(" ", 1)[0]
    if code not in _SERVER_CODES:
        return None
    return _reply_error(text)


class SendAdapter:
    """Any object with ``send(command, args)`` returning the reply or an awaitable of it.

    ``command`` is the command name and ``args`` its arguments, all ``str``. The reply comes back as the client
    reads it (bulk strings as ``bytes`` or ``str``, arrays as lists). A server error reply is recognised when it
    is raised or returned as an exception that is a redis-py / valkey-py error, or whose message is the server's
    reply text with its code first (``NOSCRIPT No matching script…``, ``ERR …``, ``WRONGTYPE …``); an
    ``OSError`` / ``ConnectionError`` / ``TimeoutError`` means the store could not be reached. Other exceptions
    pass through unchanged. ``send`` is called on the event loop thread: a blocking ``send`` blocks the
    scheduler while it waits.
    """

    def __init__(self, client: Any) -> None:
        self.client = client

    async def execute(self, command: Command) -> Reply:
        name, *args = (_text(arg) for arg in command)

        async def call() -> Any:
            reply = self.client.send(name, args)
            reply = await reply if inspect.isawaitable(reply) else reply
            if isinstance(reply, BaseException):  # an error reply handed back as a value
                raise reply
            return reply

        return decode(await _guard(call(), translate_send_error))

    async def execute_many(self, commands: Sequence[Command]) -> list[Reply | StoreError]:
        """One command after another. A refusal for now (TRYAGAIN, LOADING…) is kept in its command's place, as an
        error reply is; once the store cannot be reached, the commands left are not sent, and each is answered so
        (the commands before keep their replies: they ran)."""
        results: list[Reply | StoreError] = []
        for index, command in enumerate(commands):
            try:
                results.append(await self.execute(command))
            except StoreReplyError as error:
                results.append(error)
            except StoreUnavailableError as error:
                if not _refused_for_now(error):
                    return results + [error] * (len(commands) - index)
                results.append(error)
        return results

    async def server_info(self) -> ServerInfo:
        return await detect_server(self.execute)

    async def close(self) -> None:
        close = getattr(self.client, "close", None)
        if close is not None:
            result = close()
            if inspect.isawaitable(result):
                await result


def _encode(arg: Arg) -> str | bytes:
    return arg if isinstance(arg, str | bytes) else str(arg)


def _text(arg: Arg) -> str:
    return arg.decode() if isinstance(arg, bytes) else str(arg)


def fake_server_info(client: Any) -> ServerInfo | None:
    """fakeredis has no INFO command; its server object says what it emulates."""
    if not type(client).__module__.startswith("fakeredis"):
        return None
    settings = client.connection_pool.connection_kwargs
    server = settings.get("server")  # None unless a FakeServer was passed: then the client's own keywords say
    kind = getattr(server, "server_type", None) or settings.get("server_type") or "redis"
    version = getattr(server, "version", None) or settings.get("version") or (7, 0)
    if isinstance(version, str | int):  # fakeredis also takes "8.6" or 8
        version = tuple(int(part) for part in str(version).split("."))
    return ServerInfo("valkey" if kind == "valkey" else "redis", tuple(version))


_CONNECTION_METHODS = ("execute", "execute_many", "server_info", "close")


def _warn_of_retries(client: Any, module: str, cls: str) -> None:
    """Say where a client tries again, after the socket timeout, when it gets no answer: a sync client's commands
    (and those of an asyncio one with single_connection_client) go through its retry policy, and an asyncio
    client's pool makes its connections through it. redis-py 8's default retries ten times, with backoff, so
    that a store that stops answering fails a command (or a new connection) after about 15 s instead of one socket
    timeout, while anarchon waits to retry or hand back what is safe. -1 retries for ever."""
    get_retry = getattr(client, "get_retry", None)
    retries = getattr(get_retry(), "_retries", 0) if callable(get_retry) else 0
    if isinstance(retries, int) and retries != 0:
        times = "for ever" if retries < 0 else f"{retries} times"
        log.warning(
            "the %s.%s client tries a command or a connection again %s when the store does not answer (its retry "
            "policy): a store that stops answering then fails it after many socket timeouts, not one, and "
            "anarchon retries or hands back what it can only after that (create the client with retry=None)",
            module, cls, times,
        )  # fmt: skip


def _socket_timeout(client: object) -> object:
    """A redis-py / valkey-py client's socket_timeout (a cluster client's for its nodes); 0 when not found."""
    for holder in ("connection_pool", "nodes_manager"):
        settings = getattr(getattr(client, holder, None), "connection_kwargs", None)
        if isinstance(settings, dict):
            return settings.get("socket_timeout")
    return 0


def adapt(client: object) -> Connection:
    """Wrap a client the user passed in. Raises ConfigTypeError for an object anarchon cannot drive."""
    if isinstance(client, type):  # redis.asyncio.Redis without the call: its methods are there, unbound
        raise ConfigTypeError(
            "redis", f"got the class {client.__module__}.{client.__name__}", "a client: an instance of it"
        )
    module = type(client).__module__
    cls = type(client).__name__
    if "Pipeline" in cls and module.startswith(("redis.", "valkey.")):  # cluster ones too
        raise ConfigTypeError(
            "redis", f"got a pipeline ({module}.{cls}): it queues commands until execute()", "the client it came from"
        )
    if all(inspect.iscoroutinefunction(getattr(client, m, None)) for m in _CONNECTION_METHODS):
        return cast(Connection, client)  # already speaks the seam (the simulator's store, test doubles)
    if module.startswith("glide"):
        return GlideCluster(client) if "Cluster" in cls else Glide(client, cluster=False)
    execute_command = getattr(client, "execute_command", None)
    if execute_command is not None and hasattr(client, "pipeline"):
        if not module.startswith("fakeredis") and _socket_timeout(client) is None:
            log.warning(
                "the %s.%s client has no socket_timeout: a store that stops answering without closing the "
                "connection holds every command behind the one it waits for, until the system gives up on the "
                "connection (set socket_timeout on the client)", module, cls,
            )  # fmt: skip
        is_async = inspect.iscoroutinefunction(execute_command)
        if "Cluster" in cls and hasattr(client, "get_node_from_key"):
            return RedisPyCluster(client, blocking=not is_async)
        _warn_of_retries(client, module, cls)
        return RedisPyAsync(client) if is_async else RedisPySync(client)
    if callable(getattr(client, "send", None)):
        return SendAdapter(client)
    raise ConfigTypeError(
        "redis",
        f"cannot use a {module}.{cls} as a client",
        "a URL, an options dict, a redis-py / valkey-py / GLIDE / fakeredis client, "
        "or an object with send(command, args)",
    )
