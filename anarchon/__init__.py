"""anarchon: cron jobs that run exactly once across many instances of an app.

Redis 5+ or Valkey decides which instance wins each run, with one of four claim strategies (``lease`` by
default). See the README for a complete example.
"""

from ._backend import ClaimOnly, Leased, RedisBackend, RedisOptions, ValkeyBackend
from ._clock import Clock, SystemClock
from ._config import IdmpSettings, LeaseSettings, ScriptSettings, StrategyName, StreamIdSettings
from ._context import RunContext
from ._errors import (
    AnarchonError,
    ConfigError,
    ConfigTypeError,
    JobNotFoundError,
    SchedulerStateError,
    StoreError,
    StoreFormatError,
    StoreReplyError,
    StoreUnavailableError,
    UnknownOptionError,
    UnsupportedStrategyError,
)
from ._job import JobFunction
from ._records import RunRecord, Status
from ._scheduler import Scheduler, SchedulerThread
from ._store import ServerInfo

__all__ = [
    "AnarchonError",
    "ClaimOnly",
    "Clock",
    "ConfigError",
    "ConfigTypeError",
    "IdmpSettings",
    "JobFunction",
    "JobNotFoundError",
    "LeaseSettings",
    "Leased",
    "RedisBackend",
    "RedisOptions",
    "RunContext",
    "RunRecord",
    "Scheduler",
    "SchedulerStateError",
    "SchedulerThread",
    "ScriptSettings",
    "ServerInfo",
    "Status",
    "StoreError",
    "StoreFormatError",
    "StoreReplyError",
    "StoreUnavailableError",
    "StrategyName",
    "StreamIdSettings",
    "SystemClock",
    "UnknownOptionError",
    "UnsupportedStrategyError",
    "ValkeyBackend",
]
