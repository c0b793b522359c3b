"""The virtual-time simulator: time, determinism, faults and checkers."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace as Stub
from typing import Any

import fakeredis
import pytest
import redis.exceptions

from anarchon import RedisBackend, Scheduler, StoreError, StoreUnavailableError
from anarchon._adapters import adapt
from anarchon._strategies._claim_only import SERVER_TIME
from anarchon._strategies.lease import CLAIM as LEASE_CLAIM
from sim import fakestore
from sim import scenario as scenarios
from sim.bench import without_the_store
from sim.checkers import true_s
from sim.history import Execution, History, RecordingStrategy
from sim.links import Link, NotSent
from sim.replica import written_keys
from sim.run import Outcome, simulate
from sim.scenario import FaultSpec, Scenario, ScenarioError, parse
from sim.vtime import SimulationDeadlock, run_virtual
from sim.world import EPOCH_S, SimClock, SimStore, World

REPO = Path(__file__).resolve().parents[2]


def test_virtual_time_jumps_and_is_the_stores_clock() -> None:
    async def main() -> tuple[float, list[int], bytes | str | None, bytes]:
        store = fakeredis.FakeAsyncRedis()
        await store.set("k", "v", px=1500)
        began = asyncio.get_running_loop().time()
        await asyncio.sleep(3600)
        seconds, _ = await store.time()
        value = await store.get("k")
        entry_id = await store.xadd("s", {"f": "v"})
        await store.aclose()
        return asyncio.get_running_loop().time() - began, [seconds], value, entry_id

    wall = time.perf_counter()
    elapsed, [store_seconds], value, entry_id = run_virtual(main(), epoch_s=EPOCH_S, seed=1)
    assert elapsed == 3600
    assert store_seconds == EPOCH_S + 3600
    assert value is None  # expired in virtual time
    assert entry_id == f"{(EPOCH_S + 3600) * 1000}-0".encode()  # stream ids too
    assert time.perf_counter() - wall < 60  # an hour of sleeping took no real hour


def test_the_embedded_store_fails_a_script_where_it_sets_a_global() -> None:
    """As on Redis: the script stops at the assignment (its earlier writes stay, its later ones never happen),
    and the scripts after it run normally."""
    fakestore.install()

    async def main() -> tuple[tuple[bytes | str | None, bytes | str | None], object]:
        store = fakeredis.FakeAsyncRedis()
        with pytest.raises(redis.exceptions.ResponseError, match="global variables: stray"):
            await store.eval("redis.call('SET', 'before', 1); stray = 5; redis.call('SET', 'after', 1)", 0)
        values = (await store.get("before"), await store.get("after"))
        again = await store.eval("local fine = 2; return fine", 0)
        await store.aclose()
        return values, again

    values, again = asyncio.run(main())
    assert values == (b"1", None)
    assert again == 2


def test_the_embedded_store_caches_scripts_by_sha_as_redis_does() -> None:
    """EVAL caches the script for EVALSHA, SCRIPT FLUSH forgets it (NOSCRIPT until EVAL again), and a script that
    does not compile is refused and not cached."""
    fakestore.install()

    async def main() -> list[object]:
        store = fakeredis.FakeAsyncRedis()
        source, broken = "return ARGV[1]", "return ("
        seen: list[object] = [await store.eval(source, 0, "a")]
        sha = hashlib.sha1(source.encode()).hexdigest()
        seen.append(await store.evalsha(sha, 0, "b"))
        await store.script_flush()
        for script in (sha, hashlib.sha1(broken.encode()).hexdigest()):
            with pytest.raises(redis.exceptions.NoScriptError):
                await store.evalsha(script, 0, "c")
        with pytest.raises(redis.exceptions.ResponseError, match="unexpected symbol"):
            await store.eval(broken, 0)
        with pytest.raises(redis.exceptions.NoScriptError):
            await store.evalsha(hashlib.sha1(broken.encode()).hexdigest(), 0)
        seen.append(await store.eval(source, 0, "d"))
        seen.append(await store.evalsha(sha, 0, "e"))
        await store.aclose()
        return seen

    assert asyncio.run(main()) == [b"a", b"b", b"d", b"e"]


def test_the_embedded_connection_speaks_resp2_as_anarchons_connections_do() -> None:
    """A score is a bulk string ("2", as Redis 5+ sends it over RESP2), not RESP3's double ("2.0")."""

    async def main() -> list[object]:
        connection = fakestore.EmbeddedConnection(fakeredis.FakeServer(version=(7,)))
        await connection.execute(["ZADD", "z", 2, "b"])
        replies = [await connection.execute(["ZSCORE", "z", "b"]), await connection.execute(["HGETALL", "z2"])]
        replies.append(await connection.execute(["ZRANGE", "z", 0, -1, "WITHSCORES"]))
        await connection.close()
        return replies

    assert asyncio.run(main()) == ["2", [], ["b", "2"]]


def test_a_simulation_that_can_never_progress_says_so() -> None:
    async def stuck() -> None:
        await asyncio.get_running_loop().create_future()

    with pytest.raises(SimulationDeadlock):
        run_virtual(stuck(), epoch_s=EPOCH_S, seed=1)


@pytest.mark.parametrize("scenario", scenarios.load_all(), ids=lambda s: s.name)
def test_one_seed_gives_one_history(scenario: scenarios.Scenario) -> None:
    for strategy in scenarios.STRATEGIES:
        first, second = simulate(scenario, strategy, 7), simulate(scenario, strategy, 7)
        assert first.digest == second.digest
        assert first.history.events == second.history.events


def test_different_seeds_give_different_histories() -> None:
    scenario = scenarios.load("winner-crash")
    assert len({simulate(scenario, "lease", seed).digest for seed in range(4)}) > 1


def test_the_benchs_store_free_run_replays_the_very_commands_it_recorded() -> None:
    """The bench's bound on the simulator's speed with a free store holds only if the replayed run sends what
    the recorded one sent: a run that does not (another seed, other tokens) is refused, not timed."""
    scenario = scenarios.load("steady")
    _, commands = without_the_store(lambda: simulate(scenario, "lease", 3))
    assert commands > 100
    seeds = iter((3, 4))
    with pytest.raises(RuntimeError, match="the replayed simulation sent"):
        without_the_store(lambda: simulate(scenario, "lease", next(seeds)))


def test_the_command_line_replays_a_run_and_prints_json() -> None:
    def run(*args: str) -> dict[str, object]:
        done = subprocess.run(
            [sys.executable, "-m", "sim", "run", "zombie", "--strategy", "lease", "--seed", "5", *args],
            cwd=REPO, capture_output=True, text=True, timeout=120, check=True,
        )  # fmt: skip
        return dict(json.loads(done.stdout))

    first, second = run("--json"), run("--json")
    assert first["digest"] == second["digest"]
    assert first["seed"] == 5
    assert first["verdicts"] == {"P1": "invalid", "P2": "valid", "P3": "valid", "P4": "invalid", "P5": "valid",
                                 "P6": "valid", "P7": "valid", "lateness": "valid"}  # fmt: skip
    assert "python -m sim run" in str(first["replay"])
    text = subprocess.run(
        [sys.executable, "-m", "sim", "run", "zombie", "--seed", "5"], cwd=REPO, capture_output=True, text=True,
        timeout=120, check=True,
    ).stdout  # fmt: skip
    assert f"digest {first['digest']}" in text
    assert "replay: python -m sim run" in text  # printed because the run found a violation


def test_the_command_line_fails_a_run_that_does_not_get_its_declared_verdicts(tmp_path: Path) -> None:
    """Exit status 0 when every verdict the scenario declares for the strategy holds, 1 when one does not (said,
    with its witness), 2 for a scenario or server it cannot run."""
    declared = (REPO / "scenarios" / "zombie.toml").read_text()
    wrong = tmp_path / "zombie.toml"
    wrong.write_text(declared.replace('[expect.lease]\nP1 = "invalid"', '[expect.lease]\nP1 = "valid"'))

    def run(path: Path, *args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "sim", "run", str(path), "--strategy", "lease", "--seed", "1", *args]
        return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)

    held = run(REPO / "scenarios" / "zombie.toml")
    assert held.returncode == 0, held.stdout
    assert "as zombie declares for lease (4 verdicts)" in held.stdout
    departed = run(wrong)
    assert departed.returncode == 1
    assert "not as zombie declares for lease:\n  P1 is invalid, expected valid: tick slot at" in departed.stdout
    as_json = run(wrong, "--json")
    assert as_json.returncode == 1
    assert [d.split(":")[0] for d in json.loads(as_json.stdout)["departures"]] == ["P1 is invalid, expected valid"]
    unknown = run(tmp_path / "no-such-scenario")
    assert unknown.returncode == 2
    assert "no scenario" in unknown.stderr
    assert "or one of failover, " in unknown.stderr  # the scenarios it knows by name


def test_faults_are_history_entries() -> None:
    outcome = simulate(scenarios.load("winner-crash"), "lease", 1)
    faults = [e for e in outcome.history.events if e.kind == "fault"]
    assert [e.value.split()[-1] for e in faults] == ["killed", "restarted"]
    assert faults[0].t == pytest.approx(31.0)
    assert faults[1].t == pytest.approx(61.0)


@pytest.mark.parametrize("pause_s", [38, 45])
def test_a_zombie_still_paused_when_the_simulation_ends_is_judged_as_running(pause_s: int) -> None:
    """The winner is paused past its lease and a backup takes its run over. Whether it resumes just before the end
    (80 s) or after it, it never stopped its job: the end kills it as a crash would, but its job counts as going
    on until the end, not as stopped when its pause began (that hid the zombie from P1, P3 and P4)."""
    scenario = parse({
        "name": "zombie-end", "duration_s": 80, "scheduler": {"lease_ms": 3000, "heartbeat_ms": 1000},
        "instances": [{"name": n} for n in "abc"],
        "jobs": [{"name": "tick", "cron": "*/20 * * * * *", "work_s": 6.0}],
        "faults": [{"at_s": 41, "kind": "pause", "instance": "winner", "duration_s": pause_s}],
    })  # fmt: skip
    outcome = simulate(scenario, "lease", 1)
    assert {name: outcome.judgement.checks[name].status for name in ("P1", "P3", "P4")} == dict.fromkeys(
        ("P1", "P3", "P4"), "invalid"
    )
    slot = int((EPOCH_S + 40) * 1000)
    [zombie] = [e for e in outcome.history.executions if e.slot == slot and e.attempt == 1]
    assert zombie.started == pytest.approx(40.0)
    assert zombie.ended == pytest.approx(79.0 if pause_s == 38 else 80.0)
    # Resumed at 79 s, its work (due in the pause) ended then; still paused, it was still going at the end.
    assert zombie.cut_by_end == (pause_s == 45)
    state = "ran to the end" if pause_s == 38 else "still going at the end"
    assert (
        f"{zombie.instance} attempt 1 [40.000 .. {zombie.ended:.3f}] {state}" in outcome.judgement.checks["P1"].witness
    )


@pytest.mark.parametrize(("cut_s", "taken_over"), [(2.5, False), (6.0, True)])
def test_a_run_that_ends_while_its_winner_is_cut_off_is_not_run_again(cut_s: float, taken_over: bool) -> None:
    """The winner of the slot at 40 s (4.5 s of work, 3 s lease) is cut off from the store at 44.2 s and its job
    ends at 44.5 s. Its heartbeats go on until the store has the result, so after a cut shorter than the lease
    the result finds the lease still live (the result used to be given up on at 47.5 s, 0.2 s before the link
    healed, and a backup ran the slot again at 47 s). A winner cut off for longer than its lease loses the run
    to a backup, as documented."""
    scenario = parse({
        "name": "cut-at-finish", "duration_s": 60, "scheduler": {"lease_ms": 3000, "heartbeat_ms": 1000},
        "instances": [{"name": n} for n in "abc"],
        "jobs": [{"name": "tick", "cron": "*/10 * * * * *", "work_s": 4.5}],
        "faults": [{"at_s": 44.2, "kind": "partition", "instance": "winner", "duration_s": cut_s}],
    })  # fmt: skip
    outcome = simulate(scenario, "lease", 1)
    slot = int((EPOCH_S + 40) * 1000)
    attempts = [e for e in outcome.history.executions if e.slot == slot]
    assert [(e.attempt, e.completed) for e in attempts] == [(1, True), (2, True)][: 1 + taken_over]
    assert outcome.judgement.checks["P1"].status == ("invalid" if taken_over else "valid")


@pytest.mark.parametrize("crash_at_s", [None, 45])
def test_a_process_told_to_stop_while_paused_acts_on_it_at_the_resume(crash_at_s: int | None) -> None:
    """The winner of the slot at 40 s is paused past its lease from 41 s to 51 s, and a deploy stops it at 42 s.
    A stopped process (SIGSTOP) reads its stop only when it resumes, as in live mode: its job goes on to 51 s
    beside the backup's attempt 2 (P1 and P4 invalid), not cancelled inside the pause. Killed at 45 s instead,
    before it could act on the stop, its job stopped where the pause began."""
    faults: list[dict[str, object]] = [
        {"at_s": 41, "kind": "pause", "instance": "a", "duration_s": 10},
        {"at_s": 42, "kind": "stop", "instance": "a", "timeout_s": 0, "restart_after_s": 20},
    ]
    if crash_at_s is not None:
        faults.append({"at_s": crash_at_s, "kind": "crash", "instance": "a"})
    scenario = parse({
        "name": "stop-in-pause", "duration_s": 80, "scheduler": {"lease_ms": 3000, "heartbeat_ms": 1000},
        "instances": [{"name": n} for n in "abc"],
        "jobs": [{"name": "tick", "cron": "*/20 * * * * *", "work_s": 10.0}],
        "faults": faults,
    })  # fmt: skip
    outcome = simulate(scenario, "lease", 1)
    slot = int((EPOCH_S + 40) * 1000)
    [first] = [e for e in outcome.history.executions if e.slot == slot and e.attempt == 1]
    assert first.instance == "a"  # the scenario pauses the winner
    if crash_at_s is None:
        assert (first.ended, first.completed) == (pytest.approx(51.0), True)
        assert {name: outcome.judgement.checks[name].status for name in ("P1", "P4")} == {
            "P1": "invalid", "P4": "invalid"
        }  # fmt: skip
        stopped = [e.t for e in outcome.history.events if e.kind == "fault" and e.value == "instance a stopped"]
        assert stopped == [pytest.approx(51.0)]
    else:
        assert (first.ended, first.completed) == (pytest.approx(41.0), False)


def test_a_pause_that_begins_during_a_stop_holds_its_timeout_to_the_resume() -> None:
    """Stopped at 12 s with 3 s to finish its job, the winner of the slot at 10 s is paused from 13 s to 23 s. As a
    live process (SIGSTOP) does, it acts on the timeout that ran out meanwhile when it resumes: its job is cut
    short at 23 s, beside the backup that took the run over when its lease ran out (P1 and P4 invalid), not
    inside the pause, where a paused process does nothing."""
    scenario = parse({
        "name": "pause-in-stop", "duration_s": 40, "scheduler": {"lease_ms": 3000, "heartbeat_ms": 1000},
        "instances": [{"name": "a"}, {"name": "b"}],
        "jobs": [{"name": "tick", "cron": "*/10 * * * * *", "work_s": 20.0}],
        "faults": [
            {"at_s": 12, "kind": "stop", "instance": "a", "timeout_s": 3},
            {"at_s": 13, "kind": "pause", "instance": "a", "duration_s": 10},
        ],
    })  # fmt: skip
    outcome = simulate(scenario, "lease", 1)
    slot = int((EPOCH_S + 10) * 1000)
    runs = sorted((e.attempt, e.instance, e.ended, e.completed) for e in outcome.history.executions if e.slot == slot)
    assert runs == [(1, "a", pytest.approx(23.0), False), (2, "b", pytest.approx(35.001), True)]
    stopped = [e.t for e in outcome.history.events if e.kind == "fault" and e.value == "instance a stopped"]
    assert stopped == [pytest.approx(23.0)]
    assert {name: outcome.judgement.checks[name].status for name in ("P1", "P4")} == dict.fromkeys(
        ("P1", "P4"), "invalid"
    )


def test_clock_faults_are_history_entries_and_move_the_clock_without_a_jump() -> None:
    scenario = parse({
        "name": "clocks", "duration_s": 30,
        "instances": [{"name": "a", "offset_ms": -250}, {"name": "b"}],
        "jobs": [{"name": "tick", "cron": "*/5 * * * * *", "work_s": 1}],
        "faults": [{"at_s": 10, "kind": "drift", "instance": "b", "drift": 0.5}],
    })  # fmt: skip
    outcome = simulate(scenario, "lease", 1)
    faults = [(e.t, e.op, e.value) for e in outcome.history.events if e.kind == "fault"]
    assert faults == [
        (0.0, "skew", "instance a clock -250 ms, drift +0"),
        (10.0, "drift", "instance b clock drifts +0.5"),
    ]
    # From 10 s on, b's clock runs 1.5 times as fast: its slot at 20 s (on its clock) comes at 16.67 s true time.
    starts = sorted((e.started, e.instance) for e in outcome.history.executions if e.slot == int((EPOCH_S + 20) * 1000))
    assert starts[0] == (pytest.approx(10 + 10 / 1.5), "b")


@pytest.mark.parametrize(("drift", "ends_at_s"), [(1.0, 6.0), (-0.5, 18.0)])
def test_a_sleep_over_a_drift_change_ends_when_the_instance_clock_reaches_its_end(
    drift: float, ends_at_s: float
) -> None:
    """10 s on an instance clock whose rate changes at 2 s: the 8 s left take 4 s at twice the speed, 16 s at
    half. A sleep left to end at the old rate ended at 10 s (18 s by the faster clock): a heartbeat keeper that
    slept so lost a lease it held, and a backup ran the job beside it."""

    async def main() -> float:
        clock = SimClock()

        async def change() -> None:
            await asyncio.sleep(2)
            clock.set_drift(drift)

        changing = asyncio.ensure_future(change())
        await clock.sleep(10)
        await changing
        assert clock.monotonic() == pytest.approx(10)
        return asyncio.get_running_loop().time()

    assert run_virtual(main(), epoch_s=EPOCH_S, seed=1) == pytest.approx(ends_at_s)


@pytest.mark.parametrize("drift", [2.0, 5.0])
def test_a_clock_running_several_times_as_fast_does_not_stall_virtual_time(drift: float) -> None:
    """A sleep until a moment of such a clock ended a rounding error short of it; the heartbeat keeper asked for
    the rest, a sleep too short to move the loop's time, and again, for ever (the simulation never ended)."""
    scenario = parse({
        "name": "fast", "duration_s": 40, "scheduler": {"lease_ms": 3000, "heartbeat_ms": 1000},
        "instances": [{"name": "a"}, {"name": "b"}],
        "jobs": [{"name": "tick", "cron": "*/10 * * * * *", "work_s": 2}],
        "faults": [{"at_s": 20, "kind": "drift", "instance": "a", "drift": drift}],
    })  # fmt: skip
    outcome = simulate(scenario, "lease", 1)
    ran = {e.slot // 1000 - EPOCH_S for e in outcome.history.executions}
    assert {10, 20, 30} <= ran  # and the fast clock's early ones (a slot at 60 s of its own comes before 30 s true)
    assert outcome.judgement.checks["P1"].status == "valid"


def test_a_fault_with_no_instance_to_strike_is_recorded_and_a_failing_fault_is_not_silent() -> None:
    base = {
        "name": "f", "duration_s": 20, "instances": [{"name": "a"}],
        "jobs": [{"name": "tick", "cron": "*/5 * * * * *", "work_s": 1}],
    }  # fmt: skip
    crash = {"at_s": 2, "kind": "crash", "instance": "a"}
    again = {"at_s": 3, "kind": "crash", "instance": "a", "restart_after_s": 1}
    pause = {"at_s": 5, "kind": "pause", "instance": "winner", "duration_s": 1}
    outcome = simulate(parse({**base, "faults": [crash, again, pause]}), "lease", 1)
    faults = [(e.t, e.op, e.value) for e in outcome.history.events if e.kind == "fault"]
    assert faults == [
        (2.0, "crash", "instance a killed"),
        (3.0, "crash", "instance a is down already: nothing struck"),
        (5.0, "pause", "no instance is up: nothing struck"),
    ]
    assert [(w.kind, w.start, w.end) for w in outcome.fault_windows] == [("crash", 2.0, 20.0)]
    # A file says so when it is parsed; a fault built past the parser still fails the run, loudly.
    with pytest.raises(ScenarioError, match="soon"):
        parse({**base, "faults": [{"at_s": 2, "kind": "skew", "instance": "a", "offset_ms": "soon"}]})
    broken = dataclasses.replace(parse(base), faults=(FaultSpec(2.0, "skew", {"instance": "a", "offset_ms": "soon"}),))
    with pytest.raises(ValueError, match="soon"):
        simulate(broken, "lease", 1)


def _manual_run_on_b(*faults: dict[str, object]) -> Outcome:
    """``faults`` strike b (at 12 s unless they say); run_now is called on b at 15 s."""
    scenario = parse({
        "name": "manual", "duration_s": 40, "instances": [{"name": "a"}, {"name": "b"}],
        "jobs": [{"name": "tick", "cron": "*/10 * * * * *", "work_s": 1.0}],
        "faults": [*({"at_s": 12, "instance": "b", **fault} for fault in faults),
                   {"at_s": 15, "kind": "manual", "instance": "b", "job": "tick"}],
    })  # fmt: skip
    return simulate(scenario, "lease", 1)


def test_a_manual_run_on_a_partitioned_instance_fails_in_the_history_and_the_simulation_goes_on() -> None:
    outcome = _manual_run_on_b({"kind": "partition", "duration_s": 10})
    faults = [(e.t, e.value) for e in outcome.history.events if e.kind == "fault"]
    assert faults == [
        (12.0, "instance b cut off from the store"),
        (15.0, "instance b runs tick now"),
        (15.0, "instance b's manual run of tick failed: b: the link to the store is cut"),
        (22.0, "instance b reconnected"),
    ]
    claim = [(e.kind, e.run[0]) for e in outcome.history.events if e.op == "claim" and e.t == 15.0]
    assert claim == [("invoke", "m"), ("fail", "m")]  # never sent: a failure, not an unknown outcome
    # The simulation ran to its end: the slot at 30 s ran; the one at 40 s falls at the end, when every link dies.
    assert max(e.started for e in outcome.history.executions) == 30.0


def test_a_manual_run_on_a_down_instance_is_an_entry_in_the_history() -> None:
    outcome = _manual_run_on_b({"kind": "crash"})
    faults = [(e.t, e.value) for e in outcome.history.events if e.kind == "fault"]
    assert faults == [(12.0, "instance b killed"), (15.0, "instance b is down: no manual run of tick")]
    assert not [e for e in outcome.history.executions if e.manual]
    # Restarted within a pause, its process is still starting: it cannot take a manual run either.
    outcome = _manual_run_on_b({"kind": "pause", "duration_s": 10}, {"at_s": 13, "kind": "crash", "restart_after_s": 1})
    faults = [(e.t, e.value) for e in outcome.history.events if e.kind == "fault"]
    assert faults == [
        (12.0, "instance b paused"),
        (13.0, "instance b killed"),
        (15.0, "instance b is starting: no manual run of tick"),
        (22.0, "instance b resumed"),
        (22.0, "instance b restarted"),
    ]
    assert not [e for e in outcome.history.executions if e.manual]


def _promoted_after(*faults: dict[str, object]) -> tuple[str, str]:
    """Slot 40 is claimed at 40 s (and finished at 40.3 s); the replica is promoted at 45 s; an instance 6 s behind
    claims slot 40 at 46 s. P1 and P5 say whether the promoted replica had received the claim."""
    scenario = parse({
        "name": "replication", "duration_s": 60,
        "instances": [{"name": "a"}, {"name": "behind", "offset_ms": -6000}],
        "jobs": [{"name": "tick", "cron": "*/20 * * * * *", "work_s": 0.3}],
        "faults": [*faults, {"at_s": 45, "kind": "failover", "lag_ms": 0}],
    })  # fmt: skip
    verdicts = simulate(scenario, "lease", 1).judgement.verdicts
    return verdicts["P1"].status, verdicts["P5"].status


def test_the_replica_receives_the_replication_log_after_its_lag_or_a_hold() -> None:
    assert _promoted_after() == ("valid", "valid")
    assert _promoted_after({"at_s": 1, "kind": "replication-hold", "duration_s": 0.5}) == ("valid", "valid")
    held = {"at_s": 39, "kind": "replication-hold"}
    assert _promoted_after({**held, "duration_s": 10}) == ("invalid", "invalid")  # still held at the failover
    assert _promoted_after({**held, "duration_s": 5}) == ("valid", "valid")  # released at 44 s


def test_the_replication_log_copies_the_keys_a_script_may_write_and_none_for_a_clock_read() -> None:
    """A script is logged as writing the keys it declares; the claim-only strategies' clock read declares the
    job's runs stream only to be routed to its node, and writes nothing."""
    keys = ["{cron:j}:state", "{cron:j}:active", "{cron:j}:slots", "{cron:j}:runs", "{cron:j}:results"]
    assert written_keys(("EVALSHA", LEASE_CLAIM.sha, 5, *keys, "1", "t", "a")) == keys
    assert written_keys(("EVALSHA", SERVER_TIME.sha, 1, "cron:j:runs")) == []
    assert written_keys(("EVAL", SERVER_TIME.source, 1, "cron:j:runs")) == []
    assert written_keys(("XADD", "cron:j:runs", "1-0", "f", "v")) == ["cron:j:runs"]


def test_replication_loses_nothing_for_good_short_of_a_failover() -> None:
    """A replica whose link broke resynchronises when it is back (the primary's backlog replayed, or a full copy):
    no fault makes it miss writes for good while the primary lives."""
    with pytest.raises(ScenarioError, match="replication-drop"):
        _promoted_after({"at_s": 39, "kind": "replication-drop", "duration_s": 5})


def test_a_failover_to_a_server_whose_clock_is_behind_keeps_the_lease_to_its_length() -> None:
    """The replica promoted at 15 s has a clock 60 s behind the old primary's: its TIME reads 60 s less, and the
    runs stream's last id (the claim of 10 s) stays ahead of it. The winner of the slot at 20 s dies a second
    in: a backup takes the run over once its 3 s lease ends by the new clock, not a minute later."""
    scenario = parse({
        "name": "clock-behind", "duration_s": 40, "scheduler": {"lease_ms": 3000, "heartbeat_ms": 1000},
        "instances": [{"name": "a"}, {"name": "b"}],
        "jobs": [{"name": "tick", "cron": "*/10 * * * * *", "work_s": 5.0}],
        "faults": [
            {"at_s": 15, "kind": "failover", "lag_ms": 0, "clock_ms": -60_000},
            {"at_s": 21, "kind": "crash", "instance": "winner"},
        ],
    })  # fmt: skip
    outcome = simulate(scenario, "lease", 1)
    [failover] = [e.value for e in outcome.history.events if e.op == "failover"]
    assert failover == "promoted a replica 0 ms behind, its clock -60000 ms from the old one's"
    attempts = sorted((e.attempt, e.started) for e in outcome.history.executions if e.slot == EPOCH_S * 1000 + 20_000)
    assert [attempt for attempt, _ in attempts] == [1, 2]
    assert 23 <= attempts[1][1] <= 25, attempts  # the lease (3 s from 20 s, renewed until the crash) then ends
    assert outcome.judgement.verdicts["P4"].status == "valid"


def test_the_promoted_replica_gets_a_replica_of_its_own() -> None:
    # A first failover at 25 s; the claim at 40 s reaches the new primary's replica before the second one.
    assert _promoted_after({"at_s": 25, "kind": "failover", "lag_ms": 0}) == ("valid", "valid")


def test_a_promoted_replica_keeps_each_keys_expiry_and_drops_the_keys_expired_by_then() -> None:
    async def main() -> dict[str, tuple[object, object]]:
        store = SimStore(replicated=True)
        primary = store.connection()
        for key, ttl_ms in (("ends-now", 2000), ("ends-later", 2500)):
            await primary.execute(["SET", key, "v", "PX", ttl_ms])
        await primary.execute(["SET", "stays", "v"])
        await asyncio.sleep(2.0)  # "ends-now" expires at this very instant
        store.promote(0.0)
        promoted = store.connection()
        return {key: (await promoted.execute(["GET", key]), await promoted.execute(["PTTL", key]))
                for key in ("ends-now", "ends-later", "stays")}  # fmt: skip

    assert run_virtual(main(), epoch_s=EPOCH_S, seed=1) == {
        "ends-now": (None, -2),  # gone, not made persistent
        "ends-later": ("v", 500),
        "stays": ("v", -1),
    }


def test_a_failover_lag_loses_the_writes_of_its_last_moments() -> None:
    scenario = parse({
        "name": "lag", "duration_s": 60,
        "instances": [{"name": "a"}, {"name": "behind", "offset_ms": -6000}],
        "jobs": [{"name": "tick", "cron": "*/20 * * * * *", "work_s": 0.3}],
        "faults": [{"at_s": 45, "kind": "failover", "lag_ms": 6000}],
    })  # fmt: skip
    outcome = simulate(scenario, "lease", 1)
    assert (outcome.judgement.verdicts["P1"].status, outcome.judgement.verdicts["P5"].status) == ("invalid", "invalid")
    [window] = [w for w in outcome.fault_windows if w.kind == "failover"]
    assert (window.start, window.end) == (40.0, 45.0)  # 6 s behind, the replica lacked everything from the claim on


def _rerun_by_a_late_instance_across_a_failover(lag_ms: int, faults: Sequence[dict[str, Any]] = ()) -> Outcome:
    """An instance 15 s behind claims every slot 15 s late, after the script strategy has forgotten it (window_ms
    10 s): it runs every slot a second time. A failover at 22 s promotes a replica ``lag_ms`` behind."""
    scenario = parse({
        "name": "late-rerun", "duration_s": 40, "strategies": {"script": {"window_ms": 10_000}},
        "instances": [{"name": "on-time"}, {"name": "late", "offset_ms": -15_000}],
        "jobs": [{"name": "tick", "cron": "*/10 * * * * *", "work_s": 1.0, "max_late_ms": 5000}],
        "faults": [*faults, {"at_s": 22, "kind": "failover", "lag_ms": lag_ms}],
    })  # fmt: skip
    return simulate(scenario, "script", 1)


def test_a_failover_is_blamed_only_for_the_claims_its_replica_lacked() -> None:
    # 100 ms behind, the replica had everything: nothing was written from 21 s (the finish of the slot at 20 s) on.
    outcome = _rerun_by_a_late_instance_across_a_failover(lag_ms=100)
    assert [(w.kind, w.start, w.end, w.lost_writes) for w in outcome.fault_windows] == [("failover", 22.0, 22.0, False)]
    assert outcome.judgement.verdicts["P1"].status == "invalid"  # the strategy's own duplicates
    assert outcome.judgement.verdicts["P5"].status == "valid"
    # 2.5 s behind, it lacked the claim of the slot at 20 s (and its finish): that run was lost, not the others.
    outcome = _rerun_by_a_late_instance_across_a_failover(lag_ms=2500)
    assert [(w.kind, w.start, w.end, w.lost_writes) for w in outcome.fault_windows] == [("failover", 20.0, 22.0, True)]
    verdict = outcome.judgement.verdicts["P5"]
    assert (verdict.status, verdict.count) == ("invalid", 1)
    assert verdict.witness.startswith("tick slot at 20 s: won by on-time at 20.000 s, won again by late at 35")


def test_a_held_write_is_lost_only_if_the_failover_comes_before_the_hold_ends() -> None:
    # Held from 9.5 s to 10.5 s, the claim of the slot at 10 s reached the replica then: the replica had every
    # claim, and the late rerun of 10 s is the strategy's own (P1).
    outcome = _rerun_by_a_late_instance_across_a_failover(100, [{"at_s": 9.5, "kind": "replication-hold",
                                                                 "duration_s": 1.0}])  # fmt: skip
    assert outcome.judgement.verdicts["P1"].status == "invalid"
    assert outcome.judgement.verdicts["P5"].status == "valid"
    assert [(w.kind, w.lost_writes) for w in outcome.fault_windows] == [("replication-hold", True), ("failover", False)]
    # Held from 19.5 s past the failover at 22 s, the claim of 20 s never reached the replica: that run, and only
    # it, was lost.
    outcome = _rerun_by_a_late_instance_across_a_failover(100, [{"at_s": 19.5, "kind": "replication-hold",
                                                                 "duration_s": 5.0}])  # fmt: skip
    verdict = outcome.judgement.verdicts["P5"]
    assert (verdict.status, verdict.count) == ("invalid", 1)
    assert verdict.witness.startswith("tick slot at 20 s: won by on-time at 20.000 s, won again by late at 35")


def test_a_manual_run_is_recorded_under_its_own_run_id_and_overlaps_the_slot_it_shares_a_moment_with() -> None:
    """run_now at the very moment of a slot, while the slot's run starts elsewhere: two runs of one job at once,
    though their slot numbers are equal."""
    scenario = parse({
        "name": "run-now-at-slot", "duration_s": 60, "instances": [{"name": "a"}, {"name": "b"}],
        "jobs": [{"name": "report", "cron": "*/30 * * * * *", "work_s": 10.0}],
        "faults": [{"at_s": 30, "kind": "manual", "instance": "b", "job": "report"}],
    })  # fmt: skip
    outcome = simulate(scenario, "script", 1)
    [manual] = [e for e in outcome.history.executions if e.manual]
    [scheduled] = [e for e in outcome.history.executions if not e.manual and e.slot == manual.slot]
    claimed = {e.run for e in outcome.history.events if e.op == "claim" and e.token == manual.token}
    assert claimed == {manual.run}
    assert manual.run.startswith(f"m{manual.slot}-")
    assert scheduled.run == str(scheduled.slot)
    verdict = outcome.judgement.verdicts["P3"]
    assert verdict.status == "invalid"
    assert "slot at 30 s" in verdict.witness
    assert "manual run at 30 s" in verdict.witness


def test_a_clock_jump_and_late_claims_move_when_an_instance_starts_its_runs() -> None:
    def starts(fault: dict[str, object]) -> list[float]:
        scenario = parse({
            "name": "clock", "duration_s": 60, "instances": [{"name": "a"}],
            "jobs": [{"name": "tick", "cron": "*/10 * * * * *", "work_s": 1}], "faults": [fault],
        })  # fmt: skip
        outcome = simulate(scenario, "lease", 1)
        assert [e.op for e in outcome.history.events if e.kind == "fault"] == [fault["kind"]] * (
            2 if fault["kind"] == "late" else 1
        )
        return [round(e.started - (e.slot / 1000 - EPOCH_S), 3) for e in outcome.history.executions]

    # Slots at 10, 20, ... 60 s. Its clock jumps 4 s ahead at 15 s: the slot at 20 s keeps the timer set before
    # the jump, and from the slot at 30 s on it starts each run 4 s before the slot (true time).
    assert starts({"at_s": 15, "kind": "skew", "instance": "a", "offset_ms": 4000}) == [0, 0, -4, -4, -4, -4]
    # From 15 s to 35 s its clock is 3 s behind: the slots at 20 and 30 s start 3 s late, and so does the one at
    # 40 s, whose timer was set while the clock was behind; the slot at 60 s falls after the end. Woken at 20 s
    # for the slot at 20 s, a sees its clock went back 3 s: by it, a began at -3 s, before the slot at 0 s (at
    # its first instant by the clock of before, owed by no one then), which nobody ran. It runs it then.
    late = {"at_s": 15, "kind": "late", "instance": "a", "delay_ms": 3000, "duration_s": 20}
    assert starts(late) == [0, 20, 3, 3, 3, 0]


def _far_ahead(instances: list[dict[str, object]], faults: list[dict[str, object]], duration_s: int) -> Outcome:
    """a's clock jumps 15 s forward at 41 s; a job every 10 s that works 2 s, max_late_ms 20 s."""
    scenario = parse({
        "name": "far-ahead", "duration_s": duration_s, "scheduler": {"lease_ms": 3000, "heartbeat_ms": 1000},
        "instances": instances,
        "jobs": [{"name": "tick", "cron": "*/10 * * * * *", "work_s": 2.0, "max_late_ms": 20_000}],
        "faults": [{"at_s": 41, "kind": "skew", "instance": "a", "offset_ms": 15000}, *faults],
    })  # fmt: skip
    return simulate(scenario, "lease", 1)


def test_lease_a_clock_that_jumps_far_ahead_claims_the_next_slot_early_without_skipping_it() -> None:
    """At 49.5 s a claims the slot at 50 s (its timer was set before the jump) and, its clock reading 64.5 s, the
    slot at 60 s while that run holds its lease. The store's clock has not reached 60 s: the claim is told to come
    again at the slot, instead of the slot being recorded skipped-overlap (it never ran before), and runs then.
    The slot at 70 s, claimed at 54.5 s when no run is live, runs early, before it."""
    outcome = _far_ahead([{"name": "a", "offset_ms": 500}, {"name": "b"}], [], 80)
    runs = [(e.slot // 1000 - EPOCH_S, e.started) for e in outcome.history.executions]
    assert runs == [(10, 9.5), (20, 19.5), (30, 29.5), (40, 39.5), (50, 49.5), (70, 54.5), (60, 60.0),
                    (80, 64.5), (90, 74.5)]  # fmt: skip
    put_off = [e.t for e in outcome.history.events if e.kind == "ok" and e.value.startswith("running attempt=0")]
    assert put_off == [49.5]
    assert outcome.judgement.verdicts["P2"].status == "valid"
    assert not [e for e in outcome.history.events if e.value.startswith("overlap")]


def test_lease_a_claim_put_off_to_its_slot_and_sent_long_after_is_skipped_late() -> None:
    """As above, alone, and paused from 55 s to 105 s: the claim put off to the slot at 60 s is due again at 60 s
    and sent at 105 s, 45 s after, past max_late_ms (20 s). It is skipped (the store records no skip of a slot
    put off), rather than run 45 s late; the store's clock says so, the instance's ahead by 15 s would say so
    too soon."""
    outcome = _far_ahead([{"name": "a", "offset_ms": 500}], [{"at_s": 55, "kind": "pause", "instance": "a",
                                                                "duration_s": 50}], 130)  # fmt: skip
    slot_60 = [(e.t, e.op, e.value) for e in outcome.history.events if e.run == str((EPOCH_S + 60) * 1000)]
    assert slot_60[1:] == [(49.5, "claim", "running attempt=0 lease_ms=10500 fence=0"), (105.0, "skip", ""),
                           (105.0, "skip", "False")]  # fmt: skip
    assert 60 not in [e.slot // 1000 - EPOCH_S for e in outcome.history.executions]
    assert outcome.judgement.lateness.status == "valid"


def test_lease_a_claim_put_off_to_its_slot_is_late_by_the_stores_clock_through_its_retries() -> None:
    """As above, alone, cut off from the store from 59.9 s to 65.9 s: the claim put off to the slot at 60 s fails
    four times, and goes again at 67.5 s, 7.5 s after the slot by the store's clock (max_late_ms 20 s), 22.5 s by
    the instance's: it is a claim, not a skip (which the store would refuse, the slot being put off, and no
    instance would ever run or record it). The run of the slot at 80 s, started early (its claim came at 66 s, by
    a clock 15.5 s ahead), is going: the slot at 60 s waits for its lease, and runs at 70 s, instead of being
    recorded skipped-overlap."""
    outcome = _far_ahead([{"name": "a", "offset_ms": 500}], [{"at_s": 59.9, "kind": "partition", "instance": "a",
                                                                "duration_s": 6}], 100)  # fmt: skip
    slot_60 = str((EPOCH_S + 60) * 1000)
    answered = [
        (e.t, e.value) for e in outcome.history.events if e.run == slot_60 and e.kind == "ok" and e.op == "claim"
    ]
    assert answered == [  # the 4 tries between failed
        (49.5, "running attempt=0 lease_ms=10500 fence=0"),
        (67.501, "running attempt=0 lease_ms=2499 fence=0"),
        (70.001, f"won attempt=1 lease_ms=3000 fence={(EPOCH_S + 70) * 1_000_000 + 1000}"),  # the store's ms × 1000
    ]
    assert (60, 70.001) in [(e.slot // 1000 - EPOCH_S, e.started) for e in outcome.history.executions]
    assert outcome.judgement.lateness.status == "valid"
    assert outcome.judgement.verdicts["P2"].status == "valid"


def _restarted_within(fault: dict[str, object]) -> Outcome:
    """One instance, struck by ``fault`` from 15 s to 55 s, and killed at 20 s and restarted 2 s later."""
    scenario = parse({
        "name": "restart-within", "duration_s": 80, "scheduler": {"lease_ms": 3000, "heartbeat_ms": 1000},
        "instances": [{"name": "a"}], "jobs": [{"name": "tick", "cron": "*/10 * * * * *", "work_s": 1.0}],
        "faults": [{"at_s": 15, "instance": "a", "duration_s": 40, **fault},
                   {"at_s": 20, "kind": "crash", "instance": "a", "restart_after_s": 2}],
    })  # fmt: skip
    return simulate(scenario, "lease", 1)


def test_an_instance_restarted_within_a_partition_comes_back_still_cut_off() -> None:
    outcome = _restarted_within({"kind": "partition"})
    faults = [(e.t, e.value) for e in outcome.history.events if e.kind == "fault"]
    # It cannot reach the store to start before the partition ends; it starts as soon as it can.
    assert faults == [
        (15.0, "instance a cut off from the store"),
        (20.0, "instance a killed"),
        (55.0, "instance a reconnected"),
        (55.0, "instance a restarted"),
    ]
    assert not [e for e in outcome.history.events if e.kind == "ok" and 15 <= e.t < 55]
    assert [e.started for e in outcome.history.executions] == [10.0, 60.0, 70.0]


def test_an_instance_restarted_within_a_pause_comes_back_still_paused() -> None:
    outcome = _restarted_within({"kind": "pause"})
    faults = [(e.t, e.value) for e in outcome.history.events if e.kind == "fault"]
    assert faults == [
        (15.0, "instance a paused"),
        (20.0, "instance a killed"),
        (55.0, "instance a resumed"),
        (55.0, "instance a restarted"),
    ]
    assert not [e for e in outcome.history.events if e.kind == "ok" and 15 <= e.t < 55]
    # Started again at 22 s, within the pause, its start() goes on at 55 s: the slot at 30 s came due after start()
    # was called, and runs then, late (as a paused instance runs, late, a slot that came due in its pause).
    assert [(e.slot / 1000 - EPOCH_S, e.started) for e in outcome.history.executions][:3] == [
        (10.0, 10.0),
        (30.0, 55.0),
        (60.0, 60.0),
    ]


def test_a_command_the_cut_link_never_sent_failed_and_one_cut_in_flight_is_unknown() -> None:
    class Store:
        def __init__(self) -> None:
            self.seen: list[str] = []
            self.link: Link | None = None

        async def execute(self, command: list[str]) -> str:
            self.seen.append(command[0])
            if command[0] == "CUT-IN-FLIGHT" and self.link is not None:
                self.link.cut()
            return "OK"

    async def main() -> list[type[BaseException]]:
        store = Store()
        link = store.link = Link(store, "a")  # type: ignore[arg-type]
        raised = []
        for command in ("CUT-IN-FLIGHT", "NEVER-SENT"):
            try:
                await link.execute([command])
            except StoreUnavailableError as error:
                raised.append(type(error))
        assert store.seen == ["CUT-IN-FLIGHT"]
        return raised

    assert asyncio.run(main()) == [StoreUnavailableError, NotSent]
    # In the history, what a cut-off instance could not send is a failure, not an unknown outcome.
    outcome = simulate(scenarios.load("partition"), "lease", 1)
    cut = [e for e in outcome.history.events if e.kind in ("fail", "info") and "link to the store is cut" in e.value]
    assert cut
    assert {e.kind for e in cut} == {"fail"}


def test_a_cut_with_the_reply_lost_lets_the_next_command_reach_the_store_and_drops_its_reply() -> None:
    """A partition that begins while a command is on its way: the store runs it, its caller learns nothing (an
    unknown outcome), and nothing more is sent until the link heals."""

    async def main() -> tuple[list[type[BaseException]], Any, Any]:
        link = Link(adapt(fakeredis.FakeAsyncRedis()), "a")
        link.cut(reply_lost=True)
        raised = []
        for command in (("SET", "k", "1"), ("SET", "k", "2")):
            try:
                await link.execute(command)
            except StoreUnavailableError as error:
                raised.append(type(error))
        link.heal()
        return raised, await link.execute(("GET", "k")), await link.execute(("SET", "k", "3"))

    raised, value, after = asyncio.run(main())
    assert raised == [StoreUnavailableError, NotSent]
    assert (value, after) == ("1", "OK")  # the first ran, the second was never sent; healed, the link carries on
    # In a run: the claim that met such a cut is an unknown outcome ("info") in the history
    outcome = simulate(scenarios.load("lost-reply"), "stream-id", 1)
    assert [(e.t, e.process, e.op) for e in outcome.history.events if e.kind == "info"] == [(40.0, "a", "claim")]


def test_a_cut_with_the_reply_lost_may_lose_an_error_reply() -> None:
    """The command on its way when the link is cut may be one the store refuses (NOSCRIPT before a failover's
    EVAL, stream-id's refused XADD): its error reply is the one lost, and the command after it is not sent. The
    loss moved on to the next command instead, which then ran with its reply lost: after NOSCRIPT, the EVAL that
    follows it (a cut-off instance winning a run on the new primary that nobody hears of)."""

    async def main() -> tuple[list[type[BaseException]], Any]:
        link = Link(adapt(fakeredis.FakeAsyncRedis()), "a")
        link.cut(reply_lost=True)
        raised = []
        for command in (("EVALSHA", "0" * 40, 0), ("SET", "k", "1")):
            try:
                await link.execute(command)
            except StoreError as error:
                raised.append(type(error))
        link.heal()
        return raised, await link.execute(("GET", "k"))

    raised, value = asyncio.run(main())
    assert raised == [StoreUnavailableError, NotSent]
    assert value is None  # the SET was never sent


def test_a_slow_link_hands_each_reply_over_its_delay_after_the_store_ran_the_command() -> None:
    """A slow fault: the store runs the command when it is sent (its clock reads the send time), the reply comes
    ``reply_delay_s`` later; a link cut meanwhile loses the reply, as a partition would."""

    async def main() -> tuple[list[tuple[float, Any]], type[BaseException] | None]:
        loop = asyncio.get_running_loop()
        link = Link(adapt(fakeredis.FakeAsyncRedis()), "a")
        seen = []
        for delay_s in (1.5, 0.0):
            link.reply_delay_s = delay_s
            reply = await link.execute(("TIME",))
            seen.append((loop.time(), reply))
        link.reply_delay_s = 1.0
        sent = asyncio.ensure_future(link.execute(("SET", "k", "1")))
        await asyncio.sleep(0.5)
        link.cut()
        try:
            await sent
        except StoreUnavailableError as error:
            return seen, type(error)
        return seen, None

    seen, cut = run_virtual(main(), epoch_s=EPOCH_S, seed=1)
    (first_at, first_time), (second_at, second_time) = seen
    assert (first_at, int(first_time[0])) == (1.5, EPOCH_S)  # ran at 0 s, heard at 1.5 s
    assert (second_at, int(second_time[0])) == (1.5, EPOCH_S + 1)  # no delay: heard as it ran
    assert cut is StoreUnavailableError  # sent, then cut on its way back: its outcome is unknown


def test_overlapping_slow_faults_delay_replies_by_the_longest_in_force_and_a_restarted_process_too() -> None:
    """Replies 1 s late from 15 to 45 s and 2 s late from 25 to 35 s: each run starts the delay in force at its slot
    late. A process started again at 37 s, within the faults, is as slow as the one it replaced: its start-up's
    round trips take a second each, and it claims the slot at 40 s later than that second."""
    scenario = parse({
        "name": "slower", "duration_s": 60, "instances": [{"name": "a"}],
        "jobs": [{"name": "tick", "cron": "*/10 * * * * *", "work_s": 1.0}],
        "faults": [{"at_s": 15, "kind": "slow", "instance": "a", "duration_s": 30, "delay_ms": 1000},
                   {"at_s": 25, "kind": "slow", "instance": "a", "duration_s": 10, "delay_ms": 2000},
                   {"at_s": 36, "kind": "crash", "instance": "a", "restart_after_s": 1}],
    })  # fmt: skip
    outcome = simulate(scenario, "stream-id", 1)
    late = {
        round(true_s(e.slot, EPOCH_S)): round(e.started - true_s(e.slot, EPOCH_S), 3)
        for e in outcome.history.executions
    }
    assert late.pop(40) > 1.0
    assert late == {10: 0.0, 20: 1.0, 30: 2.0, 50: 0.0}


def test_under_slow_replies_lease_keeps_its_runs_below_half_the_lease_and_claim_only_runs_late() -> None:
    """slow-store with its delay changed: at 1.4 s of a 3 s lease every slot runs; at 1.6 s lease's holders give up
    (P2, the scenario file's verdict) while stream-id's runs start 1.6 s late, and the slow fault is in the
    history as its window."""
    base = scenarios.load("slow-store")
    faster = dataclasses.replace(base, faults=[
        dataclasses.replace(f, settings={**f.settings, "delay_ms": 1400}) for f in base.faults
    ])  # fmt: skip
    assert simulate(faster, "lease", 1).judgement.verdict("P2").status == "valid"
    outcome = simulate(base, "stream-id", 1)
    slow_slots = [e for e in outcome.history.executions if 25 < true_s(e.slot, EPOCH_S) < 55]
    assert slow_slots
    assert {round(e.started - true_s(e.slot, EPOCH_S), 3) for e in slow_slots} == {1.6}
    assert [(w.kind, w.start, w.end) for w in outcome.fault_windows if w.instance == "a"] == [("slow", 25.0, 55.0)]


def test_the_zombie_resumes_and_ends_its_work_beside_its_backup() -> None:
    """The pause outlives the lease: a backup starts attempt 2 while the winner is stopped. The winner resumes
    where it stopped, still holding the lease as far as it knows: its work, due during the pause, ends at the
    resume, while the backup's attempt runs. Two executions of one slot at once; the store refuses its finish."""
    outcome = simulate(scenarios.load("zombie"), "lease", 1)
    by_slot: dict[int, list[Execution]] = {}
    for execution in outcome.history.executions:
        by_slot.setdefault(execution.slot, []).append(execution)
    [pair] = [runs for runs in by_slot.values() if len(runs) > 1]
    first, second = sorted(pair, key=lambda e: e.attempt)
    assert (first.attempt, second.attempt) == (1, 2)
    resumed = next(e.t for e in outcome.history.events if e.value == f"instance {first.instance} resumed")
    assert first.started < second.started < resumed < second.ended
    assert (first.ended, first.completed) == (resumed, True)  # its work was due in the pause: done at once
    finishes = [e for e in outcome.history.events if e.op == "finish" and e.token in (first.token, second.token)]
    assert [(e.t, e.attempt, e.value) for e in finishes if e.kind == "ok"] == [
        (resumed, 1, "False"),  # the store knew attempt 2: the zombie's record was refused
        (second.ended, 2, "True"),
    ]
    assert second.completed


def test_a_pause_leaves_no_lasting_skew() -> None:
    # b, stopped for 15 s, claims on time after it, and so does the process that replaces it after a crash: under
    # script (window_ms 10 s) a clock left 15 s behind would claim each slot again once the window had passed.
    scenario = parse({
        "name": "pause-only", "duration_s": 120, "strategies": {"script": {"window_ms": 10_000}},
        "instances": [{"name": "a"}, {"name": "b"}],
        "jobs": [{"name": "tick", "cron": "*/10 * * * * *", "work_s": 1.0, "max_late_ms": 5000}],
        "faults": [{"at_s": 5, "kind": "pause", "instance": "b", "duration_s": 15},
                   {"at_s": 50, "kind": "crash", "instance": "b", "restart_after_s": 5}],
    })  # fmt: skip
    outcome = simulate(scenario, "script", 1)
    checks = outcome.judgement.checks
    assert (checks["P1"].status, checks["lateness"].status) == ("valid", "valid")
    claims = [e for e in outcome.history.events if e.process == "b" and e.op == "claim" and e.kind == "invoke"]
    assert {round(e.t - (int(e.run) / 1000 - EPOCH_S), 3) for e in claims if e.t > 20} == {0.0}


def test_a_paused_instance_stops_while_its_clock_runs_on_and_fires_its_overdue_timers_at_the_resume() -> None:
    clock = SimClock(offset_ms=500, drift=0.5)

    async def main() -> list[tuple[str, float, float]]:
        seen: list[tuple[str, float, float]] = []

        async def work(own_s: float) -> None:
            await clock.sleep(own_s)
            seen.append((f"slept {own_s:.0f}", asyncio.get_running_loop().time(), clock.monotonic()))

        tasks = [asyncio.ensure_future(work(own_s)) for own_s in (6, 30)]
        await asyncio.sleep(2)  # three own seconds at drift 0.5
        clock.pause()
        seen.append(("paused", clock.monotonic(), clock.wall_ms() / 1000 - EPOCH_S))
        await asyncio.sleep(10)  # the 6 s sleep falls due in here: it does not fire
        clock.resume()
        clock.set_drift(0.0)  # from here on, one own second per true second, without a jump
        seen.append(("resumed", clock.monotonic(), clock.wall_ms() / 1000 - EPOCH_S))
        await asyncio.gather(*tasks)
        return seen

    assert run_virtual(main(), epoch_s=EPOCH_S, seed=1) == [
        ("paused", 3.0, 3.5),
        ("resumed", 18.0, 18.5),  # 3 + 10 true seconds at drift 0.5: the time it would read unpaused
        ("slept 6", 12.0, 18.0),  # due at 6 own seconds, in the pause: fired at the resume
        ("slept 30", 24.0, 30.0),  # due after the resume: on time
    ]


@pytest.mark.parametrize(("max_attempts", "used_up"), [(1, True), (3, False)])
def test_a_slot_missed_because_its_attempts_were_used_up_says_so(max_attempts: int, used_up: bool) -> None:
    """The winner of the slot at 20 s crashes during its work. With max_attempts 1 nobody takes the run over:
    P2's witness says the attempts were used up (a reader took it for a lost slot). With 3, a backup runs it."""
    scenario = parse({
        "name": "attempts", "duration_s": 60, "scheduler": {"lease_ms": 3000, "heartbeat_ms": 1000},
        "instances": [{"name": n} for n in "abc"],
        "jobs": [{"name": "tick", "cron": "*/20 * * * * *", "work_s": 5.0, "max_attempts": max_attempts}],
        "faults": [{"at_s": 22, "kind": "crash", "instance": "winner"}],
    })  # fmt: skip
    p2 = simulate(scenario, "lease", 1).judgement.checks["P2"]
    assert p2.status == ("invalid" if used_up else "valid")
    if used_up:
        assert p2.witness.startswith("tick slot at 20 s: ")
        assert p2.witness.endswith("(its max_attempts, 1, were used up: the store recorded it interrupted)")


def test_a_slot_is_judged_missed_only_once_its_jittered_claim_could_have_run() -> None:
    # Claims come up to 20 s after their slot: the slot at 90 s of a 110 s run may not start before the end (the
    # jitter of this job's slot at 90 s is 17.9 s).
    scenario = parse({
        "name": "jitter", "duration_s": 110, "scheduler": {"lease_ms": 3000, "heartbeat_ms": 1000},
        "instances": [{"name": "a"}],
        "jobs": [{"name": "jittery", "cron": "*/30 * * * * *", "work_s": 2.0, "jitter_ms": 20_000}],
    })  # fmt: skip
    outcome = simulate(scenario, "lease", 3)
    assert [round(e.started - true_s(e.slot, EPOCH_S)) for e in outcome.history.executions][-1] > 15
    assert (outcome.judgement.verdicts["P2"].status, outcome.judgement.slots_checked) == ("valid", 2)  # 30 and 60 s


SHRUNK_BASE = {
    "duration_s": 120, "scheduler": {"lease_ms": 3000, "heartbeat_ms": 1000},
    "instances": [{"name": "a"}, {"name": "b"}, {"name": "c"}],
    "jobs": [{"name": "tick", "cron": "*/10 * * * * *", "work_s": 2.0, "max_late_ms": 30_000}],
}  # fmt: skip


@pytest.mark.parametrize("strategy", ["lease", "stream-id", "script", "idmp"])
def test_an_instance_whose_clock_is_set_back_past_its_start_runs_the_slot_nobody_claimed(strategy: str) -> None:
    # Found by the property search. b and c crash at 1 s; a crashes at 8 s and starts again at 12 s; at 14.2 s
    # its clock is set back 5.5 s. By it, a was up at the slot at 10 s, which nobody ran: a runs it (at 20 s,
    # when it wakes for the slot it had planned; that clock shows 14.5 s then).
    scenario = parse({**SHRUNK_BASE, "name": "stepback", "faults": [
        {"at_s": 1, "kind": "crash", "instance": "b"}, {"at_s": 1, "kind": "crash", "instance": "c"},
        {"at_s": 8, "kind": "crash", "instance": "a", "restart_after_s": 4},
        {"at_s": 14.2, "kind": "skew", "instance": "a", "offset_ms": -5500},
    ]})  # fmt: skip
    outcome = simulate(scenario, strategy, 1)
    assert outcome.judgement.verdicts["P2"].status == "valid", outcome.judgement.verdicts["P2"].witness
    ten = [e for e in outcome.history.executions if true_s(e.slot, EPOCH_S) == 10]
    assert [(e.instance, round(e.started, 1)) for e in ten] == [("a", 20.0)]


def test_a_lease_claim_put_off_to_its_slot_is_given_its_settling_time_from_the_slot() -> None:
    # Found by the property search: b's clock runs 20.5 s ahead; its claim of the slot at 120 s, at 99.5 s, is put
    # off by the store to the slot, the scenario's last instant. P2 gave the settling time from 99.5 s, and said
    # the slot never started.
    scenario = parse({**SHRUNK_BASE, "name": "early", "faults": [
        {"at_s": 31.5, "kind": "skew", "instance": "b", "offset_ms": 10_161},
        {"at_s": 77.0, "kind": "pause", "instance": "a", "duration_s": 1},
        {"at_s": 90.0, "kind": "skew", "instance": "winner", "offset_ms": 10_347},
    ]})  # fmt: skip
    assert simulate(scenario, "lease", 399).judgement.verdicts["P2"].status == "valid"


def test_bad_scenarios_are_refused_with_the_reason() -> None:
    base = {
        "name": "x",
        "duration_s": 10,
        "instances": [{"name": "a"}],
        "jobs": [{"name": "j", "cron": "* * * * *", "work_s": 1}],
    }
    with pytest.raises(ScenarioError, match="unknown fault kind"):
        parse({**base, "faults": [{"at_s": 1, "kind": "meteor"}]})
    with pytest.raises(ScenarioError, match="unknown instance 'z'"):
        parse({**base, "faults": [{"at_s": 1, "kind": "crash", "instance": "z"}]})
    with pytest.raises(ScenarioError, match="does not take"):
        parse({**base, "faults": [{"at_s": 1, "kind": "crash", "instance": "a", "colour": 1}]})
    with pytest.raises(ScenarioError, match="not a checker"):
        parse({**base, "expect": {"lease": {"P9": "valid"}}})
    with pytest.raises(ScenarioError, match="is not one of"):
        parse({**base, "expect": {"lease": {"P1": 0.5}}})
    with pytest.raises(ScenarioError, match="needs 'work_s'"):
        parse({**base, "jobs": [{"name": "j", "cron": "* * * * *"}]})


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"fualts": []}, r"unknown keys \['fualts'\]"),  # run as written, it would have had no faults
        ({"instances": [{"name": "a", "ofset_ms": 5}]}, "does not take"),
        ({"instances": [{"name": "a"}, {"name": "a"}]}, "instances named twice: a"),
        ({"jobs": [{"name": "j", "cron": "* * * * *", "work_s": 1}] * 2}, "jobs named twice: j"),
        ({"instances": [{"name": "a", "drift": -1}]}, "drift = -1 must be above -1"),
        ({"instances": [{"name": "a", "offset_ms": 1.5}]}, "offset_ms has the wrong type"),
        ({"duration_s": -10}, "duration_s = -10 must be above 0"),
        ({"duration_s": True}, "duration_s has the wrong type"),
        ({"faults": [{"at_s": -5, "kind": "partition", "instance": "a", "duration_s": 3}]}, "at_s = -5"),
        ({"faults": [{"at_s": 10, "kind": "store-restart"}]}, "before the end"),
        ({"faults": [{"at_s": 1, "kind": "pause", "instance": "a", "duration_s": -3}]}, "duration_s = -3"),
        ({"faults": [{"at_s": 1, "kind": "crash", "instance": "a", "restart_after_s": "soon"}]}, "wrong type"),
        (
            {"faults": [{"at_s": 1, "kind": "partition", "instance": "a", "duration_s": 3, "reply_lost": 1}]},
            "reply_lost has the wrong type: 1",
        ),
        (
            {"faults": [{"at_s": 1, "kind": "pause", "instance": "a", "duration_s": 3, "reply_lost": True}]},
            "does not take",
        ),
        ({"faults": [{"at_s": 1, "kind": "manual", "instance": "a", "job": "k"}]}, "unknown job 'k'"),
        ({"strategies": {"scrip": {"window_ms": 5}}}, "strategies.scrip is not a strategy"),
        ({"expect": {"lease": "valid"}}, "expect.lease must be a table"),
        ({"duration_s": float("nan")}, "duration_s = nan must be a finite number"),  # TOML writes nan and inf
        ({"jobs": [{"name": "j", "cron": "* * * * *", "work_s": float("inf")}]}, "work_s = inf must be a finite"),
        ({"faults": [{"at_s": 1, "kind": "pause", "instance": "a", "duration_s": float("nan")}]}, "finite"),
        ({"instances": [{"name": "winner"}]}, '"winner" is not an instance name'),
        # The library's own checks, said as the file is read, with the table (they were tracebacks of a run):
        ({"scheduler": {"lease_mss": 3000}}, r"scheduler, under lease: lease_mss: is not an option of Scheduler"),
        ({"scheduler": {"lease_ms": "3000"}}, "scheduler, under lease: lease_ms: must be an integer, got str"),
        ({"jobs": [{"name": "j", "cron": "* * * * *", "work_s": 1, "overlap": "yes"}]}, r"jobs \(j\), under lease"),
        ({"jobs": [{"name": "j", "cron": "0 0 * 13 *", "work_s": 1}]}, r"jobs \(j\), under lease: .*Bad month"),
        ({"strategies": {"script": {"window_msx": 5}}}, "strategies.script, under script: strategy.window_msx"),
        ({"faults": [{"at_s": 1, "kind": "failover", "lag_ms": 5, "clock_ms": "x"}]}, "clock_ms has the wrong type"),
    ],
)
def test_a_scenario_with_a_mistake_is_refused_instead_of_run_as_another(change: dict[str, Any], reason: str) -> None:
    base = {"name": "x", "duration_s": 10, "instances": [{"name": "a"}],
            "jobs": [{"name": "j", "cron": "* * * * *", "work_s": 1}]}  # fmt: skip
    with pytest.raises(ScenarioError, match=reason):
        parse({**base, **change})


async def test_a_recorded_instance_reads_its_history_through_the_strategy_it_wraps() -> None:
    """The recorder passes history() on (its own log of events is another attribute), so a job or a test in
    the simulator may call scheduler.history()."""
    server = fakeredis.FakeServer()
    backend = RedisBackend(redis=fakeredis.FakeAsyncRedis(server=server))
    backend.strategy = RecordingStrategy(backend.strategy, History(), "a", lambda: 0.0)
    scheduler = Scheduler(backend)
    scheduler.add_job("tick", "0 0 1 1 *", lambda: None)
    async with scheduler:
        await scheduler.run_now("tick")
        history = await scheduler.history("tick")
    assert [record.status for record in history] == ["ok"]


def _paused_then_killed(strategy: str, restart_after_s: float | None = None) -> Outcome:
    """The winner of the slot at 40 s (work 6 s) is paused at 41 s for 20 s and killed at 50 s."""
    crash: dict[str, object] = {"at_s": 50, "kind": "crash", "instance": "winner"}
    if restart_after_s is not None:
        crash["restart_after_s"] = restart_after_s
    scenario = parse({
        "name": "pause-then-kill", "duration_s": 120, "scheduler": {"lease_ms": 3000, "heartbeat_ms": 1000},
        "instances": [{"name": "a"}, {"name": "b"}],
        "jobs": [{"name": "tick", "cron": "*/20 * * * * *", "work_s": 6.0}],
        "faults": [{"at_s": 41, "kind": "pause", "instance": "winner", "duration_s": 20}, crash],
    })  # fmt: skip
    return simulate(scenario, strategy, 1)


@pytest.mark.parametrize("strategy", ["lease", "stream-id"])
def test_a_process_killed_while_paused_does_nothing_after_the_kill(strategy: str) -> None:
    """SIGSTOP then SIGKILL: its work stopped at the pause, never to go on, and it sends nothing more. Under lease
    a backup takes the run over once the lease has run out, after the work stopped: a retry, and the lease was
    safe. Under a claim-only strategy nobody else runs the slot: P2 sees it missed."""
    outcome = _paused_then_killed(strategy)
    [killed] = [e for e in outcome.history.events if e.kind == "fault" and "killed" in str(e.value)]
    victim = str(killed.value).split()[1]
    [execution] = [x for x in outcome.history.executions if x.instance == victim and x.slot == (EPOCH_S + 40) * 1000]
    assert (execution.ended, execution.completed) == (41.0, False)
    assert [e.t for e in outcome.history.events if e.process == victim and e.t > 50.0 and e.kind != "fault"] == []
    if strategy == "lease":
        [takeover] = [x for x in outcome.history.executions if x.slot == execution.slot and x.attempt == 2]
        assert 41.0 < takeover.started < 50.0
        assert [outcome.judgement.verdicts[p].status for p in ("P1", "P3", "P4")] == ["valid"] * 3
    if strategy == "stream-id":
        assert outcome.judgement.verdicts["P2"].status == "invalid"


def test_a_process_killed_while_paused_restarts_when_its_crash_says() -> None:
    outcome = _paused_then_killed("lease", restart_after_s=5)
    restarts = [e.t for e in outcome.history.events if e.kind == "fault" and "restarted" in str(e.value)]
    assert restarts == [61.0]  # killed at 50, due back at 55, within the pause: it starts when the pause ends


def test_nothing_reaches_the_store_after_the_end() -> None:
    """Ending the run stops the instances one after another: the others must not go on meanwhile (a paused one
    takes time to stop)."""
    scenario = parse({
        "name": "end", "duration_s": 100.5, "instances": [{"name": "a"}, {"name": "b"}],
        "jobs": [{"name": "tick", "cron": "* * * * * *", "work_s": 0.2}],
        "faults": [{"at_s": 90.1, "kind": "pause", "instance": "a", "duration_s": 30}],
    })  # fmt: skip
    outcome = simulate(scenario, "lease", 1)
    assert [e for e in outcome.history.events if e.t > 100.5] == []
    assert max(x.started for x in outcome.history.executions) <= 100.5


def test_a_backup_cut_off_for_longer_than_keep_ms_does_not_run_a_forgotten_run_again() -> None:
    """b stands by as the backup of the slots a runs, then is cut off from the store for 100 s, longer than the
    job's keep_ms (5 s late + 3 leases of 2 s + 60 s), while a's finishes trim the history to about 5 runs. Back,
    b's backups ask for runs the store has dropped: the store answers "done" for every slot up to the latest it
    dropped. Before, each such backup won a new first attempt and ran its slot a second time. (a's clock is
    0.2 s ahead, so that a wins each slot: a winner cut off mid-run, as b would be, has its slot run again.)"""
    scenario = parse({
        "name": "forgotten", "duration_s": 200,
        "scheduler": {"lease_ms": 2000, "heartbeat_ms": 500, "history_size": 5},
        "instances": [{"name": "a", "offset_ms": 200}, {"name": "b"}],
        "jobs": [{"name": "tick", "cron": "* * * * * *", "work_s": 1.5, "max_late_ms": 5000}],
        "faults": [{"at_s": 20, "kind": "partition", "instance": "b", "duration_s": 100}],
    })  # fmt: skip
    outcome = simulate(scenario, "lease", 1)
    p1 = outcome.judgement.verdict("P1")
    assert p1.status == "valid", p1.witness
    back = [e for e in outcome.history.events if (e.process, e.op, e.kind) == ("b", "claim", "ok") and e.t >= 120]
    forgotten = {int(e.run) for e in back if e.value.startswith("done attempt=0 ")}
    assert forgotten, "no backup asked for a forgotten run: the test no longer tests it"
    keep_s = 5 + 3 * 2 + 60
    assert max(forgotten) < (EPOCH_S + 120 - keep_s) * 1000  # older than keep_ms when b came back


def _deploy(faults: list[dict[str, object]]) -> Any:
    """a (its clock 1 s ahead: it wins every slot) and b; a job every 20 s working 6 s; lease 3 s."""
    scenario = parse({
        "name": "deploy", "duration_s": 60, "scheduler": {"lease_ms": 3000, "heartbeat_ms": 1000},
        "instances": [{"name": "a", "offset_ms": 1000}, {"name": "b"}],
        "jobs": [{"name": "tick", "cron": "*/20 * * * * *", "work_s": 6.0}],
        "faults": faults,
    })  # fmt: skip
    return simulate(scenario, "lease", 1)


def test_a_stop_hands_the_run_back_and_a_backup_runs_it_as_attempt_2() -> None:
    outcome = _deploy([{"at_s": 21, "kind": "stop", "instance": "a", "timeout_s": 0, "restart_after_s": 10}])
    slot = (EPOCH_S + 20) * 1000
    runs = sorted((x.attempt, x.instance, x.completed) for x in outcome.history.executions if x.slot == slot)
    assert runs == [(1, "a", False), (2, "b", True)]
    assert outcome.judgement.verdicts["P2"].status == "valid"
    assert [e.t for e in outcome.history.events if e.kind == "fault" and "restarted" in str(e.value)] == [31.0]


@pytest.mark.parametrize("strategy", ["lease", "stream-id"])
def test_an_instance_is_down_until_a_stop_that_waited_for_its_jobs_has_restarted_it(strategy: str) -> None:
    """The only instance is told at 30.5 s to stop within 20 s and come back 1 s later: it waits for its run
    (30..38 s) and restarts at 38 s. The slot at 35 s came due while it was down, not missed."""
    scenario = parse({
        "name": "slow-stop", "duration_s": 120, "scheduler": {"lease_ms": 3000, "heartbeat_ms": 1000},
        "instances": [{"name": "a"}],
        "jobs": [{"name": "tick", "cron": "*/5 * * * * *", "work_s": 8.0, "overlap": True}],
        "faults": [{"at_s": 30.5, "kind": "stop", "instance": "a", "timeout_s": 20, "restart_after_s": 1}],
    })  # fmt: skip
    outcome = simulate(scenario, strategy, 1)
    assert [e.t for e in outcome.history.events if e.kind == "fault" and "restarted" in str(e.value)] == [38.0]
    assert (EPOCH_S + 35) * 1000 not in {x.slot for x in outcome.history.executions}
    assert max(w.end for w in outcome.fault_windows) == 38.0
    assert outcome.judgement.verdicts["P2"].status == "valid"


def test_a_stop_that_waits_for_its_job_can_still_be_cut_short_by_a_crash() -> None:
    """a is told to stop at 21 s with 10 s to finish its run (19..25 s), and is killed at 23 s: as in live mode,
    where the process runs until it has stopped, the kill strikes. The run ends there, unfinished, and without
    its hand-back b takes it over once the lease has run out."""
    outcome = _deploy([
        {"at_s": 21, "kind": "stop", "instance": "a", "timeout_s": 10},
        {"at_s": 23, "kind": "crash", "instance": "a"},
    ])  # fmt: skip
    assert [e.t for e in outcome.history.events if e.kind == "fault" and "killed" in str(e.value)] == [23.0]
    slot = (EPOCH_S + 20) * 1000
    [first] = [x for x in outcome.history.executions if x.slot == slot and x.attempt == 1]
    assert (first.instance, first.ended, first.completed) == ("a", 23.0, False)
    [second] = [x for x in outcome.history.executions if x.slot == slot and x.attempt == 2]
    assert (second.instance, second.completed) == ("b", True)
    assert second.started >= 23.0 + 2.0  # after a lease that a heartbeat renewed at 22 s at the latest


def test_a_stop_strikes_the_process_started_while_the_one_before_it_was_still_stopping() -> None:
    """At 40 s a is told to stop within 10 s and waits for its run (39..45 s); meanwhile, at 41 s, the restart an
    earlier stop asked for starts a new process. A stop at 42 s strikes that one, not "nothing": an instance is
    judged by the process that is up, not by the one still stopping."""
    outcome = _deploy([
        {"at_s": 21, "kind": "stop", "instance": "a", "timeout_s": 10, "restart_after_s": 20},
        {"at_s": 22, "kind": "crash", "instance": "a", "restart_after_s": 1},
        {"at_s": 40, "kind": "stop", "instance": "a", "timeout_s": 10},
        {"at_s": 42, "kind": "stop", "instance": "a", "timeout_s": 0},
    ])  # fmt: skip
    said = [(e.t, e.value) for e in outcome.history.events if e.kind == "fault" and e.t >= 40]
    assert said == [
        (40.0, "instance a stopping (stop timeout 10 s)"),
        (41.0, "instance a restarted"),
        (42.0, "instance a stopping (stop timeout 0 s)"),
        (42.0, "instance a stopped"),
        (45.0, "instance a stopped"),  # the stop at 40 s, once its run ended
    ], said


@pytest.mark.parametrize(
    ("arguments", "said"),
    [
        (
            ["search", "--strategy", "lease", "--budget", "abc"],
            "argument --budget: a finite number of seconds above 0, not abc",
        ),
        (["report", "--mode", "live", "--servers", "bogus"], "--servers: bogus not provisioned here"),
    ],
)
def test_the_command_line_names_a_bad_argument_without_a_traceback(arguments: list[str], said: str) -> None:
    done = subprocess.run([sys.executable, "-m", "sim", *arguments], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert said in done.stderr
    assert "Traceback" not in done.stderr


def test_a_scenario_shorter_than_the_time_each_slot_is_given_says_so_for_p2() -> None:
    """Each slot is given three leases, the jitter, the work and 5 s to run before P2 counts it missed: a scenario
    of 60 s with the default 30 s lease has no slot to judge. P2 said no slot was due while an instance was healthy,
    of an instance healthy throughout."""
    scenario = parse({
        "name": "short", "duration_s": 60, "instances": [{"name": "a"}],
        "jobs": [{"name": "tick", "cron": "*/10 * * * * *", "work_s": 1}],
    })  # fmt: skip
    verdict = simulate(scenario, "lease", 1).judgement.checks["P2"]
    assert (verdict.status, verdict.witness) == (
        "unknown",
        "no slot was due in the first 0 s of the scenario (each slot is given 96 s to run: three leases, the "
        "jitter, the work and 5 s)",
    )


@pytest.mark.parametrize("kind", ["pause", "partition"])
def test_an_instance_struck_twice_at_once_recovers_only_when_the_last_fault_ends(kind: str) -> None:
    """The only instance is paused (or cut off) from 5 s to 100 s, and again from 10 s to 15 s: the shorter fault's
    end does not resume (reconnect) it. It runs nothing until 100 s, and the slots due meanwhile, too late by then
    (max_late_ms 60 s), were missed while no instance was healthy: not judged missed."""
    scenario = parse({
        "name": "nested", "duration_s": 250, "instances": [{"name": "a"}],
        "jobs": [{"name": "tick", "cron": "*/10 * * * * *", "work_s": 1.0}],
        "faults": [
            {"at_s": 5, "kind": kind, "instance": "a", "duration_s": 95},
            {"at_s": 10, "kind": kind, "instance": "a", "duration_s": 5},
        ],
    })  # fmt: skip
    outcome = simulate(scenario, "script", 1)
    assert [e.started for e in outcome.history.executions if 5 < e.started < 100] == []
    assert [e.started for e in outcome.history.executions if e.started >= 100]  # it runs again afterwards
    assert outcome.judgement.verdicts["P2"].status == "valid"


def test_a_promoted_replica_knows_the_idmp_ids_it_received_and_not_those_it_lacked() -> None:
    """IDMP's ids are part of the dataset: the replica promoted 1 s behind has the first claim's id, not the
    second's (written 0.5 s before the failover). A claim of the second run then adds an entry again (the run is
    lost, as the claim's entry is); one of the first is a repeat."""

    async def main() -> tuple[bool, object]:
        store = SimStore((8, 6), replicated=True)
        primary = store.connection()
        received = await primary.execute(["XADD", "s", "IDMP", "p", "received", "*", "f", "1"])
        await asyncio.sleep(2.0)
        await primary.execute(["XADD", "s", "IDMP", "p", "lacked", "*", "f", "2"])
        await asyncio.sleep(0.5)
        store.promote(1.0)
        promoted = store.connection()
        again = await promoted.execute(["XADD", "s", "IDMP", "p", "received", "*", "f", "3"])
        await promoted.execute(["XADD", "s", "IDMP", "p", "lacked", "*", "f", "4"])
        return again == received, await promoted.execute(["XLEN", "s"])

    assert run_virtual(main(), epoch_s=EPOCH_S, seed=1) == (True, 2)  # f=1 and f=4


def test_a_failover_blames_every_claim_its_replica_lacked() -> None:
    """Two jobs claimed in one batch each slot; 13 s behind at 22 s, the replica lacked the claims of the slots at
    10 s and 20 s: all four, rerun by the late instance, were lost acknowledged claims."""
    scenario = parse({
        "name": "late-rerun-two", "duration_s": 40, "strategies": {"script": {"window_ms": 10_000}},
        "instances": [{"name": "on-time"}, {"name": "late", "offset_ms": -15_000}],
        "jobs": [{"name": name, "cron": "*/10 * * * * *", "work_s": 1.0, "max_late_ms": 5000}
                 for name in ("tick", "tock")],
        "faults": [{"at_s": 22, "kind": "failover", "lag_ms": 13_000}],
    })  # fmt: skip
    verdict = simulate(scenario, "script", 1).judgement.verdicts["P5"]
    assert (verdict.status, verdict.count) == ("invalid", 4)


def test_a_hold_that_begins_at_the_instant_of_a_claim_holds_it() -> None:
    """A replication hold from 20 s, the very instant of the slot's claim: that claim is held with the rest, and the
    failover loses it."""
    outcome = _rerun_by_a_late_instance_across_a_failover(100, [{"at_s": 20, "kind": "replication-hold",
                                                                 "duration_s": 5.0}])  # fmt: skip
    verdict = outcome.judgement.verdicts["P5"]
    assert (verdict.status, verdict.count) == ("invalid", 1)


def test_the_stores_clock_follows_a_promoted_server_whose_clock_differs() -> None:
    """A failover to a server whose clock is a minute behind: TIME (and so leases and stream ids) follows it."""
    store = SimStore(replicated=True)

    async def main() -> int:
        before = await store.connection().execute(["TIME"])
        store.promote(0.0, -60.0)
        after = await store.connection().execute(["TIME"])
        return int(after[0]) - int(before[0])  # type: ignore[index]

    assert run_virtual(main(), epoch_s=EPOCH_S, seed=1, store_ahead_s=lambda: store.clock_ahead_s) == -60


def test_a_fault_on_the_winner_strikes_the_instance_whose_run_started_first() -> None:
    """ "winner": of the instances up and running a job, the one whose earliest run started first (b's at 3 s, not
    a's at 7 s, nor c's at 1 s: c is down); with none running, the first one up."""

    def run(started: float) -> Stub:
        return Stub(started=started)

    instances = {
        "a": Stub(name="a", up=True, running_jobs={"j": run(7.0)}),
        "b": Stub(name="b", up=True, running_jobs={"k": run(9.0), "l": run(3.0)}),
        "c": Stub(name="c", up=False, running_jobs={"m": run(1.0)}),
    }
    winner = FaultSpec(10.0, "crash", {"instance": "winner"})
    assert World._target(Stub(instances=instances), winner).name == "b"  # type: ignore[arg-type, union-attr]
    idle = {name: Stub(name=name, up=name != "a", running_jobs={}) for name in "abc"}
    assert World._target(Stub(instances=idle), winner).name == "b"  # type: ignore[arg-type, union-attr]


def _two_instances(faults: list[dict[str, Any]]) -> Scenario:
    """a (its clock 300 ms ahead) and b, a job every 10 s that works 6 s, and ``faults``."""
    return parse({
        "name": "unit", "duration_s": 90, "scheduler": {"lease_ms": 3000, "heartbeat_ms": 1000},
        "instances": [{"name": "a", "offset_ms": 300}, {"name": "b"}],
        "jobs": [{"name": "tick", "cron": "*/10 * * * * *", "work_s": 6.0}],
        "faults": faults,
    })  # fmt: skip


@pytest.mark.parametrize("strategy", scenarios.STRATEGIES)
def test_a_manual_run_asked_of_a_paused_instance_runs_when_it_resumes(strategy: str) -> None:
    """A paused process (SIGSTOP) takes a run_now when it resumes, as live mode's reads it from its stdin then: the
    manual run is named and leased by its clock of that moment, and runs its work to the end. Before, the call ran
    in the pause (named at 45.3 s by a's clock), and its lease, counted from then, cut the run as it began."""
    pause = {"at_s": 41, "kind": "pause", "instance": "a", "duration_s": 15}
    outcome = simulate(_two_instances([pause, {"at_s": 45, "kind": "manual", "instance": "a", "job": "tick"}]),
                       strategy, 1)  # fmt: skip
    [manual] = [e for e in outcome.history.executions if e.manual]
    assert (manual.instance, manual.started, manual.completed) == ("a", 56.0, True)
    assert true_s(manual.slot, EPOCH_S) == pytest.approx(56.3)
    assert not [e for e in outcome.history.events if e.process == "a" and 41 < e.t < 56]


@pytest.mark.parametrize("strategy", scenarios.STRATEGIES)
def test_a_killed_instance_records_nothing_until_it_restarts(strategy: str) -> None:
    """SIGKILL: the process attempts nothing more. Before, the simulator's stop() of the dead scheduler recorded a
    release (lease) or finish, sent and failed at the kill, which no live history can show."""
    crash = {"at_s": 42, "kind": "crash", "instance": "a", "restart_after_s": 20}
    outcome = simulate(_two_instances([crash]), strategy, 1)
    assert [e for e in outcome.history.events if e.process == "a" and 42 <= e.t < 62] == []
    slot_40 = int((EPOCH_S + 40) * 1000)
    ran = [
        (e.started, e.ended, e.completed) for e in outcome.history.executions if (e.instance, e.slot) == ("a", slot_40)
    ]
    assert ran == [(39.7, 42.0, False)]
