"""The exhaustive explorer finds each strategy's known weakness, as a shortest trace, and proves lease's
guarantees in a small scope."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import pytest

from anarchon._strategies import Claim, Outcome
from models import lease
from models.explore import MODELS, POLICY, PROPERTIES, Explorer, LeaseModel, Result, Step, main


def explore(
    strategy: str, faults: Sequence[str], *, instances: int = 2, slots: int = 2, depth: int = 10, check: str = ""
) -> Result:
    checks = check.split(",") if check else list(PROPERTIES)
    return Explorer(MODELS[strategy], instances, slots, faults, checks).run(depth)


def violated(result: Result) -> set[str]:
    return {problem[:2] for problem in result.problems}


def wins_of_slot_0(result: Result) -> int:
    return sum("claims slot 0: won" in line for line in result.trace)


def test_script_runs_a_slot_twice_when_a_claim_comes_after_the_window() -> None:
    result = explore("script", ["late"])
    assert "P1" in violated(result)
    assert wins_of_slot_0(result) == 2
    assert sum("time passes" in line for line in result.trace) >= 3  # the window is 1 quantum: 2 quanta later


def test_idmp_runs_a_slot_twice_when_a_claim_comes_after_the_duration() -> None:
    result = explore("idmp", ["late"])
    assert "P1" in violated(result)
    assert wins_of_slot_0(result) == 2
    assert len(result.trace) - 1 == 4  # the shortest: tick, claim, tick (the duration), claim


@pytest.mark.parametrize("fault", ["skew", "late"])
def test_stream_id_misses_an_earlier_slot_claimed_after_a_later_one(fault: str) -> None:
    result = explore("stream-id", [fault])
    assert violated(result) == {"P2"}
    claims = [line for line in result.trace if "claims" in line]
    assert "claims slot 1: won" in claims[0]
    assert "claims slot 0: lost" in claims[-1]


@pytest.mark.parametrize("strategy", sorted(MODELS))
def test_every_strategy_runs_a_slot_twice_when_a_failover_loses_the_claim(strategy: str) -> None:
    result = explore(strategy, ["failover"])
    assert {"P1", "P5"} <= violated(result)
    assert wins_of_slot_0(result) == 2
    assert any("failover" in line for line in result.trace)
    assert not any("replica catches up" in line for line in result.trace)


def test_lease_runs_a_slot_twice_when_the_winner_is_paused_not_crashed() -> None:
    result = explore("lease", ["pause"])
    assert {"P1", "P4"} <= violated(result)
    assert any("i0 pauses" in line for line in result.trace)
    assert "won attempt 2" in result.trace[-1]
    assert not any("resumes" in line for line in result.trace)  # the paused winner still believes in its lease


def test_lease_survives_crashes_and_skew() -> None:
    """Every property, in the scope of the performance target."""
    result = explore("lease", ["crash", "skew"], instances=3, slots=3, depth=12)
    assert result.problems == []
    assert result.states > 10_000


class HastyTakeoverLeaseModel(LeaseModel):
    """The lease store as it was when a takeover checked no other run of the job."""

    def claim(self, store: lease.LeaseStore, slot: int, token: str, now: int) -> tuple[lease.LeaseStore, Claim]:
        run = store.run(str(slot))
        expired = run is not None and run.running and run.token != token and run.lease_end <= now
        if run is not None and expired and run.attempt < self.policy.max_attempts:
            return lease._start(store, str(slot), token, now, self.policy, run.attempt + 1)
        return super().claim(store, slot, token, now)


def test_a_lease_takeover_waits_for_another_live_run() -> None:
    """A backup taking an expired run over while a later slot holds a live lease would run the two at once (the
    explorer found this when the takeover checked no other run): now it waits, and no overlap is reachable."""
    result = explore("lease", ["crash"], slots=3, check="P3")
    assert result.problems == []
    assert result.states > 1_000
    hasty = Explorer(HastyTakeoverLeaseModel(), 2, 3, ["crash"], ["P3"]).run(10)
    assert violated(hasty) == {"P3"}
    assert any("won attempt 2" in line for line in hasty.trace)


class ForgetfulLeaseModel(LeaseModel):
    """The lease store as it was before it kept the latest slot trim dropped."""

    def finish(self, store: lease.LeaseStore, slot: int, token: str, now: int) -> lease.LeaseStore:
        return replace(super().finish(store, slot, token, now), forgotten=0)

    def skip(self, store: lease.LeaseStore, slot: int, token: str, now: int) -> lease.LeaseStore:
        return replace(super().skip(store, slot, token, now), forgotten=0)


def test_lease_never_runs_a_slot_again_that_trim_forgot() -> None:
    """A history trimmed to one run, each kept for 1 quantum after it ends, and claims that may come at any time
    after their slot (as a backup cut off for longer than keep_ms asks): a claim for a dropped run is done, and
    no slot runs twice. Without the forgotten slot, the same exploration finds the slot run again."""
    trimmed = replace(POLICY, history_size=1, keep_ms=1)
    checks = ["P1", "P3", "P4", "P6"]
    result = Explorer(LeaseModel(trimmed), 2, 3, ["late"], checks).run(10)
    assert result.problems == []
    assert result.states > 50_000
    forgetful = Explorer(ForgetfulLeaseModel(trimmed), 2, 3, ["late"], checks).run(10)
    assert violated(forgetful) == {"P1"}
    assert sum("claims slot 0: won attempt 1" in line for line in forgetful.trace) == 2  # the late claim won it


def test_the_command_line_reports_states_and_the_verdict(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--strategy", "idmp", "--faults", "late", "--expect-violation"]) == 0
    out = capsys.readouterr().out
    assert "explored " in out
    assert " states/s)" in out
    assert "violation after 4 steps:" in out
    assert "   4. t=2 i1 claims slot 0: won attempt 1 fence 2000" in out
    assert main(["--strategy", "idmp", "--faults", "late"]) == 1
    assert main(["--strategy", "stream-id", "--faults", "", "--depth", "6"]) == 0
    assert "no violation" in capsys.readouterr().out
    assert main(["--strategy", "stream-id", "--faults", "", "--depth", "6", "--expect-violation"]) == 1


def test_a_manual_fault_is_refused_for_the_claim_only_strategies(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--strategy", "stream-id", "--faults", "manual"])
    assert "the manual fault explores lease only" in capsys.readouterr().err


def test_a_stop_records_a_run_on_its_last_attempt_interrupted_rather_than_handing_it_back() -> None:
    """As Scheduler.stop does: with no attempt left a hand-back would only leave the run to be closed later."""
    explorer = Explorer(LeaseModel(replace(POLICY, max_attempts=1)), 2, 1, ["stop"], list(PROPERTIES))
    world = explorer.initial()[0]
    for step in [("tick", -1, -1), ("claim", 0, 0), ("stop", 0, -1)]:
        world, _ = explorer.apply(world, step)
    run = world.store.run("1")
    assert run is not None
    assert (run.status, run.attempt) == ("interrupted", 1)
    _, note = explorer.apply(world, ("claim", 1, 0))
    assert isinstance(note, Claim)
    assert note.outcome is Outcome.DONE


def test_an_unknown_fault_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--strategy", "lease", "--faults", "crash,meteor"])
    assert "unknown fault meteor" in capsys.readouterr().err


def test_a_stopped_lease_winner_hands_its_run_back_and_the_next_claim_takes_it_over_at_once() -> None:
    explorer = Explorer(MODELS["lease"], 2, 1, ["stop"], list(PROPERTIES))
    world = explorer.initial()[0]
    notes = []
    for step in [("tick", -1, -1), ("claim", 0, 0), ("stop", 0, -1), ("claim", 1, 0)]:
        assert step in explorer.moves(world)
        world, note = explorer.apply(world, step)
        notes.append(note)
    won, taken_over = notes[1], notes[3]
    assert isinstance(won, Claim)
    assert (won.outcome, won.attempt, won.lease_ms_left) == (Outcome.WON, 1, 2)  # its lease lasts until t=3
    assert isinstance(taken_over, Claim)
    assert (taken_over.outcome, taken_over.attempt, world.now) == (Outcome.WON, 2, 1)  # at t=1, not t=3
    # A stop that handed nothing back would leave the backup waiting for the lease, as after a crash.
    holding = Explorer(HoldingLeaseModel(), 2, 1, ["stop"], list(PROPERTIES))
    world = holding.initial()[0]
    for step in [("tick", -1, -1), ("claim", 0, 0), ("stop", 0, -1)]:
        world, _ = holding.apply(world, step)
    _, note = holding.apply(world, ("claim", 1, 0))
    assert isinstance(note, Claim)
    assert (note.outcome, note.lease_ms_left) == (Outcome.RUNNING, 2)


class HoldingLeaseModel(LeaseModel):
    def stop_run(
        self, store: lease.LeaseStore, slot: int, token: str, now: int, attempt: int, manual: bool
    ) -> lease.LeaseStore:
        return store


@pytest.mark.parametrize("strategy", ["stream-id", "idmp", "script"])
def test_the_claim_only_strategies_lose_the_run_of_a_stopped_winner(strategy: str) -> None:
    result = explore(strategy, ["stop"])
    assert violated(result) == {"P2"}
    assert result.trace[-2:] == ["t=1 i0 stops", "t=1 i1 claims slot 0: lost"]


def test_lease_survives_stops_crashes_and_skew() -> None:
    result = explore("lease", ["crash", "stop", "skew"], instances=3, slots=2, depth=10)
    assert result.problems == []
    assert result.states > 10_000


def test_lease_never_runs_a_manual_run_beside_a_slot() -> None:
    """run_now, once, by any instance at any time, among crashes, stops and skewed clocks: the manual run and
    the slots never execute at once (a manual run during a slot is skipped, a slot during a manual run too)."""
    result = explore("lease", ["manual", "crash", "stop", "skew"])
    assert result.problems == []
    assert result.states > 40_000
    # With overlap allowed the same exploration finds them at once: the manual run is explored.
    overlapping = Explorer(LeaseModel(replace(POLICY, overlap=True)), 2, 2, ["manual"], ["P3"]).run(10)
    assert violated(overlapping) == {"P3"}
    assert any("calls run_now: won attempt 1" in line for line in overlapping.trace)
    assert "the manual run" in overlapping.problems[0]


def _follow(explorer: Explorer[Any], steps: Sequence[Step]) -> list[str]:
    """The problems found along ``steps`` from the world where every clock is the store's; each step must be
    one the explorer itself would take there."""
    [world] = [w for w in explorer.initial() if all(inst.skew == 0 for inst in w.instances)]
    problems = []
    for step in steps:
        assert step in explorer.moves(world), step
        after, note = explorer.apply(world, step)
        problems += explorer.transition_problems(world, step, note) + explorer.state_problems(after)
        world = after
    return problems


TICK, REPLICATE, FAILOVER = ("tick", -1, -1), ("replicate", -1, -1), ("failover", -1, -1)


@pytest.mark.parametrize("strategy", ["script", "idmp"])
def test_a_claim_only_skip_leaves_alone_a_run_the_stores_clock_does_not_see_late(strategy: str) -> None:
    """An instance whose clock runs ahead, resumed at a slot's due time, skips it as late; the store's clock is
    at the slot, so ClaimOnlyStrategy.skip claims nothing and the others still run it."""
    result = explore(strategy, ["pause", "skew"], check="P2")
    assert result.problems == []
    assert result.states > 2000


def test_a_failover_loses_only_the_wins_the_replica_had_not_caught_up_with() -> None:
    """Slot 0 won and replicated, slot 1 won, then the failover: a late claim that wins slot 0 again (its window
    over) runs it twice (P1) but lost no acknowledged claim (P5)."""
    explorer = Explorer(MODELS["script"], 2, 2, ["failover", "late"], list(PROPERTIES))
    steps = [TICK, ("claim", 0, 0), REPLICATE, TICK, ("claim", 0, 1), FAILOVER, TICK, ("claim", 1, 0)]
    assert _follow(explorer, steps) == ["P1: slot 0 is executed by i0 (attempt 1) and i1 (attempt 1) at once"]


def test_a_lease_takeover_the_failover_lost_is_granted_again_with_the_same_attempt() -> None:
    """i0 wins and is replicated, crashes; i1 takes over as attempt 2, which the failover loses; i2 then wins
    attempt 2 as well. Both hold the run at once with one attempt number: P4 and P5 name it (P4 is of holders,
    not of attempt numbers, and P5 of every lost acknowledged attempt, not only first ones)."""
    explorer = Explorer(MODELS["lease"], 3, 1, ["crash", "failover"], list(PROPERTIES))
    steps = [TICK, ("claim", 0, 0), ("claim", 1, 0), ("claim", 2, 0), REPLICATE, ("crash", 0, -1), TICK, TICK,
             ("claim", 1, 0), FAILOVER, ("claim", 2, 0)]  # fmt: skip
    problems = _follow(explorer, steps)
    assert "P5: slot 0 won by i2 after the failover lost i1's acknowledged win" in problems
    assert "P4: slot 0 is held by i1 (attempt 2) and i2 (attempt 2) at once" in problems


class ClosingSkipLeaseModel(LeaseModel):
    """The lease store as it was when a late retry of a won claim closed the run as skipped-late."""

    def skip(self, store: lease.LeaseStore, slot: int, token: str, now: int) -> lease.LeaseStore:
        r = store.run(str(slot))
        if r is not None and r.running and r.token == token:
            return lease.trim(store.put(str(slot), r.close("skipped-late", slot, now)), now, self.policy)
        return super().skip(store, slot, token, now)


class OldFenceLeaseModel(LeaseModel):
    """The lease store as it was when a retried claim that renewed its lapsed lease kept its first fence."""

    def claim(self, store: lease.LeaseStore, slot: int, token: str, now: int) -> tuple[lease.LeaseStore, Claim]:
        held = store.run(str(slot))
        store, claim = super().claim(store, slot, token, now)
        if held is not None and held.running and held.token == token and claim.outcome is Outcome.WON:
            claim = claim._replace(fence=held.fence)
        return store, claim


def test_lease_keeps_every_property_when_the_answers_to_claims_are_lost() -> None:
    """A claim reaches the store and its answer is lost; the instance sends it again (same token) whenever, as a
    skip once too late. Before, such a skip closed the winner's run as skipped-late, which the instances told it
    was running then found done: a slot lost with a backup standing by. It hands the run back now."""
    result = explore("lease", ["unanswered", "crash", "skew"])
    assert result.problems == []
    assert result.states > 15_000
    closing = Explorer(ClosingSkipLeaseModel(), 2, 2, ["unanswered"], list(PROPERTIES)).run(10)
    assert violated(closing) == {"P2"}
    assert "an answer that is lost" in closing.trace[2]
    assert any("skips (too late) slot 0 again" in line for line in closing.trace)
    assert "claims slot 0: done" in closing.trace[-1]  # the backup, at the lease's end


class SkipPastDeferralLeaseModel(LeaseModel):
    """lease as it would be if a late skip closed a slot whose early claim was told to come again at the slot."""

    def skip(self, store: lease.LeaseStore, slot: int, token: str, now: int) -> lease.LeaseStore:
        return replace(super().skip(replace(store, deferred=()), slot, token, now), deferred=store.deferred)


def test_lease_an_early_claim_put_off_to_its_slot_is_not_closed_by_a_late_skip() -> None:
    """An instance whose clock runs ahead claims slot 1 while slot 0's run holds its lease: it is told to claim
    again at the slot, rather than the slot being recorded skipped-overlap before it is due. Meanwhile nothing
    of slot 1 is stored, so a late skip (here a lost claim's retry) would close it, and the instance told to
    come again would find it done: the store keeps the slots put off, and a skip leaves them alone."""
    result = explore("lease", ["unanswered", "crash", "skew"], instances=3, depth=9)
    assert result.problems == []
    closing = Explorer(SkipPastDeferralLeaseModel(), 3, 2, ["unanswered", "crash", "skew"], list(PROPERTIES)).run(9)
    assert violated(closing) == {"P2"}
    assert any("claims slot 1: early, another run is live: claim again at t=2" in line for line in closing.trace)
    assert "skips (too late) slot 1 again" in closing.trace[-2]
    assert "claims slot 1: done" in closing.trace[-1]


def test_lease_fences_keep_growing_when_a_lost_claim_is_renewed_late() -> None:
    """The winner's answer is lost and its lease runs out; the next slot takes fence 2; the retry renews slot 0's
    lease. With the fence it first took (1), the fences acknowledged would go down."""
    assert explore("lease", ["unanswered", "late"], depth=8).problems == []
    old = Explorer(OldFenceLeaseModel(), 2, 2, ["unanswered", "late"], list(PROPERTIES)).run(8)
    assert violated(old) == {"P6"}
    assert "claims slot 0 again: won attempt 1 fence 1" in old.trace[-1]


@pytest.mark.parametrize("strategy", ["stream-id", "idmp", "script"])
def test_the_claim_only_strategies_lose_a_slot_whose_winner_heard_no_answer_in_time(strategy: str) -> None:
    """Their weakness under crashes, from a lost answer: the winner's retry comes too late and is a skip, and
    nobody else will run the slot."""
    result = explore(strategy, ["unanswered"])
    assert violated(result) == {"P2"}
    assert "claims slot 0: won attempt 1" in result.trace[2]
    assert result.trace[2].endswith("an answer that is lost")
    assert result.trace[-1].endswith("skips (too late) slot 0 again")


class DoneRetryLeaseModel(LeaseModel):
    """A defect planted for the test: a retried claim of the caller's own live lease is answered done."""

    def claim(self, store: lease.LeaseStore, slot: int, token: str, now: int) -> tuple[lease.LeaseStore, Claim]:
        r = store.run(str(slot))
        if r is not None and r.running and r.token == token and r.lease_end > 0:
            return store, Claim(Outcome.DONE, r.attempt, r.fence)
        return super().claim(store, slot, token, now)


def test_a_lost_answer_excuses_an_instance_from_p2_only_until_it_hears_again() -> None:
    """An instance whose claim went unanswered is not held to P2 for that slot while it waits; once a retry is
    answered it is again. Excused for good, it would hide a retry answered wrongly: here, answered done."""
    result = Explorer(DoneRetryLeaseModel(), 1, 1, ["unanswered"], list(PROPERTIES)).run(8)
    assert violated(result) == {"P2"}
    assert "claims slot 0 again: done" in result.trace[-1]


@pytest.mark.parametrize("argument", [["--depth", "0"], ["--instances", "0"], ["--slots", "-1"]])
def test_the_command_line_refuses_an_exploration_of_nothing(
    argument: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Explored, none of them finds anything: "no violation" would pass for a result."""
    with pytest.raises(SystemExit) as exited:
        main(["--strategy", "lease", *argument])
    assert exited.value.code == 2
    assert f"argument {argument[0]}: 1 or more, not {argument[1]}" in capsys.readouterr().err
