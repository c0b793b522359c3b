"""Exhaustive explorer: every interleaving of a few instances claiming a few slots, checked on every state.

    python -m models.explore --strategy lease --instances 3 --slots 3 --depth 12
    python -m models.explore --strategy script --faults late --expect-violation

Breadth-first over worlds (store model + instances + the store's clock + a ledger of executions), each world
visited once; the first violation found is therefore a shortest one, printed as a numbered trace. Exit status:
0 for no violation, 1 for a violation; with ``--expect-violation`` the other way round.

Abstract time, in quanta of the store's clock:

- instances start at store time 0 and schedule the slots after their own clock's reading; slot k is due at
  1 + k, claimed when the instance's clock (store time + its skew) reaches it and no later (``max_late_ms``
  is 0): time does not move on while a healthy instance has a due claim to make;
- lease_ms is 2 quanta, and time does not move on while a healthy holder's lease would end without a
  heartbeat (heartbeats are on time; a paused holder misses them);
- an instance told ``running`` claims again, as a backup, from the lease end it was told, whenever;
- the script window and the idmp duration are 1 quantum; ``max_attempts`` is 3; overlap is forbidden.

Faults (``--faults``, default crash,skew): ``crash`` kills an instance for good (its execution stops);
``stop`` stops one for good as ``Scheduler.stop(timeout=0)`` does: its execution stops, and a lease run with
attempts left is handed back (its lease ends at once, and the next claim of a backup takes it over), while a manual
run or one on its last attempt is recorded interrupted; ``manual`` (lease only) lets one instance, once, at any
time, call ``run_now``: a run of its own (nobody else claims it) that lease must not run beside a slot's (the
claim-only strategies record a manual run in a stream of its own, apart from the slots' claims);
``pause`` freezes one until it resumes, still executing and believing in its lease until a heartbeat says
otherwise; ``skew`` gives instances clocks one quantum ahead (every mix); ``late`` lets claims arrive at any time
after the slot; ``failover`` keeps a replica that a ``replicate`` step brings up to date, and a ``failover`` step
makes it the store, losing what was not replicated; ``unanswered`` lets any claim reach the store and its answer
be lost: the instance sends it again with the same token, whenever (the scheduler's backoff), as a skip once past
``max_late_ms`` (a backup's is never late), and the store's answer to a claim it already took decides.

Properties (``--check``, default all), judged where meaningful:
P1 no duplicate: no slot runs to the end twice, and no two executions of a slot are under way at once.
P2 no missed slot: a slot scheduled by an instance that stayed healthy (never crashed, stopped or paused, and heard
   every answer about the slot) runs to the end, unless some instance still means to claim or finish it, or it was
   skipped by the overlap rule.
P3 no overlap (lease): executions of two runs (slots, or a slot and the manual run) are never under way at once.
P4 lease safety (lease): no two holders of one slot are under way at once, whatever their attempts.
P5 no lost acknowledged claim: a win the failover lost (acknowledged, not yet replicated) is not won again by
   another instance (under lease: with the same attempt or an earlier one, which only the lost win explains).
P6 fencing: each acknowledged win carries a larger fence than every win acknowledged before it.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Generic, TypeAlias, TypeVar

from anarchon._strategies import Claim, JobPolicy, Outcome

from . import idmp, lease, script, stream_id

FIRST_SLOT = 1
MANUAL_RUN = 1_000_000  # the manual run's slot in the store model: unlike any scheduled slot, and never forgotten
MANUAL_RUN_ID = f"m{MANUAL_RUN}-0"  # its run id, as the scheduler names a manual run
LEASE = 2
WINDOW = 1
MAX_LATE = 0
POLICY = JobPolicy(
    lease_ms=LEASE, max_attempts=3, overlap=False, history_size=1000, keep_ms=1_000_000, late_after_ms=MAX_LATE
)

FAULTS = ("crash", "stop", "pause", "skew", "late", "failover", "manual", "unanswered")
DEFAULT_FAULTS = ("crash", "skew")
PROPERTIES = {
    "P1": "no duplicate",
    "P2": "no missed slot",
    "P3": "no overlap",
    "P4": "lease safety",
    "P5": "no lost acknowledged claim",
    "P6": "fencing",
}

S = TypeVar("S", bound=Hashable)
M = TypeVar("M", bound=Hashable)


class StoreModel(Generic[S]):
    """One strategy's store in the explorer's units. The claim-only strategies have no leases; their finish only
    writes history, which no claim reads, and their skip claims the run first (as ClaimOnlyStrategy.skip does),
    so that no claim after it wins."""

    leases = False
    remembers: int | None = None  # how long after its slot the store knows a run was claimed (None: for ever)

    def initial(self) -> S:
        raise NotImplementedError

    def claim(self, store: S, slot: int, token: str, now: int) -> tuple[S, Claim]:
        raise NotImplementedError

    def heartbeat(self, store: S, slot: int, token: str, now: int) -> tuple[S, int]:
        return store, 0

    def finish(self, store: S, slot: int, token: str, now: int) -> S:
        return store

    def skip(self, store: S, slot: int, token: str, now: int) -> S:
        """As ClaimOnlyStrategy.skip: a run that the store's clock does not see as late yet (an instance whose
        clock runs ahead skips early), or that the store no longer remembers (its margin is well under a
        quantum), is left alone; any other is claimed."""
        if now <= slot + MAX_LATE or (self.remembers is not None and now > slot + self.remembers):
            return store
        return self.claim_for_skip(store, slot, token, now)[0]

    def claim_for_skip(self, store: S, slot: int, token: str, now: int) -> tuple[S, Claim]:
        return self.claim(store, slot, token, now)

    def stop_run(self, store: S, slot: int, token: str, now: int, attempt: int, manual: bool) -> S:
        """What ``Scheduler.stop`` leaves of a run it cuts short."""
        return store  # nothing to hand back: the run stays claimed


class LeaseModel(StoreModel[lease.LeaseStore]):
    """``policy``: POLICY keeps every run; a small history_size and keep_ms let finishes trim (see the tests)."""

    leases = True

    def __init__(self, policy: JobPolicy = POLICY) -> None:
        self.policy = policy

    def initial(self) -> lease.LeaseStore:
        return lease.LeaseStore()

    def claim(self, store: lease.LeaseStore, slot: int, token: str, now: int) -> tuple[lease.LeaseStore, Claim]:
        return lease.claim(store, _run_id(slot), token, now, self.policy)

    def heartbeat(self, store: lease.LeaseStore, slot: int, token: str, now: int) -> tuple[lease.LeaseStore, int]:
        return lease.heartbeat(store, _run_id(slot), token, now, self.policy)

    def finish(self, store: lease.LeaseStore, slot: int, token: str, now: int) -> lease.LeaseStore:
        return lease.finish(store, _run_id(slot), token, "ok", now, self.policy)[0]

    def skip(self, store: lease.LeaseStore, slot: int, token: str, now: int) -> lease.LeaseStore:
        return lease.skip(store, _run_id(slot), token, now, self.policy)[0]

    def stop_run(
        self, store: lease.LeaseStore, slot: int, token: str, now: int, attempt: int, manual: bool
    ) -> lease.LeaseStore:
        """Handed back when backups may take it over; otherwise recorded interrupted (closed)."""
        if manual or attempt >= self.policy.max_attempts:
            return lease.finish(store, _run_id(slot), token, "interrupted", now, self.policy)[0]
        return lease.release(store, _run_id(slot), token, now)[0]


def _run_id(slot: int) -> str:
    return MANUAL_RUN_ID if slot == MANUAL_RUN else str(slot)


class StreamIdModel(StoreModel[stream_id.StreamIdStore]):
    def initial(self) -> stream_id.StreamIdStore:
        return stream_id.StreamIdStore()

    def claim(
        self, store: stream_id.StreamIdStore, slot: int, token: str, now: int
    ) -> tuple[stream_id.StreamIdStore, Claim]:
        return stream_id.claim(store, slot, token)


class IdmpModel(StoreModel[idmp.IdmpStore]):
    remembers = WINDOW

    def initial(self) -> idmp.IdmpStore:
        return idmp.IdmpStore()

    def claim(self, store: idmp.IdmpStore, slot: int, token: str, now: int) -> tuple[idmp.IdmpStore, Claim]:
        return idmp.claim(store, slot, token, now, duration_ms=WINDOW, max_size=1000)


class ScriptModel(StoreModel[script.ScriptStore]):
    remembers = WINDOW

    def initial(self) -> script.ScriptStore:
        return script.ScriptStore()

    def claim(self, store: script.ScriptStore, slot: int, token: str, now: int) -> tuple[script.ScriptStore, Claim]:
        return script.claim(store, slot, token, now, WINDOW, POLICY)

    def claim_for_skip(
        self, store: script.ScriptStore, slot: int, token: str, now: int
    ) -> tuple[script.ScriptStore, Claim]:
        return script.claim(store, slot, token, now, WINDOW, POLICY, for_skip=True)


MODELS: dict[str, StoreModel[Any]] = {
    "lease": LeaseModel(),
    "stream-id": StreamIdModel(),
    "idmp": IdmpModel(),
    "script": ScriptModel(),
}

# --- worlds --------------------------------------------------------------------------------------------------------

UP, PAUSED, RESUMED, CRASHED, STOPPED = "up", "paused", "resumed", "crashed", "stopped"


@dataclass(frozen=True, slots=True)
class Todo:
    """The slot is scheduled: claim it when the instance's clock reaches it."""


@dataclass(frozen=True, slots=True)
class Backup:
    """Told ``running``: claim again from store time ``at`` (the lease end the answer gave)."""

    at: int


@dataclass(frozen=True, slots=True)
class Unanswered:
    """The claim's answer was lost: send it again, whenever; a backup's is never late."""

    backup: bool


@dataclass(frozen=True, slots=True)
class Holding:
    """Executing a won attempt, believing the lease lasts until ``lease_end`` (store time)."""

    attempt: int
    lease_end: int


@dataclass(frozen=True, slots=True)
class Done:
    """Nothing more to do with the slot."""


Phase: TypeAlias = Todo | Backup | Unanswered | Holding | Done
TODO, DONE = Todo(), Done()


@dataclass(frozen=True, slots=True)
class Instance:
    status: str  # up (never faulted) | paused | resumed | crashed | stopped
    skew: int  # its clock minus the store's
    phases: tuple[Phase, ...]  # per slot


@dataclass(frozen=True, slots=True)
class World(Generic[S]):
    now: int
    store: S
    replica: S | None  # with failover only
    instances: tuple[Instance, ...]
    completed: tuple[int, ...]  # per slot: executions that ran to the end (2 means "more than one")
    skipped: frozenset[int]  # slots answered "overlap"
    # Per run, with failover only: (instance, attempt) of each win acknowledged since the replica last caught up,
    # and of each such win a failover lost.
    unreplicated: tuple[frozenset[tuple[int, int]], ...]
    forgotten: tuple[frozenset[tuple[int, int]], ...]
    top_fence: int  # the largest fence acknowledged
    manual_left: bool = False  # run_now may still be called (with the manual fault)
    # (instance, slot index) of each claim whose answer was lost and not heard since: to P2, that instance is cut
    # off from the slot (until a retry is answered; for good once its retry became a skip)
    unanswered: frozenset[tuple[int, int]] = frozenset()


Step: TypeAlias = tuple[str, int, int]  # (kind, instance or -1, slot index or -1)
Note: TypeAlias = Claim | int | None  # what the store answered, for the trace


@dataclass(frozen=True)
class Result:
    states: int
    seconds: float
    problems: list[str]  # empty: no violation
    trace: list[str]  # the start, then one line per step


def token(instance: int) -> str:
    return f"i{instance}"


class Explorer(Generic[S]):
    def __init__(
        self, model: StoreModel[S], instances: int, slots: int, faults: Sequence[str], checks: Sequence[str]
    ) -> None:
        self.model, self.n, self.k = model, instances, slots
        self.faults, self.checks = frozenset(faults), frozenset(checks)
        self.late, self.failover = "late" in self.faults, "failover" in self.faults
        if "manual" in self.faults and not model.leases:
            raise ValueError("the manual fault explores lease only: a claim-only manual run is not a claim")
        # Run k < slots is slot k; with the manual fault, run k == slots is the manual run.
        self.runs = slots + ("manual" in self.faults)
        self.no_wins: tuple[frozenset[tuple[int, int]], ...] = (frozenset(),) * self.runs  # per run

    def slot_of(self, k: int) -> int:
        return FIRST_SLOT + k if k < self.k else MANUAL_RUN

    def run_name(self, k: int) -> str:
        return f"slot {k}" if k < self.k else "the manual run"

    def initial(self) -> list[World[S]]:
        """One world per mix of clocks (instances are interchangeable, so skews come sorted)."""
        skews = (0, 1) if "skew" in self.faults else (0,)
        store = self.model.initial()
        return [
            World(0, store, store if self.failover else None, tuple(self._started(skew) for skew in assignment),
                  (0,) * self.runs, frozenset(), self.no_wins, self.no_wins, 0, manual_left="manual" in self.faults)
            for assignment in itertools.combinations_with_replacement(skews, self.n)
        ]  # fmt: skip

    def _started(self, skew: int) -> Instance:
        # A scheduler starting schedules the slots strictly after its clock's reading (store time 0 + skew).
        slots = tuple(TODO if FIRST_SLOT + k > skew else DONE for k in range(self.k))
        return Instance(UP, skew, slots + (DONE,) * (self.runs - self.k))

    # --- steps ---------------------------------------------------------------------------------------------------

    def moves(self, w: World[S]) -> list[Step]:
        steps: list[Step] = []
        urgent = False  # a healthy instance must act before time moves on
        for i, inst in enumerate(w.instances):
            if inst.status in (CRASHED, STOPPED):
                continue
            if inst.status == PAUSED:
                steps.append(("resume", i, -1))
            else:
                local = w.now + inst.skew
                for k, phase in enumerate(inst.phases):
                    if isinstance(phase, Todo) and local >= FIRST_SLOT + k:
                        on_time = local <= FIRST_SLOT + k + MAX_LATE
                        steps.append(("claim" if on_time or self.late else "skip", i, k))
                        urgent = urgent or not self.late
                    elif isinstance(phase, Backup) and w.now >= phase.at:
                        steps.append(("claim", i, k))
                    elif isinstance(phase, Unanswered):
                        on_time = phase.backup or local <= FIRST_SLOT + k + MAX_LATE
                        steps.append(("claim" if on_time or self.late else "skip", i, k))
                    elif isinstance(phase, Holding):
                        steps.append(("end", i, k))
                        # Only a heartbeat at the lease's last quantum changes anything (lease_ms is 2).
                        if self.model.leases and phase.lease_end <= w.now + 1:
                            steps.append(("heartbeat", i, k))
                            urgent = True
                if "pause" in self.faults and inst.status == UP:
                    steps.append(("pause", i, -1))
                if "stop" in self.faults:  # a paused process cannot run its stop
                    steps.append(("stop", i, -1))
                if w.manual_left:
                    steps.append(("manual", i, self.k))
            if "crash" in self.faults:
                steps.append(("crash", i, -1))
        if "unanswered" in self.faults:
            steps += [("unanswered", i, k) for kind, i, k in steps if kind == "claim" and k < self.k]
        if not urgent:
            steps.append(("tick", -1, -1))
        if w.replica is not None and w.replica != w.store:
            steps += [("replicate", -1, -1), ("failover", -1, -1)]
        return steps

    def apply(self, w: World[S], step: Step) -> tuple[World[S], Note]:
        kind, i, k = step
        if kind == "tick":
            return replace(w, now=w.now + 1), None
        if kind == "replicate":
            return replace(w, replica=w.store, unreplicated=self.no_wins), None
        if kind == "failover":
            assert w.replica is not None
            forgotten = tuple(f | won for f, won in zip(w.forgotten, w.unreplicated, strict=True))
            return replace(w, store=w.replica, unreplicated=self.no_wins, forgotten=forgotten), None
        inst = w.instances[i]
        if kind == "crash":
            return self._with(w, i, Instance(CRASHED, inst.skew, (DONE,) * self.runs)), None
        if kind == "stop":
            store = w.store
            for k, phase in enumerate(inst.phases):
                if isinstance(phase, Holding):
                    store = self.model.stop_run(store, self.slot_of(k), token(i), w.now, phase.attempt, k >= self.k)
            return self._with(replace(w, store=store), i, Instance(STOPPED, inst.skew, (DONE,) * self.runs)), None
        if kind in ("pause", "resume"):
            return self._with(w, i, replace(inst, status=PAUSED if kind == "pause" else RESUMED)), None
        slot, me, phase = self.slot_of(k), token(i), inst.phases[k]
        note: Note = None
        if kind == "manual":
            w = replace(w, manual_left=False)
        if kind == "unanswered":  # the store takes the claim; the instance hears nothing and will send it again
            store, claim = self.model.claim(w.store, slot, me, w.now)
            backup = isinstance(phase, Backup) or (isinstance(phase, Unanswered) and phase.backup)
            w, note, phase = replace(w, store=store, unanswered=w.unanswered | {(i, k)}), claim, Unanswered(backup)
            if claim.outcome is Outcome.OVERLAP:  # the store recorded the skip, whoever heard of it
                w = replace(w, skipped=w.skipped | {k})
        elif kind in ("claim", "manual"):
            store, claim = self.model.claim(w.store, slot, me, w.now)
            w, note = replace(w, store=store, unanswered=w.unanswered - {(i, k)}), claim
            if claim.outcome is Outcome.WON:
                phase = Holding(claim.attempt, w.now + claim.lease_ms_left)
                w = replace(w, top_fence=max(w.top_fence, claim.fence))
                if self.failover:
                    w = replace(w, unreplicated=_add(w.unreplicated, k, (i, claim.attempt)))
            elif claim.outcome is Outcome.RUNNING:
                phase = Backup(w.now + claim.lease_ms_left)
            else:
                phase = DONE
                if claim.outcome is Outcome.OVERLAP:
                    w = replace(w, skipped=w.skipped | {k})
        elif kind == "skip":
            w, phase = replace(w, store=self.model.skip(w.store, slot, me, w.now)), DONE
        elif kind == "heartbeat":
            assert isinstance(phase, Holding)
            store, left = self.model.heartbeat(w.store, slot, me, w.now)
            w, note = replace(w, store=store), left
            phase = replace(phase, lease_end=w.now + left) if left > 0 else DONE
        elif kind == "end":
            completed = tuple(min(2, c + 1) if j == k else c for j, c in enumerate(w.completed))
            w, phase = replace(w, store=self.model.finish(w.store, slot, me, w.now), completed=completed), DONE
        phases = tuple(phase if j == k else p for j, p in enumerate(inst.phases))
        return self._with(w, i, replace(inst, phases=phases)), note

    @staticmethod
    def _with(w: World[S], i: int, inst: Instance) -> World[S]:
        return replace(w, instances=tuple(inst if j == i else x for j, x in enumerate(w.instances)))

    # --- properties ----------------------------------------------------------------------------------------------

    def transition_problems(self, before: World[S], step: Step, note: Note) -> list[str]:
        """P5 and P6 judge a win against what was acknowledged before it."""
        if step[0] not in ("claim", "manual") or not isinstance(note, Claim) or note.outcome is not Outcome.WON:
            return []
        _, i, k = step
        problems = []
        others = {o for o, attempt in before.forgotten[k] if o != i and note.attempt <= attempt}
        if others:
            who = ", ".join(token(o) for o in sorted(others))
            lost = f"after the failover lost {who}'s acknowledged win"
            problems.append(f"P5: {self.run_name(k)} won by {token(i)} {lost}")
        if note.fence <= before.top_fence:
            problems.append(
                f"P6: {token(i)} won {self.run_name(k)} with fence {note.fence}, not above {before.top_fence}"
            )
        return [p for p in problems if p[:2] in self.checks]

    def state_problems(self, w: World[S]) -> list[str]:
        holders: dict[int, list[tuple[int, int]]] = {}
        for i, inst in enumerate(w.instances):
            for k, phase in enumerate(inst.phases):
                if isinstance(phase, Holding):
                    holders.setdefault(k, []).append((i, phase.attempt))
        problems = []
        for k in range(self.runs):
            running = holders.get(k, [])
            if w.completed[k] > 1:
                problems.append(f"P1: {self.run_name(k)} ran to the end twice")
            if len(running) > 1:
                who = " and ".join(f"{token(i)} (attempt {a})" for i, a in running)
                problems.append(f"P1: {self.run_name(k)} is executed by {who} at once")
                if self.model.leases:  # whatever their attempts: a failover can grant one attempt twice
                    problems.append(f"P4: {self.run_name(k)} is held by {who} at once")
        if self.model.leases and len(holders) > 1:
            problems.append(f"P3: {' and '.join(self.run_name(k) for k in sorted(holders))} are executed at once")
        for k in range(self.k):
            # Due while healthy: an instance that scheduled the slot has been up all along.
            healthy = [
                token(i)
                for i, x in enumerate(w.instances)
                if x.status == UP and FIRST_SLOT + k > x.skew and (i, k) not in w.unanswered
            ]
            pending = any(not isinstance(inst.phases[k], Done) for inst in w.instances)
            if healthy and not w.completed[k] and not pending and k not in w.skipped:
                problems.append(f"P2: slot {k} will never run, though {', '.join(healthy)} stayed healthy")
        return [p for p in problems if p[:2] in self.checks]

    # --- search --------------------------------------------------------------------------------------------------

    def run(self, depth: int) -> Result:
        started = time.perf_counter()
        parents: dict[World[S], tuple[World[S], Step, Note] | None] = {}
        frontier = self.initial()
        for world in frontier:
            parents[world] = None
        for _ in range(depth):
            following: list[World[S]] = []
            for world in frontier:
                for step in self.moves(world):
                    after, note = self.apply(world, step)
                    problems = self.transition_problems(world, step, note)
                    if after not in parents:
                        parents[after] = (world, step, note)
                        problems += self.state_problems(after)
                        following.append(after)
                    if problems:
                        trace = [*self._trace(parents, world), self._describe(world, step, note)]
                        return Result(len(parents), time.perf_counter() - started, problems, trace)
            frontier = following
        return Result(len(parents), time.perf_counter() - started, [], [])

    def _trace(self, parents: dict[World[S], tuple[World[S], Step, Note] | None], world: World[S]) -> list[str]:
        lines = []
        link = parents[world]
        while link is not None:
            before, step, note = link
            lines.append(self._describe(before, step, note))
            world, link = before, parents[before]
        clocks = ", ".join(f"{token(i)} {inst.skew:+d}" for i, inst in enumerate(world.instances))
        return [f"start: store time 0, clocks {clocks}; slot k is due at time {FIRST_SLOT} + k", *reversed(lines)]

    def _describe(self, before: World[S], step: Step, note: Note) -> str:
        kind, i, k = step
        at = f"t={before.now}"
        if kind == "tick":
            return f"{at} time passes: t={before.now + 1}"
        if kind == "replicate":
            return f"{at} the replica catches up"
        if kind == "failover":
            return f"{at} failover: the replica takes over"
        if kind in ("crash", "stop", "pause", "resume"):
            return f"{at} {token(i)} {'crashe' if kind == 'crash' else kind}s"
        if kind == "manual":
            assert isinstance(note, Claim)
            return f"{at} {token(i)} calls run_now: {_answer(note, before.now)}"
        what = {"claim": "claims", "unanswered": "claims", "skip": "skips (too late)", "heartbeat": "heartbeats",
                "end": "ends"}[kind]  # fmt: skip
        line = f"{at} {token(i)} {what} {self.run_name(k)}"
        if isinstance(before.instances[i].phases[k], Unanswered):
            line += " again"
        if isinstance(note, Claim):
            lost = ", an answer that is lost" if kind == "unanswered" else ""
            return f"{line}: {_answer(note, before.now)}{lost}"
        if kind == "heartbeat":
            return f"{line}: lease until t={before.now + note}" if note else f"{line}: refused"
        return line


def _answer(claim: Claim, now: int) -> str:
    until = f"lease until t={now + claim.lease_ms_left}"
    match claim.outcome:
        case Outcome.WON:
            text = f"won attempt {claim.attempt} fence {claim.fence}"
            return f"{text}, {until}" if claim.lease_ms_left else text
        case Outcome.RUNNING if claim.attempt == 0:
            return f"early, another run is live: claim again at t={now + claim.lease_ms_left}"
        case Outcome.RUNNING:
            return f"running (attempt {claim.attempt}), {until}"
        case Outcome.OVERLAP:
            return f"overlap: another run's {until}"
        case Outcome.DONE:
            return f"done (attempt {claim.attempt})"
        case _:
            return claim.outcome.value


def _add(sets: tuple[frozenset[M], ...], k: int, member: M) -> tuple[frozenset[M], ...]:
    return tuple(s | {member} if j == k else s for j, s in enumerate(sets))


def _names(text: str, allowed: Sequence[str], what: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in allowed]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(unknown)}; choose from {', '.join(allowed)}")
    return names


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m models.explore", description=__doc__.split("\n")[0])
    parser.add_argument("--strategy", choices=sorted(MODELS), required=True)
    parser.add_argument("--instances", type=int, default=2)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--depth", type=int, default=10, help="longest trace explored, in steps (default 10)")
    parser.add_argument(
        "--faults", type=lambda text: _names(text, FAULTS, "fault"), default=list(DEFAULT_FAULTS),
        help=f"comma list of {', '.join(FAULTS)} (default {','.join(DEFAULT_FAULTS)}; '' for none)",
    )  # fmt: skip
    parser.add_argument(
        "--check", type=lambda text: _names(text, list(PROPERTIES), "property"), default=list(PROPERTIES),
        help="comma list of the properties to check (default all)",
    )  # fmt: skip
    parser.add_argument("--expect-violation", action="store_true", help="exit 0 only if a violation is found")
    args = parser.parse_args(argv)
    for count in ("instances", "slots", "depth"):  # an exploration of none finds nothing: "no violation" misleads
        if getattr(args, count) < 1:
            parser.error(f"argument --{count}: 1 or more, not {getattr(args, count)}")
    try:
        explorer = Explorer(MODELS[args.strategy], args.instances, args.slots, args.faults, args.check)
    except ValueError as error:
        parser.error(str(error))
    print(
        f"{args.strategy}: {args.instances} instances, {args.slots} slots, depth {args.depth}, "
        f"faults {','.join(args.faults) or 'none'}, checking {','.join(args.check)}"
    )
    result = explorer.run(args.depth)
    rate = result.states / result.seconds if result.seconds else 0.0
    print(f"explored {result.states} states in {result.seconds:.2f} s ({rate:,.0f} states/s)")
    if not result.problems:
        print("no violation")
        return 1 if args.expect_violation else 0
    print(f"violation after {len(result.trace) - 1} steps:")
    for problem in result.problems:
        print(f"  {problem} ({PROPERTIES[problem[:2]]})")
    for number, line in enumerate(result.trace):
        print(f"{number:>4}. {line}")
    return 0 if args.expect_violation else 1


if __name__ == "__main__":
    sys.exit(main())
