"""Client adapters: every supported client behind the :class:`~anarchon._store.Connection` seam.

Recognised: redis-py and valkey-py (sync, asyncio and cluster clients; fakeredis is a redis-py client), Valkey
GLIDE (standalone and cluster), and any object with ``send(command, args)`` returning the reply (or an
awaitable of it). Replies are normalised to RESP2 shape with ``str`` for bulk strings, and each client's
exceptions are translated here into :class:`StoreReplyError` / :class:`StoreUnavailableError`.
"""

from __future__ import annotations

import asyncio
import inspect
import re
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar, cast

from ._errors import ConfigTypeError, StoreError, StoreReplyError, StoreUnavailableError
from ._store import Arg, Command, Connection, Reply, ServerInfo, as_text, parse_info

T = TypeVar("T")

# redis-py strips the error code from the server's reply and encodes it in the exception class instead.
_REDIS_PY_CODES = {
    "NoScriptError": "NOSCRIPT",
    "ReadOnlyError": "READONLY",
    "ExecAbortError": "EXECABORT",
    "BusyLoadingError": "LOADING",
    "OutOfMemoryError": "OOM",
    "NoPermissionError": "NOPERM",
    "AskError": "ASK",
    "MovedError": "MOVED",
    "TryAgainError": "TRYAGAIN",
    "ClusterDownError": "CLUSTERDOWN",
    "ClusterCrossSlotError": "CROSSSLOT",
    "MasterDownError": "MASTERDOWN",
}
_UNAVAILABLE = ("ConnectionError", "TimeoutError", "ClosingError", "BusyLoadingError", "MaxConnectionsError")
_CODE_WORD = re.compile(r"[A-Z]{3,}\b")


def _class_names(error: BaseException) -> list[str]:
    return [cls.__name__ for cls in type(error).__mro__]


def translate(error: BaseException) -> StoreError | None:
    """Map a client's exception to anarchon's store errors; None if it is not a store error."""
    if isinstance(error, StoreError):
        return error
    names = _class_names(error)
    if any(name in _UNAVAILABLE for name in names) or isinstance(error, OSError | asyncio.TimeoutError):
        return StoreUnavailableError(f"store unavailable: {error}")
    if "ResponseError" in names:  # redis-py, valkey-py, fakeredis
        text = str(error)
        code = next((_REDIS_PY_CODES[n] for n in names if n in _REDIS_PY_CODES), None)
        if code and not text.startswith(code):
            text = f"{code} {text}"
        elif not code and not _CODE_WORD.match(text):
            text = f"ERR {text}"
        return StoreReplyError(text)
    if "RequestError" in names or "ExecAbortError" in names:  # GLIDE
        text = str(error)
        match = re.search(r"\b(NOSCRIPT|READONLY|ERR|WRONGTYPE|EXECABORT|LOADING|OOM|NOPERM|CROSSSLOT)\b.*", text)
        return StoreReplyError(match.group(0) if match else text)
    return None


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
    if isinstance(reply, dict):  # GLIDE returns multi-node replies as {node: reply}
        return [decode(value) for value in reply.values()]
    return str(reply)


def decode_in_place(reply: Any) -> Reply | StoreReplyError:
    """Decode one reply of a batch, keeping error replies as values instead of raising them."""
    if isinstance(reply, BaseException):
        translated = translate(reply)
        if isinstance(translated, StoreReplyError):
            return translated
        raise translated or reply
    return decode(reply)


async def _guard(awaitable: Awaitable[T]) -> T:
    try:
        return await awaitable
    except Exception as error:
        translated = translate(error)
        if translated is None or translated is error:
            raise
        raise translated from error


def _wire_name(command: Command) -> list[Any]:
    # redis-py parses some replies (INFO, XRANGE, TIME…) through callbacks looked up by command name; a bytes
    # name skips that lookup, so every client hands back the server's raw reply.
    name, *rest = command
    return [name.encode() if isinstance(name, str) else name, *rest]


def _command_key(command: Command) -> Arg | None:
    name = str(command[0]).upper() if not isinstance(command[0], bytes) else command[0].decode().upper()
    if name in ("EVAL", "EVALSHA"):
        return command[3] if int(command[2]) > 0 else None
    return command[1] if len(command) > 1 and name not in ("INFO", "PING", "SCRIPT", "TIME") else None


class RedisPyAsync:
    """redis-py / valkey-py / fakeredis asyncio clients (``redis.asyncio.Redis``)."""

    def __init__(self, client: Any) -> None:
        self.client = client

    async def execute(self, command: Command) -> Reply:
        return decode(await _guard(self.client.execute_command(*_wire_name(command))))

    async def execute_many(self, commands: Sequence[Command]) -> list[Reply | StoreReplyError]:
        pipe = self.client.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*_wire_name(command))
        replies = await _guard(pipe.execute(raise_on_error=False))
        return [decode_in_place(reply) for reply in replies]

    async def server_info(self) -> ServerInfo:
        fake = _fake_server_info(self.client)
        return fake or parse_info(as_text(await self.execute(["INFO", "server"])))

    async def close(self) -> None:
        await self.client.aclose()


class RedisPySync:
    """redis-py / valkey-py blocking clients: each call runs in a worker thread, never on the event loop."""

    def __init__(self, client: Any) -> None:
        self.client = client

    async def execute(self, command: Command) -> Reply:
        return decode(await _guard(asyncio.to_thread(self.client.execute_command, *_wire_name(command))))

    async def execute_many(self, commands: Sequence[Command]) -> list[Reply | StoreReplyError]:
        def run() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for command in commands:
                pipe.execute_command(*_wire_name(command))
            return cast(list[Any], pipe.execute(raise_on_error=False))

        return [decode_in_place(reply) for reply in await _guard(asyncio.to_thread(run))]

    async def server_info(self) -> ServerInfo:
        fake = _fake_server_info(self.client)
        return fake or parse_info(as_text(await self.execute(["INFO", "server"])))

    async def close(self) -> None:
        await asyncio.to_thread(self.client.close)


class RedisPyCluster:
    """redis-py / valkey-py cluster clients. Commands are routed to the node owning their key explicitly,
    because the client's own routing needs ``str`` command names (see ``_wire_name``)."""

    def __init__(self, client: Any, *, blocking: bool) -> None:
        self.client = client
        self.blocking = blocking

    async def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self.blocking:
            return await _guard(asyncio.to_thread(fn, *args, **kwargs))
        return await _guard(fn(*args, **kwargs))

    async def execute(self, command: Command) -> Reply:
        key = _command_key(command)
        node = self.client.get_node_from_key(key) if key is not None else self.client.get_random_node()
        reply = await self._call(self.client.execute_command, *_wire_name(command), target_nodes=node)
        return decode(reply)

    async def execute_many(self, commands: Sequence[Command]) -> list[Reply | StoreReplyError]:
        async def one(command: Command) -> Reply | StoreReplyError:
            try:
                return await self.execute(command)
            except StoreReplyError as error:
                return error

        return list(await asyncio.gather(*(one(command) for command in commands)))

    async def server_info(self) -> ServerInfo:
        return parse_info(as_text(await self.execute(["INFO", "server"])))

    async def close(self) -> None:
        await self._call(self.client.close if self.blocking else self.client.aclose)


class Glide:
    """Valkey GLIDE ``GlideClient`` and ``GlideClusterClient`` (GLIDE routes keyed commands itself)."""

    def __init__(self, client: Any, *, cluster: bool) -> None:
        self.client = client
        self.cluster = cluster

    async def execute(self, command: Command) -> Reply:
        return decode(await _guard(self.client.custom_command([_encode(arg) for arg in command])))

    async def execute_many(self, commands: Sequence[Command]) -> list[Reply | StoreReplyError]:
        import glide

        if self.cluster:  # a cluster batch must stay on one slot; route each command on its own instead
            results: list[Reply | StoreReplyError] = []
            for reply in await asyncio.gather(
                *(self.client.custom_command([_encode(a) for a in c]) for c in commands),
                return_exceptions=True,
            ):
                results.append(decode_in_place(reply))
            return results
        batch = glide.Batch(is_atomic=False)
        for command in commands:
            batch.custom_command([_encode(arg) for arg in command])
        replies = await _guard(self.client.exec(batch, raise_on_error=False))
        return [decode_in_place(reply) for reply in replies or []]

    async def server_info(self) -> ServerInfo:
        return parse_info(as_text(await self.execute(["INFO", "server"])))

    async def close(self) -> None:
        await _guard(self.client.close())


class SendAdapter:
    """Any object with ``send(command, args)`` returning the reply or an awaitable of it."""

    def __init__(self, client: Any) -> None:
        self.client = client

    async def execute(self, command: Command) -> Reply:
        name, *args = (_text(arg) for arg in command)

        async def call() -> Any:
            reply = self.client.send(name, args)
            return await reply if inspect.isawaitable(reply) else reply

        return decode(await _guard(call()))

    async def execute_many(self, commands: Sequence[Command]) -> list[Reply | StoreReplyError]:
        results: list[Reply | StoreReplyError] = []
        for command in commands:
            try:
                results.append(await self.execute(command))
            except StoreReplyError as error:
                results.append(error)
        return results

    async def server_info(self) -> ServerInfo:
        return parse_info(as_text(await self.execute(["INFO", "server"])))

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


def _fake_server_info(client: Any) -> ServerInfo | None:
    """fakeredis has no INFO command; its server object says what it emulates."""
    if not type(client).__module__.startswith("fakeredis"):
        return None
    server = client.connection_pool.connection_kwargs.get("server")
    kind = getattr(server, "server_type", "redis")
    version = tuple(getattr(server, "version", (7, 0)))
    return ServerInfo("valkey" if kind == "valkey" else "redis", version)


def adapt(client: object) -> Connection:
    """Wrap a client the user passed in. Raises ConfigTypeError for an object anarchon cannot drive."""
    module = type(client).__module__
    cls = type(client).__name__
    if module.startswith("glide"):
        return Glide(client, cluster="Cluster" in cls)
    execute_command = getattr(client, "execute_command", None)
    if execute_command is not None and hasattr(client, "pipeline"):
        is_async = inspect.iscoroutinefunction(execute_command)
        if "Cluster" in cls and hasattr(client, "get_node_from_key"):
            return RedisPyCluster(client, blocking=not is_async)
        return RedisPyAsync(client) if is_async else RedisPySync(client)
    if callable(getattr(client, "send", None)):
        return SendAdapter(client)
    raise ConfigTypeError(
        "redis",
        f"cannot use a {module}.{cls} as a client",
        "a URL, an options dict, a redis-py / valkey-py / GLIDE / fakeredis client, "
        "or an object with send(command, args)",
    )
