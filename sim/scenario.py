"""Scenarios: declarative TOML files in ``scenarios/`` that say who runs what, which faults strike when, and the
verdict each strategy is expected to get. The virtual and the live mode run the same files.

    name = "winner-crash"
    description = "The instance running a slot dies mid-run and comes back later."
    duration_s = 120
    [scheduler]                     # scheduler options (lease options apply to the lease strategy only)
    lease_ms = 3000
    [[instances]]                   # name, offset_ms (clock skew), drift (0.001 = 1 ms per second fast)
    name = "a"
    [[jobs]]                        # name, cron, work_s, and job options
    name = "tick"
    cron = "*/10 * * * * *"
    work_s = 2.0
    [[faults]]                      # at_s, kind, and the kind's own settings (see FAULT_KINDS)
    at_s = 31
    kind = "crash"
    instance = "winner"             # an instance name, or "winner": the one running a job at that moment
    restart_after_s = 30
    [expect.lease]                  # checker (P1..P7, lateness): valid | invalid | unknown
    P1 = "valid"
"""

from __future__ import annotations

import json
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from anarchon import AnarchonError, RedisBackend, RunContext, Scheduler

SCENARIOS_DIR = Path(__file__).resolve().parent.parent / "scenarios"
STRATEGIES = ("lease", "stream-id", "idmp", "script")
CHECKERS = ("P1", "P2", "P3", "P4", "P5", "P6", "P7", "lateness")
VERDICTS = ("valid", "invalid", "unknown")
LEASE_SCHEDULER_OPTIONS = ("lease_ms", "heartbeat_ms")
LEASE_JOB_OPTIONS = ("overlap", "max_attempts", "catch_up_ms")

# kind: (required settings, optional settings)
FAULT_KINDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "crash": (("instance",), ("restart_after_s",)),
    "stop": (("instance",), ("restart_after_s", "timeout_s")),  # stop(timeout_s, default 0): a deploy
    "pause": (("instance", "duration_s"), ()),
    # cut off; with reply_lost, its next command still reaches the store, and then its reply is lost (a partition
    # that begins while a command is on its way)
    "partition": (("instance", "duration_s"), ("reply_lost",)),
    # every reply to the instance comes delay_ms after the store ran its command (a slow network, a busy store)
    "slow": (("instance", "duration_s", "delay_ms"), ()),
    "skew": (("instance", "offset_ms"), ()),  # the clock jumps
    "drift": (("instance", "drift"), ()),  # the clock runs 1 + drift times as fast from here on
    "late": (("instance", "delay_ms", "duration_s"), ()),
    # the replica, lag_ms behind, is promoted; its clock clock_ms ahead of the old primary's (behind if below 0)
    "failover": (("lag_ms",), ("clock_ms",)),
    # writes reach the replica when the hold ends (a broken link too: the replica resynchronises when it is back)
    "replication-hold": (("duration_s",), ()),
    "store-restart": ((), ()),
    "manual": (("instance", "job"), ()),  # run_now on that instance
}


def toml_value(value: Any) -> str:
    """A setting as TOML writes it (scenario files written by the search, and for live instance processes)."""
    if isinstance(value, str):
        return json.dumps(value)
    return str(value).lower() if isinstance(value, bool) else str(value)


class ScenarioError(ValueError):
    """A scenario file that cannot be run as written."""


@dataclass(frozen=True)
class InstanceSpec:
    name: str
    offset_ms: int = 0
    drift: float = 0.0


@dataclass(frozen=True)
class JobSpec:
    name: str
    cron: str
    work_s: float
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class FaultSpec:
    at_s: float
    kind: str
    settings: dict[str, Any]

    @property
    def instance(self) -> str:
        return str(self.settings.get("instance", ""))

    @property
    def duration_s(self) -> float:
        """How long the fault lasts (0 for instantaneous ones; a crash or stop without restart lasts to the end)."""
        if "duration_s" in self.settings:
            return float(self.settings["duration_s"])
        if self.kind in ("crash", "stop"):
            return float(self.settings.get("restart_after_s", float("inf")))
        return 0.0


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    duration_s: float
    instances: tuple[InstanceSpec, ...]
    jobs: tuple[JobSpec, ...]
    faults: tuple[FaultSpec, ...]
    scheduler: dict[str, Any]
    strategies: dict[str, dict[str, Any]]  # strategy settings, e.g. {"script": {"window_ms": 60000}}
    expect: dict[str, dict[str, str]]  # strategy -> checker -> verdict
    path: Path | None = None

    def strategy_option(self, strategy: str) -> str | dict[str, Any]:
        settings = self.strategies.get(strategy, {})
        return {"name": strategy, **settings} if settings else strategy

    def scheduler_options(self, strategy: str) -> dict[str, Any]:
        if strategy == "lease":
            return dict(self.scheduler)
        return {k: v for k, v in self.scheduler.items() if k not in LEASE_SCHEDULER_OPTIONS}

    def job_options(self, job: JobSpec, strategy: str) -> dict[str, Any]:
        if strategy == "lease":
            return dict(job.options)
        return {k: v for k, v in job.options.items() if k not in LEASE_JOB_OPTIONS}


def load(path: Path | str) -> Scenario:
    """A scenario file, or one of ``scenarios/`` by its name."""
    given = path
    path = Path(path)
    if not path.exists() and not path.suffix:
        path = SCENARIOS_DIR / f"{path}.toml"
    if not path.exists():
        names = ", ".join(p.stem for p in sorted(SCENARIOS_DIR.glob("*.toml")))
        raise ScenarioError(f"no scenario {str(given)!r}: a .toml file, or one of {names}")
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise ScenarioError(f"{path}: {error}") from error
    return parse(data, path)


def load_all() -> list[Scenario]:
    return [load(path) for path in sorted(SCENARIOS_DIR.glob("*.toml"))]


TOP_LEVEL = ("name", "description", "duration_s", "scheduler", "instances", "jobs", "faults", "strategies", "expect")
INSTANCE_KEYS = ("name", "offset_ms", "drift")
# Fault settings that are numbers: (the least allowed, whether the least itself is allowed)
FAULT_NUMBERS: dict[str, tuple[float, bool]] = {
    "duration_s": (0.0, False), "restart_after_s": (0.0, False), "timeout_s": (0.0, True), "delay_ms": (0.0, False),
    "lag_ms": (0.0, True), "offset_ms": (-float("inf"), False), "drift": (-1.0, False),
    "clock_ms": (-float("inf"), False),
}  # fmt: skip


def parse(data: dict[str, Any], path: Path | None = None) -> Scenario:
    """A scenario from its TOML data. A mistake is refused with what is wrong, rather than run as another
    scenario: an unknown key, a name given twice, a fault outside the run, a setting of the wrong kind."""
    where = str(path or data.get("name", "scenario"))

    def fail(problem: str) -> ScenarioError:
        return ScenarioError(f"{where}: {problem}")

    def need(table: dict[str, Any], key: str, kind: type | tuple[type, ...], context: str) -> Any:
        if key not in table:
            raise fail(f"{context} needs '{key}'")
        return kind_of(table, key, kind, context)

    def kind_of(table: dict[str, Any], key: str, kind: type | tuple[type, ...], context: str) -> Any:
        value = table[key]
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):  # TOML's true is no number
            raise fail(f"{context}.{key} has the wrong type: {value!r}")
        return value

    def number(table: dict[str, Any], key: str, context: str, least: float, least_allowed: bool) -> float:
        value = float(need(table, key, (int, float), context))
        if not math.isfinite(value):  # TOML has nan and inf: every comparison with nan is false
            raise fail(f"{context}.{key} = {value:g} must be a finite number")
        if value < least or (value == least and not least_allowed):
            raise fail(f"{context}.{key} = {value:g} must be {'at least' if least_allowed else 'above'} {least:g}")
        return value

    def table(value: object, context: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise fail(f"{context} must be a table, not {value!r}")
        return value

    def unique(names: list[str], context: str) -> None:
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise fail(f"{context} named twice: {', '.join(twice)}")

    unknown_keys = sorted(set(data) - set(TOP_LEVEL))
    if unknown_keys:
        raise fail(f"unknown keys {unknown_keys}; known: {', '.join(TOP_LEVEL)}")
    duration_s = number(data, "duration_s", "the file", 0.0, False)
    instances = []
    for i in data.get("instances", []):
        i = table(i, "[[instances]]")
        if set(i) - set(INSTANCE_KEYS):
            raise fail(f"[[instances]] does not take {sorted(set(i) - set(INSTANCE_KEYS))}; known: {INSTANCE_KEYS}")
        offset = int(kind_of(i, "offset_ms", int, "instances")) if "offset_ms" in i else 0
        drift = number(i, "drift", "instances", -1.0, False) if "drift" in i else 0.0
        instances.append(InstanceSpec(need(i, "name", str, "instances"), offset, drift))
    if not instances:
        raise fail("at least one [[instances]] is needed")
    unique([i.name for i in instances], "instances")
    if "winner" in {i.name for i in instances}:
        raise fail('"winner" is not an instance name: a fault on instance "winner" strikes the one running a job')
    names = {i.name for i in instances}
    jobs = []
    for j in data.get("jobs", []):
        j = table(j, "[[jobs]]")
        work_s = number(j, "work_s", "jobs", 0.0, True)
        options = {k: v for k, v in j.items() if k not in ("name", "cron", "work_s")}
        jobs.append(JobSpec(need(j, "name", str, "jobs"), need(j, "cron", str, "jobs"), work_s, options))
    if not jobs:
        raise fail("at least one [[jobs]] is needed")
    unique([j.name for j in jobs], "jobs")
    faults = []
    for f in data.get("faults", []):
        f = table(f, "[[faults]]")
        kind = need(f, "kind", str, "faults")
        if kind not in FAULT_KINDS:
            raise fail(f"unknown fault kind {kind!r}; known: {', '.join(FAULT_KINDS)}")
        required, optional = FAULT_KINDS[kind]
        settings = {k: v for k, v in f.items() if k not in ("at_s", "kind")}
        for key in required:
            need(f, key, (str, int, float), f"faults ({kind})")
        unknown = set(settings) - set(required) - set(optional)
        if unknown:
            raise fail(f"fault {kind!r} does not take {sorted(unknown)}")
        for key in settings.keys() & FAULT_NUMBERS.keys():
            number(settings, key, f"faults ({kind})", *FAULT_NUMBERS[key])
        for key in settings.keys() & {"instance", "job"}:
            kind_of(settings, key, str, f"faults ({kind})")
        if "reply_lost" in settings:
            kind_of(settings, "reply_lost", bool, f"faults ({kind})")
        instance = settings.get("instance")
        if instance is not None and instance not in names and instance != "winner":
            raise fail(f"fault {kind!r} names unknown instance {instance!r}")
        if "job" in settings and settings["job"] not in {j.name for j in jobs}:
            raise fail(f"fault {kind!r} names unknown job {settings['job']!r}")
        at_s = number(f, "at_s", f"faults ({kind})", 0.0, True)
        if at_s >= duration_s:
            raise fail(f"fault {kind!r} at {at_s:g} s: faults strike before the end ({duration_s:g} s)")
        faults.append(FaultSpec(at_s, kind, settings))
    strategies = {}
    for strategy, settings in table(data.get("strategies", {}), "strategies").items():
        if strategy not in STRATEGIES:
            raise fail(f"strategies.{strategy} is not a strategy ({', '.join(STRATEGIES)})")
        strategies[strategy] = dict(table(settings, f"strategies.{strategy}"))
    expect: dict[str, dict[str, str]] = {}
    for strategy, verdicts in table(data.get("expect", {}), "expect").items():
        if strategy not in STRATEGIES:
            raise fail(f"expect.{strategy} is not a strategy")
        for checker, verdict in table(verdicts, f"expect.{strategy}").items():
            if checker not in CHECKERS:
                raise fail(f"expect.{strategy}.{checker} is not a checker ({', '.join(CHECKERS)})")
            if verdict not in VERDICTS:
                raise fail(f"expect.{strategy}.{checker} = {verdict!r} is not one of {VERDICTS}")
        expect[strategy] = dict(verdicts)
    scenario = Scenario(
        name=need(data, "name", str, "the file"),
        description=str(data.get("description", "")),
        duration_s=duration_s,
        instances=tuple(instances),
        jobs=tuple(jobs),
        faults=tuple(sorted(faults, key=lambda f: f.at_s)),
        scheduler=dict(table(data.get("scheduler", {}), "scheduler")),
        strategies=strategies,
        expect=expect,
        path=path,
    )
    if (refused := _refused_settings(scenario)) is not None:
        raise fail(refused)
    return scenario


class _NoStore:
    """The client of the backends built only to check settings: they send nothing. (An embedded store here would
    bring fakeredis and numpy into every live instance process, which reads its scenario as it starts: a third
    more time to start, which a test of restarts on a loaded machine feels.)"""

    def send(self, command: str, args: list[str], /) -> Any:
        raise NotImplementedError(f"{command} sent to a backend built to check settings")


def _refused_settings(scenario: Scenario) -> str | None:
    """What the library refuses of the scenario's strategy, scheduler and job settings under any strategy, with the
    table it came from: said as the file is read, not as a traceback once a simulation of it runs (and a strategy's
    settings also when another strategy is run)."""
    for strategy in STRATEGIES:
        where = f"strategies.{strategy}"
        try:
            option: Any = scenario.strategy_option(strategy)  # a name or settings, checked by the backend
            backend = RedisBackend(redis=_NoStore(), strategy=option)
            where = "scheduler"
            scheduler = Scheduler(backend, **scenario.scheduler_options(strategy))
            for job in scenario.jobs:
                where = f"jobs ({job.name})"
                scheduler.add_job(job.name, job.cron, _no_work, **scenario.job_options(job, strategy))
        except AnarchonError as error:
            return f"{where}, under {strategy}: {error}"
    return None


def _no_work(run: RunContext) -> None:
    return None
