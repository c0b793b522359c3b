"""The comparison report: its statistics and what it writes."""

from __future__ import annotations

import re
import subprocess
import unittest.mock
from dataclasses import replace
from pathlib import Path

import pytest

from sim import report
from sim.__main__ import main as sim_main
from sim.checkers import Verdict, true_s
from sim.history import Execution
from sim.live import SCALE, scaled
from sim.run import simulate
from sim.scenario import load, load_all, parse
from sim.world import FaultWindow


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
    assert "### lease in zombie: P1 (no duplicate), P4 (lease safety)" in text
    assert "### script in late-claim: P1 (no duplicate)" in text
    assert "### stream-id in late-claim: P2 (no missed slot)" in text
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
    # With no run at all, lateness has nothing to judge either.
    assert lease == "✓ the others hold (1 runs)<br>P2 not judged in 1/1<br>lateness not judged in 1/1"
    # P4, of leases, is not script's to judge
    assert script == "✓ the others hold (1 runs)<br>P2 not judged in 1/1<br>lateness not judged in 1/1"


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
    [line] = [line for line in _render(results) if line.startswith("- ") and "live runs" in line]
    hours = 2 * steady.duration_s / 0.2 / 3600
    assert line == (f"- 2 live runs, each judged once per strategy that ran side by side in it (7 judged); "
                    f"{2 * steady.duration_s / 60:.0f} min of live time ({hours:.1f} h of scenario time) in 100 s "
                    "of wall time")  # fmt: skip


def test_a_live_verdict_names_each_server_with_its_own_count_of_runs() -> None:
    """Pooled over servers, "P1 2/4 on redis-7" would read as one failure in two there: it was every run there.
    A checker violated in every run on every server says so once; on the only server that ran it, names it."""
    zombie = load("zombie")
    results = report.Results("live", 2, ["redis-7", "redis-8.6"], [zombie])
    for target in results.targets:
        for seed in (1, 2):
            outcome = simulate(zombie, "lease", seed)  # P1 invalid with every seed
            if target == "redis-8.6":
                verdicts = {**outcome.judgement.verdicts, "P1": Verdict("P1", "valid")}
                outcome = replace(outcome, judgement=replace(outcome.judgement, verdicts=verdicts))
            results.add(outcome, target)
    [row] = [line for line in _render(results) if line.startswith("| **zombie**")]
    lease = row.split(" | ")[1]
    assert re.fullmatch(r"✗ P1 2/4 \(\d+–\d+%\) on redis-7 2/2<br>✗ P4 4/4 \(\d+–100%\) on every server", lease)
    # idmp runs on redis-8.6 only: "every server" would hide which.
    only = report.Results("live", 2, ["redis-8.6"], [zombie])
    for seed in (1, 2):
        only.add(simulate(zombie, "lease", seed), "redis-8.6")
    [row] = [line for line in _render(only) if line.startswith("| **zombie**")]
    assert row.split(" | ")[1].startswith("✗ P1 2/2 (34–100%) on redis-8.6 2/2<br>")


def test_a_live_report_gives_its_times_in_live_ms() -> None:
    zombie = load("zombie")
    for mode, unit in (("virtual", "ms"), ("live", "live ms")):
        results = report.Results(mode, 1, ["redis-7"] if mode == "live" else [], [zombie])
        results.add(simulate(zombie, "lease", 1), "redis-7" if mode == "live" else "")
        text = "\n".join(_render(results))
        assert f"| strategy | job runs | min ({unit}) | p50 ({unit}) | p99 ({unit}) | max ({unit}) |" in text
        assert re.search(rf"worked past their lease; min -?\d+ {unit}, p50 -?\d+ {unit}\.", text)


def _git(repository: Path, *args: str) -> None:
    # Whatever the user's git configuration asks (signed commits, say): these commits are throwaway.
    identity = ["-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(["git", *identity, *args], cwd=repository, check=True, capture_output=True)


def test_a_report_says_when_the_code_it_was_made_with_differs_from_its_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _git(tmp_path, "init", "-q")
    (tmp_path / "code.py").write_text("x = 1\n")
    _git(tmp_path, "add", "code.py")
    _git(tmp_path, "commit", "-q", "-m", "code")
    monkeypatch.chdir(tmp_path)
    commit = report._commit()
    assert re.fullmatch(r"[0-9a-f]{7,}", commit)
    (tmp_path / "notes.txt").write_text("not tracked\n")  # a report's own output, say
    assert report._commit() == commit
    (tmp_path / "code.py").write_text("x = 2\n")
    assert report._commit() == f"{commit} with uncommitted changes"


def test_a_report_rewriting_its_own_tracked_figures_names_its_commit_clean(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sample report kept in the repository is made again: its figures change as it is written, which must
    not read as code that differed from its commit."""

    out = tmp_path / "sample"
    out.mkdir()
    (out / "lateness.png").write_bytes(b"an older figure")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "sample")
    _git(tmp_path, "commit", "-q", "-m", "sample")
    monkeypatch.chdir(tmp_path)
    zombie = load("zombie")
    results = report.Results("virtual", 1, [], [zombie])
    results.add(simulate(zombie, "lease", 1))
    markdown, _ = report.write(results, out)
    assert (out / "lateness.png").read_bytes() != b"an older figure"
    [line] = [line for line in markdown.read_text().splitlines() if line.startswith("- anarchon")]
    assert re.search(r"commit [0-9a-f]{7,}$", line), line


def test_late_runs_and_counted_violations_are_traced_to_their_scenarios() -> None:
    """Lateness is judged like the checkers, in the verdicts and the counterexamples; the rates name the
    scenarios their counts come from (lease's missed slots are long-job's skipped-overlap ones)."""
    scenarios = [load("late-claim"), load("long-job")]
    results = report.Results("virtual", 1, [], scenarios)
    for scenario in scenarios:
        results.add(simulate(scenario, "lease", 1))
    lines = _render(results)
    [late_claim] = [line for line in lines if line.startswith("| **late-claim**")]
    assert "lateness 1/1" in late_claim
    assert "### lease in late-claim: lateness (on time)" in lines
    long_job_p2 = results.cells[("long-job", "lease")].counts["P2"]
    assert long_job_p2 > 0
    assert f"- lease: P2 in long-job {long_job_p2}" in lines
    lateness = lines[next(i for i, line in enumerate(lines) if "runs started early" in line) :]
    lease = next(line for line in lateness if line.startswith("| lease |")).removesuffix(" |").split(" | ")
    assert (lease[5], lease[6]) == ("15000", "late-claim")  # the latest start, and the scenario it is in


def test_missed_slots_skipped_for_overlap_among_others_lost_are_not_said_to_be_by_design() -> None:
    """Where a fault lost some slots, those lease skipped did so behind a run the fault held up (a retry)."""
    some = report.Cell(skipped_overlap=1, counts={"P2": 3})
    assert report._overlap_skips(some) == " (1 of 3 missed slots skipped-overlap, behind a run still holding its lease)"
    every = report.Cell(skipped_overlap=3, counts={"P2": 3})
    assert report._overlap_skips(every) == " (every missed slot skipped-overlap, by design)"


def test_the_checkers_one_run_violates_share_its_counterexample() -> None:
    """A failover's duplicate and its lost claim are one run's: one section names both, with both witnesses and
    one timeline, titled with both."""
    failover = load("failover")
    results = report.Results("virtual", 1, [], [failover])
    outcome = simulate(failover, "lease", 1)
    results.add(outcome)
    names: list[str] = []

    def figure(name: str, png: bytes) -> str:
        names.append(name)
        return f"![{name}]({name})"

    with unittest.mock.patch.object(report.plt.Axes, "set_title") as title:
        lines = report.render(results, figure).splitlines()
    start = lines.index("### lease in failover: P1 (no duplicate), P5 (no lost acknowledged claim)")
    section = lines[start : lines.index("```", start)]
    assert f"- P1 witness: {outcome.judgement.verdict('P1').witness}" in section
    assert f"- P5 witness: {outcome.judgement.verdict('P5').witness}" in section
    figures = [n for n in names if n.startswith("timeline-")]
    assert figures == ["timeline-failover-lease-P1-P5.png"]
    assert [line for line in section if line.startswith("![")] == [f"![{figures[0]}]({figures[0]})"]
    assert title.call_args.args[0] == "failover / lease / seed 1: P1, P5 violated"
    assert "tick slot at 40 s: won by" in outcome.judgement.verdict("P5").witness  # a slot, not the store's run id


def test_checkers_whose_smallest_runs_differ_get_a_counterexample_each() -> None:
    one = simulate(load("zombie"), "lease", 1)
    other = replace(one, seed=2)
    assert report._by_run({"P1": one, "P2": other, "P4": one}) == [(one, ["P1", "P4"]), (other, ["P2"])]


def test_a_live_runs_timeline_names_its_server_not_a_seed() -> None:
    outcome = replace(simulate(load("zombie"), "lease", 1), target="redis-7")
    checker = next(name for name, v in outcome.judgement.verdicts.items() if v.status == "invalid")
    with unittest.mock.patch.object(report.plt.Axes, "set_title") as title:
        report.timeline_figure(outcome, checker)
    assert title.call_args.args[0] == f"zombie / lease / on redis-7: {checker} violated"


def test_a_timeline_labels_a_crash_and_the_live_restart_after_it_once_and_marks_overlap_answers() -> None:
    """Live mode records an instance's restart as a window that begins where its crash ends: one fault, one label.
    A claim answered overlap is drawn apart from a lost one."""
    outcome = simulate(load("long-job"), "lease", 1)
    windows = [FaultWindow(30, 40, "crash", "a"), FaultWindow(40, 41, "crash", "a"), FaultWindow(45, 46, "pause", "b")]
    with (
        unittest.mock.patch.object(report.plt.Axes, "text") as text,
        unittest.mock.patch.object(report.plt.Axes, "plot") as plot,
    ):
        report.timeline_figure(replace(outcome, fault_windows=windows), "P2")
    labels = [call.args[2] for call in text.call_args_list if not call.args[2].startswith((" slot", " missed"))]
    assert labels == [" crash", " pause"]
    assert "o" in {call.kwargs["marker"] for call in plot.call_args_list}


def test_a_missed_slot_is_marked_on_the_store_lane_of_its_timeline() -> None:
    """A slot no instance ran has no bar of its own: the figure marks it where the witness says it was due."""
    outcome = simulate(load("slow-store"), "lease", 1)
    verdict = outcome.judgement.verdict("P2")
    assert verdict.status == "invalid"
    assert len(verdict.slots) == verdict.count == 2
    with unittest.mock.patch.object(report.plt.Axes, "plot") as plot:
        report.timeline_figure(outcome, "P2")
    marked = [call.args[:2] for call in plot.call_args_list if call.kwargs["marker"] == "X"]
    due = [true_s(slot, outcome.history.epoch_s) for _, slot in verdict.slots]
    assert marked == [(at, 0) for at in due]
    assert f"slot at {due[0]:.0f} s" in verdict.witness
    with unittest.mock.patch.object(report.plt.Axes, "plot") as plot:
        report.timeline_figure(outcome, "P4")  # another checker names no slot: none is marked
    assert not [call for call in plot.call_args_list if call.kwargs["marker"] == "X"]


def test_the_page_renders_the_markdown_paragraphs_lists_and_tables_as_html() -> None:
    markdown = (
        "One sentence\nwrapped over two lines.\n\n- first\n- second\n\n| a | b |\n|---|---|\n| x<br>y | **z** |\n"
    )
    page = report._html(markdown, {})
    assert "<p>One sentence\nwrapped over two lines.</p>" in page  # one paragraph, not two
    assert "<ul>\n<li>first</li>\n<li>second</li>\n</ul>" in page
    assert "<td>x<br>y</td>\n<td><strong>z</strong></td>" in page


def test_runs_of_one_instance_that_execute_at_once_are_stacked_in_its_lane() -> None:
    first, second, third = (_run_of("a", start, start + 15) for start in (10, 20, 30))
    other = _run_of("b", 12, 13)
    stacked = {
        (e.instance, e.started): (level, levels) for e, level, levels in report._stacked([first, second, third, other])
    }
    # 20-35 starts while 10-25 runs; 30-45 starts once 10-25 has ended and takes its level again.
    assert stacked == {("a", 10): (0, 2), ("a", 20): (1, 2), ("a", 30): (0, 2), ("b", 12): (0, 1)}


def _run_of(instance: str, started: float, ended: float) -> Execution:
    return Execution(instance, "tick", 0, "0", 1, 1, f"t-{instance}-{started}", False, started, ended, True)


def test_a_timeline_is_as_wide_whatever_faults_lie_outside_its_window() -> None:
    outcome = simulate(load("late-claim"), "script", 1)  # its witness is early; the crash at 59 s is outside
    assert outcome.judgement.verdict("lateness").status == "invalid"
    far = replace(outcome, fault_windows=[*outcome.fault_windows, FaultWindow(190.0, 199.0, "pause", "late")])
    widths = {
        _png_width(report.timeline_figure(o, "lateness")) for o in (outcome, far, replace(outcome, fault_windows=[]))
    }
    assert len(widths) == 1, widths


def _png_width(png: bytes) -> int:
    return int.from_bytes(png[16:20], "big")  # the IHDR chunk's width


def test_a_report_needs_at_least_one_seed() -> None:
    with pytest.raises(SystemExit) as exit_:
        sim_main(["report", "--seeds", "0"])
    assert exit_.value.code == 2


def test_a_virtual_report_counts_its_replays_without_an_interval_and_names_its_command() -> None:
    zombie = load("zombie")
    results = report.Results("virtual", 2, [], [zombie])
    for seed in (1, 2):
        results.add(simulate(zombie, "lease", seed))
    lines = _render(results)
    [row] = [line for line in lines if line.startswith("| **zombie**")]
    assert row.split(" | ")[1] == "✗ P1 2/2<br>✗ P4 2/2"
    [made_by] = [line for line in lines if line.startswith("- made by")]
    assert made_by.startswith("- made by `python -m sim report --mode virtual --seeds 2`, seeds 1 to 2, fakeredis ")


def test_a_report_tells_overlap_skips_from_lost_slots_and_counts_early_starts_and_fence_disorder() -> None:
    """lease's missed slots in long-job are all skipped-overlap (its protection, by design), and the cell says so;
    stream-id's duplicate after a store restart repeats its slot's fence, which the rates count (P6); the skew
    scenario's instance ahead starts runs before their slots, which the lateness table counts."""
    scenarios = [load("long-job"), load("store-restart"), load("skew")]
    results = report.Results("virtual", 1, [], scenarios)
    for scenario in scenarios:
        for strategy in ("lease", "stream-id"):
            results.add(simulate(scenario, strategy, 1))
    lines = _render(results)
    [row] = [line for line in lines if line.startswith("| **long-job**")]
    lease_cell = row.removesuffix(" |").split(" | ")[1]
    assert re.search(r"P2 1/1 \(every missed slot skipped-overlap, by design\)", lease_cell), lease_cell
    rates = lines[lines.index("## Rates per 1,000 slots") :]
    stream_id = next(line for line in rates if line.startswith("| stream-id |")).removesuffix(" |").split(" | ")
    lease = next(line for line in rates if line.startswith("| lease |")).removesuffix(" |").split(" | ")
    assert float(stream_id[-1]) > 0  # the duplicate's fence repeats the slot's
    assert float(lease[-1]) == 0  # lease's fences follow the store's clock past its data loss
    lateness = lines[next(i for i, line in enumerate(lines) if "runs started early" in line) :]
    early = next(line for line in lateness if line.startswith("| lease |")).removesuffix(" |").split(" | ")[-2]
    assert int(early) > 0


def test_the_guides_advice_names_every_scenario_in_which_lease_ran_a_run_twice_missed_or_overlapped_one() -> None:
    """The advice above the guide's table is prose: a scenario the table names for lease under P1, P2 or P3 that
    the advice does not name would mean the advice has gone out of date."""
    scenarios = load_all()
    results = report.Results("virtual", 1, [], scenarios)
    for scenario in scenarios:
        results.add(simulate(scenario, "lease", 1))
    lines = report._guide(results)
    table = next(i for i, line in enumerate(lines) if line.startswith("|"))
    advice = " ".join(lines[:table])
    named = set()
    for checker in ("P1", "P2", "P3"):
        [row] = [line for line in lines[table:] if line.startswith(f"| {report.CONSEQUENCES[checker]} in |")]
        # Each scenario, with what the table says of it in brackets: a skip by design is no failure.
        for name, said in re.findall(r"([\w-]+)( \([^)]*\))?", row.split(" | ")[1]):
            if "by design" not in said:
                named.add(name)
    assert {"zombie", "finish-lost", "slow-store", "failover", "store-restart"} <= named  # lease's failures here
    unnamed = {name for name in named if not re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", advice)}
    assert unnamed == set()


def test_the_guide_names_for_each_strategy_the_scenarios_it_failed_a_job_in_and_how() -> None:
    """The guide's rows come from the verdicts: zombie runs a lease run twice, winner-crash loses stream-id's run,
    and where lease missed slots only by skipping them for overlap, the row says it was by design. A live report
    adds each strategy's claim cost, and each scenario says what it sets and how much of it a live run covers."""
    scenarios = [load("zombie"), load("winner-crash"), load("long-job")]
    results = report.Results("live", 1, ["redis-7"], scenarios)
    for scenario in scenarios:
        for strategy in ("lease", "stream-id"):
            results.add(simulate(scenario, strategy, 1), "redis-7")
    ratios = {"lease": 1.5, "stream-id": 1.25}
    claims = {s: {"p50_us": 150 * r, "p99_us": 300 * r, "ratio_to_set_nx_px": r} for s, r in ratios.items()}
    floor = {"ping": {"p50_us": 90, "p99_us": 150}, "set_nx_px": {"p50_us": 100, "p99_us": 200}}
    results.bench = {"claims": {"redis-7": {**floor, **claims}}, "commands": {}, "memory": {}}
    lines = _render(results)

    def guide(row: str) -> list[str]:
        [line] = [line for line in lines if line.startswith(f"| {row} |")]
        return line.removesuffix(" |").split(" | ")[1:]

    assert guide("runs a run twice (P1) in") == ["zombie", "–", "–", "–"]
    assert guide("misses slots (P2) in") == ["long-job (skipped-overlap, by design)", "winner-crash", "–", "–"]
    assert guide("lets runs of a job overlap (P3) in") == ["–", "long-job", "–", "–"]
    assert guide("claim p50 over a SET NX PX lock's") == ["1.50–1.50×", "1.25–1.25×", "–", "–"]
    [zombie] = [line for line in lines if line.startswith("- **zombie**")]
    covered = scaled(load("zombie")).duration_s / SCALE
    assert zombie.endswith(f"Sets: lease_ms 3000; heartbeat_ms 1000; job tick: `*/20 * * * * *`, works 6 s; a live "
                           f"run covers its first {covered:g} s.")  # fmt: skip
