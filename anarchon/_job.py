"""A registered job: its name, schedule, function and options, validated when it is created."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeAlias

from ._config import check_int
from ._context import RunContext
from ._cron import CronSchedule, load_timezone
from ._errors import ConfigError, ConfigTypeError
from ._keys import check_job_name

JobFunction: TypeAlias = Callable[[RunContext], object] | Callable[[], object]
"""A job: sync or async, taking the :class:`RunContext` or nothing. Sync jobs run in a worker thread."""

DAY_MS = 86_400_000
LEASE_OPTIONS = ("overlap", "max_attempts", "catch_up_ms")


@dataclass(frozen=True, slots=True, kw_only=True)
class JobOptions:
    overlap: bool = False
    max_attempts: int = 3
    catch_up_ms: int = 0
    jitter_ms: int = 0
    max_late_ms: int = 60_000
    timezone: str = "UTC"

    def __post_init__(self) -> None:
        if not isinstance(self.overlap, bool):
            raise ConfigTypeError("overlap", f"must be a bool, got {type(self.overlap).__name__}", "True or False")
        check_int("max_attempts", self.max_attempts, 1, 100)
        check_int("catch_up_ms", self.catch_up_ms, 0, 30 * DAY_MS)
        check_int("jitter_ms", self.jitter_ms, 0, DAY_MS)
        check_int("max_late_ms", self.max_late_ms, 0, 30 * DAY_MS)
        load_timezone(self.timezone)


@dataclass(frozen=True, slots=True)
class Job:
    name: str
    schedule: CronSchedule
    function: JobFunction
    options: JobOptions
    takes_context: bool  # called as function(run), or function()
    is_async: bool

    @classmethod
    def create(cls, name: object, cron: object, function: object, options: JobOptions) -> Job:
        check_job_name(name)
        assert isinstance(name, str)
        if not callable(function):
            raise ConfigTypeError("func", f"job {name!r}: {type(function).__name__} is not callable", "a function")
        if not isinstance(cron, str):
            raise ConfigTypeError("cron", f"must be a string, got {type(cron).__name__}", "a cron expression")
        schedule = CronSchedule(cron, load_timezone(options.timezone))
        return cls(name, schedule, function, options, _takes_context(function), _is_async(function))

    def call(self, context: RunContext) -> object:
        return self.function(context) if self.takes_context else self.function()  # type: ignore[call-arg]

    def claim_horizon_ms(self, lease_ms: int) -> int:
        """How long after its slot a run of this job may still be claimed by some instance."""
        o = self.options
        return max(o.jitter_ms + o.max_late_ms, o.catch_up_ms) + lease_ms * o.max_attempts


def _takes_context(function: Callable[..., object]) -> bool:
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # some builtins have no signature: give them the context
        return True
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return any(p.kind in positional or p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters)


def _is_async(function: Callable[..., object]) -> bool:
    call = getattr(function, "__call__", None)  # noqa: B004 - callable objects with an async __call__
    return inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(call)


def check_memory(job: Job, strategy: str, memory_ms: int, setting: str) -> None:
    """A claim-only strategy that forgets runs must remember them longer than any claim can come late."""
    latest = job.options.jitter_ms + job.options.max_late_ms
    if memory_ms <= latest:
        raise ConfigError(
            setting,
            f"{memory_ms} ms is not longer than job {job.name!r}'s jitter_ms + max_late_ms ({latest} ms), "
            f"so strategy {strategy!r} could forget a run before its last claim",
            f"more than {latest} ms, or a smaller jitter_ms / max_late_ms",
        )
