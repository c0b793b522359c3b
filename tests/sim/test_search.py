"""Property search finds known failures and shrinks them to smallest schedules that replay, within its budget."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings

from sim import search
from sim.__main__ import main as sim_main
from sim.run import simulate
from sim.scenario import FAULT_KINDS, load

REPO = Path(__file__).resolve().parents[2]


# The simulator is deterministic for one seed under one string-hash seed (the store iterates sets in hash
# order; python -m sim always runs with PYTHONHASHSEED=0). A search that must find something runs there too.
SEARCH_P4 = """
import itertools, json, sys
from dataclasses import replace
from sim import search
from sim.__main__ import main as sim_main
from sim.run import simulate
from sim.scenario import load

finding = search.search_checker("lease", "P4", examples=100, derandomize=True,
                                 kinds=["pause", "partition", "skew", "late", "stop"])
if finding is None:
    print(json.dumps(None))
    sys.exit()
path = sys.argv[1]
open(path, "w").write(search.to_toml(finding, "lease"))

def breaks_p4(subset):
    smaller = path + ".subset.toml"  # through a scenario file, as a replay would
    open(smaller, "w").write(search.to_toml(replace(finding, faults=subset), "lease"))
    return simulate(load(smaller), "lease", finding.seed).judgement.verdicts["P4"].status == "invalid"

faults = finding.faults
smaller = [list(s) for size in (0, 1, 2) if size < len(faults) for s in itertools.combinations(faults, size)]
smaller += [faults[:i] + faults[i + 1 :] for i in range(len(faults)) if len(faults) > 3]
print(json.dumps({"faults": faults, "seed": finding.seed, "minimal": finding.minimal,
                  "digest": finding.outcome.digest, "smaller_failing": [s for s in smaller if breaks_p4(s)]}))
"""


@pytest.fixture(scope="module")
def p4_finding(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    path = tmp_path_factory.mktemp("search") / "found.toml"
    done = subprocess.run([sys.executable, "-c", SEARCH_P4, str(path)], cwd=REPO, capture_output=True, text=True,
                          timeout=300, check=True, env={**os.environ, "PYTHONHASHSEED": "0"})  # fmt: skip
    found = json.loads(done.stdout)
    assert found is not None, "no schedule that breaks P4 in 100 examples"
    return {**found, "path": path}


@pytest.mark.slow
def test_search_finds_a_lease_violation_and_writes_a_replayable_schedule(p4_finding: dict[str, Any]) -> None:
    kinds = {fault["kind"] for fault in p4_finding["faults"]}
    assert kinds & {"pause", "partition", "late", "skew", "failover", "store-restart"}
    command = [sys.executable, "-m", "sim", "run", str(p4_finding["path"]), "--strategy", "lease", "--seed",
               str(p4_finding["seed"])]  # fmt: skip
    done = subprocess.run([*command, "--json"], cwd=REPO, capture_output=True, text=True, timeout=120, check=True)
    replayed = json.loads(done.stdout)
    assert replayed["digest"] == p4_finding["digest"]
    assert replayed["verdicts"]["P4"] == "invalid"
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120, check=True)
    assert "P4 invalid" in done.stdout


@pytest.mark.slow
def test_a_found_schedule_is_a_smallest_failing_one(p4_finding: dict[str, Any]) -> None:
    faults = p4_finding["faults"]
    assert p4_finding["minimal"]
    assert all(a != b for a, b in itertools.combinations(faults, 2)), f"duplicate faults: {faults}"
    # No schedule of fewer faults (none, one, any two, any all but one) breaks P4 with that seed.
    assert p4_finding["smaller_failing"] == [], f"{faults} shrinks further"


# A schedule like one the search once reported for P4: a crash twice (the same fault), another crash, and a
# pause; the pause alone breaks P4, but no single fault can go without P4 holding again.
CRASH_A, CRASH_B, PAUSE_B, SKEW_C = "crash a", "crash b", "pause b", "skew c"
STUCK = [CRASH_A, CRASH_A, CRASH_B, PAUSE_B]


def _calls(fails: set[tuple[str, ...]]) -> tuple[list[list[str]], Any]:
    tried: list[list[str]] = []

    def predicate(subset: list[str]) -> bool:
        tried.append(subset)
        return tuple(subset) in fails

    return tried, predicate


def test_shrinking_finds_a_single_fault_where_dropping_one_at_a_time_is_stuck() -> None:
    tried, fails = _calls({tuple(STUCK), (PAUSE_B,)})
    assert search.smallest_failing(STUCK, fails) == ([PAUSE_B], True)
    # Duplicates first (the run without them passes here, so they stay), then none, then each single in order.
    assert tried == [[CRASH_A, CRASH_B, PAUSE_B], [], [CRASH_A], [CRASH_A], [CRASH_B], [PAUSE_B]]


def test_shrinking_drops_duplicates_and_keeps_the_first_smallest_subset() -> None:
    schedule = [SKEW_C, PAUSE_B, PAUSE_B, CRASH_B]
    failing = {tuple(schedule), (SKEW_C, PAUSE_B, CRASH_B), (SKEW_C, CRASH_B), (PAUSE_B, CRASH_B)}
    _, fails = _calls(failing)
    assert search.smallest_failing(schedule, fails) == ([SKEW_C, CRASH_B], True)


def test_shrinking_past_pairs_drops_one_fault_at_a_time() -> None:
    four = [CRASH_A, CRASH_B, PAUSE_B, SKEW_C]
    _, fails = _calls({tuple(four), (CRASH_A, PAUSE_B, SKEW_C)})
    assert search.smallest_failing(four, fails) == ([CRASH_A, PAUSE_B, SKEW_C], True)
    five = [*four, "late a"]
    _, fails = _calls({tuple(five)})
    assert search.smallest_failing(five, fails) == (five, False)  # triples of five were not all tried


def test_shrinking_stops_when_out_of_time_and_says_so() -> None:
    tried, fails = _calls({tuple(STUCK), (PAUSE_B,)})
    budget = iter([False, False, True])
    assert search.smallest_failing(STUCK, fails, lambda: next(budget)) == (STUCK, False)
    assert len(tried) == 2


def test_the_search_generates_every_fault_kind_a_scenario_can_have() -> None:
    assert list(search.FAULT_KINDS) == list(FAULT_KINDS)


@pytest.mark.parametrize("kind", list(search.FAULT_KINDS))
def test_a_generated_fault_replays_from_its_file_and_is_recorded_at_its_moment(kind: str, tmp_path: Path) -> None:
    @settings(max_examples=3, derandomize=True, deadline=None, database=None)
    @given(fault=search.FAULT_KINDS[kind])
    def replays(fault: dict[str, Any]) -> None:
        path = tmp_path / "schedule.toml"
        path.write_text(search.schedule_toml([fault], "one-fault", f"a {kind}"))
        outcome = simulate(load(path), "lease", 1)
        assert outcome.digest == simulate(search.schedule_scenario([fault], "lease"), "lease", 1).digest
        struck = [e for e in outcome.history.events if e.kind == "fault"]
        assert struck, "no fault recorded"
        assert (struck[0].op, struck[0].t) == (kind, fault["at_s"])

    replays()


def test_a_guarantee_that_holds_yields_no_finding() -> None:
    # Runs of a 2 s job every 10 s never overlap under lease through crashes, stops, partitions, clock faults and
    # run_now (a pause longer than the lease, or a store that forgets a run in progress, breaks it).
    kinds = ["crash", "stop", "partition", "skew", "drift", "late", "manual"]
    assert search.search_checker("lease", "P3", examples=60, derandomize=True, kinds=kinds) is None


def test_a_search_narrowed_to_some_kinds_draws_only_those() -> None:
    drawn: list[str] = []

    def record(faults: list[dict[str, Any]], strategy: str, seed: int) -> Any:
        drawn.extend(fault["kind"] for fault in faults)
        raise RuntimeError("not simulated")

    budget = search.Budget()
    budget.simulate = record  # type: ignore[method-assign]
    search.search_checker("lease", "P3", examples=30, derandomize=True, budget=budget, broken=[], kinds=["pause"])
    assert drawn
    assert set(drawn) == {"pause"}


def test_a_simulator_failure_is_reported_apart_and_the_search_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object) -> None:
        raise RuntimeError("the store went away")

    monkeypatch.setattr(search, "simulate", broken)
    breakages: list[search.Breakage] = []
    assert search.search_checker("lease", "P1", examples=5, derandomize=True, broken=breakages) is None
    assert len(breakages) == 5
    assert breakages[0].error == "RuntimeError: the store went away"
    with pytest.raises(RuntimeError):
        search.search_checker("lease", "P1", examples=5, derandomize=True)


def test_a_simulator_failure_while_shrinking_is_reported_apart_and_the_shrink_goes_on() -> None:
    """The schedule fails the checker with both its faults; the simulator raises under the crash alone. The shrink
    keeps the finding instead of ending the search (and losing what it found and the checkers after it)."""
    crash = {"at_s": 31.0, "kind": "crash", "instance": "winner", "restart_after_s": 5}
    pause = {"at_s": 41.0, "kind": "pause", "instance": "a", "duration_s": 6}

    def judged(status: str) -> Any:
        return SimpleNamespace(judgement=SimpleNamespace(verdicts={"P1": SimpleNamespace(status=status)}))

    def simulate(faults: list[dict[str, Any]], strategy: str, seed: int) -> Any:
        if faults == [crash]:
            raise RuntimeError("the simulator broke")
        return judged("invalid" if faults == [crash, pause] else "valid")

    budget = search.Budget()
    budget.simulate = simulate  # type: ignore[method-assign]
    breakages: list[search.Breakage] = []
    finding = search.Finding("P1", [crash, pause], 7, judged("invalid"))
    shrunk = search.shrink(finding, "lease", budget, breakages)
    assert (shrunk.faults, shrunk.minimal) == ([crash, pause], True)
    assert breakages
    assert {(str(b.faults), b.seed, b.error) for b in breakages} == {
        (str([crash]), 7, "RuntimeError: the simulator broke")
    }
    with pytest.raises(RuntimeError, match="the simulator broke"):
        search.shrink(finding, "lease", budget)


@pytest.mark.slow
def test_the_search_keeps_to_its_budget_shrinking_included(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The budget is spent in a clock that only simulations move (a longer one for more faults), so the test is
    of how the search spends its budget, not of how busy the machine is: it ends at most one run past it."""
    elapsed = [0.0]
    runs_s: list[float] = []

    def timed(scenario: Any, strategy: str, seed: int) -> Any:
        run_s = 0.05 + 0.05 * len(scenario.faults)
        runs_s.append(run_s)
        elapsed[0] += run_s
        return simulate(scenario, strategy, seed)

    monkeypatch.setattr(search, "simulate", timed)
    lines: list[str] = []
    findings = search.run("lease", 4.0, tmp_path, report=lines.append, seed=701, clock=lambda: elapsed[0])
    assert elapsed[0] <= 4.0 + max(runs_s), (elapsed[0], len(runs_s), lines)
    assert "the budget ran out" in lines[0]  # the first checker's share was spent searching
    assert len(runs_s) >= 2 + 7 * 3  # the warm-up and probe, and several runs per checker
    assert findings, lines
    assert all(f.minimal for f in findings), lines  # shrinking included, within the budget
    assert lines[-1].startswith("searched for")


@pytest.mark.parametrize("kind", ["crash", "stop"])
def test_the_search_draws_instances_that_stay_down_as_well_as_restarted_ones(kind: str) -> None:
    restarts: list[bool] = []

    @settings(max_examples=40, derandomize=True, deadline=None, database=None)
    @given(fault=search.FAULT_KINDS[kind])
    def draw(fault: dict[str, Any]) -> None:
        restarts.append("restart_after_s" in fault)

    draw()
    assert set(restarts) == {True, False}


def test_half_the_faults_strike_while_a_slot_is_run() -> None:
    # Between runs most faults change nothing: drawn uniformly, four in five fell there.
    during: list[bool] = []

    @settings(max_examples=400, derandomize=True, deadline=None, database=None)
    @given(fault=search.FAULT_KINDS["pause"])
    def draw(fault: dict[str, Any]) -> None:
        into_the_period = fault["at_s"] % search.PERIOD_S
        during.append(into_the_period < search.WORK_S)
        assert 5 <= fault["at_s"] < 90 + search.WORK_S

    draw()
    assert 0.45 <= sum(during) / len(during) <= 0.8, sum(during)


def _drawn(seed: int, examples: int = 20, search_checker: Any = search.search_checker) -> list[Any]:
    """The schedules (and simulation seeds) a search of lease's P3 with this seed draws, none simulated (by the
    search itself, bound here: a test may have replaced ``search.search_checker``)."""
    schedules: list[Any] = []
    budget = search.Budget()
    budget.simulate = lambda faults, strategy, seed: schedules.append((faults, seed))  # type: ignore[method-assign]
    search_checker("lease", "P3", examples=examples, seed=seed, budget=budget, broken=[])
    return schedules


def test_a_seeded_search_draws_the_same_schedules_again() -> None:
    first = _drawn(7)
    assert len(first) == 20
    assert _drawn(7) == first
    assert _drawn(8) != first


def test_each_checker_is_searched_with_schedules_of_its_own(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """One seed for the whole search, but the checkers' searches draw different schedules: with the same ones,
    each checker would only simulate again what the first did."""
    seeds: dict[str, int] = {}

    def searched(strategy: str, checker: str, *args: Any, **options: Any) -> None:
        seeds[checker] = options["seed"]

    monkeypatch.setattr(search, "search_checker", searched)
    search.run("lease", 6.0, tmp_path, report=lambda line: None, seed=3)
    assert len(set(seeds.values())) == len(seeds) == 7
    assert seeds["P1"] == 3  # the first draws what the printed seed draws
    assert _drawn(seeds["P1"], 10) != _drawn(seeds["P2"], 10)


@pytest.mark.parametrize("budget", ["0", "-5", "inf", "nan"])
def test_the_search_refuses_a_budget_that_is_not_a_positive_number_of_seconds(
    budget: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        sim_main(["search", f"--budget={budget}"])
    assert exited.value.code == 2
    assert f"argument --budget: a finite number of seconds above 0, not {budget}" in capsys.readouterr().err


def test_a_search_replaces_what_the_last_one_wrote_and_its_status_says_whether_it_found_something(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "script-P1.toml").write_text("an earlier search's finding")
    (tmp_path / "lease-P4.toml").write_text("another strategy's")
    monkeypatch.setattr(search, "simulate", lambda *args: None)  # the probe runs
    monkeypatch.setattr(search, "search_checker", lambda *args, **kwargs: None)
    lines: list[str] = []
    assert search.run("script", 1.0, tmp_path, report=lines.append, seed=3) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lease-P4.toml"]
    assert lines[-1].endswith("the same draw: --seed 3")
    monkeypatch.setenv("PYTHONHASHSEED", "0")  # as python -m sim has it, which would run itself again otherwise
    monkeypatch.setenv("HYPOTHESIS_STORAGE_DIRECTORY", str(tmp_path / "hypothesis"))  # kept: the test's own
    arguments = ["search", "--strategy", "script", "--budget", "1", "--out", str(tmp_path)]
    assert sim_main(arguments) == 0
    monkeypatch.setattr(search, "run", lambda *args, **kwargs: ["a finding"])
    assert sim_main(arguments) == 1
