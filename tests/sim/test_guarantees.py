"""Guarantees the scenario files leave unexercised, each checked in virtual time the way they are: a scenario, the
strategies it concerns, the verdicts they must get, three seeds. Each case fails on a one-line defect of the
library that every scenario file passes with (named in its docstring), so the testbed catches it.
"""

from __future__ import annotations

from typing import Any

import pytest

from sim.scenario import STRATEGIES, parse
from tests.support import assert_virtual_verdicts

pytestmark = pytest.mark.scenarios
LEASE = {"lease_ms": 3000, "heartbeat_ms": 1000}


def three(**instance: Any) -> list[dict[str, Any]]:
    return [{"name": name, **instance} for name in "abc"]


def assert_verdicts(scenario: dict[str, Any], strategies: tuple[str, ...], expected: dict[str, str]) -> None:
    parsed = parse({"name": "guarantee", **scenario})
    for strategy in strategies:
        assert_virtual_verdicts(parsed, strategy, expected)


def test_a_restarted_winner_does_not_take_its_old_process_run_for_its_own() -> None:
    """The winner is killed 1 s into its run and back 1 s later, its catch-up asking for the run its old process
    holds (same instance id, another token) while that lease is live: it is told "running", and waits. Caught: a
    lease claim that knew a retry of its own by the runner instead of the token ran the slot twice."""
    assert_verdicts(
        {
            "duration_s": 80, "scheduler": LEASE, "instances": three(),
            "jobs": [{"name": "tick", "cron": "*/10 * * * * *", "work_s": 4.0, "catch_up_ms": 30_000}],
            "faults": [{"at_s": 31, "kind": "crash", "instance": "winner", "restart_after_s": 1}],
        },
        ("lease",),
        {"P1": "valid", "P4": "valid"},
    )  # fmt: skip


def test_max_attempts_1_gives_a_crashed_run_up() -> None:
    """max_attempts 1: the backups do not run again the slot whose winner crashed. Caught: attempts compared with
    ``>`` instead of ``>=``, which ran an attempt 2."""
    assert_verdicts(
        {
            "duration_s": 80, "scheduler": LEASE, "instances": three(),
            "jobs": [{"name": "tick", "cron": "*/10 * * * * *", "work_s": 4.0, "max_attempts": 1}],
            "faults": [{"at_s": 31, "kind": "crash", "instance": "winner", "restart_after_s": 30}],
        },
        ("lease",),
        {"P1": "valid"},
    )  # fmt: skip


def test_a_run_longer_than_the_time_a_job_keeps_its_runs_keeps_its_lease() -> None:
    """Runs of 100 s with max_late_ms 1 s (a job keeps its runs about 70 s): trim must leave a run whose lease is
    live. Caught: a trim that closed such a run as abandoned, which cut it short."""
    assert_verdicts(
        {
            "duration_s": 300, "scheduler": LEASE, "instances": three()[:2],
            "jobs": [{"name": "tick", "cron": "*/20 * * * * *", "work_s": 100.0, "max_late_ms": 1000,
                      "overlap": True}],
        },
        ("lease",),
        {"P2": "valid", "P4": "valid"},
    )  # fmt: skip


def test_heartbeats_at_half_the_lease_keep_long_runs() -> None:
    """heartbeat_ms 1500 with lease_ms 3000 and runs of 10 s: every run keeps its lease to its end. Caught: a
    keeper beating at twice its period (every scenario file beats at a third of the lease, where that still fits)."""
    assert_verdicts(
        {
            "duration_s": 60, "scheduler": {"lease_ms": 3000, "heartbeat_ms": 1500}, "instances": three()[:2],
            "jobs": [{"name": "tick", "cron": "*/20 * * * * *", "work_s": 10.0}],
        },
        ("lease",),
        {"P2": "valid", "P4": "valid"},
    )  # fmt: skip


def test_a_zombie_finish_does_not_end_its_backups_run() -> None:
    """The winner of a job every 5 s (runs of 4 s) is paused 4 s: its backup takes the run over, and the zombie's
    result, sent as it resumes, is refused. Caught: a finish accepted with a stale token, which closed the
    backup's run, so that the next slot started beside it."""
    assert_verdicts(
        {
            "duration_s": 80, "scheduler": LEASE, "instances": three(),
            "jobs": [{"name": "tick", "cron": "*/5 * * * * *", "work_s": 4.0}],
            "faults": [{"at_s": 31, "kind": "pause", "instance": "winner", "duration_s": 4}],
        },
        ("lease",),
        {"P3": "valid"},
    )  # fmt: skip


def test_a_claim_retried_after_its_answer_was_lost_runs_the_slot() -> None:
    """The winner's claim is granted and its answer lost; the cut heals 2 s later, within max_late_ms, and the
    retry (same token) is told it won: every slot runs, under every strategy. Caught: a retry known by the runner
    instead of the token (stream-id, script), which lost its own slot."""
    assert_verdicts(
        {
            "duration_s": 80, "scheduler": LEASE, "instances": [{"name": "a"}, {"name": "b", "offset_ms": -4000}],
            "jobs": [{"name": "tick", "cron": "*/10 * * * * *", "work_s": 2.0}],
            "faults": [{"at_s": 39, "kind": "partition", "instance": "a", "duration_s": 2, "reply_lost": True}],
        },
        STRATEGIES,
        {"P2": "valid"},
    )  # fmt: skip


def test_script_finds_a_claim_behind_more_than_a_page_of_newer_ones() -> None:
    """A job every second; b's clock is 10 s behind, so each of its claims comes after ten newer claims of the job:
    the script claim reads past its first page of eight entries, finds the slot's claim and loses. Caught: a scan
    that stopped after one page, which ran every slot twice."""
    assert_verdicts(
        {
            "duration_s": 40, "scheduler": LEASE, "instances": [{"name": "a"}, {"name": "b", "offset_ms": -10_000}],
            "jobs": [{"name": "tick", "cron": "* * * * * *", "work_s": 0.2}],
            "strategies": {"script": {"window_ms": 90_000}},
        },
        ("script",),
        {"P1": "valid"},
    )  # fmt: skip


def test_two_jobs_due_at_the_same_slots_each_run_every_slot() -> None:
    """Two jobs on one schedule: each has keys of its own, so each runs every slot once. Caught: lease keys whose
    hash tag left out the job, so that both jobs shared one state and one of them never ran."""
    assert_verdicts(
        {
            "duration_s": 60, "scheduler": LEASE, "instances": three(),
            "jobs": [{"name": name, "cron": "*/10 * * * * *", "work_s": 2.0} for name in ("sync", "report")],
        },
        STRATEGIES,
        {"P1": "valid", "P2": "valid"},
    )  # fmt: skip


def test_a_crashed_winners_lease_ends_a_lease_after_its_last_heartbeat() -> None:
    """The winner of a run of 8 s is killed 7 s in, after seven heartbeats: a backup takes the run over when the
    lease of the last beat ends, and it ends before the next slot. Caught: a heartbeat that extended the lease
    from its previous end instead of from the store's now, which held the run past the next slot: skipped."""
    assert_verdicts(
        {
            "duration_s": 100, "scheduler": LEASE, "instances": three(),
            "jobs": [{"name": "tick", "cron": "*/20 * * * * *", "work_s": 8.0}],
            "faults": [{"at_s": 27, "kind": "crash", "instance": "winner", "restart_after_s": 30}],
        },
        ("lease",),
        {"P1": "valid", "P2": "valid"},
    )  # fmt: skip


def test_a_claim_delayed_by_its_jitter_is_not_late() -> None:
    """jitter_ms 8 s with max_late_ms 2 s: a claim may come up to 10 s after its slot and still run it. Caught:
    a lateness limit that left out the jitter, which skipped every slot whose drawn delay passed 2 s."""
    assert_verdicts(
        {
            "duration_s": 200, "scheduler": LEASE, "instances": three(),
            "jobs": [{"name": "tick", "cron": "*/20 * * * * *", "work_s": 1.0, "jitter_ms": 8000,
                      "max_late_ms": 2000}],
        },
        STRATEGIES,
        {"P2": "valid", "lateness": "valid"},
    )  # fmt: skip


def test_a_backup_takes_a_run_over_after_max_late_ms() -> None:
    """max_late_ms 1 s; the winner of a run of 10 s is killed 5 s in: the backup's takeover, 8 s after the slot,
    is no late claim, and runs the slot. Caught: a late skip that did not spare backups, which lost the run."""
    assert_verdicts(
        {
            "duration_s": 80, "scheduler": LEASE, "instances": three(),
            "jobs": [{"name": "tick", "cron": "*/20 * * * * *", "work_s": 10.0, "max_late_ms": 1000}],
            "faults": [{"at_s": 25, "kind": "crash", "instance": "winner", "restart_after_s": 30}],
        },
        ("lease",),
        {"P2": "valid"},
    )  # fmt: skip


def test_script_keeps_claims_inside_its_window_past_history_size() -> None:
    """history_size 5 with a job every second: script's trim keeps more than five claims while they are inside
    window_ms, so b, 3 s behind, finds each slot's claim; every strategy's history keeps five records (P7). Caught:
    a trim by history_size that deleted claims still inside the window, which let b run slots again; a lease trim
    that kept four records."""
    assert_verdicts(
        {
            "duration_s": 40, "scheduler": {**LEASE, "history_size": 5},
            "instances": [{"name": "a"}, {"name": "b", "offset_ms": -3000}],
            "jobs": [{"name": "tick", "cron": "* * * * * *", "work_s": 0.2}],
        },
        STRATEGIES,
        {"P1": "valid", "P7": "valid"},
    )  # fmt: skip


def test_a_catch_up_waits_for_the_run_another_catch_up_is_running() -> None:
    """Both instances are down from 15 s; b is back at 31 s and catches up the slot at 20 s (runs of 15 s); a, back
    at 35 s, catches up its own period's slot at 30 s, which nobody has claimed: it waits for b's run, and the two
    never overlap. Caught: a catch-up's claim of a slot with no state that skipped the overlap check."""
    assert_verdicts(
        {
            "duration_s": 120, "scheduler": LEASE, "instances": [{"name": "a"}, {"name": "b"}],
            "jobs": [{"name": "tick", "cron": "*/10 * * * * *", "work_s": 15.0, "catch_up_ms": 15_000}],
            "faults": [{"at_s": 15, "kind": "crash", "instance": "a", "restart_after_s": 20},
                       {"at_s": 15, "kind": "crash", "instance": "b", "restart_after_s": 16}],
        },
        ("lease",),
        {"P1": "valid", "P3": "valid"},
    )  # fmt: skip


def test_a_lease_claim_sent_again_takes_a_fence_above_those_granted_meanwhile() -> None:
    """a's claim of the slot at 10 s is granted and its answer lost; cut off 3.5 s, a sends it again while its
    lease is live, after b won the slot at 12 s (overlap allowed): the renewed claim is told the next fence, above
    b's. Caught: a renewal that kept the fence of the first try, below one granted since."""
    assert_verdicts(
        {
            "duration_s": 40, "scheduler": {"lease_ms": 6000, "heartbeat_ms": 2000},
            "instances": [{"name": "a"}, {"name": "b"}],
            "jobs": [{"name": "tick", "cron": "*/2 * * * * *", "work_s": 0.5, "overlap": True}],
            "faults": [{"at_s": 9, "kind": "partition", "instance": "a", "duration_s": 3.5, "reply_lost": True}],
        },
        ("lease",),
        {"P1": "valid", "P6": "valid"},
    )  # fmt: skip


def test_an_instance_late_after_a_pause_records_no_skip_beside_a_run() -> None:
    """Runs of 15 s every 10 s, a's clock 3 s ahead: a claims each slot 3 s before it is due, and at 40 s its run of
    the slot at 30 s is still going while it has claimed the slot at 40 s. b, paused from 25 to 40 s, finds the
    slot at 30 s late and records no skip beside that run (P7). Caught: a stream-id skip that looked for the slot's
    entry at the stream's newest instead of at the slot, and a script skip's claim that looked for claims from the
    slot on, not window_ms before it, missing a's early claim."""
    assert_verdicts(
        {
            "duration_s": 80, "scheduler": LEASE, "instances": [{"name": "a", "offset_ms": 3000}, {"name": "b"}],
            "jobs": [{"name": "tick", "cron": "*/10 * * * * *", "work_s": 15.0, "max_late_ms": 2000}],
            "faults": [{"at_s": 25, "kind": "pause", "instance": "b", "duration_s": 15}],
        },
        STRATEGIES,
        {"P1": "valid", "P7": "valid"},
    )  # fmt: skip


def test_a_run_now_cut_short_by_stop_is_recorded_interrupted() -> None:
    """a's run_now (10 s of work) is cut short 3 s in by a stop with no timeout: the store records it interrupted,
    as nobody takes a run_now over (P7). Caught: a cut-short run_now handed back like a slot's run, after which no
    record of it was ever written."""
    assert_verdicts(
        {
            "duration_s": 40, "scheduler": LEASE, "instances": [{"name": "a"}, {"name": "b"}],
            "jobs": [{"name": "tick", "cron": "0 * * * * *", "work_s": 10.0}],
            "faults": [{"at_s": 12, "kind": "manual", "instance": "a", "job": "tick"},
                       {"at_s": 15, "kind": "stop", "instance": "a", "timeout_s": 0, "restart_after_s": 5}],
        },
        STRATEGIES,
        {"P1": "valid", "P7": "valid"},
    )  # fmt: skip
