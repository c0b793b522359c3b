"""The comparison report: its statistics and what it writes."""

from __future__ import annotations

from pathlib import Path

import pytest

from sim import report
from sim.run import simulate
from sim.scenario import load, parse


def test_wilson_interval_matches_the_textbook_values() -> None:
    low, high = report.wilson(3, 3)
    assert (round(low, 3), high) == (0.438, 1.0)
    low, high = report.wilson(0, 20)
    assert (low, round(high, 3)) == (0.0, 0.161)
    low, high = report.wilson(10, 20)
    assert (round(low, 3), round(high, 3)) == (0.299, 0.701)


@pytest.mark.slow
def test_a_report_names_every_scenario_and_shows_each_violation(tmp_path: Path) -> None:
    markdown, page = report.main(tmp_path, seeds=1, progress=False)
    text = markdown.read_text()
    for scenario in ("steady", "zombie", "failover", "late-claim"):
        assert f"**{scenario}**" in text
    assert "### lease: P1 (no duplicate) in zombie" in text
    assert "### script: P1 (no duplicate) in late-claim" in text
    assert "### stream-id: P2 (no missed slot) in late-claim" in text
    assert "python -m sim run" in text
    html = page.read_text()
    assert html.count("data:image/png;base64,") == text.count("![")  # every figure embedded
    assert (tmp_path / "lateness.png").stat().st_size > 1000


def _render(results: report.Results) -> list[str]:
    return report.render(results, lambda name, png: f"![{name}]({name})").splitlines()


def test_a_checker_that_could_not_judge_is_shown_not_counted_as_held() -> None:
    # The only instance dies at 5 s: no slot can be expected of anyone, so P2 judges nothing.
    dead = parse({
        "name": "dead", "duration_s": 60, "instances": [{"name": "a"}],
        "jobs": [{"name": "tick", "cron": "*/10 * * * * *", "work_s": 1.0}],
        "faults": [{"at_s": 5, "kind": "crash", "instance": "a"}],
    })  # fmt: skip
    results = report.Results("virtual", 1, [], [dead])
    for strategy in ("lease", "script"):
        results.add(simulate(dead, strategy, 1))
    [row] = [line for line in _render(results) if line.startswith("| **dead**")]
    lease, _, _, script = row.removesuffix(" |").split(" | ")[1:5]
    assert lease == "the others hold (1 runs)<br>P2 not judged in 1/1"
    assert script == "the others hold (1 runs)<br>P2 not judged in 1/1"  # P4, of leases, is not script's to judge


def test_a_live_report_counts_its_live_runs_and_the_strategy_runs_judged_in_them() -> None:
    steady = load("steady")
    results = report.Results("live", 1, ["redis-7", "redis-8.6"], [steady])
    for target in results.targets:
        strategies = [s for s in report.STRATEGIES if s != "idmp" or target == "redis-8.6"]
        for strategy in strategies:
            results.add(simulate(steady, strategy, 1), target)
        results.simulations += 1
        results.simulated_s += steady.duration_s
    results.seconds = 100.0
    [line] = [line for line in _render(results) if "live runs" in line]
    hours = 2 * steady.duration_s / 0.2 / 3600
    assert line == (f"- 2 live runs, each judged once per strategy that ran side by side in it (7 judged); "
                    f"{2 * steady.duration_s / 60:.0f} min of live time ({hours:.1f} h of scenario time) in 100 s "
                    "of wall time")  # fmt: skip
