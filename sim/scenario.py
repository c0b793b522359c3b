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
    [expect.lease]                  # checker (P1..P6, lateness): valid | invalid | unknown
    P1 = "valid"
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCENARIOS_DIR = Path(__file__).resolve().parent.parent / "scenarios"
STRATEGIES = ("lease", "stream-id", "idmp", "script")
CHECKERS = ("P1", "P2", "P3", "P4", "P5", "P6", "lateness")
VERDICTS = ("valid", "invalid", "unknown")
LEASE_SCHEDULER_OPTIONS = ("lease_ms", "heartbeat_ms")
LEASE_JOB_OPTIONS = ("overlap", "max_attempts", "catch_up_ms")

# kind: (required settings, optional settings)
FAULT_KINDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "crash": (("instance",), ("restart_after_s",)),
    "pause": (("instance", "duration_s"), ()),
    "partition": (("instance", "duration_s"), ()),
    "skew": (("instance", "offset_ms"), ()),  # the clock jumps
    "drift": (("instance", "drift"), ()),  # the clock runs 1 + drift times as fast from here on
    "late": (("instance", "delay_ms", "duration_s"), ()),
    "failover": (("lag_ms",), ()),  # the replica, lag_ms behind, is promoted
    "replication-hold": (("duration_s",), ()),  # writes reach the replica when the hold ends
    "replication-drop": (("duration_s",), ()),  # writes made meanwhile never reach the replica
    "store-restart": ((), ()),
    "manual": (("instance", "job"), ()),  # run_now on that instance
}


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
        """How long the fault lasts (0 for instantaneous ones; a crash without restart lasts to the end)."""
        if "duration_s" in self.settings:
            return float(self.settings["duration_s"])
        if self.kind == "crash":
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
    path = Path(path)
    if not path.exists() and not path.suffix:
        path = SCENARIOS_DIR / f"{path}.toml"
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise ScenarioError(f"{path}: {error}") from error
    return parse(data, path)


def load_all() -> list[Scenario]:
    return [load(path) for path in sorted(SCENARIOS_DIR.glob("*.toml"))]


def parse(data: dict[str, Any], path: Path | None = None) -> Scenario:
    where = str(path or data.get("name", "scenario"))

    def need(table: dict[str, Any], key: str, kind: type | tuple[type, ...], context: str) -> Any:
        if key not in table:
            raise ScenarioError(f"{where}: {context} needs '{key}'")
        if not isinstance(table[key], kind):
            raise ScenarioError(f"{where}: {context}.{key} has the wrong type: {table[key]!r}")
        return table[key]

    instances = tuple(
        InstanceSpec(need(i, "name", str, "instances"), int(i.get("offset_ms", 0)), float(i.get("drift", 0.0)))
        for i in data.get("instances", [])
    )
    if not instances:
        raise ScenarioError(f"{where}: at least one [[instances]] is needed")
    names = {i.name for i in instances}
    jobs = tuple(
        JobSpec(
            need(j, "name", str, "jobs"),
            need(j, "cron", str, "jobs"),
            float(need(j, "work_s", (int, float), "jobs")),
            {k: v for k, v in j.items() if k not in ("name", "cron", "work_s")},
        )
        for j in data.get("jobs", [])
    )
    if not jobs:
        raise ScenarioError(f"{where}: at least one [[jobs]] is needed")
    faults = []
    for f in data.get("faults", []):
        kind = need(f, "kind", str, "faults")
        if kind not in FAULT_KINDS:
            raise ScenarioError(f"{where}: unknown fault kind {kind!r}; known: {', '.join(FAULT_KINDS)}")
        required, optional = FAULT_KINDS[kind]
        settings = {k: v for k, v in f.items() if k not in ("at_s", "kind")}
        for key in required:
            need(f, key, (str, int, float), f"faults ({kind})")
        unknown = set(settings) - set(required) - set(optional)
        if unknown:
            raise ScenarioError(f"{where}: fault {kind!r} does not take {sorted(unknown)}")
        instance = settings.get("instance")
        if instance is not None and instance not in names and instance != "winner":
            raise ScenarioError(f"{where}: fault {kind!r} names unknown instance {instance!r}")
        faults.append(FaultSpec(float(need(f, "at_s", (int, float), "faults")), kind, settings))
    expect: dict[str, dict[str, str]] = {}
    for strategy, verdicts in data.get("expect", {}).items():
        if strategy not in STRATEGIES:
            raise ScenarioError(f"{where}: expect.{strategy} is not a strategy")
        for checker, verdict in verdicts.items():
            if checker not in CHECKERS:
                raise ScenarioError(f"{where}: expect.{strategy}.{checker} is not a checker ({', '.join(CHECKERS)})")
            if verdict not in VERDICTS:
                raise ScenarioError(f"{where}: expect.{strategy}.{checker} = {verdict!r} is not one of {VERDICTS}")
        expect[strategy] = dict(verdicts)
    return Scenario(
        name=need(data, "name", str, "the file"),
        description=str(data.get("description", "")),
        duration_s=float(need(data, "duration_s", (int, float), "the file")),
        instances=instances,
        jobs=jobs,
        faults=tuple(sorted(faults, key=lambda f: f.at_s)),
        scheduler=dict(data.get("scheduler", {})),
        strategies={k: dict(v) for k, v in data.get("strategies", {}).items()},
        expect=expect,
        path=path,
    )
