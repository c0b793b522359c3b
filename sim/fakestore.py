"""The embedded store, made fast enough for days of simulated time.

fakeredis 2.41 compiles a script's source on every EVAL and runs a full Lua garbage collection after it: about
270 µs per call, most of a simulation's time. :func:`install` replaces its EVAL with one that keeps each script
compiled (by SHA) and collects garbage incrementally; everything else (KEYS/ARGV, redis.call, errors, the check
for stray globals) is fakeredis's own. The pinned fakeredis version is the one this was written against.
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
    compiled = server.__dict__.setdefault("_sim_compiled", {})
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
        runtime.execute("collectgarbage('step')")
    scripting._check_for_lua_globals(runtime, server._lua_expected_globals)
    return self._convert_lua_result(result, nested=False)


# Keep fakeredis's command registration (the decorator's attributes) on the replacement.
_fast_eval.__dict__.update(_original_eval.__dict__)


def install() -> None:
    """Use compiled-script caching in every fakeredis server of this process (idempotent)."""
    ScriptingCommandsMixin.eval = _fast_eval  # type: ignore[method-assign]
