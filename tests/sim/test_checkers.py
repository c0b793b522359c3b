"""The checkers on hand-made histories: lease safety and its margins, and lateness."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from anarchon import RunRecord
from sim import report
from sim.checkers import Judgement, Verdict, _Clock, judge, percentile
from sim.history import Event, Execution, History
from sim.live import SCALE, judge_live, scaled
from sim.run import simulate
from sim.scenario import Scenario, load, parse
from sim.world import EPOCH_S, FaultWindow

REPO = Path(__file__).resolve().parents[2]


def _scenario(**job_options: Any) -> Any:
    return parse(
        {
            "name": "unit",
            "duration_s": 100,
            "scheduler": {"lease_ms": 3000},
            "instances": [{"name": "a"}, {"name": "b"}],
            "jobs": [{"name": "tick", "cron": "*/10 * * * * *", "work_s": 1.0, **job_options}],
        }
    )


def _execution(instance: str, slot_s: float, started: float, ended: float | None, completed: bool = True,
               attempt: int = 1) -> Execution:  # fmt: skip
    slot = int((EPOCH_S + slot_s) * 1000)
    return Execution(instance, "tick", slot, str(slot), attempt, attempt, f"t-{instance}-{slot_s:.0f}-{attempt}",
                     False, started, ended, completed)  # fmt: skip


def _every_slot(skip: float | None = None) -> list[Execution]:
    return [_execution("a", s, s, s + 1) for s in range(10, 100, 10) if s != skip]


def _judge(executions: list[Execution], events: list[Event] | None = None, strategy: str = "lease",
           **job_options: Any) -> Judgement:  # fmt: skip
    history = History(epoch_s=EPOCH_S, events=events or [], executions=executions)
    return judge(_scenario(**job_options), strategy, history, [])


def _fenced(e: Execution, fence: int) -> Execution:
    return replace(e, fence=fence)


def _ack(e: Execution, t: float, op: str = "claim", value: str = "") -> Event:
    value = value or f"won attempt={e.attempt} fence={e.fence}"
    return Event(t, "ok", e.instance, op, e.job, e.run, e.token, value)


def test_checkers_accept_a_clean_history() -> None:
    runs = [_fenced(e, i + 1) for i, e in enumerate(_every_slot())]
    verdicts = _judge(runs, [_ack(e, e.started) for e in runs]).verdicts
    assert {name: verdict.status for name, verdict in verdicts.items()} == {
        **dict.fromkeys(["P1", "P2", "P3", "P4", "P5", "P6"], "valid"),
        "P7": "unknown",  # the history holds no records read from the store
    }
    # Without the claims' acknowledgements the fences cannot be ordered.
    assert _judge(runs).verdicts["P6"].status == "unknown"


# --- P1 no duplicate -------------------------------------------------------------------------------------------


def test_a_slot_run_again_after_it_had_run_to_the_end_is_a_duplicate_even_if_the_rerun_stops_early() -> None:
    # The rerun's side effects happened whether or not it reached its end (here it was killed half way).
    first, rerun = _execution("a", 40, 40, 41), _execution("b", 40, 44, 45, completed=False)
    verdict = _judge([*_every_slot(skip=40), first, rerun]).verdicts["P1"]
    assert verdict.status == "invalid"
    assert verdict.witness == (
        "tick slot at 40 s: a attempt 1 [40.000 .. 41.000] ran to the end; b attempt 1 [44.000 .. 45.000] stopped early"
    )
    # The other way round it is a retry: the first execution had stopped before the second began.
    stopped, retry = _execution("a", 40, 40, 41, completed=False), _execution("b", 40, 44, 45, attempt=2)
    assert _judge([*_every_slot(skip=40), stopped, retry]).verdicts["P1"].status == "valid"


def test_a_takeover_begun_before_the_first_attempt_stopped_is_a_duplicate_and_breaks_lease_safety() -> None:
    first, takeover = _execution("a", 40, 40, 43, completed=False), _execution("b", 40, 42, 45, attempt=2)
    verdicts = _judge([*_every_slot(skip=40), first, takeover]).verdicts
    assert (verdicts["P1"].status, verdicts["P4"].status) == ("invalid", "invalid")


def test_under_lease_an_execution_no_retry_could_make_is_a_duplicate() -> None:
    # A manual run allows one attempt (no backup retries it); a job of max_attempts 3 has no attempt 4.
    first, second = _execution("a", 45, 45, 45.5, completed=False), _execution("b", 45, 50, 51, attempt=2)
    manual = [_manual(first), replace(_manual(second), run=_manual(first).run)]
    assert _judge([*_every_slot(), *manual]).verdicts["P1"].status == "invalid"
    chain = [_execution(name, 40, 40 + n, 40.5 + n, completed=n == 3, attempt=n + 1) for n, name in enumerate("abab")]
    assert _judge([*_every_slot(skip=40), *chain[:3]]).verdicts["P1"].status == "valid"
    assert _judge([*_every_slot(skip=40), *chain], max_attempts=3).verdicts["P1"].status == "invalid"


def _manual(e: Execution) -> Execution:
    return replace(e, manual=True, run=f"m{e.slot}-x")


@pytest.mark.parametrize("strategy", ["lease", "script"])
def test_a_manual_run_executed_twice_is_a_duplicate_and_a_slot_of_the_same_number_is_another_run(
    strategy: str,
) -> None:
    """A run_now's run is a run of its own, never retried: a second execution of it is a duplicate (under lease
    too, and two holders of its lease at once break P4), while a manual run and the scheduled run of the slot its
    number names are two runs."""
    once, again = _manual(_execution("a", 45, 45, 47)), _manual(_execution("b", 45, 46, 48))
    judgement = _judge([*_every_slot(), once, again], strategy=strategy)
    assert judgement.verdicts["P1"].status == "invalid"
    assert judgement.verdicts["P1"].witness.startswith("tick manual run at 45 s: a attempt 1 [45.000 .. 47.000]")
    if strategy == "lease":
        assert judgement.verdicts["P4"].status == "invalid"
        assert judgement.verdicts["P4"].witness.startswith("tick manual run at 45 s: a attempt 1")
    beside_its_slot = _manual(_execution("b", 40, 40.5, 41.5))
    assert _judge([*_every_slot(), beside_its_slot], strategy=strategy).verdicts["P1"].status == "valid"


@pytest.mark.parametrize("strategy", ["stream-id", "idmp", "script"])
def test_a_claim_only_slot_run_again_after_its_first_run_stopped_early_is_a_duplicate(strategy: str) -> None:
    # These strategies retry nothing: a second execution is a second winning claim (a window that forgot the
    # first, a lost store), and it repeats whatever the first had done before it was killed.
    stopped, again = _execution("a", 40, 40, 40.5, completed=False), _execution("b", 40, 55, 56)
    verdict = _judge([*_every_slot(skip=40), stopped, again], strategy=strategy).verdicts["P1"]
    assert verdict.status == "invalid"
    assert verdict.witness.startswith("tick slot at 40 s: a attempt 1 [40.000 .. 40.500] stopped early; b attempt 1")


def test_under_lease_the_same_attempt_run_again_after_it_stopped_early_is_a_duplicate() -> None:
    # Not a retry (that would be attempt 2): the store granted attempt 1 twice, as after losing the first claim.
    stopped, again = _execution("a", 40, 40, 40.5, completed=False), _execution("b", 40, 44, 45)
    assert _judge([*_every_slot(skip=40), stopped, again]).verdicts["P1"].status == "invalid"


# --- P2 no missed slot -----------------------------------------------------------------------------------------


def test_a_slot_is_not_expected_of_an_instance_that_was_down_within_its_settling_time() -> None:
    # b is down throughout; a is up at the slot at 40 s and again when its settling time (15 s) ends, but it was
    # killed 1 s into the run and back 3 s later: nobody was healthy throughout, so the slot is not owed.
    history = History(epoch_s=EPOCH_S, executions=[*_every_slot(skip=40), _execution("a", 40, 40, 41, completed=False)])
    windows = [FaultWindow(0, 100, "crash", "b"), FaultWindow(41, 44, "crash", "a")]
    judgement = judge(_scenario(), "lease", history, windows)
    assert judgement.verdicts["P2"].status == "valid"
    # Slots at 10 .. 80 s can be judged (the last settling time ends by 100 s); those at 30 and 40 s settle over
    # the outage.
    assert judgement.slots_checked == 6


def test_a_slot_an_instance_s_clock_shows_too_late_to_settle_before_the_end_is_not_owed() -> None:
    # The only instance's clock is 20 s behind: it reaches the slot at 80 s at true 100 s, the end.
    scenario = parse({
        "name": "behind", "duration_s": 100, "scheduler": {"lease_ms": 3000},
        "instances": [{"name": "a", "offset_ms": -20_000}],
        "jobs": [{"name": "tick", "cron": "*/10 * * * * *", "work_s": 1.0}],
    })  # fmt: skip
    runs = [_execution("a", s, s + 20, s + 21) for s in range(-10, 80, 10)]
    judgement = judge(scenario, "lease", History(epoch_s=EPOCH_S, executions=runs), [])
    assert judgement.verdicts["P2"].status == "valid"
    # -10 .. 60 s: shown by 80 s, settled (15 s each) by the end; the first two before the run began, by the
    # true time, but after a's start by its clock (-20 s then)
    assert judgement.slots_checked == 8


def test_an_instance_started_again_exactly_at_a_slot_is_not_owed_that_slot() -> None:
    # b is down throughout; a crashed at 35 s and was started again at 40 s exactly. A scheduler's slots are those
    # after the moment it is started: the slot at 40 s was nobody's. Started again a moment earlier, a owes it.
    history = History(epoch_s=EPOCH_S, executions=_every_slot(skip=40))
    restarted_at_the_slot = [FaultWindow(0, 100, "crash", "b"), FaultWindow(35, 40, "crash", "a")]
    assert judge(_scenario(), "lease", history, restarted_at_the_slot).verdicts["P2"].status == "valid"
    restarted_before = [FaultWindow(0, 100, "crash", "b"), FaultWindow(35, 39.9, "crash", "a")]
    assert judge(_scenario(), "lease", history, restarted_before).verdicts["P2"].status == "invalid"


@pytest.mark.parametrize(
    ("offset_ms", "restarted_at", "owed"),
    [(3000, 38.0, False), (3000, 36.9, True), (-2000, 41.0, True), (-2000, 42.0, False)],
)
def test_an_instance_owes_the_slots_its_own_clock_shows_after_its_start(
    offset_ms: int, restarted_at: float, owed: bool
) -> None:
    """As above, by the instance's clock: 3 s ahead, a shows 40 s at 37 s true time, so started again at 38 s it
    owes that slot nothing, and at 36.9 s it does; 2 s behind, it shows 40 s at 42 s, and started again at 41 s it
    owes it."""
    scenario = parse({
        "name": "unit", "duration_s": 100, "scheduler": {"lease_ms": 3000},
        "instances": [{"name": "a", "offset_ms": offset_ms}, {"name": "b"}],
        "jobs": [{"name": "tick", "cron": "*/10 * * * * *", "work_s": 1.0}],
    })  # fmt: skip
    # The slot at 0 s ran too: 2 s behind, a's clock shows it at 2 s, after a started.
    history = History(epoch_s=EPOCH_S, executions=[_execution("a", 0, 2, 3), *_every_slot(skip=40)])
    windows = [FaultWindow(0, 100, "crash", "b"), FaultWindow(35, restarted_at, "crash", "a")]
    assert judge(scenario, "lease", history, windows).verdicts["P2"].status == ("invalid" if owed else "valid")


def test_when_a_clock_shows_a_time_follows_its_jumps_and_drift() -> None:
    scenario = parse({
        "name": "unit", "duration_s": 100, "scheduler": {"lease_ms": 3000},
        "instances": [{"name": "a", "offset_ms": 1000}],
        "jobs": [{"name": "tick", "cron": "*/10 * * * * *", "work_s": 1.0}],
        "faults": [
            {"at_s": 20, "kind": "drift", "instance": "a", "drift": 1.0},  # twice as fast from 20 s (clock 21 s)
            {"at_s": 30, "kind": "skew", "instance": "a", "offset_ms": 5000},  # 41 s, then jumps to 46 s
            {"at_s": 40, "kind": "late", "instance": "a", "delay_ms": 10_000, "duration_s": 5},  # 66 s, back to 56
        ],  # and at 45 s (66 s again) forward to 76 s
    })  # fmt: skip
    clock = _Clock.of(scenario.instances[0], _struck(scenario, "a"))
    walls = (0.5, 1, 11, 21, 31, 43, 50, 60, 70, 80)
    # Set back 10 s at 40 s (66 s to 56 s), the clock shows 60 s again at 42 s, and 66 s again at 45 s, where it
    # jumps forward to 76 s: over 70 s, which it had not shown.
    assert [clock.showings(t) for t in walls] == [
        [], [], [10], [20], [25], [30], [32], [37, 42], [45], [47]
    ]  # fmt: skip
    assert clock.shown_between(0, 50) == (1, 86)
    assert clock.shown_between(41, 44) == (58, 64)  # set back meanwhile
    assert _Clock.of(scenario.instances[0], []).showings(50) == [49]  # the faults struck nobody: only the offset


def _struck(scenario: Scenario, instance: str) -> list[FaultWindow]:
    """The windows of the scenario's faults, each as it struck ``instance`` at its time."""
    return [FaultWindow(f.at_s, f.at_s + f.duration_s, f.kind, instance, fault=f) for f in scenario.faults]


def test_a_clock_fault_aimed_at_the_winner_moves_the_clock_of_the_instance_it_struck() -> None:
    """a's clock, set 5 s back at 30 s by a fault aimed at "winner" that struck a, shows 40 s at 45 s true time:
    restarted at 44 s after a crash, a owes that slot (b is down throughout), and the slot never ran."""
    scenario = parse({
        "name": "unit", "duration_s": 100, "scheduler": {"lease_ms": 3000},
        "instances": [{"name": "a"}, {"name": "b"}],
        "jobs": [{"name": "tick", "cron": "*/10 * * * * *", "work_s": 1.0}],
        "faults": [{"at_s": 30, "kind": "skew", "instance": "winner", "offset_ms": -5000}],
    })  # fmt: skip
    history = History(epoch_s=EPOCH_S, executions=_every_slot(skip=40))
    down = [FaultWindow(0, 100, "crash", "b"), FaultWindow(35, 44, "crash", "a")]
    assert judge(scenario, "lease", history, [*down, *_struck(scenario, "a")]).verdicts["P2"].status == "invalid"
    # Had it struck b, a's clock would have shown 40 s while it was down: the slot was owed by nobody.
    assert judge(scenario, "lease", history, [*down, *_struck(scenario, "b")]).verdicts["P2"].status == "valid"


def test_a_slot_still_going_when_the_run_ended_is_not_judged_missed() -> None:
    # The slot at 80 s began late, at 92 s, and was going when the run ended at 100 s: it may yet finish.
    going = replace(_execution("a", 80, 92, 100, completed=False), cut_by_end=True)
    verdict = _judge([*_every_slot(skip=80), going]).verdicts["P2"]
    assert verdict.status == "unknown"
    assert verdict.witness == (
        "still going at the end: tick slot at 80 s: a attempt 1 [92.000 .. 100.000] still going at the end"
    )
    # Killed there instead, it is missed; and a slot missed elsewhere makes the verdict invalid whatever is going.
    killed = replace(going, cut_by_end=False)
    assert _judge([*_every_slot(skip=80), killed]).verdicts["P2"].status == "invalid"
    missed = _judge([*(e for e in _every_slot(skip=80) if e.started != 20), going])
    assert (missed.verdicts["P2"].status, missed.verdicts["P2"].count) == ("invalid", 1)


def test_missed_slots_that_lease_skipped_as_overlaps_are_counted_apart() -> None:
    # The slot at 30 s was answered overlap (the run of 20 s still held its lease); the one at 60 s never claimed.
    runs = [e for e in _every_slot() if e.started not in (30, 60)]
    skipped = _execution("b", 30, 30, None)
    events = [Event(30.0, "ok", "b", "claim", "tick", skipped.run, "t-b", "overlap attempt=0 lease_ms=2000 fence=0")]
    verdict = _judge(runs, events).verdicts["P2"]
    assert (verdict.status, verdict.count, verdict.figures) == ("invalid", 2, {"skipped_overlap": 1})


# --- P3 no overlap --------------------------------------------------------------------------------------------


def test_a_manual_run_at_the_time_of_a_slot_is_another_run_and_overlapping_it_is_an_overlap() -> None:
    scheduled = _execution("a", 30, 30, 40)
    slot = int((EPOCH_S + 30) * 1000)  # run_now called at the slot's very moment: the same slot number
    manual = Execution("b", "tick", slot, f"m{slot}-b1", 1, 9, "t-manual", True, 30, 40, True)
    verdict = _judge([*_every_slot(skip=30), scheduled, manual]).verdicts["P3"]
    assert verdict.status == "invalid"
    assert verdict.witness == (
        "tick: slot at 30 s (a attempt 1 [30.000 .. 40.000] ran to the end) and manual run at 30 s "
        "(b attempt 1 [30.000 .. 40.000] ran to the end)"
    )


def test_a_long_run_overlaps_a_later_slot_whatever_runs_between_them() -> None:
    # b's short retry of the slot at 40 s starts between a's long run and the slot at 50 s.
    long_run, retry = _execution("a", 40, 40, 55, completed=False), _execution("b", 40, 41, 42, attempt=2)
    runs = [*_every_slot(skip=40), long_run, retry]
    verdict = _judge(runs).verdicts["P3"]
    assert (verdict.status, verdict.count) == ("invalid", 1)
    assert verdict.witness == (
        "tick: slot at 40 s (a attempt 1 [40.000 .. 55.000] stopped early) and slot at 50 s "
        "(a attempt 1 [50.000 .. 51.000] ran to the end)"
    )


# --- P4 lease safety -------------------------------------------------------------------------------------------


def test_two_holders_of_the_same_attempt_at_once_break_lease_safety() -> None:
    # After a failover the store forgot a's claim and b won attempt 1 of the same run again, while a still ran.
    a, b = _execution("a", 40, 40, 43), _execution("b", 40, 41, 44)
    verdict = _judge([*_every_slot(skip=40), a, b]).verdicts["P4"]
    assert verdict.status == "invalid"
    assert "a attempt 1 [40.000 .. 43.000]" in verdict.witness
    assert "b attempt 1 [41.000 .. 44.000]" in verdict.witness


def test_a_holder_still_going_at_the_end_is_named_so_in_the_witness() -> None:
    # The zombie's claim was acknowledged; it has no margin only because its work had not ended.
    zombie = _execution("a", 40, 40, 99)
    zombie.cut_by_end = True
    backup = _execution("b", 40, 44, 45, attempt=2)
    verdict = _judge([*_every_slot(skip=40), zombie, backup], [_ack(zombie, 40.0), _ack(backup, 44.0)]).verdicts["P4"]
    assert verdict.status == "invalid"
    assert "(a: still going at the end; b's lease ran out at" in verdict.witness


def test_the_same_attempt_won_again_after_the_first_had_stopped_is_not_a_lease_violation() -> None:
    a, b = _execution("a", 40, 40, 41, completed=False), _execution("b", 40, 44, 45)
    assert _judge([*_every_slot(skip=40), a, b]).verdicts["P4"].status == "valid"


def test_the_lease_margin_is_the_last_acknowledged_expiry_minus_the_last_side_effect() -> None:
    zombie = _execution("a", 40, 40, 47, completed=False)  # paused past its lease, then went on
    backup = _execution("b", 40, 43.5, 45, attempt=2)
    events = [
        _ack(zombie, 40.0),  # claim won: lease to 43
        _ack(zombie, 41.0, "heartbeat", "3000"),  # extended to 44
        _ack(zombie, 46.5, "heartbeat", "0"),  # refused: no extension
        _ack(zombie, 47.5, "heartbeat", "3000"),  # after its end: says nothing about what it did before
        _ack(backup, 43.5),  # lease to 46.5
        _ack(backup, 44.0, "heartbeat", "2500"),  # extended to 46.5
    ]
    judgement = _judge([*_every_slot(skip=40), zombie, backup], events)
    assert judgement.lease_margins_ms == pytest.approx([-3000.0, 1500.0])
    verdict = judgement.verdicts["P4"]
    assert verdict.status == "invalid"
    assert "a's lease ran out at 44.000 s, 3000 ms before it stopped" in verdict.witness
    assert verdict.figures == {"attempts": 2, "past_lease": 1, "min_margin_ms": -3000.0, "p50_margin_ms": -3000.0}
    assert judgement.as_json()["figures"]["P4"]["past_lease"] == 1


def test_a_lease_counts_from_when_its_request_was_sent_not_when_the_reply_was_read() -> None:
    # a sent a heartbeat at 41 s and was paused before reading the reply (read at 46.5 s): its lease ran to 44 s,
    # as its scheduler counts it, however late the reply came.
    zombie = _execution("a", 40, 40, 47, completed=False)
    sent = Event(41.0, "invoke", "a", "heartbeat", "tick", zombie.run, zombie.token)
    events = [_ack(zombie, 40.0), sent, _ack(zombie, 46.5, "heartbeat", "3000")]
    judgement = _judge([*_every_slot(skip=40), zombie], events)
    assert judgement.lease_margins_ms == pytest.approx([-3000.0])


def test_an_execution_still_going_at_the_end_has_no_lease_margin() -> None:
    # Paused at 41 s until the end (100 s): its work never ended, so nothing measures how far past its lease.
    zombie = replace(_execution("a", 40, 40, 100, completed=False), cut_by_end=True)
    judgement = _judge([*_every_slot(skip=40), zombie], [_ack(zombie, 40.0)])
    assert judgement.lease_margins_ms == []


def test_a_retried_claim_counts_only_the_lease_it_had_left() -> None:
    # The claim's reply was lost and a's retry recognised its own token 2 s later: 1 s of the lease was left.
    a = _execution("a", 40, 40, 42.5)
    events = [_ack(a, 42.0, value="won attempt=1 lease_ms=1000 fence=1")]
    assert _judge([*_every_slot(skip=40), a], events).lease_margins_ms == pytest.approx([500.0])
    # A history that does not say what was left counts the whole lease.
    assert _judge([*_every_slot(skip=40), a], [_ack(a, 42.0)]).lease_margins_ms == pytest.approx([2500.0])


def test_an_attempt_without_an_acknowledged_lease_has_no_margin() -> None:
    judgement = _judge(_every_slot())
    assert judgement.lease_margins_ms == []
    assert judgement.verdicts["P4"].figures == {"attempts": 0, "past_lease": 0}


def test_other_strategies_have_no_lease_margins() -> None:
    runs = _every_slot()
    judgement = _judge(runs, [_ack(e, e.started) for e in runs], strategy="script")
    assert judgement.verdicts["P4"].status == "unknown"
    assert judgement.lease_margins_ms == []
    assert "P4" not in judgement.as_json()["figures"]


# --- P5 no lost acknowledged claim -----------------------------------------------------------------------------


def _won(instance: str, t: float, attempt: int = 1, slot_s: float = 40) -> Event:
    run = str(int((EPOCH_S + slot_s) * 1000))
    value = f"won attempt={attempt} lease_ms=3000 fence={attempt}"
    return Event(t, "ok", instance, "claim", "tick", run, f"t-{instance}-{slot_s:.0f}-{attempt}", value, attempt)


def _p5(events: list[Event], windows: list[FaultWindow], strategy: str = "lease") -> Verdict:
    history = History(epoch_s=EPOCH_S, events=events, executions=_every_slot())
    return judge(_scenario(), strategy, history, windows).verdicts["P5"]


def test_a_failover_loses_only_the_claims_the_replica_had_not_received() -> None:
    # The replica lacked what was written from 21.9 s on when it took over at 22 s.
    failover = [FaultWindow(21.9, 22.0, "failover")]
    lost = _p5([_won("a", 21.95), _won("b", 25.0)], failover, "script")
    assert lost.status == "invalid"
    assert lost.witness == (
        "tick slot at 40 s: won by a at 21.950 s, won again by b at 25.000 s after the store lost it"
    )
    # The same instance winning it again with a claim of its own (a restart: a new token) is named as such.
    again = replace(_won("b", 25.0), process="a")
    assert _p5([_won("a", 21.95), again], failover, "script").witness == (
        "tick slot at 40 s: won by a at 21.950 s, won again by a (a new claim) at 25.000 s after the store lost it"
    )
    # A claim it had received long before was not lost by the failover: won again, it is a duplicate (P1) that
    # the strategy made on its own (here: it had forgotten the run).
    assert _p5([_won("a", 10.0), _won("b", 25.0)], failover, "script").status == "valid"


def test_under_lease_a_lost_takeover_granted_again_is_a_lost_claim_and_a_later_attempt_is_not() -> None:
    # a's attempt 1 ran out; b took the run over as attempt 2, but the replica lacked that when it took over.
    failover = [FaultWindow(41.5, 43.5, "failover")]
    first, takeover = _won("a", 40.0), _won("b", 43.001, attempt=2)
    granted_again = _p5([first, takeover, _won("c", 46.002, attempt=2)], failover)
    assert granted_again.status == "invalid"
    assert granted_again.witness.startswith("tick slot at 40 s: won by b at 43.001 s, won again by c at "
                                            "46.002 s")  # fmt: skip
    # Attempt 3: the store still knew attempt 2, so c took over a lease that had run out; nothing was lost.
    assert _p5([first, takeover, _won("c", 46.002, attempt=3)], failover).status == "valid"


def test_a_claim_won_at_the_instant_of_a_store_restart_but_before_it_was_lost() -> None:
    restart = Event(40.0, "fault", "nemesis", "store-restart", value="store restarted empty")
    windows = [FaultWindow(40.0, 40.0, "store-restart")]
    before = _p5([_won("a", 40.0), restart, _won("b", 41.0)], windows)
    assert before.status == "invalid"
    assert before.witness.startswith("tick slot at 40 s: won by a at 40.000 s, won again by b at 41")
    # Won on the empty store just after the restart, at the same instant: nothing lost.
    assert _p5([restart, _won("a", 40.0), _won("b", 41.0)], windows).status == "valid"


def test_a_store_restart_loses_the_claims_acknowledged_before_it_began() -> None:
    # Even one answered again while the restart is under way: the store forgot everything as it went down.
    twice = [_won("a", 40.0), _won("b", 41.0)]
    assert _p5(twice, [FaultWindow(40.5, 41.2, "store-restart")]).status == "invalid"
    # Won again before anything was lost: a store bug, not a lost claim (P1 reports the duplicate).
    assert _p5(twice, [FaultWindow(41.5, 41.5, "store-restart")]).status == "valid"
    assert _p5([_won("a", 40.0)], [FaultWindow(40.5, 41.2, "store-restart")]).status == "valid"


def test_a_claim_won_at_the_instant_of_a_failover_was_lost_only_if_the_replica_lacked_it() -> None:
    failover = Event(22.0, "fault", "nemesis", "failover", value="promoted a replica 0 ms behind")
    events = [_won("a", 22.0), failover, _won("b", 25.0)]
    # A replica behind lacks what was written at that instant; one with no lag had received it.
    assert _p5(events, [FaultWindow(22.0, 22.0, "failover")]).status == "invalid"
    nothing_lost = _p5(events, [FaultWindow(22.0, 22.0, "failover", lost_writes=False)])
    assert (nothing_lost.status, nothing_lost.witness) == ("valid", "no failover or store restart lost a write")


def test_a_failover_that_knows_the_tokens_it_lost_blames_those_claims_only() -> None:
    # Both claims fall in the window; the replica lacked only b's (a's keys came whole with a later write).
    events = [_won("a", 20.0, slot_s=20), _won("b", 21.0), _won("c", 25.0, slot_s=20), _won("c", 26.0)]
    lost_b = frozenset({"t-b-40-1", "tick"})
    verdict = _p5(events, [FaultWindow(19.0, 22.0, "failover", lost_words=lost_b)], "script")
    assert (verdict.status, verdict.count) == ("invalid", 1)
    assert verdict.witness.startswith("tick slot at 40 s: won by b at 21.000 s")
    # Without the tokens, every claim acknowledged within the window counts as lost.
    assert _p5(events, [FaultWindow(19.0, 22.0, "failover")], "script").count == 2


def test_a_lost_token_won_again_after_the_failover_is_not_a_lost_claim() -> None:
    # a's claim reached the old primary inside the window, but its reply was lost: a retried it on the new primary
    # at 23 s with the same token, won, and b's claim at 25 s lost to it. Nothing acknowledged was lost.
    lost_a = frozenset({"t-a-40-1"})
    verdict = _p5([_won("a", 23.0), _won("b", 25.0)], [FaultWindow(19.0, 22.0, "failover", lost_words=lost_a)])
    assert verdict.status == "valid"


def test_a_claim_sent_before_a_store_fault_and_answered_after_it() -> None:
    # a's claim went out at 40 s and its answer was read at 50 s; the store lost what it had at 45 s, and b won the
    # run at 51 s. Where the failover knows a's claim among the writes it lost, the store lost an acknowledged claim
    # (a, paused as the answer came, read it late). Otherwise it cannot be told: held on its way (a paused
    # instance's command waits to leave), a's claim may have reached the store that followed, and b's win then
    # lost nothing.
    won_late = _won("a", 50.0)
    sent = Event(40.0, "invoke", "a", "claim", "tick", won_late.run, won_late.token)
    failover = FaultWindow(40.0, 45.0, "failover", lost_words=frozenset({won_late.token}))
    for kind, window, status in [
        ("failover", failover, "invalid"),
        ("failover", replace(failover, lost_words=frozenset()), "valid"),  # the replica had received it
        ("failover", replace(failover, lost_words=None), "unknown"),
        ("store-restart", FaultWindow(45.0, 45.0, "store-restart"), "unknown"),
    ]:
        fault = Event(45.0, "fault", "nemesis", kind, value="")
        verdict = _p5([sent, fault, won_late, _won("b", 51.0)], [window])
        assert verdict.status == status, (kind, window)
        # Sent after the fault, its claim went to the store that followed it: nothing acknowledged was lost.
        resent = replace(sent, t=46.0)
        assert _p5([fault, resent, won_late, _won("b", 51.0)], [window]).status == "valid", kind
    failed_over = _p5([sent, Event(45.0, "fault", "nemesis", "failover", value=""), won_late, _won("b", 51.0)],
                      [failover])  # fmt: skip
    assert failed_over.witness == (
        "tick slot at 40 s: won by a at 50.000 s, won again by b at 51.000 s after the store lost it"
    )
    held = _p5([sent, Event(45.0, "fault", "nemesis", "store-restart", value=""), _won("b", 46.0), won_late],
               [FaultWindow(45.0, 45.0, "store-restart")])  # fmt: skip
    assert (held.status, held.witness) == (
        "unknown",
        "tick slot at 40 s: won by a, sent at 40.000 s and answered at 50.000 s, across a store fault; won again "
        "by b at 46.000 s (may have been lost)",
    )


# --- P6 fencing ------------------------------------------------------------------------------------------------


def test_fences_accepted_at_the_same_instant_keep_the_order_of_the_history() -> None:
    def p6(*fences: int) -> Verdict:
        runs = [_fenced(_execution("a", 10 * (i + 1), 40, 41), fence) for i, fence in enumerate(fences)]
        return _judge(runs, [_ack(e, 40.0) for e in runs]).verdicts["P6"]

    inverted = p6(7, 3)
    assert inverted.status == "invalid"
    assert inverted.witness == "tick: fence 3 accepted at 40.000 s after fence 7 at 40.000 s"
    assert p6(3, 7).status == "valid"

    # Each acceptance is held against the highest fence before it: 3 and 4 both come after 5.
    after_a_reset = p6(1, 5, 3, 4, 6)
    assert (after_a_reset.status, after_a_reset.count) == ("invalid", 2)
    assert after_a_reset.witness == "tick: fence 3 accepted at 40.000 s after fence 5 at 40.000 s"


def test_two_claims_accepted_with_one_fence_are_out_of_order_whichever_came_first() -> None:
    # Both were sent before either was answered: no order of the two makes the fences grow.
    a, b = _fenced(_execution("a", 40, 41, 42), 5), _fenced(_execution("b", 50, 51, 52), 5)
    events = [
        Event(40.0, "invoke", "a", "claim", "tick", a.run, a.token),
        Event(40.5, "invoke", "b", "claim", "tick", b.run, b.token),
        _ack(a, 41.0),
        _ack(b, 41.0),
    ]
    verdict = _judge([a, b], events).verdicts["P6"]
    assert (verdict.status, verdict.witness) == ("invalid", "tick: fence 5 accepted twice, at 41.000 s and at 41.000 s")


def test_a_retried_claim_recognising_its_own_token_is_one_acceptance() -> None:
    # a's claim reply was lost; its retry at 41 s got the same fence back. b then accepted fence 2.
    a, b = _execution("a", 40, 40, 41), _fenced(_execution("b", 50, 50, 51), 2)
    events = [_ack(a, 40.0), _ack(b, 40.5), _ack(a, 41.0)]
    assert _judge([a, b], events).verdicts["P6"].status == "valid"


def test_fences_are_judged_in_the_order_the_store_surely_accepted_them() -> None:
    """The store accepts a claim between its first send and the answer its sender reads. a's claim, sent at 40 s,
    took fence 4, and a read the answer at 47 s (it was paused); b's claim, sent at 45 s, took fence 5 and was
    answered at once. The store may well have accepted a's first: its lower fence, read later, is no fault. Had a
    read the answer at 44 s, before b's send, a's claim was accepted first, and its fence must be the lower."""
    a, b = _execution("a", 40, 47, 48), _execution("b", 40, 45, 46)

    def p6(a_answered: float, a_fence: int) -> Verdict:
        runs = [_fenced(a, a_fence), _fenced(b, 5)]
        events = [
            Event(40.0, "invoke", "a", "claim", "tick", a.run, a.token),
            Event(45.0, "invoke", "b", "claim", "tick", b.run, b.token),
            _ack(runs[1], 45.0),
            _ack(runs[0], a_answered),
        ]
        return _judge(runs, sorted(events, key=lambda event: event.t)).verdicts["P6"]

    assert p6(a_answered=47.0, a_fence=4).status == "valid"
    assert p6(a_answered=44.0, a_fence=4).status == "valid"
    stale = p6(a_answered=44.0, a_fence=6)
    assert stale.status == "invalid"
    assert stale.witness == "tick: fence 5 accepted at 45.000 s after fence 6 at 44.000 s"


def test_a_claim_whose_outcome_is_unknown_is_no_acceptance() -> None:
    # The store may or may not have run it: only acknowledged claims are judged (P5, P6, the margins).
    a = _fenced(_execution("a", 40, 40, 41), 5)
    unknown = Event(40.5, "info", "a", "claim", "tick", a.run, "t-other", "won attempt=1 fence=0")
    judgement = _judge([a], [_ack(a, 40.0), unknown])
    assert judgement.verdicts["P6"].status == "valid"


# --- P7: the records history() gives against the ledger ------------------------------------------------------


def _record(e: Execution, status: str = "ok", **changes: Any) -> RunRecord:
    fields: dict[str, Any] = {
        "job": e.job, "run": e.run, "slot": e.slot, "attempt": e.attempt, "status": status, "runner": e.instance,
        "token": e.token, "fence": e.fence, "manual": e.manual, "started": e.slot, "ended": e.slot + 1000,
    }  # fmt: skip
    return RunRecord(**{**fields, **changes})


def _true_history(executions: list[Execution], records: list[RunRecord], events: list[Event] | None = None,
                  windows: list[FaultWindow] | None = None, **scheduler: Any) -> Verdict:  # fmt: skip
    history = History(epoch_s=EPOCH_S, events=events or [], executions=executions, records=records)
    scenario = replace(_scenario(), scheduler={"lease_ms": 3000, **scheduler})
    return judge(scenario, "lease", history, windows or []).verdicts["P7"]


def _finished(executions: list[Execution], op: str = "finish") -> list[Event]:
    """The store's acknowledgements of each execution's finish (or, with op "release", of its hand-back)."""
    return [_ack(e, e.ended or e.started, op, "True") for e in executions]


def test_records_that_agree_with_the_ledger_are_a_true_history() -> None:
    runs = _every_slot()
    assert _true_history(runs, [_record(e) for e in runs], _finished(runs)).status == "valid"
    assert _judge(runs).verdicts["P7"].status == "unknown"  # no records were read
    # A claim-only skip has no token (every instance that finds the run late writes the same record): it names
    # nobody; a takeover records the attempt it took over, whose holder never ran it.
    late = _record(_execution("a", 100, 100, 101), "skipped-late", runner="", token="", fence=0)
    holder = _execution("b", 30, 30, None, completed=False)  # its claim won, then it crashed before it began
    taken_over = _record(replace(holder, attempt=1), "interrupted", token="t-crashed")
    assert _true_history(runs, [*map(_record, runs), late, taken_over], _finished(runs)).status == "valid"


def test_a_run_recorded_skipped_beside_its_execution_is_a_false_history_unless_a_store_fault_lost_its_claim() -> None:
    runs = _every_slot()
    skipped = _record(runs[2], "skipped-late", runner="", token="")
    verdict = _true_history(runs, [*map(_record, runs), skipped], _finished(runs))
    assert verdict.status == "invalid"
    assert "slot at 30 s: recorded skipped-late, but it ran (a attempt 1 [30.000 .. 31.000]" in verdict.witness
    # A restart forgot the run's claim: a later instance that found it late could not tell.
    restart = [FaultWindow(35.0, 35.0, "store-restart")]
    assert _true_history(runs, [*map(_record, runs), skipped], _finished(runs), restart).status == "valid"


@pytest.mark.parametrize(
    ("record", "witness"),
    [
        (lambda e: _record(e, token="t-nobody"), "recorded ok by a, but no execution has its token"),
        (lambda e: _record(e, runner="b"), "recorded ok by b attempt 1 fence 1, but that token's execution is a"),
        (lambda e: _record(e, fence=7), "fence 7, but that token's execution is a attempt 1"),
    ],
)
def test_a_record_that_names_no_execution_or_another_one_is_a_false_history(record: Any, witness: str) -> None:
    run = _fenced(_execution("a", 30, 30, 31), 1)
    verdict = _true_history([run], [record(run)])
    assert verdict.status == "invalid"
    assert witness in verdict.witness


def test_a_run_recorded_ok_that_did_not_run_to_its_end_is_a_false_history() -> None:
    run = replace(_execution("a", 30, 30, 31, completed=False), killed=True)
    assert "did not run to its end" in _true_history([run], [_record(run)]).witness


def test_a_run_recorded_twice_or_with_another_status_than_its_end_is_a_false_history() -> None:
    runs = _every_slot()
    twice = _true_history(runs, [*map(_record, runs), _record(runs[0], "interrupted")], _finished(runs))
    assert twice.witness == "tick slot at 10 s: attempt 1 of a recorded twice"
    records = [_record(e, "interrupted" if e is runs[3] else "ok") for e in runs]
    assert "slot at 40 s (a attempt 1 [40.000 .. 41.000] ran to the end): recorded interrupted, not ok" in (
        _true_history(runs, records, _finished(runs)).witness
    )
    # A failover lost its finish: a backup took the attempt over, which the store still saw running.
    failover = FaultWindow(40.5, 42.0, "failover")
    assert _true_history(runs, records, _finished(runs), [failover]).status == "valid"


def test_an_acknowledged_finish_without_its_record_is_a_false_history_unless_lost_or_trimmed() -> None:
    runs = _every_slot()
    kept = [_record(e) for e in runs if e.slot != runs[4].slot]
    verdict = _true_history(runs, kept, _finished(runs))
    assert "slot at 50 s (a attempt 1 [50.000 .. 51.000] ran to the end): the store heard of its end at 51.000 s, " \
        "but no record of it is kept" in verdict.witness  # fmt: skip
    # A store restart after the finish lost it, and so did a failover whose replica lacked it; not a failover
    # whose replica had every write, nor a restart before the finish.
    for window, status in [
        (FaultWindow(60.0, 60.0, "store-restart"), "valid"),
        (FaultWindow(50.5, 52.0, "failover"), "valid"),
        (FaultWindow(50.5, 52.0, "failover", lost_writes=False), "invalid"),
        (FaultWindow(45.0, 45.0, "store-restart"), "invalid"),
    ]:
        assert _true_history(runs, kept, _finished(runs), [window]).status == status, window
    # A finish sent before the fault ended and answered after it may have been applied by the store that lost it,
    # its answer read late (a live instance's clock reads the answer after the server sent it); one sent after the
    # fault reached the store that followed, which must keep its record.
    e = runs[4]
    for window in [FaultWindow(50.2, 50.8, "failover"), FaultWindow(50.5, 50.8, "store-restart")]:
        for sent, status in [(50.7, "valid"), (50.9, "invalid")]:
            invoke = Event(sent, "invoke", e.instance, "finish", e.job, e.run, e.token)
            events = sorted([*_finished(runs), invoke], key=lambda event: event.t)
            assert _true_history(runs, kept, events, [window]).status == status, (window, sent)
    # Trimming drops the oldest records of a job that keeps history_size of them, not fewer.
    newest = [_record(e) for e in runs[1:]]
    assert _true_history(runs, newest, _finished(runs), history_size=8).status == "valid"
    assert _true_history(runs, newest, _finished(runs)).status == "invalid"


def test_a_run_its_scheduler_ended_early_is_owed_a_record_once_the_store_heard_of_its_end() -> None:
    stopped = _execution("a", 30, 30, 31, completed=False)
    # Its interrupted record, acknowledged: owed. Cut off or killed before its scheduler told the store: not.
    verdict = _true_history([stopped], [], _finished([stopped]))
    assert "slot at 30 s (a attempt 1 [30.000 .. 31.000] stopped early): the store heard of its end" in verdict.witness
    assert _true_history([stopped], [_record(stopped, "interrupted")], _finished([stopped])).status == "valid"
    assert _true_history([stopped], []).status == "valid"
    # A lease run handed back is recorded when a backup's claim takes it over; a run_now (never taken over) at once.
    handed_back = _finished([stopped], "release")
    assert _true_history([stopped], [], handed_back).status == "valid"  # nobody claimed it again before the end
    takeover = Event(34.0, "ok", "b", "claim", "tick", stopped.run, "t-b", "won attempt=2 fence=2")
    assert _true_history([stopped], [], [*handed_back, takeover]).status == "invalid"
    run_now = replace(stopped, manual=True, run=f"m{stopped.slot}-t")
    assert "manual run at 30 s" in _true_history([run_now], [], _finished([run_now], "release")).witness


def test_a_history_keeps_at_least_history_size_records() -> None:
    runs = _every_slot()  # nine runs
    assert _true_history(runs, [_record(e) for e in runs[-5:]], _finished(runs), history_size=5).status == "valid"
    four = _true_history(runs, [_record(e) for e in runs[-4:]], _finished(runs), history_size=5)
    assert (four.status, four.count) == ("invalid", 6)  # the five it should have kept, and the count
    ttl = _true_history(runs, [_record(e) for e in runs[-4:]], _finished(runs), history_size=5, history_ttl_ms=1)
    assert ttl.status == "valid"  # history_ttl_ms may drop more


# --- lateness --------------------------------------------------------------------------------------------------


def test_runs_on_time_have_valid_lateness_with_figures() -> None:
    # The slot at 50 s starts 0.5 s late; the one at 30 s 2 s early (its instance's clock ahead): shown, not judged.
    started = {50: 50.5, 30: 28.0}
    runs = [_execution("a", s, started.get(s, s), started.get(s, s) + 1) for s in range(10, 100, 10)]
    judgement = _judge(runs)
    assert judgement.lateness.status == "valid"
    assert judgement.lateness.figures == {"runs": 9, "min_ms": -2000.0, "p50_ms": 0.0, "p99_ms": 500.0,
                                          "max_ms": 500.0}  # fmt: skip
    assert "nearest its allowance: tick slot at 50 s" in judgement.lateness.witness
    assert "started 500 ms after its slot" in judgement.lateness.witness
    assert judgement.as_json()["lateness"]["verdict"] == "valid"
    assert judgement.as_json()["lateness"]["max_ms"] == 500.0


def test_a_first_attempt_later_than_max_late_ms_and_the_margin_is_late() -> None:
    late = [*_every_slot(skip=40), _execution("b", 40, 47, 48)]
    judgement = _judge(late, max_late_ms=5000)
    assert judgement.lateness.status == "invalid"
    assert judgement.lateness.count == 1
    assert judgement.lateness.witness.startswith("late: tick slot at 40 s: b attempt 1")
    assert "7000 ms after its slot (allowed 6000 ms)" in judgement.lateness.witness
    out = judgement.as_json()["lateness"]
    assert (out["verdict"], out["count"], out["max_ms"]) == ("invalid", 1, 7000.0)
    # Within the margin, or with jitter allowed on top of max_late_ms: on time.
    assert _judge(late, max_late_ms=6500).lateness.status == "valid"
    assert _judge(late, max_late_ms=5000, jitter_ms=2000).lateness.status == "valid"


def test_the_default_max_late_ms_applies_and_takeovers_do_not_count() -> None:
    late = [*_every_slot(skip=40), _execution("b", 40, 40 + 62, 40 + 63)]
    assert _judge(late).lateness.status == "invalid"  # default max_late_ms 60 s, + 1 s margin
    takeover = [*_every_slot(skip=40), _execution("a", 40, 40, 41, False), _execution("b", 40, 102, 103, attempt=2)]
    assert _judge(takeover).lateness.status == "valid"


def test_lateness_is_each_runs_first_start_and_a_late_duplicate_does_not_count() -> None:
    """A duplicate is attempt 1 too (the claim-only strategies, or lease after a failover): it is P1's to judge.
    The run itself started on time."""
    duplicated = [*_every_slot(skip=40), _execution("a", 40, 40, 41), _execution("b", 40, 55, 56)]
    judgement = _judge(duplicated, strategy="script", max_late_ms=5000)
    assert judgement.lateness.status == "valid"
    assert judgement.lateness.figures == {"runs": 9, "min_ms": 0.0, "p50_ms": 0.0, "p99_ms": 0.0, "max_ms": 0.0}
    assert judgement.verdicts["P1"].status == "invalid"


def test_a_run_whose_first_attempt_never_started_started_when_a_later_attempt_did() -> None:
    """Attempt 1 was won but never ran (its winner crashed first, or handed the run back as it stopped): the run
    started with attempt 2, 7 s after its slot, and counts in the figures and the verdict as that late."""
    taken_over = [*_every_slot(skip=40), _execution("b", 40, 47, 48, attempt=2)]
    judgement = _judge(taken_over, max_late_ms=5000)
    assert (judgement.lateness.figures["runs"], judgement.lateness.figures["max_ms"]) == (9, 7000.0)
    assert judgement.lateness.status == "invalid"
    assert judgement.lateness.witness.startswith("late: tick slot at 40 s: b attempt 2")


@pytest.mark.parametrize("slot_s", [-10, 0])
def test_a_slot_due_before_the_run_began_or_as_it_began_is_not_judged_late(slot_s: int) -> None:
    # An instance whose clock is behind runs the slot of -10 s (or of 0 s) at 5 s: no one could have run it on
    # time. The instances start at 0 s, and a scheduler owes only the slots after its start.
    before = _execution("a", slot_s, 5, 6)
    judgement = _judge([*_every_slot(), before])
    assert (judgement.lateness.status, judgement.lateness.figures["runs"]) == ("valid", 9)


def test_lateness_is_unknown_without_runs() -> None:
    judgement = _judge([])
    assert judgement.lateness.status == "unknown"
    assert judgement.as_json()["lateness"]["verdict"] == "unknown"


def test_percentile_is_the_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert (percentile(values, 50), percentile(values, 99), percentile(values, 100)) == (50.0, 99.0, 100.0)
    assert percentile([3.0], 99) == 3.0


# --- where the figures show ------------------------------------------------------------------------------------


def test_the_command_line_prints_lateness_and_lease_margins() -> None:
    def run(name: str, strategy: str, *args: str) -> str:
        command = [sys.executable, "-m", "sim", "run", name, "--strategy", strategy, "--seed", "1", *args]
        return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120, check=True).stdout

    late = json.loads(run("late-claim", "script", "--json"))
    assert late["lateness"]["verdict"] == "invalid"  # the late instance's clock is 15 s behind; max_late_ms 5 s
    assert late["lateness"]["max_ms"] == pytest.approx(15000, abs=10)
    assert {"runs", "p50_ms", "p99_ms"} <= set(late["lateness"])
    zombie = json.loads(run("zombie", "lease", "--json"))
    assert zombie["figures"]["P4"]["past_lease"] == 1  # the paused winner worked on after its lease ran out
    assert zombie["figures"]["P4"]["min_margin_ms"] < 0
    text = run("late-claim", "lease")
    assert "  lateness invalid: late: tick slot at" in text
    # a late run is a finding to replay, like any invalid verdict; the file is named from where the command ran
    assert "replay: python -m sim run scenarios/late-claim.toml --strategy lease --seed 1" in text


def test_a_replay_names_a_scenario_outside_the_working_directory_by_its_whole_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert simulate(load("steady"), "lease", 1).replay_command() == (
        f"python -m sim run {REPO / 'scenarios' / 'steady.toml'} --strategy lease --seed 1"
    )


def test_the_report_tables_lateness_and_sums_up_lease_margins() -> None:
    results = report.Results("virtual", 1, [], [load("zombie"), load("late-claim")])
    for name, strategy in (("zombie", "lease"), ("late-claim", "script"), ("late-claim", "lease")):
        results.add(simulate(load(name), strategy, 1))
    text = report.render(results, lambda name, png: f"![{name}]({name})")
    lines = text.splitlines()
    table = lines[next(i for i, line in enumerate(lines) if "simulations with a late run" in line) :]
    script = next(line for line in table if line.startswith("| script |"))
    assert "| 15000 |" in script  # max lateness
    assert "1/1" in script  # its one simulation had a late run
    assert "1 worked past their lease; min -4000 ms" in text


def test_a_live_run_is_allowed_the_lateness_of_the_scenario_it_compresses() -> None:
    # max_late_ms 5 s + 1 s of margin: a run 7.5 s late is late, whether judged in scenario time or live, 5x faster.
    scenario = parse({
        "name": "late", "duration_s": 100, "scheduler": {"lease_ms": 3000}, "instances": [{"name": "a"}],
        "jobs": [{"name": "tick", "cron": "*/10 * * * * *", "work_s": 1.0, "max_late_ms": 5000}],
    })  # fmt: skip

    def one_run_late(scale: float) -> History:
        runs = []
        for k in range(1, 9):
            slot_s = 10 * k * scale
            start = slot_s + (7.5 * scale if k == 4 else 0)
            slot = round((EPOCH_S + slot_s) * 1000)
            runs.append(Execution("a", "tick", slot, str(slot), 1, k, f"t{k}", False, start, start + scale, True))
        return History(epoch_s=EPOCH_S, executions=runs)

    virtual = judge(scenario, "script", one_run_late(1.0), [])
    live = judge_live(scaled(scenario), "script", one_run_late(SCALE), [])
    assert (virtual.lateness.status, virtual.lateness.count) == ("invalid", 1)
    assert (live.lateness.status, live.lateness.count) == ("invalid", 1)
    assert live.lateness.witness.endswith("started 1500 ms after its slot (allowed 1200 ms)")


def _manual_at(at_s: int) -> Scenario:
    return parse({
        "name": "manual-run", "duration_s": 30, "scheduler": {"lease_ms": 3000, "heartbeat_ms": 1000},
        "instances": [{"name": "a"}, {"name": "b"}],
        "jobs": [{"name": "tick", "cron": "*/10 * * * * *", "work_s": 2.0}],
        "faults": [{"at_s": at_s, "kind": "manual", "instance": "a", "job": "tick"}],
    })  # fmt: skip


def _won_fences(history: History) -> list[tuple[float, str, int]]:
    return [(e.t, e.run, int(e.value.split("fence=")[1])) for e in history.events
            if e.op == "claim" and e.kind == "ok" and e.value.startswith("won")]  # fmt: skip


def test_a_claim_only_manual_runs_fence_is_not_judged_against_the_slots() -> None:
    """Under the claim-only strategies a manual run's fence comes from the job's manual stream, documented as not
    ordered against the slots' (at a slot's very ms it equals the slot's): P6 judges the scheduled runs' only."""
    scenario = _manual_at(10)
    for strategy in ("stream-id", "script"):
        outcome = simulate(scenario, strategy, 1)
        fences = [fence for t, _, fence in _won_fences(outcome.history) if t == 10.0]
        assert any(e.manual for e in outcome.history.executions), "no manual run: the test tests nothing"
        assert fences == [fences[0]] * 2, (strategy, fences)  # the slot's win and the manual run's: one fence
        assert outcome.judgement.verdict("P6").status == "valid", (strategy, fences)
    assert simulate(scenario, "stream-id", 1).judgement.verdict("P3").status == "invalid"  # still judged apart


def test_a_lease_manual_run_takes_the_next_fence_and_is_judged_with_the_slots() -> None:
    """Under lease every attempt, manual or not, takes the job's next fence, and P6 judges them all: a manual
    run's fence no higher than the slot's before it is a violation."""
    scenario = _manual_at(15)  # between two slots' runs (at 10 s and 20 s, 2 s each): neither overlaps it
    outcome = simulate(scenario, "lease", 1)
    [(_, slot_run, first), (_, manual_run, fence), (_, next_run, third)] = _won_fences(outcome.history)[:3]
    assert [run.startswith("m") for run in (slot_run, manual_run, next_run)] == [False, True, False]
    assert first < fence < third
    assert outcome.judgement.verdict("P6").status == "valid"
    manual = next(e for e in outcome.history.events if e.run.startswith("m") and e.value.startswith("won"))
    stale = History(outcome.history.epoch_s, [
        replace(e, value=e.value.replace(f"fence={fence}", f"fence={first}")) if e is manual else e
        for e in outcome.history.events
    ], [_fenced(e, first) if e.token == manual.token else e for e in outcome.history.executions])  # fmt: skip
    verdict = judge(scenario, "lease", stale, []).verdict("P6")
    assert (verdict.status, verdict.count) == ("invalid", 1), verdict
    assert verdict.witness == f"tick: fence {first} accepted at 15.000 s after fence {first} at 10.000 s"
    # The run's own fence, told to its claim, is what its execution must run with.
    told_another = History(outcome.history.epoch_s, outcome.history.events, stale.executions)
    verdict = judge(scenario, "lease", told_another, []).verdict("P6")
    assert (verdict.status, verdict.witness) == (
        "invalid",
        f"tick a attempt 1 ran with fence {first}; its claim was told {fence}",
    )


def test_a_live_run_compresses_the_defaults_of_the_time_options_a_scenario_leaves_unset() -> None:
    """Else a live run would judge lateness against max_late_ms's 60 s where its scenario allows 12 live s, and
    keep script windows and idmp durations 5x longer than the scenario's."""
    scenario = parse({
        "name": "defaults", "duration_s": 100, "instances": [{"name": "a"}],
        "jobs": [{"name": "tick", "cron": "*/10 * * * * *", "work_s": 1.0, "jitter_ms": 500}],
        "strategies": {"script": {"window_ms": 65_000}},  # longer than the job's jitter_ms + max_late_ms
    })  # fmt: skip
    live = scaled(scenario)
    [job] = live.jobs
    assert (job.options["max_late_ms"], job.options["jitter_ms"], job.options["catch_up_ms"]) == (12_000, 100, 0)
    assert live.scheduler["lease_ms"] == 6_000
    assert live.strategy_option("idmp") == {"name": "idmp", "duration_sec": 60}
    assert live.strategies["script"]["window_ms"] == 13_000  # set: compressed as before
    assert scenario.jobs[0].options == {"jitter_ms": 500}  # the scenario itself is left as it was


def test_a_lease_catch_up_is_allowed_catch_up_ms_of_lateness_and_a_claim_only_run_is_not() -> None:
    # The slot at 40 s was caught up at 60 s: 20 s late, beyond max_late_ms (5 s) but within catch_up_ms (30 s).
    caught_up = [*_every_slot(skip=40), _execution("b", 40, 60, 61)]
    assert _judge(caught_up, max_late_ms=5000, catch_up_ms=30_000).lateness.status == "valid"
    assert _judge(caught_up, max_late_ms=5000, catch_up_ms=10_000).lateness.status == "invalid"
    # catch_up_ms is a lease option: under the claim-only strategies the run is late.
    assert _judge(caught_up, strategy="script", max_late_ms=5000, catch_up_ms=30_000).lateness.status == "invalid"


def test_a_slot_its_clock_had_passed_before_it_started_is_not_owed_by_an_instance() -> None:
    # a's clock is 15 s ahead: it shows 15 s as the run begins and never shows the slot at 10 s; b is down
    # throughout. Nobody owed the slot at 10 s; the one at 20 s (shown at 5 s) a owed, and ran.
    scenario = parse({
        "name": "unit", "duration_s": 100, "scheduler": {"lease_ms": 3000},
        "instances": [{"name": "a", "offset_ms": 15_000}, {"name": "b"}],
        "jobs": [{"name": "tick", "cron": "*/10 * * * * *", "work_s": 1.0}],
    })  # fmt: skip
    ahead = [_execution("a", s, s - 15, s - 14) for s in (20, 30, 40, 50, 60, 70, 80, 90, 100)]
    history = History(epoch_s=EPOCH_S, executions=ahead)
    judgement = judge(scenario, "lease", history, [FaultWindow(0, 100, "crash", "b")])
    assert judgement.verdicts["P2"].status == "valid"
    assert judgement.slots_checked == 9  # 20 .. 100 s: 90 s and 100 s shown at 75 s and 85 s, in time to settle


@pytest.mark.parametrize(("offset_ms", "slot_s"), [(8000, 90), (-8000, 0)])
def test_a_slot_only_an_instance_s_clock_shows_in_the_judged_time_is_owed(offset_ms: int, slot_s: int) -> None:
    """b is down throughout. 8 s ahead, a shows the slot at 90 s at 82 s true time, in time to settle by the end
    (85 s are judged); 8 s behind, it shows the slot at 0 s at 8 s, after its start (its clock showed -8 s). Either
    slot, by true time outside the judged time, is a's to run: missing, it is a missed slot."""
    scenario = parse({
        "name": "unit", "duration_s": 100, "scheduler": {"lease_ms": 3000},
        "instances": [{"name": "a", "offset_ms": offset_ms}, {"name": "b"}],
        "jobs": [{"name": "tick", "cron": "*/10 * * * * *", "work_s": 1.0}],
    })  # fmt: skip
    shift = -offset_ms / 1000
    runs = [_execution("a", s, s + shift, s + shift + 1) for s in range(0, 100, 10)]
    windows = [FaultWindow(0, 100, "crash", "b")]
    assert judge(scenario, "lease", History(epoch_s=EPOCH_S, executions=runs), windows).verdicts["P2"].status == "valid"
    missing = [run for run in runs if run.slot != int((EPOCH_S + slot_s) * 1000)]
    verdict = judge(scenario, "lease", History(epoch_s=EPOCH_S, executions=missing), windows).verdicts["P2"]
    assert (verdict.status, verdict.witness) == ("invalid", f"tick slot at {slot_s} s: never started")


def test_a_run_whose_last_attempt_is_still_going_is_not_said_to_have_used_its_attempts_up() -> None:
    """Attempts 1 and 2 of the slot at 80 s stopped short; attempt 3, the last max_attempts allows, is still going
    at the end: undecided, and the store has recorded nothing yet. Had it stopped short too, the store would have
    recorded the run interrupted."""
    tried = [_execution("a", 80, 80, 81, completed=False), _execution("b", 80, 85, 86, completed=False, attempt=2)]
    going = replace(_execution("a", 80, 90, None, completed=False, attempt=3), cut_by_end=True)
    verdict = _judge([*_every_slot(skip=80), *tried, going]).verdicts["P2"]
    assert verdict.status == "unknown"
    assert verdict.witness.endswith("attempt 3 [90.000 .. still running] still going at the end")
    stopped = _execution("a", 80, 90, 91, completed=False, attempt=3)
    verdict = _judge([*_every_slot(skip=80), *tried, stopped]).verdicts["P2"]
    assert verdict.status == "invalid"
    assert verdict.witness.endswith("(its max_attempts, 3, were used up: the store recorded it interrupted)")


def test_a_slot_a_clock_set_back_shows_again_after_a_restart_is_owed() -> None:
    """b is down from the start; a is down from 30 s to 45 s, and its clock is set 10 s back at 44 s. It showed
    the slot at 40 s while down, and shows it again at 50 s, started: a owes it then."""
    scenario = parse({
        "name": "unit", "duration_s": 100, "scheduler": {"lease_ms": 3000},
        "instances": [{"name": "a"}, {"name": "b"}],
        "jobs": [{"name": "tick", "cron": "*/10 * * * * *", "work_s": 1.0}],
        "faults": [{"at_s": 44, "kind": "skew", "instance": "a", "offset_ms": -10_000}],
    })  # fmt: skip
    windows = [FaultWindow(0, 100, "crash", "b"), FaultWindow(30, 45, "crash", "a"), *_struck(scenario, "a")]
    runs = [_execution("a", s, s, s + 1) for s in (10, 20)] + [_execution("a", s, s + 10, s + 11) for s in (50, 60, 70)]
    verdict = judge(scenario, "lease", History(epoch_s=EPOCH_S, executions=runs), windows).verdicts["P2"]
    assert (verdict.status, verdict.witness) == ("invalid", "tick slot at 40 s: never started")
    ran = [*runs, _execution("a", 40, 50, 51)]
    assert judge(scenario, "lease", History(epoch_s=EPOCH_S, executions=ran), windows).verdicts["P2"].status == "valid"


def test_a_claim_won_just_after_a_restart_at_the_same_instant_won_a_lost_claim_again() -> None:
    # a's claim at 39 s was lost by the restart at 40 s; b won the run again on the empty store at that very instant,
    # after the restart's entry in the history.
    restart = Event(40.0, "fault", "nemesis", "store-restart", value="store restarted empty")
    verdict = _p5([_won("a", 39.0), restart, _won("b", 40.0)], [FaultWindow(40.0, 40.0, "store-restart")])
    assert verdict.status == "invalid"
    assert verdict.witness.startswith("tick slot at 40 s: won by a at 39.000 s, won again by b at 40.000 s")


def test_a_claim_acknowledged_again_with_its_own_token_after_a_failover_is_not_a_lost_claim() -> None:
    # a's claim was acknowledged at 21.95 s and lost by the failover; a's retry with the same token won at 23 s.
    # One claim, one claimant: nobody else won the run.
    failover = [FaultWindow(21.9, 22.0, "failover")]
    again = replace(_won("a", 23.0), value="won attempt=1 lease_ms=3000 fence=2")
    assert _p5([_won("a", 21.95), again], failover, "script").status == "valid"
    # Won by b instead, it is.
    assert _p5([_won("a", 21.95), _won("b", 23.0)], failover, "script").status == "invalid"


def test_a_retried_claim_is_judged_from_its_first_send_and_under_lease_from_the_try_answered() -> None:
    """a's claim, sent at 40 s, went unanswered; a sent it again (the same token) at 42 s and won fence 4. b's claim,
    sent at 41 s, won fence 5 at 41.1 s. Under the claim-only strategies a retry is told its first fence, and the
    store may have accepted a's first try, at 40 s, before b's: no fault. Under lease the retry took the next
    fence at 42 s, after b's 5: fence 4 is out of order."""
    a, b = _fenced(_execution("a", 40, 42, 43), 4), _fenced(_execution("b", 50, 41, 42), 5)
    events = [
        Event(40.0, "invoke", "a", "claim", "tick", a.run, a.token),
        Event(41.0, "invoke", "b", "claim", "tick", b.run, b.token),
        _ack(b, 41.1),
        Event(41.5, "info", "a", "claim", "tick", a.run, a.token, "timed out"),
        Event(42.0, "invoke", "a", "claim", "tick", a.run, a.token),
        _ack(a, 42.1),
    ]
    assert _judge([a, b], events, strategy="script").verdicts["P6"].status == "valid"
    renewed = _judge([a, b], events).verdicts["P6"]
    assert (renewed.status, renewed.witness) == ("invalid", "tick: fence 4 accepted at 42.100 s (sent at 42.000 s) "
                                                            "after fence 5 at 41.100 s")  # fmt: skip
    # Had the first try failed (the store never ran it), only the second could have won: after fence 5.
    failed = [*events[:3], Event(41.5, "fail", "a", "claim", "tick", a.run, a.token, "link cut: not sent"), *events[4:]]
    stale = _judge([a, b], failed, strategy="script").verdicts["P6"]
    assert (stale.status, stale.witness) == ("invalid", "tick: fence 4 accepted at 42.100 s (sent at 42.000 s) after "
                                                        "fence 5 at 41.100 s")  # fmt: skip


def test_a_claim_sent_early_and_answered_late_is_judged_against_the_claims_accepted_before_its_send() -> None:
    """x's claim, sent at 40 s, took fence 4 and was answered at 47 s; y's (sent 45 s) took 5, z's (sent 46 s) 7.
    Only y is surely accepted before z; nothing surely before x, whose answer came last: no fault."""
    x, y, z = _execution("a", 40, 47, 48), _execution("b", 50, 45.5, 46), _execution("c", 60, 46.5, 47)
    x, y = _fenced(x, 4), _fenced(y, 5)

    def events(z_fence: int) -> list[Event]:
        return [
            Event(40.0, "invoke", "a", "claim", "tick", x.run, x.token),
            Event(45.0, "invoke", "b", "claim", "tick", y.run, y.token),
            _ack(y, 45.5),
            Event(46.0, "invoke", "c", "claim", "tick", z.run, z.token),
            _ack(_fenced(z, z_fence), 46.5),
            _ack(x, 47.0),
        ]

    assert _judge([x, y, _fenced(z, 7)], events(7)).verdicts["P6"].status == "valid"
    # z with fence 3 is stale: y's fence 5 was surely accepted before z's claim was sent.
    assert _judge([x, y, _fenced(z, 3)], events(3)).verdicts["P6"].status == "invalid"


def test_under_lease_a_catch_up_owes_the_slots_due_while_every_instance_was_down() -> None:
    """a and b are down from 35 s; a is back at 62 s, b at 100 s. With catch_up_ms 30 s, a's catch-up owes the
    slots at 40, 50 and 60 s, due while nobody was up: missing one is a missed slot, named with who owed it."""
    windows = [FaultWindow(35, 62, "crash", "a"), FaultWindow(35, 100, "crash", "b")]
    before = [_execution("a", s, s, s + 1) for s in (10, 20, 30)]
    caught_up = [_execution("a", s, 62 + i, 63 + i) for i, s in enumerate((40, 50, 60))]
    after = [_execution("a", s, s, s + 1) for s in (70, 80)]

    def p2(executions: list[Execution], strategy: str = "lease", **job_options: Any) -> Verdict:
        history = History(epoch_s=EPOCH_S, executions=executions)
        return judge(_scenario(**job_options), strategy, history, windows).verdicts["P2"]

    assert p2([*before, *caught_up, *after], catch_up_ms=30_000).status == "valid"
    skipped = p2([*before, *caught_up[::2], *after], catch_up_ms=30_000)
    assert (skipped.status, skipped.count) == ("invalid", 1)
    assert skipped.witness == "tick slot at 50 s: never started (owed by a's catch-up at 62 s)"
    # No catch-up asked for, or a strategy without one: nobody owed those slots.
    assert p2([*before, *after]).status == "valid"
    assert p2([*before, *after], "script", catch_up_ms=30_000).status == "valid"


@pytest.mark.parametrize(
    ("crashed_again_at", "catch_up_ms", "owed"),
    [(None, 30_000, ["40", "50", "60"]), (75.0, 30_000, []), (None, 25_000, ["50", "60"])],
)
def test_a_catch_up_owes_only_what_it_had_time_to_run(
    crashed_again_at: float | None, catch_up_ms: int, owed: list[str]
) -> None:
    """A catch-up owes its slots where its instance stays up while it runs them (three slots of 1 s here) and
    one's settling time after (15 s), and the slots still within catch_up_ms once the ones before them are done:
    with 25 s, the slot at 40 s may have aged out (it would be 25 s old at 65 s)."""
    windows = [FaultWindow(35, 62, "crash", "a"), FaultWindow(35, 100, "crash", "b")]
    if crashed_again_at is not None:
        windows.append(FaultWindow(crashed_again_at, 100, "crash", "a"))
    ran = [_execution("a", s, s, s + 1) for s in (10, 20, 30, 70, 80)]  # none of 40, 50 and 60 s
    judgement = judge(_scenario(catch_up_ms=catch_up_ms), "lease", History(epoch_s=EPOCH_S, executions=ran), windows)
    p2 = judgement.verdicts["P2"]
    assert p2.count == len(owed)
    # The slot at 10 s, those at 70 and 80 s unless a was down again in their settling time, and those owed
    assert judgement.slots_checked == (1 if crashed_again_at else 3) + len(owed)
    if owed:
        assert p2.witness.startswith(f"tick slot at {owed[0]} s: never started (owed by a's catch-up at 62 s)")
