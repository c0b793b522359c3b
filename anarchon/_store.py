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

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Literal, Protocol, TypeAlias

from ._errors import StoreError, StoreReplyError

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

    def __str__(self) -> str:
        name = "Redis" if self.kind == "redis" else "Valkey"
        return f"{name} {'.'.join(map(str, self.version))}"


def parse_info(text: str) -> ServerInfo:
    """Read ``INFO server`` text. Valkey reports ``redis_version:7.2.4`` beside its own ``valkey_version``."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields[key.strip()] = value.strip()
    if "valkey_version" in fields or fields.get("server_name") == "valkey":
        return ServerInfo("valkey", _version(fields.get("valkey_version", fields.get("redis_version", "0"))))
    return ServerInfo("redis", _version(fields.get("redis_version", "0")))


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


class Connection(Protocol):
    """What anarchon needs from a client. Implementations translate their exceptions at this seam."""

    async def execute(self, command: Command) -> Reply:
        """Send one command; raise StoreReplyError for an error reply, StoreUnavailableError if unreachable."""
        ...

    async def execute_many(self, commands: Sequence[Command]) -> list[Reply | StoreReplyError]:
        """Send commands in one round trip where the client can (not a transaction). Error replies are
        returned in place, so one failing command does not hide the others' results."""
        ...

    async def server_info(self) -> ServerInfo:
        """Detect the server (``INFO server`` on real servers)."""
        ...

    async def close(self) -> None:
        """Release the client. Called only for connections anarchon opened itself."""
        ...


@dataclass(frozen=True, slots=True)
class Script:
    """A Lua script shipped in ``anarchon/_lua``; every file starts with its KEYS / ARGV / return header."""

    name: str
    source: str
    sha: str

    @classmethod
    def load(cls, name: str, *, prelude: str | None = None) -> Script:
        """Load ``_lua/<name>.lua``, after ``_lua/<prelude>.lua`` when given (shared local functions)."""
        source = _lua_source(name)
        if prelude:
            source = _lua_source(prelude) + "\n" + source
        return cls(name, source, hashlib.sha1(source.encode()).hexdigest())


def _lua_source(name: str) -> str:
    return resources.files("anarchon").joinpath("_lua", f"{name}.lua").read_text(encoding="utf-8")


@dataclass(frozen=True, slots=True)
class ScriptCall:
    script: Script
    keys: Sequence[str]
    args: Sequence[Arg]

    def evalsha(self) -> list[Arg]:
        return ["EVALSHA", self.script.sha, len(self.keys), *self.keys, *self.args]

    def eval(self) -> list[Arg]:
        return ["EVAL", self.script.source, len(self.keys), *self.keys, *self.args]


def as_list(reply: Reply | StoreReplyError, length: int | None = None) -> list[Reply]:
    """A reply that must be an array (of ``length`` items); anything else means a store anarchon cannot read."""
    if isinstance(reply, StoreReplyError):
        raise reply
    if not isinstance(reply, list) or (length is not None and len(reply) != length):
        raise StoreError(f"unexpected reply from the store: {reply!r:.200}")
    return reply


def as_text(reply: Reply | StoreReplyError) -> str:
    if isinstance(reply, StoreReplyError):
        raise reply
    if isinstance(reply, list) and reply:  # a multi-node reply (cluster clients): every node answers alike
        return as_text(reply[0])
    if not isinstance(reply, str | int):
        raise StoreError(f"unexpected reply from the store: {reply!r:.200}")
    return str(reply)


def is_noscript(reply: object) -> bool:
    return isinstance(reply, StoreReplyError) and reply.reply.startswith("NOSCRIPT")


class Store:
    """A connection plus script handling. ``owned`` connections are closed by :meth:`close`, others never."""

    def __init__(self, connection: Connection, *, owned: bool) -> None:
        self.connection = connection
        self.owned = owned

    async def execute(self, *command: Arg) -> Reply:
        return await self.connection.execute(command)

    async def execute_many(self, commands: Sequence[Command]) -> list[Reply | StoreReplyError]:
        if not commands:
            return []
        if len(commands) == 1:
            try:
                return [await self.connection.execute(commands[0])]
            except StoreReplyError as error:
                return [error]
        return await self.connection.execute_many(commands)

    async def run(self, script: Script, keys: Sequence[str], args: Sequence[Arg]) -> Reply:
        call = ScriptCall(script, keys, args)
        try:
            return await self.connection.execute(call.evalsha())
        except StoreReplyError as error:
            if not is_noscript(error):
                raise
        # NOSCRIPT: the script did not run. EVAL runs it and caches it for the next EVALSHA.
        return await self.connection.execute(call.eval())

    async def run_many(self, calls: Sequence[ScriptCall]) -> list[Reply | StoreReplyError]:
        """Run script calls in one round trip; calls answered NOSCRIPT (not run) are resent with EVAL."""
        if len(calls) == 1:  # a plain command costs less than a one-command pipeline
            call = calls[0]
            try:
                return [await self.run(call.script, call.keys, call.args)]
            except StoreReplyError as error:
                return [error]
        replies = await self.execute_many([call.evalsha() for call in calls])
        missing = [i for i, reply in enumerate(replies) if is_noscript(reply)]
        if missing:
            resent = await self.execute_many([calls[i].eval() for i in missing])
            for i, reply in zip(missing, resent, strict=True):
                replies[i] = reply
        return replies

    async def server_info(self) -> ServerInfo:
        return await self.connection.server_info()

    async def close(self) -> None:
        if self.owned:
            await self.connection.close()
