"""Property search: Hypothesis generates fault schedules, looks for runs a checker rejects, and shrinks each to a
smallest schedule (no subset of it fails), printed as a timeline with the scenario file and command that replay
it. The budget covers the shrinking; a schedule the budget left unshrunk is reported as such.

    python -m sim search --strategy lease --budget 60 [--seed N] [--examples N] [--out reports/latest/search]

The search draws at random: ``--seed`` repeats a search, and with ``--examples`` (per checker) also on a
machine of another speed, as long as the budget lets every example run. Exit status 1 when a violation was found.
"""

from __future__ import annotations

import contextlib
import itertools
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from hypothesis.errors import Flaky

from sim.run import Outcome, simulate
from sim.scenario import CHECKERS, Scenario, parse, toml_value

PERIOD_S = 10  # the job's slots: every 10 s
WORK_S = 2.0
BASE: dict[str, Any] = {
    "name": "search",
    "description": "A fault schedule found by python -m sim search.",
    "duration_s": 120,
    "scheduler": {"lease_ms": 3000, "heartbeat_ms": 1000},
    "instances": [{"name": "a"}, {"name": "b"}, {"name": "c"}],
    # max_late_ms below the claim-only strategies' 60 s memory, which must outlast any claim
    "jobs": [{"name": "tick", "cron": f"*/{PERIOD_S} * * * * *", "work_s": WORK_S, "max_late_ms": 30_000}],
}
TARGETS = ("a", "b", "c", "winner")


def _at() -> st.SearchStrategy[float]:
    """A fault's moment: half of them while a slot's run is under way (in half seconds from the slot to the end
    of its work), the others anywhere in 5-90 s. Drawn uniformly, four moments in five fell between runs, where
    most faults change nothing: a winner paused past its lease, the lease strategy's known failure, was in
    0.3 % of schedules."""
    slots = st.integers(1, 90 // PERIOD_S).map(lambda n: n * PERIOD_S)
    into = st.integers(0, int(2 * WORK_S) - 1).map(lambda halves: halves / 2)
    in_a_run = st.builds(lambda slot, offset: slot + offset, slots, into)
    return st.one_of(st.integers(5, 90).map(float), in_a_run)


def _fault(
    kind: str, optional: dict[str, st.SearchStrategy[Any]] | None = None, **settings: st.SearchStrategy[Any]
) -> st.SearchStrategy[dict[str, Any]]:
    required: dict[str, st.SearchStrategy[Any]] = {"at_s": _at(), "kind": st.just(kind), **settings}
    return st.fixed_dictionaries(required, optional=optional or {})


_INSTANCE = st.sampled_from(TARGETS)
# One fault of each kind a scenario can have (sim.scenario.FAULT_KINDS), with the settings the search varies.
FAULT_KINDS: dict[str, st.SearchStrategy[dict[str, Any]]] = {
    # Without restart_after_s the instance stays down to the end.
    "crash": _fault("crash", {"restart_after_s": st.integers(1, 30)}, instance=_INSTANCE),
    "stop": _fault("stop", {"restart_after_s": st.integers(1, 30)}, instance=_INSTANCE, timeout_s=st.integers(0, 5)),
    "pause": _fault("pause", instance=_INSTANCE, duration_s=st.integers(1, 20)),
    "partition": _fault("partition", {"reply_lost": st.booleans()}, instance=_INSTANCE, duration_s=st.integers(1, 20)),
    "slow": _fault("slow", instance=_INSTANCE, duration_s=st.integers(1, 20), delay_ms=st.integers(100, 3_000)),
    "skew": _fault("skew", instance=_INSTANCE, offset_ms=st.integers(-15_000, 15_000)),
    "drift": _fault("drift", instance=_INSTANCE, drift=st.sampled_from([-0.05, -0.01, 0.01, 0.05])),
    "late": _fault("late", instance=_INSTANCE, delay_ms=st.integers(1_000, 30_000), duration_s=st.integers(5, 30)),
    "failover": _fault("failover", {"clock_ms": st.integers(-600_000, 600_000)}, lag_ms=st.integers(100, 5_000)),
    "replication-hold": _fault("replication-hold", duration_s=st.integers(1, 20)),
    "store-restart": _fault("store-restart"),
    "manual": _fault("manual", instance=_INSTANCE, job=st.just("tick")),
}


def schedule_scenario(faults: list[dict[str, Any]], strategy: str) -> Scenario:
    data = {**BASE, "faults": faults, "strategies": {"script": {"window_ms": 60_000}, "idmp": {"duration_sec": 60}}}
    return parse(data)


@dataclass
class Finding:
    checker: str
    faults: list[dict[str, Any]]
    seed: int
    outcome: Outcome
    minimal: bool = True  # False when the budget ran out before the schedule was shrunk to a smallest one


@dataclass
class Breakage:
    """A schedule under which the simulator itself failed: a testbed bug, reported apart from the checkers'."""

    faults: list[dict[str, Any]]
    seed: int
    error: str


@dataclass
class Budget:
    """The time on ``clock`` (wall time by default) by which a search ends, of which some is kept for the final
    shrink: twice what ``SHRINK_RUNS`` simulations take at the mean pace so far (``run_s`` before the first; a
    failing run often takes longer), at most ``shrink_cap_s``. Counts the simulations run and their time."""

    deadline: float = float("inf")
    run_s: float = 0.0
    shrink_cap_s: float = 0.0
    clock: Callable[[], float] = time.perf_counter
    simulations: int = 0
    simulated_s: float = 0.0

    def simulate(self, faults: list[dict[str, Any]], strategy: str, seed: int) -> Outcome:
        began = self.clock()
        try:
            return simulate(schedule_scenario(faults, strategy), strategy, seed)
        finally:
            self.simulations += 1
            self.simulated_s += self.clock() - began

    def searching(self) -> bool:
        pace = self.simulated_s / self.simulations if self.simulations else self.run_s
        return self.clock() < self.deadline - min(self.shrink_cap_s, 2 * SHRINK_RUNS * pace)

    def shrinking(self) -> bool:
        return self.clock() < self.deadline


# Simulations the final shrink runs at most, for a schedule of up to four distinct faults: without duplicates,
# none, four singles, six pairs, four triples.
SHRINK_RUNS = 16


def search_checker(
    strategy: str,
    checker: str,
    examples: int,
    *,
    derandomize: bool = False,
    seed: int | None = None,
    budget: Budget | None = None,
    broken: list[Breakage] | None = None,
    kinds: Sequence[str] = tuple(FAULT_KINDS),
) -> Finding | None:
    """Look for a schedule under which ``checker`` rejects a run, shrunk to a smallest one (see :func:`shrink`).
    ``derandomize`` makes the search itself repeatable (for tests), as ``seed`` does with a draw of its own.
    Once ``budget`` stops searching nothing more is simulated: the generation ends, Hypothesis's shrinking stops
    at the smallest failure found so far, and the final shrink has what is left. A simulation that raises is
    added to ``broken`` and counts as passing; without ``broken`` it propagates. ``kinds``: the fault kinds drawn
    (every kind by default)."""
    budget = budget or Budget()
    found: list[Finding] = []

    drawn = st.one_of(*(FAULT_KINDS[kind] for kind in kinds))

    @settings(max_examples=examples, deadline=None, database=None, derandomize=derandomize,
              suppress_health_check=list(HealthCheck), phases=[Phase.generate, Phase.shrink])  # fmt: skip
    @given(faults=st.lists(drawn, max_size=4), seed=st.integers(1, 1_000))
    def holds(faults: list[dict[str, Any]], seed: int) -> None:
        if not budget.searching():
            return
        outcome = _simulated(budget, faults, strategy, seed, broken)
        if outcome is not None and outcome.judgement.verdicts[checker].status == "invalid":
            found.append(Finding(checker, faults, seed, outcome))
            raise AssertionError(outcome.judgement.verdicts[checker].witness)

    if seed is not None:
        holds = hypothesis_seed(seed)(holds)
    # Flaky: the budget ran out while Hypothesis shrank, and its last replay passed.
    with contextlib.suppress(AssertionError, Flaky):
        holds()
    if not found:
        return None
    # The last failure Hypothesis tried is the smallest it reached: it only tries schedules smaller than the last
    # failing one, and ends by replaying the smallest.
    return shrink(found[-1], strategy, budget, broken)


def shrink(
    finding: Finding, strategy: str, budget: Budget | None = None, broken: list[Breakage] | None = None
) -> Finding:
    """The smallest failing subset of the finding's schedule, with the same seed.

    Hypothesis's shrinking does not promise a smallest schedule (it once stopped at four faults, two of them the
    same crash, where a pause alone broke the checker), and dropping one fault at a time does not either: a run
    is not monotonic in its faults (each changes who wins what), so a fault the failure does not need can be
    needed for the others to fail. Schedules are small, so :func:`smallest_failing` tries every subset of fewer
    than three faults. Once ``budget`` stops shrinking, the finding says it may not be minimal. A subset whose
    simulation raises is added to ``broken`` and counts as passing (without ``broken`` it propagates)."""
    budget = budget or Budget()
    checker, seed = finding.checker, finding.seed
    failures = [finding]  # the last one is the schedule smallest_failing settles on

    def fails(faults: list[dict[str, Any]]) -> bool:
        outcome = _simulated(budget, faults, strategy, seed, broken)
        if outcome is None or outcome.judgement.verdicts[checker].status != "invalid":
            return False
        failures.append(Finding(checker, faults, seed, outcome))
        return True

    faults, minimal = smallest_failing(finding.faults, fails, lambda: not budget.shrinking())
    assert failures[-1].faults == faults
    return replace(failures[-1], minimal=minimal)


def _simulated(
    budget: Budget, faults: list[dict[str, Any]], strategy: str, seed: int, broken: list[Breakage] | None
) -> Outcome | None:
    """The run's outcome; None when the simulator itself failed, which is added to ``broken`` (without
    ``broken``, it propagates)."""
    try:
        return budget.simulate(faults, strategy, seed)
    except Exception as error:
        if broken is None:
            raise
        broken.append(Breakage(faults, seed, f"{type(error).__name__}: {error}"))
        return None


T = TypeVar("T")


def smallest_failing(
    items: list[T], fails: Callable[[list[T]], bool], out_of_time: Callable[[], bool] = lambda: False
) -> tuple[list[T], bool]:
    """A smallest sublist of ``items`` (which fail) that ``fails`` too, and whether it is known to be one (not
    when ``out_of_time`` cut the search short, or for more than four items once duplicates went). The sublist is
    the last one ``fails`` was true of, or ``items``.

    Exact duplicates go first, if the list still fails without them; then the empty list, each single item and
    each pair are tried in order, and the first that fails is the answer; failing that, items are dropped one
    at a time while the rest still fails."""
    current = items
    unique = [item for i, item in enumerate(items) if item not in items[:i]]
    if len(unique) < len(items):
        if out_of_time():
            return (current, False)
        if fails(unique):
            current = unique
    tried = len(current)  # every sublist of fewer than three of these is tried below
    for size in range(min(3, tried)):
        for candidate in itertools.combinations(current, size):
            if out_of_time():
                return (current, False)
            if fails(list(candidate)):
                return (list(candidate), True)
    i = 0
    while i < len(current):
        if out_of_time():
            return (current, False)
        fewer = current[:i] + current[i + 1 :]
        if fails(fewer):
            current = fewer
        else:
            i += 1
    # No sublist of fewer than three fails: of up to four, dropping one at a time has left a smallest.
    return (current, tried <= 4)


def timeline(finding: Finding) -> str:
    lines = [f"{finding.checker} violated: {finding.outcome.judgement.verdicts[finding.checker].witness}"]
    events = [e for e in finding.outcome.history.events if e.kind == "fault"]
    for event in events:
        lines.append(f"  {event.t:7.2f} s  {event.op:<13} {event.value}")
    return "\n".join(lines)


def to_toml(finding: Finding, strategy: str) -> str:
    """The schedule as a scenario file, so that ``python -m sim run FILE`` replays it."""
    what = f"{finding.checker} fails under {strategy}"
    return schedule_toml(finding.faults, f"search-{strategy}-{finding.checker}", what)


def schedule_toml(faults: list[dict[str, Any]], name: str, what: str) -> str:
    lines = [
        f"name = {toml_value(name)}",
        f"description = {toml_value(f'Found by python -m sim search: {what}.')}",
        f"duration_s = {BASE['duration_s']}",
        "",
        "[scheduler]",
        *[f"{k} = {toml_value(v)}" for k, v in BASE["scheduler"].items()],
        "",
        "[strategies.script]",
        "window_ms = 60000",
        "",
        "[strategies.idmp]",
        "duration_sec = 60",
        "",
    ]
    for instance in BASE["instances"]:
        lines += ["[[instances]]", f"name = {toml_value(instance['name'])}"]
    for job in BASE["jobs"]:
        lines += ["", "[[jobs]]", *[f"{k} = {toml_value(v)}" for k, v in job.items()]]
    for fault in faults:
        lines += ["", "[[faults]]", *[f"{k} = {toml_value(v)}" for k, v in fault.items()]]
    return "\n".join(lines) + "\n"


def run(
    strategy: str,
    budget_s: float,
    out: Path,
    report: Callable[[str], None] = print,
    *,
    seed: int | None = None,
    examples: int | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> list[Finding]:
    """Spend at most about ``budget_s`` seconds looking for violations of each checker, shrinking included; write
    each one found, in place of what an earlier search of the strategy wrote to ``out``. A simulation in progress
    when the time is up ends first: the overrun is about one run. ``seed``: the search's draw (random if None,
    and printed); ``examples``: schedules per checker (by default, as many as the budget's share would run);
    ``clock``: the seconds the budget is spent in (wall time by default)."""
    seed = random.randrange(2**32) if seed is None else seed
    # The checkers P1-P7 (not lateness); P4 judges leases only.
    checkers = [c for c in CHECKERS if c != "lateness" and (c != "P4" or strategy == "lease")]
    began = clock()
    simulate(schedule_scenario([], strategy), strategy, 1)  # warm up, then measure one run
    probe = clock()
    simulate(schedule_scenario([], strategy), strategy, 2)
    per_run = max(clock() - probe, 0.005)
    findings = []
    broken: list[Breakage] = []
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob(f"{strategy}-*.toml"):  # an earlier search's: what remains is this one's
        stale.unlink()
    for i, checker in enumerate(checkers):
        now = clock()
        share = (budget_s - (now - began)) / (len(checkers) - i)
        budget = Budget(now + share, run_s=per_run, shrink_cap_s=share / 2, clock=clock)
        count = examples or max(5, int(share / per_run))
        # A seed of its own for each checker: with one, each would draw (and simulate) the schedules the first did.
        finding = search_checker(strategy, checker, count, seed=seed + i, budget=budget, broken=broken)
        if finding is None:
            left = "" if budget.simulations >= count else f" (of {count}: the budget ran out)"
            report(f"{checker}: no violation in {budget.simulations} generated schedules{left}")
            continue
        findings.append(finding)
        path = out / f"{strategy}-{finding.checker}.toml"
        path.write_text(to_toml(finding, strategy))
        report(timeline(finding))
        if not finding.minimal:
            report("  the budget ran out while shrinking: a smaller schedule may fail too")
        report(f"  replay: python -m sim run {path} --strategy {strategy} --seed {finding.seed}")
    for n, breakage in enumerate(broken[:3]):  # a testbed bug, not a checker's finding
        path = out / f"{strategy}-broken-{n + 1}.toml"
        path.write_text(schedule_toml(breakage.faults, path.stem, f"the simulator fails under {strategy}"))
        report(f"the simulator failed: {breakage.error}")
        report(f"  replay: python -m sim run {path} --strategy {strategy} --seed {breakage.seed}")
    if len(broken) > 3:
        report(f"  ... and under {len(broken) - 3} more schedules")
    report(f"searched for {clock() - began:.1f} s (budget {budget_s:g} s); the same draw: --seed {seed}")
    return findings
