"""A registered job: its name, schedule, function and options, validated when it is created."""

from __future__ import annotations

import functools
import hashlib
import inspect
import itertools
import typing
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal, TypeAlias
from zoneinfo import ZoneInfo

from ._config import check_int
from ._context import RunContext
from ._cron import CronSchedule, load_timezone
from ._errors import ConfigError, ConfigTypeError
from ._keys import check_job_name

JobFunction: TypeAlias = Callable[[RunContext], object] | Callable[[], object]
"""A job: sync or async, taking the :class:`RunContext` or nothing. Sync jobs run in a worker thread."""

DAY_MS = 86_400_000
IDMP_MAX_SIZE = 10_000  # the most ids the server keeps per producer (XCFGSET IDMP-MAXSIZE)
LEASE_OPTIONS = ("overlap", "max_attempts", "catch_up_ms")


@dataclass(frozen=True, slots=True, kw_only=True)
class JobOptions:
    overlap: bool = False
    max_attempts: int = 3
    catch_up_ms: int = 0
    jitter_ms: int = 0
    max_late_ms: int = 60_000
    timezone: str | ZoneInfo = "UTC"

    @property
    def late_after_ms(self) -> int:
        """How long after its slot a run may still be claimed: jitter_ms (the claim's own delay), then max_late_ms."""
        return self.jitter_ms + self.max_late_ms

    def __post_init__(self) -> None:
        if not isinstance(self.overlap, bool):
            raise ConfigTypeError("overlap", f"must be a bool, got {type(self.overlap).__name__}", "True or False")
        check_int("max_attempts", self.max_attempts, 1, 100)
        check_int("catch_up_ms", self.catch_up_ms, 0, 30 * DAY_MS)
        check_int("jitter_ms", self.jitter_ms, 0, DAY_MS)
        # A claim leaves some time after its slot (the dispatcher's wake-up, a round trip, a burst's other claims:
        # a few hundred ms for 10,000 runs due together); a smaller allowance would skip runs that were on time.
        check_int("max_late_ms", self.max_late_ms, 1_000, 30 * DAY_MS)
        # Kept as the zone's name: options that differ only in how the zone was given are equal, and shared.
        object.__setattr__(self, "timezone", load_timezone(self.timezone).key)


@dataclass(frozen=True, slots=True)
class Job:
    name: str
    schedule: CronSchedule
    function: JobFunction
    options: JobOptions
    takes_context: bool  # called as function(run), or function()
    is_async: bool

    def jitter_for(self, slot: int) -> int:
        """How long after ``slot`` its run is claimed: between 0 and jitter_ms, the same on every instance (drawn
        from a hash of the job's name and the slot), so that the run starts then whichever instance wins it.
        Drawn by each instance on its own, the earliest draw would start the run: with five instances, 40 % of
        the runs started in the first tenth of jitter_ms."""
        if not self.options.jitter_ms:
            return 0
        digest = hashlib.blake2b(b"%s\0%d" % (self.name.encode(), slot), digest_size=8).digest()
        return int.from_bytes(digest, "big") % (self.options.jitter_ms + 1)

    @classmethod
    def create(cls, name: object, cron: object, function: object, options: JobOptions) -> Job:
        check_job_name(name)
        assert isinstance(name, str)
        if not callable(function):
            raise ConfigTypeError("func", f"job {name!r}: {type(function).__name__} is not callable", "a function")
        if not isinstance(cron, str):
            raise ConfigTypeError("cron", f"must be a string, got {type(cron).__name__}", "a cron expression")
        schedule = CronSchedule(cron, load_timezone(options.timezone))
        takes_context = _takes_context(function)
        _check_callable_as_a_job(name, function, takes_context)
        return cls(name, schedule, function, options, takes_context, _is_async(function))

    def call(self, context: RunContext) -> object:
        return self.function(context) if self.takes_context else self.function()  # type: ignore[call-arg]

    def claim_horizon_ms(self, lease_ms: int) -> int:
        """How long after its slot a run of this job may still be claimed by some instance."""
        o = self.options
        return max(o.jitter_ms + o.max_late_ms, o.catch_up_ms) + lease_ms * o.max_attempts


def _takes_context(function: Callable[..., object]) -> bool:
    """Whether a job's function is called with the RunContext: if its first positional parameter must be given,
    or is named ``run`` or annotated RunContext, or it takes ``*args``. One whose positional parameters all have
    defaults is called with none (``def cleanup(dry_run=False)``, ``gc.collect``), not with the context in the
    first's place."""
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):  # some builtins have no signature: give them the context
        return True
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    first = next((p for p in parameters if p.kind in positional or p.kind is inspect.Parameter.VAR_POSITIONAL), None)
    if first is None:
        return False
    return (
        first.kind is inspect.Parameter.VAR_POSITIONAL
        or first.default is inspect.Parameter.empty
        or first.name == "run"
        or _names_run_context(first.annotation)
    )


def _names_run_context(annotation: object) -> bool:
    """Whether a parameter's annotation is RunContext, alone or in a union (``RunContext | None``), as an object
    or as the text of a postponed annotation."""
    if isinstance(annotation, typing.ForwardRef):  # Optional["RunContext"]: imported only for type checkers
        annotation = annotation.__forward_arg__
    if isinstance(annotation, str):
        return "RunContext" in annotation
    return annotation is RunContext or any(_names_run_context(part) for part in typing.get_args(annotation))


def _check_callable_as_a_job(name: str, function: Callable[..., object], takes_context: bool) -> None:
    """Refuse, when the job is added, a function that a run could not call, or whose call would not run it."""
    allowed = "a function or coroutine function taking the RunContext, or nothing"
    check_callable("func", function, ("run",) if takes_context else (), allowed, f"job {name!r}: ")


_ARGUMENT_NAMES = {"run": "the RunContext", "record": "the RunRecord"}


def check_callable(
    option: str, function: Callable[..., object], arguments: tuple[str, ...], allowed: str, context: str = ""
) -> None:
    """Refuse a function (a job's, a hook) that cannot be called with ``arguments``, or whose call would not run
    its body (a generator function): found when it is given, not at every run, in the log."""
    if not callable(function):
        raise ConfigTypeError(option, f"{context}got {type(function).__name__}", allowed)
    shown = getattr(function, "__qualname__", type(function).__name__)
    call = getattr(function, "__call__", None)  # noqa: B004 - callable objects
    if inspect.isclass(function) and any("__call__" in vars(klass) for klass in function.__mro__[:-1]):
        # Calling the class makes an instance and runs nothing (or, with an async __call__, fails every run).
        raise ConfigTypeError(option, f"{context}{shown} is a class whose instances are callable: pass one", allowed)
    if any(inspect.isgeneratorfunction(f) or inspect.isasyncgenfunction(f) for f in (function, call)):
        # Calling it only creates a generator: the body would never run, and every run would be recorded ok.
        raise ConfigTypeError(option, f"{context}{shown} is a generator function", allowed)
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # some builtins have no signature: their calls show what they take
        return
    try:
        signature.bind(*(None for _ in arguments))
    except TypeError as error:
        how = "with " + (" and ".join(_ARGUMENT_NAMES[a] for a in arguments) or "no argument")
        raise ConfigTypeError(option, f"{context}{shown} cannot be called {how}: {error}", allowed) from None


def _is_async(function: Callable[..., object]) -> bool:
    call = getattr(function, "__call__", None)  # noqa: B004 - callable objects with an async __call__
    return inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(call)


def check_memory(job: Job, strategy: str, memory: int, setting: str, unit: Literal["ms", "s"] = "ms") -> None:
    """A claim-only strategy that forgets runs must remember them longer than any claim can come late. ``memory``
    is in the setting's own unit, and so is the error."""
    latest = job.options.jitter_ms + job.options.max_late_ms
    per_unit = 1000 if unit == "s" else 1
    if memory * per_unit <= latest:
        raise ConfigError(
            setting,
            f"{memory} {unit} is not longer than job {job.name!r}'s jitter_ms + max_late_ms ({latest} ms), "
            f"so strategy {strategy!r} could forget a run before its last claim",
            f"more than {latest / per_unit:g} {unit}, or a smaller jitter_ms / max_late_ms",
        )


def check_idmp_size(job: Job, max_size: int, now_ms: int) -> None:
    """idmp must remember a run's id until the run's last claim, and Redis keeps at most ``max_size`` ids per
    producer (here, per job): the id of slot ``s`` is evicted once ``max_size`` later slots were claimed, and all
    slots in ``(s, s + jitter_ms + max_late_ms]`` can be claimed before ``s``'s last claim. So no window of that
    length, counting ``s`` itself, may hold more than ``max_size`` slots.

    Slots are at least a second apart (a minute without a seconds field), so most jobs pass without reading
    their schedule. Otherwise the check is sampled, to stay cheap however many jobs are registered: it counts
    the windows that start at the job's slots during one day (or one window, if longer) from the first slot of
    the UTC day of ``now_ms``, reading at most ``4 * (max_size + 1)`` slots, and caches the answer per schedule,
    window, ``max_size`` and day. A schedule that is denser on days it does not sample (a day-of-month or month
    field that picks out another stretch of days) can pass and still lose an id.
    """
    window = job.options.jitter_ms + job.options.max_late_ms
    if window // job.schedule.min_gap_ms + 1 <= max_size:
        return  # even a slot every second (minute) leaves no more than max_size in a window
    day = now_ms // DAY_MS * DAY_MS
    crowd, _ = _densest_window(job.schedule, window, day, max_size + 1)
    if crowd <= max_size:
        return
    crowd, start = _densest_window(job.schedule, window, day, IDMP_MAX_SIZE + 1)  # how many, for the message
    when = datetime.fromtimestamp(start / 1000, tz=UTC).isoformat(timespec="seconds")
    if crowd > IDMP_MAX_SIZE:
        count, allowed = f"more than {IDMP_MAX_SIZE}", "a smaller jitter_ms / max_late_ms, or another strategy"
    else:
        count, allowed = str(crowd), f"{crowd}..{IDMP_MAX_SIZE}, or a smaller jitter_ms / max_late_ms"
    raise ConfigError(
        "strategy.max_size",
        f"job {job.name!r} ({job.schedule.expression!r}) has {count} runs within {window} ms "
        f"(its jitter_ms + max_late_ms) starting at {when}, but strategy 'idmp' remembers only the last "
        f"{max_size} runs per job, so it could forget a run before its last claim, which would then run it again",
        allowed,
    )


def check_claim_order(job: Job, now_ms: int) -> None:
    """stream-id takes a run's claim only while no later slot of the job was claimed: the claims of two slots
    closer together than ``jitter_ms`` could come in the wrong order, and the earlier slot would never run.
    Sampled over a day, as :func:`check_idmp_size` is, and from ``jitter_ms`` before each clock change of the
    coming year, where slots crowd: a run whose time clocks going forward skip comes at the jump, close to the
    runs beside it (``30 * * * *`` runs at 01:30, 03:00 and 03:30 when Berlin's clocks skip from 02:00 to 03:00,
    half an hour apart)."""
    jitter = job.options.jitter_ms
    if jitter < job.schedule.min_gap_ms:
        return  # slots are at least a second (a minute) apart
    day = now_ms // DAY_MS * DAY_MS
    changes = job.schedule.offset_changes(day, day + 366 * DAY_MS)
    for after in (day, *(change - jitter - 1000 for change in changes)):
        crowd, start = _densest_window(job.schedule, jitter, after, 2)
        if crowd >= 2:
            break
    else:
        return
    gap = job.schedule.next_after(start)
    shown = f"{gap - start} ms" if gap is not None else "the time"
    raise ConfigError(
        "jitter_ms",
        f"{jitter} ms is not less than {shown} between two slots of job {job.name!r} "
        f"({job.schedule.expression!r}), so under strategy 'stream-id' the claim of the later one could come "
        "first, and the earlier one would then never run",
        f"less than {shown}, or another strategy",
    )


@functools.lru_cache(maxsize=1024)
def _densest_window(schedule: CronSchedule, window_ms: int, after_ms: int, cap: int) -> tuple[int, int]:
    """The most slots found in one window ``[s, s + window_ms]`` (counted up to ``cap``) and its first slot ``s``,
    over the windows that start at the slots of one day (or window) from the first slot after ``after_ms``; at
    most ``4 * cap`` slots are read. Equal schedules share the answer."""
    first = schedule.next_after(after_ms)
    if first is None:
        return 0, 0
    inside: deque[int] = deque()
    best, best_start = 0, 0
    slots = schedule.slots_between(first - 1, first + max(DAY_MS, window_ms) + window_ms)
    for slot in itertools.islice(slots, 4 * cap):
        while inside and inside[0] < slot - window_ms:
            inside.popleft()
        inside.append(slot)
        if len(inside) > best:
            best, best_start = len(inside), inside[0]
            if best >= cap:
                break
    return best, best_start
