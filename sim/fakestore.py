"""The embedded store, made fast enough for days of simulated time.

fakeredis 2.41 compiles a script's source on every EVAL and runs a full Lua garbage collection after it: about
270 µs per call, most of a simulation's time. :func:`install` replaces its EVAL with one that keeps each script
compiled (found by its source) and collects garbage incrementally. Stray globals are refused the way Redis does
it, by a guard on the globals table that fails the script when it sets one, instead of fakeredis's comparison of
every global after every call (an eighth of a simulation's time). Everything else (KEYS/ARGV, redis.call, errors) is
fakeredis's own. The pinned fakeredis version is the one this was written against.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import fakeredis
from fakeredis import _msgs as msgs
from fakeredis._helpers import SimpleError
from fakeredis.commands_mixins import scripting_mixin as scripting
from fakeredis.commands_mixins.scripting_mixin import ScriptingCommandsMixin

from anarchon._adapters import decode_in_place, fake_server_info
from anarchon._errors import StoreError
from anarchon._store import Arg, Command, Reply, ServerInfo

_original_eval = ScriptingCommandsMixin.eval


def _fast_eval(self: Any, script: bytes, numkeys: int, *keys_and_args: bytes) -> Any:
    if numkeys > len(keys_and_args):
        raise SimpleError(msgs.TOO_MANY_KEYS_MSG)
    if numkeys < 0:
        raise SimpleError(msgs.NEGATIVE_KEYS_MSG)
    server: Any = self._server
    runtime = self._get_server_runtime(server)
    compiled = server.__dict__.get("_sim_compiled")
    if compiled is None:
        compiled = server._sim_compiled = {}
        _guard_globals(runtime)
        server._sim_set_keys_argv = runtime.eval("function(k, a) rawset(_G, 'KEYS', k) rawset(_G, 'ARGV', a) end")
        server._sim_collect = runtime.eval("function() collectgarbage('step') end")
    # Keyed by the source itself: EVALSHA passes the cached source object, whose hash Python keeps, so a call
    # by SHA costs no SHA-1 of the whole script.
    known = compiled.get(script)
    if known is None:
        sha1 = hashlib.sha1(script).hexdigest().encode()
        try:
            known = compiled[script] = (sha1, runtime.compile(script))
        except scripting.LUA_MODULE.LuaError as error:
            raise SimpleError(msgs.SCRIPT_ERROR_MSG.format(sha1.decode(), error)) from error
    sha1, function = known
    server.script_cache[sha1] = script
    server._lua_current_socket[0] = self
    self._script_resp = 2
    caller_fieldsets, self._fieldsets = self._fieldsets, {}
    server._sim_set_keys_argv(runtime.table_from(keys_and_args[:numkeys]), runtime.table_from(keys_and_args[numkeys:]))
    try:
        result = function()
    except SimpleError as error:
        message = error.value
        if self.version < (7,):
            message = msgs.SCRIPT_ERROR_MSG.format(sha1.decode(), message)
        raise SimpleError(message) from error
    except scripting.LUA_MODULE.LuaError as error:
        raise SimpleError(msgs.SCRIPT_ERROR_MSG.format(sha1.decode(), error)) from error
    finally:
        self._script_resp = None
        self._fieldsets = caller_fieldsets
        server._sim_collect()
    return self._convert_lua_result(result, nested=False)


def _guard_globals(runtime: Any) -> None:
    """Make a script fail where it sets a new global or reads one that does not exist, as on Redis. KEYS and
    ARGV are set with rawset, past the guard, so that a script that clears them cannot break later ones."""
    runtime.execute(
        "setmetatable(_G, {"
        "__newindex = function(_, name) "
        f"error({msgs.GLOBAL_VARIABLE_MSG.removeprefix('ERR ').format('')!r} .. tostring(name), 2) end, "
        "__index = function(_, name) "
        'error("Script attempted to access nonexistent global variable \'" .. tostring(name) .. "\'", 2) end})'
    )


# Keep fakeredis's command registration (the decorator's attributes) on the replacement.
_fast_eval.__dict__.update(_original_eval.__dict__)


def _no_globals_check(lua_runtime: Any, expected_globals: set[Any]) -> None:
    return None  # the guard on the globals table refuses a new global when it is set


def install() -> None:
    """Use compiled-script caching and the globals guard in every fakeredis server of this process (idempotent).
    fakeredis also compares every global before each redis.call; the guard makes that redundant."""
    ScriptingCommandsMixin.eval = _fast_eval  # type: ignore[method-assign]
    scripting._check_for_lua_globals = _no_globals_check


class EmbeddedConnection:
    """anarchon's store connection (:class:`anarchon._store.Connection`) straight into fakeredis's command
    engine: each command goes in as its fields and its reply comes back as fakeredis produced it, with no RESP
    encoding, parsing or client connection machinery in between. The engine is the one a fakeredis client
    reaches (transactions, ACL, the store's clock); only the wire is left out."""

    def __init__(self, server: Any) -> None:
        self._client = fakeredis.FakeAsyncRedis(server=server, protocol=2)
        self._socket: Any = None

    async def _engine(self) -> Any:
        if self._socket is None:
            connection = await self._client.connection_pool.get_connection()  # type: ignore[no-untyped-call]
            await connection.connect()
            self._socket = connection._sock
        return self._socket

    async def execute(self, command: Command) -> Reply:
        reply = await self._run(command)
        if isinstance(reply, StoreError):
            raise reply
        return reply

    async def execute_many(self, commands: Sequence[Command]) -> list[Reply | StoreError]:
        return [await self._run(command) for command in commands]

    async def _run(self, command: Command) -> Reply | StoreError:
        socket = await self._engine()
        socket._process_command([_field(arg) for arg in command])
        return decode_in_place(socket.responses.get_nowait())

    async def server_info(self) -> ServerInfo:
        info = fake_server_info(self._client)
        assert info is not None  # a fakeredis client's server always says what it emulates
        return info

    async def close(self) -> None:
        await self._client.aclose()


def _field(arg: Arg) -> bytes:
    return arg if isinstance(arg, bytes) else (arg if isinstance(arg, str) else str(arg)).encode()
