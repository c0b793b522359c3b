"""Checkers: each reads a run's history and ledger and returns valid / invalid / unknown with a witness.

P1 no duplicate: a run (a slot's, or a manual one) is executed at most once. The one exception is a lease retry: a
   later attempt, begun after the earlier one had stopped short of its end (a crash, a lost lease). Under the
   claim-only strategies, which retry nothing, and for two executions of one lease attempt, a second execution is
   a duplicate however the first ended.
P2 no missed slot: every slot due while at least one instance was healthy (up, not paused, not cut off, then
   and throughout a settling time after) has an execution that ran to the end. Slots due while a fault lasts count
   too (where some instance stayed healthy), not only those after the last fault healed: a slot whose winner
   crashed mid-run is where lease and the claim-only strategies differ.
   A slot whose only executions were still going when the run ended may yet have run to its end: unknown.
   Under lease, a job's catch_up_ms owes more: a slot due while no instance was healthy, within the job's last
   catch_up_ms before an instance started again (by its clock) and after the job's first slot, is run by that
   instance's catch-up where it then stayed healthy long enough to run every slot of the period and settle.
P3 no overlap: two runs of a job whose overlap is forbidden never execute at once in true time (a manual run is a
   run of its own, whatever its slot number; two executions of one run are P1's concern).
P4 lease safety (lease only): no two attempts of one run, a manual one's too (two lease holders: two tokens),
   execute at the same true time, whatever their attempt numbers (after a failover the store can grant attempt 1
   twice). Each attempt's margin is reported: its lease expiry as last acknowledged (the true time the last won
   claim or heartbeat was sent, as the scheduler counts it, plus the lease its reply granted) minus the end of its
   execution, its last side effect; below 0, it worked past its lease. An execution still going at the run's end
   has no margin.
P5 no lost acknowledged claim: a run whose won claim the store lost (a restart loses every claim won before it,
   a failover those its replica had not received) is not won again by someone else after it (under lease: the
   same attempt, or an earlier one, granted again; a later attempt is a takeover of a lease the store still knew).
P6 fencing: the fences of a job's executions grow in the order their claims were acknowledged (under the claim-only
   strategies a manual run's fence comes from a stream of its own, documented as not ordered against the slots':
   those of scheduled runs only). Under lease a claim sent again after its answer was lost takes the next fence,
   accepted by the try answered; under the others it is told its first fence, accepted by the first try applied.
P7 true history: what ``Scheduler.history`` says at the end agrees with the ledger. A run recorded ok was executed
   to its end by the attempt the record names (its token), a record names that execution's instance, attempt and
   fence, and no attempt is recorded twice; a run recorded skipped (late, or for overlap) was executed by nobody,
   unless a store fault lost its claim. An execution whose end the store heard of (its finish acknowledged; a lease
   attempt handed back, once a later claim of its run took it over or closed it, a run_now at once) is recorded, ok
   if it ran to its end and interrupted if not, unless a store fault lost the record (or may have: the try that told
   the store was sent before the fault ended and answered after it began) or trimming dropped it (older than every
   record of a job that keeps history_size of them, or with history_ttl_ms). One that a kill, a cut or the run's
   end kept from the store is owed nothing. A job keeps at least history_size records, or every one it was owed if
   fewer (without history_ttl_ms, or a store fault that lost writes).
At one true time, what happened first is what comes first in the history (P5, P6).
Lateness: every scheduled run starts (its earliest execution, true time) within the job's allowance after its
   slot: jitter_ms + max_late_ms (or catch_up_ms under lease, if larger: a catch-up is not told apart from a late
   claim) plus a margin; min / p50 / p99 / max are reported. A start before the slot (an instance's clock ahead)
   is shown by the min, not judged: every strategy names its slots by the instances' clocks.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any
from zoneinfo import ZoneInfo

from anarchon._cron import CronSchedule
from anarchon._job import JobOptions
from anarchon._records import RunRecord
from anarchon._scheduler import DEFAULT_HISTORY_SIZE, DEFAULT_LEASE_MS
from anarchon._strategies import Outcome, run_id
from sim.history import ClaimAnswer, Event, Execution, History
from sim.scenario import InstanceSpec, JobSpec, Scenario
from sim.world import FaultWindow

STORE_FAULTS = ("failover", "store-restart")


@dataclass(frozen=True)
class Verdict:
    checker: str
    status: str  # valid | invalid | unknown
    witness: str = ""
    count: int = 0  # how many violations
    figures: dict[str, float] = field(default_factory=dict)  # what the checker measured, e.g. P4's lease margins
    slots: tuple[tuple[str, int], ...] = ()  # (job, slot ms) of each violation that is a slot: P2's missed ones


@dataclass
class Judgement:
    verdicts: dict[str, Verdict]  # P1..P7
    slots_checked: int
    lateness_ms: list[float] = field(default_factory=list)  # each scheduled run's earliest start - its slot
    lease_margins_ms: list[float] = field(default_factory=list)  # lease: each attempt's lease expiry - its end
    lateness: Verdict = field(default_factory=lambda: Verdict("lateness", "unknown", "not judged"))

    @property
    def checks(self) -> dict[str, Verdict]:
        """P1..P7 and lateness."""
        return {**self.verdicts, "lateness": self.lateness}

    def verdict(self, checker: str) -> Verdict:
        return self.checks[checker]

    def as_json(self) -> dict[str, Any]:
        return {
            "verdicts": {name: v.status for name, v in self.checks.items()},
            "witnesses": {name: v.witness for name, v in self.verdicts.items() if v.witness},
            "counts": {name: v.count for name, v in self.verdicts.items()},
            "figures": {name: v.figures for name, v in self.verdicts.items() if v.figures},
            "lateness": {
                "verdict": self.lateness.status,
                "witness": self.lateness.witness,
                "count": self.lateness.count,
                **self.lateness.figures,
            },
            "slots_checked": self.slots_checked,
        }


def percentile(values: Sequence[float], p: float) -> float:
    """The nearest-rank ``p``-th percentile (0 < p <= 100) of ``values`` (not empty)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def true_s(slot_ms: int, epoch_s: float) -> float:
    """A slot (epoch ms) as true time: seconds since the run began at wall time ``epoch_s``."""
    return slot_ms / 1000 - epoch_s


def judge(
    scenario: Scenario,
    strategy: str,
    history: History,
    fault_windows: list[FaultWindow],
    slack_s: float = 5.0,
    late_margin_s: float = 1.0,
) -> Judgement:
    """Run every checker. ``slack_s`` is added to the time a takeover may take before a slot counts as missed;
    ``late_margin_s`` to a job's lateness allowance (the claim's round trip and the dispatcher's wake-up)."""
    epoch = history.epoch_s
    # P1 and P4 judge every run, a manual one too (a run of its own, never retried by backups); P2 and lateness
    # the scheduled ones, whose run id is their slot.
    by_run: dict[tuple[str, int, str], list[Execution]] = defaultdict(list)
    for execution in history.executions:
        by_run[(execution.job, execution.slot, execution.run)].append(execution)
    by_slot = {(job, slot): executions for (job, slot, _), executions in by_run.items() if not executions[0].manual}
    lease_s = float(scenario.scheduler.get("lease_ms", DEFAULT_LEASE_MS)) / 1000
    longest = max(job.work_s for job in scenario.jobs)
    jitter_s = max(_jitter_ms(job) for job in scenario.jobs) / 1000  # a claim may come this long after its slot
    settle_s = lease_s * 3 + jitter_s + longest + slack_s  # long enough for backups to take a run over and finish it
    names = [instance.name for instance in scenario.instances]

    healthy: dict[float, bool] = {}  # by slot time: every job with a slot then asks the same
    # (instance, slot) of the lease claims made early that the store put off to the slot (any job's)
    put_off = {
        (event.process, int(event.run))
        for event in history.events
        if (answer := ClaimAnswer.of(event)) and answer[:2] == (Outcome.RUNNING.value, 0) and event.run.isdigit()
    }
    clocks = {instance.name: _Clock.of(instance, fault_windows) for instance in scenario.instances}

    judged_until = scenario.duration_s - settle_s  # later slots may not have run by the end: not judged

    def someone_healthy(t: float) -> bool:
        """Whether an instance was healthy from a moment its clock showed the slot at ``t`` throughout the settling
        time: an outage anywhere in it, not only at its ends, can leave the slot to nobody. By its own clock: a
        scheduler started again after that moment owes the slot nothing, however early in true time it was, but
        one whose clock is set back and shows it again owes it then; one whose clock shows it too late for the
        settling time to pass before the end may not have run it yet. Under lease, a clock ahead of the store's
        whose claim came while another run of the job was live was told to claim again at the slot by the store's
        clock: its settling time counts from then."""
        if t not in healthy:
            healthy[t] = any(
                not any(w.hits(name, at, begin + settle_s) for w in fault_windows)
                for name in names
                for at in clocks[name].showings(t)
                for begin in [max(at, t) if (name, round((t + epoch) * 1000)) in put_off else at]
                if at >= 0 and begin <= judged_until
            )
        return healthy[t]

    # The slots the instances' clocks show while slots are judged: a clock ahead shows later ones than the true
    # time, one behind earlier ones (before the run's start, by the true time).
    shown = [clock.shown_between(0.0, max(judged_until, 0.0)) for clock in clocks.values()]
    due = _expected_slots(scenario, epoch, min(low for low, _ in shown), max(high for _, high in shown))
    expected = [(job, slot) for job, slot in due if someone_healthy(true_s(slot, epoch))]
    # Slots due while no instance was healthy that a catch-up owes (lease, catch_up_ms), and who owed each.
    already = set(expected)
    caught_up = _caught_up(scenario, strategy, fault_windows, clocks, due, expected, epoch, settle_s)
    overlapped = _overlapped(history)  # and not one recorded skipped-overlap: decided, not caught up
    owed = {
        key: owner
        for key, owner in caught_up.items()
        if key not in already and (key[0], run_id(key[1])) not in overlapped
    }
    expected += [key for key in due if key in owed]
    nothing_to_judge = (
        "no slot was due while an instance was healthy"
        if due
        else f"no slot was due in the first {max(judged_until, 0):.0f} s of the scenario (each slot is given "
        f"{settle_s:.0f} s to run: three leases, the jitter, the work and {slack_s:.0f} s)"
    )

    margins = (
        lease_margins(history, int(scenario.scheduler.get("lease_ms", DEFAULT_LEASE_MS))) if strategy == "lease" else {}
    )
    attempts = _attempts(scenario, strategy)
    verdicts = {
        "P1": _no_duplicate(strategy, by_run, epoch, attempts),
        "P2": _no_missed(by_slot, expected, epoch, overlapped, attempts, owed, nothing_to_judge),
        "P3": _no_overlap(scenario, history.executions, epoch),
        "P4": _lease_safety(strategy, by_run, epoch, margins),
        "P5": _no_lost_ack(strategy, history, fault_windows),
        "P6": _fencing(history, lease=strategy == "lease"),
        "P7": _true_history(scenario, history, fault_windows),
    }
    # When each run started: its earliest execution (a duplicate is P1's to judge), whatever its attempt: a run
    # whose first attempt never started (its winner crashed first, or handed it back) started when a backup took
    # it over. For the slots due after the simulation began (one due before, or at its first instant, as the
    # instances start, could not have run on time: a scheduler owes the slots after its start).
    first = sorted(
        (
            min(executions, key=lambda e: e.started)
            for (_, slot), executions in by_slot.items()
            if true_s(slot, epoch) > 0
        ),
        key=lambda e: e.started,
    )
    lateness = [(e.started - true_s(e.slot, epoch)) * 1000 for e in first]
    return Judgement(
        verdicts,
        len(expected),
        lateness,
        [margin for margin, _ in margins.values()],
        _lateness(scenario, strategy, first, lateness, epoch, late_margin_s),
    )


@dataclass(frozen=True)
class _Clock:
    """An instance's clock through the run, from its offset and drift and the faults that moved it (skew, drift,
    late) as they struck: pieces (from true time, the clock then, its rate), in order. Times in seconds since the
    run's epoch."""

    pieces: tuple[tuple[float, float, float], ...]

    @classmethod
    def of(cls, instance: InstanceSpec, fault_windows: Sequence[FaultWindow]) -> _Clock:
        """One aimed at "winner" moved the clock of the instance it struck; one that struck nobody moved none."""
        changes: list[tuple[float, float, float | None]] = []  # (when, the jump in seconds, the new rate or None)
        for window in fault_windows:
            fault = window.fault
            if window.instance != instance.name or fault is None:
                continue
            if window.kind == "skew":
                changes.append((window.start, float(fault.settings["offset_ms"]) / 1000, None))
            elif window.kind == "late":  # behind for its duration, then back (sim/nemesis.py)
                delay_s = float(fault.settings["delay_ms"]) / 1000
                changes += [(window.start, -delay_s, None), (window.end, delay_s, None)]
            elif window.kind == "drift":
                changes.append((window.start, 0.0, 1 + float(fault.settings["drift"])))
        t, shown, rate = 0.0, instance.offset_ms / 1000, 1 + instance.drift
        pieces = []
        for at, jump, new_rate in sorted(changes, key=lambda change: change[0]):
            pieces.append((t, shown, rate))
            shown, t = shown + (at - t) * rate + jump, at
            rate = rate if new_rate is None else new_rate
        pieces.append((t, shown, rate))
        return cls(tuple(pieces))

    def _ends(self) -> list[float]:
        """Each piece's end in true time (the last never ends)."""
        return [start for start, _, _ in self.pieces[1:]] + [math.inf]

    def showings(self, wall: float) -> list[float]:
        """Every true time at which the clock shows the wall time ``wall``: once as it passes it, and again after
        each time it is set back below it. A clock that jumps over ``wall`` shows it at the jump; one that showed
        it, or more, as the instance started owes it nothing then (a scheduler's slots are those after its start)."""
        times, before = [], None  # the clock just before each piece began
        for (start, clock, speed), end in zip(self.pieces, self._ends(), strict=True):
            if clock >= wall:
                if before is not None and before < wall:  # jumped over it at this moment
                    times.append(start)
            elif (at := start + (wall - clock) / speed) <= end:
                times.append(at)
            before = clock + (end - start) * speed
        return times

    def shown_between(self, start_s: float, end_s: float) -> tuple[float, float]:
        """The lowest and the highest time the clock shows from ``start_s`` through ``end_s`` (true time)."""
        readings = []
        for (start, clock, speed), end in zip(self.pieces, self._ends(), strict=True):
            low, high = max(start, start_s), min(end, end_s)
            if low <= high:
                readings += [clock + (low - start) * speed, clock + (high - start) * speed]
        return min(readings), max(readings)


def _caught_up(
    scenario: Scenario,
    strategy: str,
    fault_windows: Sequence[FaultWindow],
    clocks: dict[str, _Clock],
    due: list[tuple[str, int]],
    expected: list[tuple[str, int]],
    epoch: float,
    settle_s: float,
) -> dict[tuple[str, int], str]:
    """The slots a catch-up owes (lease only), each with who owed it: those of a job's last catch_up_ms before an
    instance started again (a crash's or a stop's end), by its clock then. Only where the catch-up had time: the
    instance stayed healthy while it ran every slot of the period one after another and a slot's settling time
    after, and the slot was still inside the period when the slots before it were done (the scheduler does not
    claim one that aged out). A catch-up reaches back no further than the job's first start on the store: only the
    slots after the job's first slot some instance owed."""
    if strategy != "lease":
        return {}
    owed: dict[tuple[str, int], str] = {}
    for job in scenario.jobs:
        catch_up_s = int(job.options.get("catch_up_ms", JobOptions().catch_up_ms)) / 1000
        first = min((true_s(slot, epoch) for name, slot in expected if name == job.name), default=None)
        if not catch_up_s or first is None:
            continue
        for restart in sorted(fault_windows, key=lambda window: window.end):  # the first started owes it
            if restart.kind not in ("crash", "stop") or math.isinf(restart.end):
                continue
            shown, _ = clocks[restart.instance].shown_between(restart.end, restart.end)
            period = [(job.name, slot) for name, slot in due
                      if name == job.name and first <= true_s(slot, epoch) < shown
                      and true_s(slot, epoch) > shown - catch_up_s]  # fmt: skip
            busy_s = len(period) * job.work_s
            done_by = restart.end + busy_s + settle_s
            if done_by > scenario.duration_s or any(
                other.hits(restart.instance, restart.end, done_by) for other in fault_windows if other is not restart
            ):
                continue
            for key in period:
                if true_s(key[1], epoch) > shown - catch_up_s + busy_s:
                    owed.setdefault(key, f"{restart.instance}'s catch-up at {restart.end:.0f} s")
    return owed


def _expected_slots(scenario: Scenario, epoch: float, start_s: float, end_s: float) -> list[tuple[str, int]]:
    slots: list[tuple[str, int]] = []
    for job in scenario.jobs:
        schedule = CronSchedule(job.cron, ZoneInfo(str(job.options.get("timezone", "UTC"))))
        low, high = int((epoch + start_s) * 1000), int((epoch + end_s) * 1000)
        slots.extend((job.name, slot) for slot in schedule.slots_between(low, high))
    return slots


def _run(e: Execution, epoch: float) -> str:
    return _run_at(e.slot, e.manual, epoch)


def _run_at(slot: int, manual: bool, epoch: float) -> str:
    """A run as witnesses name it: its slot (a run_now's moment) in true seconds, as the scenarios give times."""
    return f"{'manual run' if manual else 'slot'} at {true_s(slot, epoch):.0f} s"


def _run_named(run: str, epoch: float) -> str:
    """A run id of the store (the slot's epoch ms, or "m<ms>-<tag>" for a run_now) named as witnesses name runs."""
    return _run_at(int(run.removeprefix("m").split("-")[0]), run.startswith("m"), epoch)


def _describe(e: Execution) -> str:
    end = "still running" if e.ended is None else f"{e.ended:.3f}"
    state = "ran to the end" if e.completed else "still going at the end" if e.cut_by_end else "stopped early"
    return f"{e.instance} attempt {e.attempt} [{e.started:.3f} .. {end}] {state}"


def _no_duplicate(
    strategy: str, by_run: dict[tuple[str, int, str], list[Execution]], epoch: float, attempts: dict[str, int]
) -> Verdict:
    bad = []

    def retry(a: Execution, b: Execution) -> bool:
        """Whether ``b`` is a lease retry of ``a``: a later attempt, within the job's max_attempts, begun after
        ``a`` had stopped short. Under the claim-only strategies no run is retried, nor a manual run under lease
        (its claim allows one attempt), and under lease a second execution of the same attempt is a claim won
        twice: all are duplicates however ``a`` ended."""
        return (
            strategy == "lease"
            and not a.manual
            and a.attempt < b.attempt <= attempts[a.job]
            and not a.completed
            and not a.overlaps(b)
        )

    for (job, _, _), executions in sorted(by_run.items()):
        in_order = sorted(executions, key=lambda e: e.started)
        pair = next(((a, b) for a, b in itertools.combinations(in_order, 2) if not retry(a, b)), None)
        if pair is not None:
            bad.append(f"{job} {_run(pair[0], epoch)}: {_describe(pair[0])}; {_describe(pair[1])}")
    return Verdict("P1", "invalid" if bad else "valid", bad[0] if bad else "", len(bad))


def _overlapped(history: History) -> set[tuple[str, str]]:
    """The runs (job, run id) some claim of was answered ``overlap``: lease skipped them, by design, while an
    earlier run of the job held its lease."""
    return {(e.job, e.run) for e in history.events
            if (answer := ClaimAnswer.of(e)) and answer.outcome == Outcome.OVERLAP.value}  # fmt: skip


def _attempts(scenario: Scenario, strategy: str) -> dict[str, int]:
    """Each job's max_attempts under lease (the claim-only strategies make one attempt, and have no backups)."""
    if strategy != "lease":
        return {}
    return {job.name: int(job.options.get("max_attempts", JobOptions().max_attempts)) for job in scenario.jobs}


def _no_missed(
    by_slot: dict[tuple[str, int], list[Execution]],
    expected: list[tuple[str, int]],
    epoch: float,
    overlapped: set[tuple[str, str]],
    attempts: dict[str, int],
    owed: dict[tuple[str, int], str],
    nothing_to_judge: str,
) -> Verdict:
    if not expected:
        return Verdict("P2", "unknown", nothing_to_judge)

    def witness(job: str, slot: int) -> str:
        tried = by_slot.get((job, slot), [])
        how = "; ".join(_describe(e) for e in tried) if tried else "never started"
        # Its last attempt allowed has ended (not still going at the end): the store recorded it interrupted.
        used_up = (
            tried
            and not any(e.cut_by_end for e in tried)
            and max(e.attempt for e in tried) >= attempts.get(job, math.inf)
        )
        if (job, run_id(slot)) in overlapped:
            how += " (skipped-overlap: an earlier run of the job held its lease)"
        elif used_up:
            how += f" (its max_attempts, {attempts[job]}, were used up: the store recorded it interrupted)"
        if (job, slot) in owed:
            how += f" (owed by {owed[job, slot]})"
        return f"{job} slot at {true_s(slot, epoch):.0f} s: {how}"

    unfinished = [(job, slot) for job, slot in expected if not any(e.completed for e in by_slot.get((job, slot), []))]
    # Still going when the run ended: it may yet run to its end.
    undecided = [key for key in unfinished if any(e.cut_by_end for e in by_slot.get(key, []))]
    missed = [key for key in unfinished if key not in undecided]
    if missed:
        skipped = sum(1 for job, slot in missed if (job, run_id(slot)) in overlapped)
        return Verdict("P2", "invalid", witness(*missed[0]), len(missed), {"skipped_overlap": skipped}, tuple(missed))
    if undecided:
        return Verdict("P2", "unknown", f"still going at the end: {witness(*undecided[0])}")
    return Verdict("P2", "valid")


def _no_overlap(scenario: Scenario, executions: list[Execution], epoch: float) -> Verdict:
    forbidden = {job.name for job in scenario.jobs if not job.options.get("overlap", False)}
    bad = []
    by_job: dict[str, list[Execution]] = defaultdict(list)
    for e in executions:
        if e.job in forbidden:
            by_job[e.job].append(e)
    for job, runs in sorted(by_job.items()):
        # A sweep in start order: each execution meets every earlier one still going when it starts, not only
        # the one just before it (a long run would hide behind shorter ones that started after it).
        going: list[Execution] = []
        for b in sorted(runs, key=lambda e: e.started):
            going = [a for a in going if a.ended is None or a.ended > b.started]
            for a in going:
                # Two runs, not two executions of one run (P1's concern): a manual run is a run of its own even
                # when its slot number is a scheduled slot's.
                if a.run != b.run and a.overlaps(b):
                    bad.append(f"{job}: {_run(a, epoch)} ({_describe(a)}) and {_run(b, epoch)} ({_describe(b)})")
            going.append(b)
    return Verdict("P3", "invalid" if bad else "valid", bad[0] if bad else "", len(bad))


def _lease_safety(
    strategy: str,
    by_run: dict[tuple[str, int, str], list[Execution]],
    epoch: float,
    margins: dict[tuple[str, str], tuple[float, float]],
) -> Verdict:
    if strategy != "lease":
        return Verdict("P4", "unknown", "no leases under this strategy")

    def lease(e: Execution) -> str:
        known = margins.get((e.instance, e.token))
        if known is None and (e.ended is None or e.cut_by_end):  # no end to measure its lease against
            return f"{e.instance}: still going at the end"
        if known is None:
            return f"{e.instance}: no acknowledged lease"
        margin, expiry = known
        when = "before" if margin < 0 else "after"
        return f"{e.instance}'s lease ran out at {expiry:.3f} s, {abs(margin):.0f} ms {when} it stopped"

    bad = []
    for (job, _, _), executions in sorted(by_run.items()):
        for a, b in itertools.combinations(sorted(executions, key=lambda e: e.started), 2):
            if a.token != b.token and a.overlaps(b):  # two lease holders at once, whatever their attempts
                bad.append(f"{job} {_run(a, epoch)}: {_describe(a)} overlaps {_describe(b)} "
                           f"({lease(a)}; {lease(b)})")  # fmt: skip
    values = [margin for margin, _ in margins.values()]
    figures: dict[str, float] = {"attempts": len(values), "past_lease": sum(1 for m in values if m < 0)}
    if values:
        figures |= {"min_margin_ms": round(min(values), 1), "p50_margin_ms": round(percentile(values, 50), 1)}
    return Verdict("P4", "invalid" if bad else "valid", bad[0] if bad else "", len(bad), figures)


def lease_margins(history: History, lease_ms: int) -> dict[tuple[str, str], tuple[float, float]]:
    """For each execution that ended, keyed by (instance, token): (margin ms, lease expiry), the margin being the
    lease expiry as its holder last heard it minus the execution's end. The expiry is the true time the last
    operation acknowledged before the end - a won claim or a heartbeat - was sent, plus the lease its reply
    granted (``lease_ms`` when the history does not say).
    An execution with no acknowledged lease in the history, or still going at the end, has no margin."""
    acks: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
    sent: dict[tuple[str, str, str], float] = {}  # (process, op, token) -> when its latest request went out
    for event in history.events:
        if event.kind == "invoke":
            sent[(event.process, event.op, event.token)] = event.t
        if event.kind != "ok":
            continue
        answer = ClaimAnswer.of(event)
        if answer and answer.outcome == Outcome.WON.value:
            # What is left of the lease (a retried claim's is less).
            granted_ms = lease_ms if answer.lease_ms is None else answer.lease_ms
        elif event.op == "heartbeat" and event.value.isdigit() and int(event.value) > 0:
            granted_ms = int(event.value)
        else:
            continue
        # The lease counts from when the request was sent (the scheduler's deadline does too): a reply read late,
        # after a pause, does not lengthen it.
        since = sent.get((event.process, event.op, event.token), event.t)
        acks[(event.process, event.token)].append((event.t, since + granted_ms / 1000))
    margins = {}
    for e in history.executions:
        if e.ended is None or e.cut_by_end:  # its work had not ended: no last side effect to measure from
            continue
        expiries = [expiry for t, expiry in acks.get((e.instance, e.token), []) if t <= e.ended]
        if expiries:
            expiry = max(expiries)
            margins[(e.instance, e.token)] = ((expiry - e.ended) * 1000, expiry)
    return margins


def _allowance_ms(job: JobSpec, strategy: str) -> int:
    """How long after its slot a run may start: claims come up to jitter_ms after the slot and are
    skipped beyond max_late_ms; a catch-up at start (lease only) may run a slot up to catch_up_ms late."""
    defaults = JobOptions()
    max_late = int(job.options.get("max_late_ms", defaults.max_late_ms))
    catch_up = int(job.options.get("catch_up_ms", defaults.catch_up_ms)) if strategy == "lease" else 0
    return max(_jitter_ms(job) + max_late, catch_up)


def _jitter_ms(job: JobSpec) -> int:
    return int(job.options.get("jitter_ms", JobOptions().jitter_ms))


def _lateness(
    scenario: Scenario,
    strategy: str,
    first: list[Execution],
    lateness_ms: list[float],
    epoch: float,
    margin_s: float,
) -> Verdict:
    if not first:
        return Verdict("lateness", "unknown", "no run started")
    allowed = {job.name: _allowance_ms(job, strategy) + margin_s * 1000 for job in scenario.jobs}
    late = [ms > allowed[e.job] for e, ms in zip(first, lateness_ms, strict=True)]
    worst = max(range(len(first)), key=lambda i: (late[i], lateness_ms[i] - allowed[first[i].job]))
    e, ms = first[worst], lateness_ms[worst]
    when = f"{ms:.0f} ms after its slot" if ms >= 0 else f"{-ms:.0f} ms before its slot"
    witness = (f"{'late' if late[worst] else 'nearest its allowance'}: {e.job} slot at {true_s(e.slot, epoch):.0f} "
               f"s: {_describe(e)}, started {when} (allowed {allowed[e.job]:.0f} ms)")  # fmt: skip
    figures = {
        "runs": len(first),
        "min_ms": round(min(lateness_ms), 1),
        "p50_ms": round(percentile(lateness_ms, 50), 1),
        "p99_ms": round(percentile(lateness_ms, 99), 1),
        "max_ms": round(max(lateness_ms), 1),
    }
    count = sum(late)
    return Verdict("lateness", "invalid" if count else "valid", witness, count, figures)


def _no_lost_ack(strategy: str, history: History, fault_windows: list[FaultWindow]) -> Verdict:
    store_faults = [w for w in fault_windows if w.kind in STORE_FAULTS]
    if not store_faults:
        return Verdict("P5", "valid", "no failover or store restart happened")
    losses = [_Loss.of(w, history) for w in store_faults if w.lost_writes]
    if not losses:
        return Verdict("P5", "valid", "no failover or store restart lost a write")
    # Each won claim with the places of its answer and of the try it answered: a process paused as the answer
    # came reads it late, but the store the try was sent to accepted the claim.
    wins: dict[tuple[str, str], list[tuple[_Place, _Place, str, int, str]]] = defaultdict(list)
    for event, place, sent in _claim_answers(history):
        if (answer := ClaimAnswer.of(event)) and answer.outcome == Outcome.WON.value:
            wins[(event.job, event.run)].append((place, sent, event.token, answer.attempt, event.process))
    bad, doubtful = [], []
    for (job, run), acks in sorted(wins.items()):
        acks.sort()
        named = f"{job} {_run_named(run, history.epoch_s)}"
        for earlier, later in itertools.permutations(acks, 2):  # either answer may have been read first
            answered, sent, token1, attempt1, first = earlier
            (t2, at2), _, token2, attempt2, again = later
            t1 = answered[0]
            # Under lease a higher attempt is a takeover of a lease the store still knew; the same attempt (or an
            # earlier one) granted again means it had forgotten the claim.
            if token1 == token2 or (strategy == "lease" and attempt2 > attempt1):
                continue
            lost = [loss.lost(sent, answered, token1) for loss in losses if loss.struck_before(t2, at2)]
            by = f"by {again}" if again != first else f"by {again} (a new claim)"
            if True in lost:
                bad.append(f"{named}: won by {first} at {t1:.3f} s, won again {by} at {t2:.3f} s "
                           "after the store lost it")  # fmt: skip
                break
            if None in lost:
                doubtful.append(f"{named}: won by {first}, sent at {sent[0]:.3f} s and answered at {t1:.3f} s, "
                                f"across a store fault; won again {by} at {t2:.3f} s")  # fmt: skip
    if bad:
        return Verdict("P5", "invalid", bad[0], len(bad))
    if doubtful:  # each such claim may have reached the store that followed the fault, held on its way
        return Verdict("P5", "unknown", f"{doubtful[0]} (may have been lost)", len(doubtful))
    return Verdict("P5", "valid", "", 0)


@dataclass(frozen=True)
class _Loss:
    """What a store fault lost: the claims acknowledged from ``since`` up to the moment ``at`` it struck, that
    moment being a true time and a place in the history (claims answered at the same instant but before the
    fault's entry were lost; -1 when the history has no entry for it: none at that instant counts as before).
    Where the fault knows the tokens of the claims it lost (``words``), those are the claims lost."""

    since: float
    at: float
    place: int
    words: frozenset[str] | None = None

    @classmethod
    def of(cls, window: FaultWindow, history: History) -> _Loss:
        # A restart forgets everything as the store goes down (claims may be won on the empty store before the
        # restart is seen to be over); a failover forgets the writes the replica had not received, its window,
        # when the replica takes over at the window's end.
        since, at = (-math.inf, window.start) if window.kind == "store-restart" else (window.start, window.end)
        place = next((i for i, e in enumerate(history.events) if e.kind == "fault" and e.op == window.kind
                      and e.t == at), -1)  # fmt: skip
        return cls(since, at, place, window.lost_words)

    def lost(self, sent: _Place, answered: _Place, token: str) -> bool | None:
        """Whether the claim of ``token``, whose try sent at the place ``sent`` was answered at ``answered``, was
        lost: where the fault knows the writes it lost, whether the try (sent before it) wrote one of them;
        otherwise, whether the answer came before the fault. None for a try sent before the fault and answered
        after it, which cannot be told: it may have been held on its way (a paused instance's) and reached the
        store that followed, or been answered by the store that lost it and read late."""
        fault = (self.at, self.place)
        if self.words is not None:
            return token in self.words and sent < fault
        if self.since > answered[0] or sent > fault:
            return False
        return True if answered < fault else None

    def struck_before(self, t: float, place: int) -> bool:
        """Whether the fault had struck before the history's entry ``place``, at ``t``."""
        return (t, place) > (self.at, self.place)


# A place in the history: (true time, index), which orders what happened at one true time (one event loop records
# events as they happen).
_Place = tuple[float, int]
# A claim's acceptance: (its first send that may have been applied, the answer that it won, its fence).
_Acceptance = tuple[_Place, _Place, int]


def _answers(history: History) -> Iterator[tuple[Event, _Place, _Place]]:
    """Each answer (ok, fail or info) to a store operation, with its place and the place of the try it answers."""
    sending: dict[tuple[str, str], _Place] = {}  # (op, token) -> the place of its try in flight
    for index, event in enumerate(history.events):
        if event.kind == "fault":
            continue
        place = (event.t, index)
        if event.kind == "invoke":
            sending[(event.op, event.token)] = place
        else:
            yield event, place, sending.pop((event.op, event.token), place)


def _claim_answers(history: History) -> Iterator[tuple[Event, _Place, _Place]]:
    """Each claim's answer, as ``_answers`` gives it."""
    return (answer for answer in _answers(history) if answer[0].op == "claim")


def _fencing(history: History, lease: bool) -> Verdict:
    """Fences must grow in the order the store accepted the claims, and each execution must run with the fence
    its claim was acknowledged. The store accepted a claim between the first send it may have applied (a retry
    may win with a try whose answer was lost; a try that failed was not applied) and the answer that told its
    sender it won. Under lease a claim sent again takes the next fence (nobody heard its first): the fence it is
    told was accepted by the try answered, between that try's send and its answer. Under the claim-only
    strategies a manual run's fence is not ordered against the slots' (documented): only lease's are judged. One
    claim was surely accepted before another when its answer came before the other's first
    such send. Two claims of a job accepted with the same fence are out of order whichever came first. Places in
    the history (true time, then the order events were recorded: one event loop records them as they happen) order
    them."""
    first_send: dict[str, _Place] = {}  # token -> the place of its first try that may have been applied
    acknowledged: dict[str, int] = {}  # token -> the fence its won claim was told (a retry recognising its own
    # token is the same acceptance)
    accepted: dict[str, list[_Acceptance]] = defaultdict(list)  # by job
    for event, place, sent in _claim_answers(history):
        if event.kind == "fail":
            continue
        first_send.setdefault(event.token, sent)
        answer = ClaimAnswer.of(event)
        if answer and answer.outcome == Outcome.WON.value and event.token not in acknowledged:
            fence = acknowledged[event.token] = answer.fence
            if event.run.startswith("m") and not lease:
                continue
            accepted[event.job].append((sent if lease else first_send[event.token], place, fence))
    bad = [
        f"{e.job} {e.instance} attempt {e.attempt} ran with fence {e.fence}; its claim was told {acknowledged[e.token]}"
        for e in history.executions
        if e.token in acknowledged and e.fence != acknowledged[e.token]
    ]
    for job, acks in sorted(accepted.items()):
        # Two acceptances of one fence that the order below cannot tell apart (neither surely before the other)
        by_fence: dict[int, list[_Acceptance]] = defaultdict(list)
        for ack in acks:
            by_fence[ack[2]].append(ack)
        for fence, same in sorted(by_fence.items()):
            for (sent, at, _), (other_sent, other_at, _) in itertools.combinations(same, 2):
                if not (at < other_sent or other_at < sent):
                    bad.append(f"{job}: fence {fence} accepted twice, at {at[0]:.3f} s and at {other_at[0]:.3f} s")
        # Each acceptance against the highest fence of those surely accepted before it, as a downstream system
        # that refuses stale fences would see them: each one it would refuse counts.
        done = sorted(acks, key=lambda ack: ack[1])
        highest: _Acceptance | None = None
        before = 0
        for ack in sorted(acks, key=lambda ack: ack[0]):
            while before < len(done) and done[before][1] < ack[0]:
                if highest is None or done[before][2] > highest[2]:
                    highest = done[before]
                before += 1
            if highest is not None and ack[2] <= highest[2]:
                sent_at = f" (sent at {ack[0][0]:.3f} s)" if ack[0][0] != ack[1][0] else ""
                bad.append(f"{job}: fence {ack[2]} accepted at {ack[1][0]:.3f} s{sent_at} after fence {highest[2]} "
                           f"at {highest[1][0]:.3f} s")  # fmt: skip
    if not bad and history.executions and not acknowledged:
        return Verdict("P6", "unknown", "no acknowledged claim: the fences cannot be ordered")
    return Verdict("P6", "invalid" if bad else "valid", bad[0] if bad else "", len(bad))


SKIPPED = ("skipped-late", "skipped-overlap")


def _true_history(scenario: Scenario, history: History, fault_windows: list[FaultWindow]) -> Verdict:
    """What the store's records say of each run against what the ledger saw run (see P7)."""
    if history.records is None:
        return Verdict("P7", "unknown", "the store's records were not read")
    epoch = history.epoch_s
    by_token = {e.token: e for e in history.executions}
    ran = {(e.job, e.run): e for e in history.executions}
    lossy = [w for w in fault_windows if w.kind in STORE_FAULTS and w.lost_writes]

    def lost(sent: float, at: float, token: str) -> bool:
        """Whether a store fault may have lost what ``token``'s claim or finish wrote, by a try sent at ``sent`` and
        answered at ``at``: a restart everything written before it, a failover what its replica had not received
        (the writes naming the token, where known: a finish's record holds it inside the record). A try sent
        before the fault ended and answered after it may have been applied by the store that lost it, its answer
        read late (as a live instance reads it, or a paused one): the benefit of that doubt goes to the strategy."""
        return any(
            sent <= w.end
            and (
                w.kind == "store-restart"
                or (w.start <= at if w.lost_words is None else any(token in word for word in w.lost_words))
            )
            for w in lossy
        )

    records: dict[str, list[RunRecord]] = defaultdict(list)  # by token; a claim-only skip has none
    bad = []
    for record in history.records:
        where = f"{record.job} {_run_at(record.slot, record.manual, epoch)}"
        execution = by_token.get(record.token) if record.token else None
        other = ran.get((record.job, record.run))
        if record.token:
            records[record.token].append(record)
        if len(records[record.token]) == 2:
            bad.append(f"{where}: attempt {record.attempt} of {record.runner or 'nobody'} recorded twice")
        elif record.status in SKIPPED and other is not None and not lost(other.started, other.started, other.token):
            bad.append(f"{where}: recorded {record.status}, but it ran ({_describe(other)})")
        elif record.status in ("ok", "error") and execution is None:
            bad.append(f"{where}: recorded {record.status} by {record.runner}, but no execution has its token")
        elif record.status == "ok" and execution is not None and not execution.completed:
            bad.append(f"{where}: recorded ok, but its execution did not run to its end ({_describe(execution)})")
        elif execution is not None and (execution.job, execution.run, execution.instance, execution.attempt,
                                        execution.fence) != (record.job, record.run, record.runner, record.attempt,
                                                             record.fence):  # fmt: skip
            bad.append(f"{where}: recorded {record.status} by {record.runner} attempt {record.attempt} fence "
                       f"{record.fence}, but that token's execution is {_describe(execution)} with fence "
                       f"{execution.fence}")  # fmt: skip
    owed = _owed_records(history)
    history_size = int(scenario.scheduler.get("history_size", DEFAULT_HISTORY_SIZE))
    trims_by_age = scenario.scheduler.get("history_ttl_ms") is not None
    kept = {job: [r for r in history.records if r.job == job] for job in {e.job for e, *_ in owed}}
    for execution, sent, since in owed:
        status = "ok" if execution.completed else "interrupted"
        mine = records.get(execution.token, [])
        if any(record.status == status for record in mine):
            continue
        job_kept = kept[execution.job]
        trimmed = (len(job_kept) >= history_size or trims_by_age) and execution.slot < min(
            (r.slot for r in job_kept), default=math.inf
        )
        if lost(sent, since, execution.token) or trimmed:  # a lost finish leaves a takeover to record it interrupted
            continue
        what = f"{execution.job} {_run(execution, epoch)} ({_describe(execution)})"
        if mine:
            bad.append(f"{what}: recorded {mine[0].status}, not {status}")
        else:
            bad.append(f"{what}: the store heard of its end at {since:.3f} s, but no record of it is kept")
    if not (trims_by_age or lossy):  # trimming keeps history_size records of a job
        for job, job_kept in sorted(kept.items()):
            written = sum(e.job == job for e, *_ in owed)
            if len(job_kept) < min(history_size, written):
                bad.append(f"{job}: {len(job_kept)} records kept of the {written} it was owed, with history_size "
                           f"{history_size}")  # fmt: skip
    return Verdict("P7", "invalid" if bad else "valid", bad[0] if bad else "", len(bad))


def _owed_records(history: History) -> list[tuple[Execution, float, float]]:
    """The executions the store must have recorded, each with the try that told it their end: when that try was
    sent and when it was answered. Those are the executions whose finish it acknowledged (ok, or interrupted for one
    its scheduler stopped short), and the lease attempts handed back that a later claim of their run took over or
    closed (the takeover records them), or at once for a run_now, which nobody takes over. One that a kill, a
    partition or the run's end kept from the store is owed nothing."""
    finished: dict[str, tuple[float, float]] = {}  # token -> its acknowledged finish (sent, answered)
    handed_back: dict[str, tuple[float, float]] = {}  # token -> its acknowledged hand-back (sent, answered)
    # run -> the claims that took it over or closed it: (answered, sent, by whom)
    closed_by_claims: dict[tuple[str, str], list[tuple[float, float, str]]] = defaultdict(list)
    for event, _, (sent, _) in _answers(history):
        if event.kind != "ok":
            continue
        if event.op in ("finish", "release") and event.value == "True":
            (finished if event.op == "finish" else handed_back)[event.token] = sent, event.t
        elif (answer := ClaimAnswer.of(event)) and answer.outcome in (Outcome.WON.value, Outcome.DONE.value):
            closed_by_claims[(event.job, event.run)].append((event.t, sent, event.token))
    owed = []
    for e in history.executions:
        if e.token in finished:
            owed.append((e, *finished[e.token]))
        elif not e.completed and e.token in handed_back:
            sent, back = handed_back[e.token]
            later = [(t, by_sent) for t, by_sent, by in closed_by_claims[(e.job, e.run)] if t >= back and by != e.token]
            if e.manual:
                owed.append((e, sent, back))
            elif later:
                closed, closing_sent = min(later)
                owed.append((e, closing_sent, closed))
    return owed
