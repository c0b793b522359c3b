"""The embedded store, made fast enough for days of simulated time.

fakeredis 2.41 compiles a script's source on every EVAL and runs a full Lua garbage collection after it: about
270 µs per call, most of a simulation's time. :func:`install` replaces its EVAL with one that keeps each script
compiled (by SHA) and collects garbage incrementally. Stray globals are refused the way Redis does it, by a
guard on the globals table that fails the script when it sets one, instead of fakeredis's comparison of every
global after every call (an eighth of a simulation's time). Everything else (KEYS/ARGV, redis.call, errors) is
fakeredis's own. The pinned fakeredis version is the one this was written against.
"""

from __future__ import annotations

import hashlib
from typing import Any

from fakeredis import _msgs as msgs
from fakeredis._helpers import SimpleError
from fakeredis.commands_mixins import scripting_mixin as scripting
from fakeredis.commands_mixins.scripting_mixin import ScriptingCommandsMixin

_original_eval = ScriptingCommandsMixin.eval


def _fast_eval(self: Any, script: bytes, numkeys: int, *keys_and_args: bytes) -> Any:
    if numkeys > len(keys_and_args):
        raise SimpleError(msgs.TOO_MANY_KEYS_MSG)
    if numkeys < 0:
        raise SimpleError(msgs.NEGATIVE_KEYS_MSG)
    sha1 = hashlib.sha1(script).hexdigest().encode()
    server: Any = self._server
    server.script_cache[sha1] = script
    runtime = self._get_server_runtime(server)
    compiled = server.__dict__.get("_sim_compiled")
    if compiled is None:
        compiled = server._sim_compiled = {}
        _guard_globals(runtime)
        server._sim_collect = runtime.eval("function() collectgarbage('step') end")
    function = compiled.get(sha1)
    if function is None:
        try:
            function = compiled[sha1] = runtime.compile(script)
        except scripting.LUA_MODULE.LuaError as error:
            raise SimpleError(msgs.SCRIPT_ERROR_MSG.format(sha1.decode(), error)) from error
    server._lua_current_socket[0] = self
    self._script_resp = 2
    caller_fieldsets, self._fieldsets = self._fieldsets, {}
    server._lua_set_keys_argv(runtime.table_from(keys_and_args[:numkeys]), runtime.table_from(keys_and_args[numkeys:]))
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
    """Make setting a new global fail the script at that point, as on Redis (fakeredis sets up KEYS and ARGV
    before this, and only reassigns them later)."""
    runtime.execute(
        "setmetatable(_G, {__newindex = function(_, name) "
        f"error({msgs.GLOBAL_VARIABLE_MSG.removeprefix('ERR ').format('')!r} .. tostring(name), 2) end}})"
    )


# Keep fakeredis's command registration (the decorator's attributes) on the replacement.
_fast_eval.__dict__.update(_original_eval.__dict__)


def _no_globals_check(runtime: Any, expected_globals: set[Any]) -> None:
    return None  # the guard on the globals table refuses a new global when it is set


def install() -> None:
    """Use compiled-script caching and the globals guard in every fakeredis server of this process (idempotent).
    fakeredis also compares every global before each redis.call; the guard makes that redundant."""
    ScriptingCommandsMixin.eval = _fast_eval  # type: ignore[method-assign]
    scripting._check_for_lua_globals = _no_globals_check
