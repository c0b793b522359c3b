"""Property search: Hypothesis generates fault schedules, looks for runs a checker rejects, and shrinks each to a
minimal schedule, printed as a timeline with the scenario file and command that replay it.

    python -m sim search --strategy lease --budget 60 [--out reports/latest/search]
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Flaky

from sim.run import Outcome, simulate
from sim.scenario import Scenario, parse

BASE: dict[str, Any] = {
    "name": "search",
    "description": "A fault schedule found by python -m sim search.",
    "duration_s": 120,
    "scheduler": {"lease_ms": 3000, "heartbeat_ms": 1000},
    "instances": [{"name": "a"}, {"name": "b"}, {"name": "c"}],
    "jobs": [{"name": "tick", "cron": "*/10 * * * * *", "work_s": 2.0}],
}
TARGETS = ("a", "b", "c", "winner")


def _at() -> st.SearchStrategy[float]:
    return st.integers(5, 90).map(float)


FAULTS = st.one_of(
    st.fixed_dictionaries({"at_s": _at(), "kind": st.just("crash"), "instance": st.sampled_from(TARGETS),
                           "restart_after_s": st.integers(1, 30)}),
    st.fixed_dictionaries({"at_s": _at(), "kind": st.just("pause"), "instance": st.sampled_from(TARGETS),
                           "duration_s": st.integers(1, 20)}),
    st.fixed_dictionaries({"at_s": _at(), "kind": st.just("partition"), "instance": st.sampled_from(TARGETS),
                           "duration_s": st.integers(1, 20)}),
    st.fixed_dictionaries({"at_s": _at(), "kind": st.just("skew"), "instance": st.sampled_from(TARGETS),
                           "offset_ms": st.integers(-15_000, 15_000)}),
    st.fixed_dictionaries({"at_s": _at(), "kind": st.just("late"), "instance": st.sampled_from(TARGETS),
                           "delay_ms": st.integers(1_000, 30_000), "duration_s": st.integers(5, 30)}),
    st.fixed_dictionaries({"at_s": _at(), "kind": st.just("failover"), "lag_ms": st.integers(100, 5_000)}),
    st.fixed_dictionaries({"at_s": _at(), "kind": st.just("store-restart")}),
)  # fmt: skip


def schedule_scenario(faults: list[dict[str, Any]], strategy: str) -> Scenario:
    data = {**BASE, "faults": faults, "strategies": {"script": {"window_ms": 60_000}, "idmp": {"duration_sec": 60}}}
    return parse(data)


@dataclass
class Finding:
    checker: str
    faults: list[dict[str, Any]]
    seed: int
    outcome: Outcome


def search_checker(strategy: str, checker: str, examples: int, *, derandomize: bool = False) -> Finding | None:
    """Look for a schedule under which ``checker`` rejects a run; the smallest one Hypothesis can shrink to.
    ``derandomize`` makes the search itself repeatable (for tests)."""
    found: list[Finding] = []

    @settings(max_examples=examples, deadline=None, database=None, derandomize=derandomize,
              suppress_health_check=list(HealthCheck), phases=[Phase.generate, Phase.shrink])  # fmt: skip
    @given(faults=st.lists(FAULTS, max_size=4), seed=st.integers(1, 1_000))
    def holds(faults: list[dict[str, Any]], seed: int) -> None:
        outcome = simulate(schedule_scenario(faults, strategy), strategy, seed)
        if outcome.judgement.verdicts[checker].status == "invalid":
            found.append(Finding(checker, faults, seed, outcome))
            raise AssertionError(outcome.judgement.verdicts[checker].witness)

    try:
        holds()
    except (AssertionError, Flaky):
        if found:  # the last failure Hypothesis tried is the shrunk one
            return _without_needless_faults(found[-1], strategy)
    return None


def _without_needless_faults(finding: Finding, strategy: str) -> Finding:
    """Hypothesis's shrinking does not promise that no single fault can go (it once stopped at three identical
    crashes where two were enough). Drop each fault without which the checker still fails, until every fault
    left is needed."""
    i = 0
    while i < len(finding.faults):
        fewer = finding.faults[:i] + finding.faults[i + 1 :]
        outcome = simulate(schedule_scenario(fewer, strategy), strategy, finding.seed)
        if outcome.judgement.verdicts[finding.checker].status == "invalid":
            finding = Finding(finding.checker, fewer, finding.seed, outcome)
        else:
            i += 1
    return finding


def timeline(finding: Finding) -> str:
    lines = [f"{finding.checker} violated: {finding.outcome.judgement.verdicts[finding.checker].witness}"]
    events = [e for e in finding.outcome.history.events if e.kind == "fault"]
    for event in events:
        lines.append(f"  {event.t:7.2f} s  {event.op:<13} {event.value}")
    return "\n".join(lines)


def to_toml(finding: Finding, strategy: str) -> str:
    """The schedule as a scenario file, so that ``python -m sim run FILE`` replays it."""

    def value(v: Any) -> str:
        return f'"{v}"' if isinstance(v, str) else str(v)

    lines = [
        f'name = "search-{strategy}-{finding.checker}"',
        f'description = "Found by python -m sim search: {finding.checker} fails under {strategy}."',
        f"duration_s = {BASE['duration_s']}",
        "",
        "[scheduler]",
        *[f"{k} = {value(v)}" for k, v in BASE["scheduler"].items()],
        "",
        "[strategies.script]",
        "window_ms = 60000",
        "",
        "[strategies.idmp]",
        "duration_sec = 60",
        "",
    ]
    for instance in BASE["instances"]:
        lines += ["[[instances]]", f'name = "{instance["name"]}"']
    for job in BASE["jobs"]:
        lines += ["", "[[jobs]]", *[f"{k} = {value(v)}" for k, v in job.items()]]
    for fault in finding.faults:
        lines += ["", "[[faults]]", *[f"{k} = {value(v)}" for k, v in fault.items()]]
    return "\n".join(lines) + "\n"


def run(strategy: str, budget_s: float, out: Path, report: Callable[[str], None] = print) -> list[Finding]:
    """Spend about ``budget_s`` seconds looking for violations of each checker; write each one found."""
    checkers = ["P1", "P2", "P3", "P4", "P5", "P6"] if strategy == "lease" else ["P1", "P2", "P3", "P5", "P6"]
    began = time.perf_counter()
    simulate(schedule_scenario([], strategy), strategy, 1)  # warm up, then measure one run
    probe = time.perf_counter()
    simulate(schedule_scenario([], strategy), strategy, 2)
    per_run = max(time.perf_counter() - probe, 0.005)
    findings = []
    out.mkdir(parents=True, exist_ok=True)
    for i, checker in enumerate(checkers):
        left = budget_s - (time.perf_counter() - began)
        share = left / (len(checkers) - i)
        examples = max(5, int(share / per_run / 3))  # shrinking costs runs too
        finding = search_checker(strategy, checker, examples)
        if finding is None:
            report(f"{checker}: no violation in {examples} generated schedules")
            continue
        findings.append(finding)
        path = out / f"{strategy}-{finding.checker}.toml"
        path.write_text(to_toml(finding, strategy))
        report(timeline(finding))
        report(f"  replay: python -m sim run {path} --strategy {strategy} --seed {finding.seed}")
    report(f"searched for {time.perf_counter() - began:.0f} s")
    return findings
