"""Checkers: each reads a run's history and ledger and returns valid / invalid / unknown with a witness.

P1 no duplicate: a slot is executed at most once. Two executions of one slot count as a duplicate if both ran
   to the end, or if they overlapped in true time (a retry after a crash is fine once the first had stopped).
P2 no missed slot: every slot due while at least one instance was healthy (up, not paused, not cut off, then
   and for a settling time after) has an execution that ran to the end, judged once every fault has healed.
P3 no overlap: executions of a job whose overlap is forbidden never overlap in true time.
P4 lease safety (lease only): no two attempts of one run execute at the same true time; the margin between the
   end of an interrupted attempt and the start of the next is reported.
P5 no lost acknowledged claim: a run won before a failover or store restart is not won again, as a first
   attempt, by someone else after it.
P6 fencing: the fences of a job's executions grow in the order their claims were acknowledged.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any
from zoneinfo import ZoneInfo

from anarchon._cron import CronSchedule
from sim.history import Execution, History
from sim.scenario import Scenario
from sim.world import FaultWindow

STORE_FAULTS = ("failover", "store-restart")


@dataclass(frozen=True)
class Verdict:
    checker: str
    status: str  # valid | invalid | unknown
    witness: str = ""
    count: int = 0  # how many violations


@dataclass
class Judgement:
    verdicts: dict[str, Verdict]
    slots_checked: int
    lateness_ms: list[float] = field(default_factory=list)
    lease_margins_ms: list[float] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {
            "verdicts": {name: v.status for name, v in self.verdicts.items()},
            "witnesses": {name: v.witness for name, v in self.verdicts.items() if v.witness},
            "counts": {name: v.count for name, v in self.verdicts.items()},
            "slots_checked": self.slots_checked,
        }


def true_s(slot_ms: int, epoch_s: float) -> float:
    """A slot (epoch ms) as true time: seconds since the run began at wall time ``epoch_s``."""
    return slot_ms / 1000 - epoch_s


def judge(
    scenario: Scenario, strategy: str, history: History, fault_windows: list[FaultWindow], slack_s: float = 5.0
) -> Judgement:
    """Run every checker. ``slack_s`` is added to the time a takeover may take before a slot counts as missed."""
    epoch = history.epoch_s
    runs = [e for e in history.executions if not e.manual]
    by_slot: dict[tuple[str, int], list[Execution]] = defaultdict(list)
    for execution in runs:
        by_slot[(execution.job, execution.slot)].append(execution)
    lease_s = float(scenario.scheduler.get("lease_ms", 30_000)) / 1000
    longest = max(job.work_s for job in scenario.jobs)
    settle_s = lease_s * 3 + longest + slack_s  # long enough for backups to take a run over and finish it
    names = [instance.name for instance in scenario.instances]

    def someone_healthy(t: float) -> bool:
        return any(not any(w.hits(name, t) or w.hits(name, t + settle_s) for w in fault_windows) for name in names)

    expected = [
        (job, slot)
        for job, slot in _expected_slots(scenario, epoch, 0.0, scenario.duration_s - settle_s)
        if someone_healthy(true_s(slot, epoch))
    ]

    verdicts = {
        "P1": _no_duplicate(by_slot, epoch),
        "P2": _no_missed(by_slot, expected, epoch),
        "P3": _no_overlap(scenario, runs + [e for e in history.executions if e.manual], epoch),
        "P4": _lease_safety(strategy, by_slot, epoch),
        "P5": _no_lost_ack(strategy, history, fault_windows),
        "P6": _fencing(history),
    }
    lateness = [(e.started - true_s(e.slot, epoch)) * 1000 for e in runs if e.attempt == 1]
    return Judgement(verdicts, len(expected), lateness, _margins(by_slot) if strategy == "lease" else [])


def _expected_slots(scenario: Scenario, epoch: float, start_s: float, end_s: float) -> list[tuple[str, int]]:
    slots = []
    for job in scenario.jobs:
        schedule = CronSchedule(job.cron, ZoneInfo(str(job.options.get("timezone", "UTC"))))
        low, high = int((epoch + start_s) * 1000), int((epoch + end_s) * 1000)
        slots.extend((job.name, slot) for slot in schedule.slots_between(low, high))
    return slots


def _describe(e: Execution) -> str:
    end = "still running" if e.ended is None else f"{e.ended:.3f}"
    state = "ran to the end" if e.completed else "stopped early"
    return f"{e.instance} attempt {e.attempt} [{e.started:.3f} .. {end}] {state}"


def _no_duplicate(by_slot: dict[tuple[str, int], list[Execution]], epoch: float) -> Verdict:
    bad = []
    for (job, slot), executions in sorted(by_slot.items()):
        completed = [e for e in executions if e.completed]
        overlapping = [(a, b) for a, b in itertools.combinations(executions, 2) if a.overlaps(b)]
        if len(completed) > 1 or overlapping:
            pair = overlapping[0] if overlapping else (completed[0], completed[1])
            bad.append(f"{job} slot at {true_s(slot, epoch):.0f} s: {_describe(pair[0])}; {_describe(pair[1])}")
    return Verdict("P1", "invalid" if bad else "valid", bad[0] if bad else "", len(bad))


def _no_missed(
    by_slot: dict[tuple[str, int], list[Execution]], expected: list[tuple[str, int]], epoch: float
) -> Verdict:
    if not expected:
        return Verdict("P2", "unknown", "no slot was due while an instance was healthy")
    missed = [(job, slot) for job, slot in expected if not any(e.completed for e in by_slot.get((job, slot), []))]
    witness = ""
    if missed:
        job, slot = missed[0]
        tried = by_slot.get((job, slot), [])
        how = "; ".join(_describe(e) for e in tried) if tried else "never started"
        witness = f"{job} slot at {true_s(slot, epoch):.0f} s: {how}"
    return Verdict("P2", "invalid" if missed else "valid", witness, len(missed))


def _no_overlap(scenario: Scenario, executions: list[Execution], epoch: float) -> Verdict:
    forbidden = {job.name for job in scenario.jobs if not job.options.get("overlap", False)}
    bad = []
    by_job: dict[str, list[Execution]] = defaultdict(list)
    for e in executions:
        if e.job in forbidden:
            by_job[e.job].append(e)
    for job, runs in sorted(by_job.items()):
        runs.sort(key=lambda e: e.started)
        for a, b in itertools.pairwise(runs):
            if a.slot != b.slot and a.overlaps(b):
                bad.append(f"{job}: slot at {true_s(a.slot, epoch):.0f} s ({_describe(a)}) and slot at "
                           f"{true_s(b.slot, epoch):.0f} s ({_describe(b)})")  # fmt: skip
    return Verdict("P3", "invalid" if bad else "valid", bad[0] if bad else "", len(bad))


def _lease_safety(strategy: str, by_slot: dict[tuple[str, int], list[Execution]], epoch: float) -> Verdict:
    if strategy != "lease":
        return Verdict("P4", "unknown", "no leases under this strategy")
    bad = []
    for (job, slot), executions in sorted(by_slot.items()):
        for a, b in itertools.combinations(sorted(executions, key=lambda e: e.started), 2):
            if a.attempt != b.attempt and a.overlaps(b):
                bad.append(f"{job} slot at {true_s(slot, epoch):.0f} s: {_describe(a)} overlaps {_describe(b)}")
    return Verdict("P4", "invalid" if bad else "valid", bad[0] if bad else "", len(bad))


def _margins(by_slot: dict[tuple[str, int], list[Execution]]) -> list[float]:
    """For each takeover, how long before the next attempt started the previous one had stopped (ms)."""
    margins = []
    for executions in by_slot.values():
        ordered = sorted(executions, key=lambda e: e.started)
        for a, b in itertools.pairwise(ordered):
            if a.ended is not None and b.attempt > a.attempt:
                margins.append((b.started - a.ended) * 1000)
    return margins


def _no_lost_ack(strategy: str, history: History, fault_windows: list[FaultWindow]) -> Verdict:
    store_faults = sorted(_data_lost_at(w) for w in fault_windows if w.kind in STORE_FAULTS)
    if not store_faults:
        return Verdict("P5", "valid", "no failover or store restart happened")
    wins: dict[tuple[str, str], list[tuple[float, str, int]]] = defaultdict(list)
    for event in history.events:
        if event.kind == "ok" and event.op == "claim" and event.value.startswith("won"):
            attempt = int(event.value.split("attempt=")[1].split()[0])
            wins[(event.job, event.run)].append((event.t, event.token, attempt))
    bad = []
    for (job, run), acks in sorted(wins.items()):
        acks.sort()
        for (t1, token1, _), (t2, token2, attempt2) in itertools.combinations(acks, 2):
            lost = token1 != token2 and any(t1 < f <= t2 for f in store_faults)
            if lost and (strategy != "lease" or attempt2 == 1):
                bad.append(f"{job} run {run}: won at {t1:.3f} s, won again by another instance at {t2:.3f} s "
                           "after the store lost it")  # fmt: skip
                break
    return Verdict("P5", "invalid" if bad else "valid", bad[0] if bad else "", len(bad))


def _data_lost_at(window: FaultWindow) -> float:
    """When the store forgot what it had acknowledged: a restart forgets everything as it goes down (claims may
    be won on the empty store before the restart is seen to be over); a failover forgets the writes the replica
    had not received when the old primary dies and the replica takes over, at the end of the window."""
    return window.start if window.kind == "store-restart" else window.end


def _fencing(history: History) -> Verdict:
    accepted: dict[str, list[tuple[float, int, str]]] = defaultdict(list)
    for event in history.events:
        if event.kind == "ok" and event.op == "claim" and event.value.startswith("won"):
            fence = int(event.value.split("fence=")[1])
            accepted[event.job].append((event.t, fence, event.token))
    bad = []
    for job, acks in sorted(accepted.items()):
        acks.sort()
        seen: set[str] = set()
        previous: tuple[float, int, str] | None = None
        for ack in acks:
            if ack[2] in seen:  # a retried claim recognising its own token: the same acceptance
                continue
            seen.add(ack[2])
            if previous is not None and ack[1] <= previous[1]:
                bad.append(f"{job}: fence {ack[1]} accepted at {ack[0]:.3f} s after fence {previous[1]} "
                           f"at {previous[0]:.3f} s")  # fmt: skip
            previous = ack
    return Verdict("P6", "invalid" if bad else "valid", bad[0] if bad else "", len(bad))
