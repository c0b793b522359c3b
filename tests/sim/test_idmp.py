"""The simulator's IDMP emulation answers like a real Redis 8.6, command for command; and the idmp strategy's rules,
run on it on every test run (its contract tests need a real Redis 8.6)."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest

from anarchon import RedisBackend, RunContext, Scheduler, StoreUnavailableError
from anarchon._adapters import RedisPyAsync
from anarchon._errors import StoreReplyError
from anarchon._store import Connection, Store
from anarchon._strategies import JobPolicy, Outcome, RunRequest, run_id
from anarchon._strategies.idmp import CONFIGURE, SKIP_CLAIM, TRIM_RUNS
from sim.links import Link
from sim.servers.testing import ServerUnderTest
from sim.vtime import run_virtual
from sim.world import EPOCH_S, SimClock, SimStore
from tests.anarchon.support import (
    IDMP_TRIMMED_QUICKLY,
    claim_one,
    record,
    request,
    server_ms,
    trimmed_after_claims_sent_together,
)

# (command, pause in seconds afterwards). Durations are short so that expiry can be seen in real time.
PROGRAM: list[tuple[tuple[Any, ...], float]] = [
    (("XADD", "s", "IDMP", "p", "a", "*", "f", "1"), 0),
    (("XADD", "s", "IDMP", "p", "a", "*", "f", "2"), 0),  # duplicate: the first entry's ID, nothing written
    (("XADD", "s", "IDMP", "q", "a", "*", "f", "3"), 0),  # another producer: new
    (("XCFGSET", "s", "IDMP-DURATION", 100, "IDMP-MAXSIZE", 100), 0),  # the defaults: nothing cleared
    (("XADD", "s", "IDMP", "p", "a", "*", "f", "4"), 0),  # still a duplicate
    (("XCFGSET", "s", "IDMP-DURATION", 1, "IDMP-MAXSIZE", 2), 0),  # changed: every id forgotten
    (("XADD", "s", "IDMP", "p", "a", "*", "f", "5"), 0),  # new again
    (("XADD", "s", "IDMP", "p", "b", "*", "f", "6"), 0),
    (("XADD", "s", "IDMP", "p", "c", "*", "f", "7"), 0),  # a third id: the oldest (a) goes
    (("XADD", "s", "IDMP", "p", "a", "*", "f", "8"), 0),  # new: a was evicted (and b goes now)
    (("XADD", "s", "IDMP", "p", "c", "*", "f", "9"), 2.5),  # duplicate of c; then wait out the duration
    (("XADD", "s", "IDMP", "p", "c", "*", "f", "10"), 0),  # expired: new
    (("XADD", "s", "MAXLEN", 0, "IDMP", "p", "z", "*", "f", "11"), 0),  # written, then trimmed away at once
    (("XADD", "s", "IDMP", "p", "z", "*", "f", "12"), 0),  # the original's ID, though the entry is gone
    (("XLEN", "s"), 0),
    (("XCFGSET", "missing", "IDMP-DURATION", 5), 0),
    (("XCFGSET", "s", "IDMP-DURATION", 0), 0),
    (("XCFGSET", "s", "IDMP-MAXSIZE", 10_001), 0),
    (("XADD", "s", "IDMP", "p", "x", "5-0", "f", "13"), 0),
    (("XADD", "s", "IDMP", "p", "x", "5-0", "f", "*"), 0),  # a value of '*' is no auto-generated ID
    (("XCFGSET", "s"), 0),
    (("XCFGSET", "s", "IDMP-DURATION", "soon"), 0),
    (("XADD", "t", "NOMKSTREAM", "IDMP", "p", "a", "*", "f", "14"), 0),  # no stream: nil, nothing made
    (("EXISTS", "t"), 0),
    (("XADD", "t", "IDMP", "p", "a", "*", "f", "15"), 0.01),  # made; nil above registered no id (then a new ms)
    (("DEL", "t"), 0),
    (("XADD", "t", "IDMP", "p", "a", "*", "f", "16"), 0),  # the stream's ids went with it: new
    (("XLEN", "t"), 0),
    (("XADD", "t", "MAXLEN", "~", 5, "NOMKSTREAM", "IDMP", "p", "a", "*", "f", "17"), 0),  # options in any order
    # Settings read one at a time, each checked as it comes, none applied when one is wrong.
    (("XCFGSET", "s", "FOO", 1), 0),
    (("XCFGSET", "s", "IDMP-DURATION"), 0),
    (("XCFGSET", "s", "IDMP-DURATION", 5, "FOO"), 0),
    (("XCFGSET", "s", "IDMP-MAXSIZE", 5, "IDMP-MAXSIZE", "x"), 0),
    (("XCFGSET", "s", "IDMP-DURATION", 0, "IDMP-DURATION", 5), 0),
    *((("XCFGSET", "s", "IDMP-DURATION", value), 0) for value in ("+6", " 7", "1_0", "08", "99999999999999999999")),
    (("SET", "str", "x"), 0),
    (("XCFGSET", "str", "IDMP-DURATION", 5), 0),
    (("XCFGSET",), 0),
]


async def play(connection: Connection) -> list[str]:
    """The program's answers, with entry IDs replaced by the step that created them (IDs differ by clock)."""
    created: dict[tuple[str, str], int] = {}
    answers = []
    for step, (command, pause) in enumerate(PROGRAM):
        try:
            reply = await connection.execute(command)
        except StoreReplyError as error:
            answers.append(f"error {error.reply}")
        else:
            if command[0] == "XADD" and reply is not None:
                entry = (str(command[1]), str(reply))  # two streams may make equal IDs in the same ms
                answers.append(f"entry of step {created.setdefault(entry, step)}")
            else:
                answers.append(str(reply))
        await asyncio.sleep(pause)
    info = await connection.execute(("XINFO", "STREAM", "s"))
    assert isinstance(info, list)
    fields = dict(zip(info[::2], info[1::2], strict=True))
    answers.append(f"duration {fields['idmp-duration']} maxsize {fields['idmp-maxsize']}")
    return answers


async def test_emulated_idmp_answers_like_redis_8_6(real_server: ServerUnderTest) -> None:
    if real_server.target != "redis-8.6":
        pytest.skip(f"IDMP exists on redis-8.6 only; {real_server.target} has none to compare with")
    real = RedisPyAsync(real_server.async_client())
    emulated = SimStore((8, 6)).connection()
    expected, got = await asyncio.gather(play(real), play(emulated))
    assert got == expected
    assert expected[1] == "entry of step 0"  # the program does test what it says
    assert expected[9] == "entry of step 9"
    assert expected[11] == "entry of step 11"
    assert expected[22:28] == ["None", "0", "entry of step 24", "1", "entry of step 26", "1"]
    assert expected[28] == "entry of step 26"
    await emulated.close()


async def cached_scripts(connection: Connection) -> list[str]:
    """The scripts the emulation answers itself, after the store lost its script cache (a restart, a failover):
    EVALSHA refused, EVAL run and cached."""
    answers = []
    for command in [
        ("SCRIPT", "FLUSH"),
        ("EVALSHA", CONFIGURE.sha, 1, "s", 300, 50, "job"),
        ("EVALSHA", TRIM_RUNS.sha, 1, "s", 10, 0),
        ("EVALSHA", SKIP_CLAIM.sha, 1, "s", "job", 1000, 0, "slot", 1000, "token", "a", "runner", "x"),
        ("EVAL", CONFIGURE.source, 1, "s", 300, 50, "job"),
        ("EVALSHA", CONFIGURE.sha, 1, "s", 300, 50, "job"),
        ("EVAL", TRIM_RUNS.source, 1, "s", 10, 0),
        ("EVALSHA", TRIM_RUNS.sha, 1, "s", 10, 0),
        ("SCRIPT", "EXISTS", CONFIGURE.sha, TRIM_RUNS.sha, SKIP_CLAIM.sha),
    ]:
        try:
            answers.append(str(await connection.execute(command)))
        except StoreReplyError as error:
            answers.append(f"error {error.reply}")
    return answers


async def test_emulated_idmp_answers_its_scripts_by_sha_only_once_cached_like_redis_8_6(
    real_server: ServerUnderTest,
) -> None:
    if real_server.target != "redis-8.6":
        pytest.skip(f"IDMP exists on redis-8.6 only; {real_server.target} has none to compare with")
    expected, got = await asyncio.gather(
        cached_scripts(RedisPyAsync(real_server.async_client())), cached_scripts(SimStore((8, 6)).connection())
    )
    assert got == expected
    noscript = "error NOSCRIPT No matching script. Please use EVAL."
    assert expected[1:4] == [noscript] * 3  # the program does test what it says
    assert expected[-1] == "[1, 1, 0]"


async def reconfigure(connection: Connection) -> list[str]:
    """A stream that remembers runs, given other IDMP settings by the idmp strategy's configure script (a deploy
    that changes duration_sec): the answers, entry IDs replaced by the step that made them, then the stream."""
    store = Store(connection, owned=True)
    made: dict[str, int] = {}
    steps: list[tuple[Any, ...]] = [
        ("configure", 300, 50),  # a new stream: made and set, nothing to copy
        ("XADD", "s", "IDMP", "job", "1000", "*", "slot", "1000", "token", "a"),
        ("XADD", "s", "IDMP", "job", "2000", "*", "slot", "2000", "token", "b"),
        ("configure", 300, 50),  # the same settings: nothing done
        ("XADD", "s", "IDMP", "job", "1000", "*", "slot", "1000", "token", "c"),  # remembered: a's entry
        ("configure", 900, 50),  # longer: both runs copied
        ("XADD", "s", "IDMP", "job", "1000", "*", "slot", "1000", "token", "d"),  # remembered: the copy of a's
        ("configure", 300, 20),  # shorter and smaller (the previous deploy again): kept as they are
        ("XADD", "s", "IDMP", "job", "2000", "*", "slot", "2000", "token", "e"),  # remembered: the copy of b's
        ("configure", 300, 80),  # larger, shorter: the size raised, the duration kept; each run copied again
        ("XADD", "s", "IDMP", "job", "2000", "*", "slot", "2000", "token", "f"),
    ]
    answers = []
    for step, command in enumerate(steps):
        if command[0] == "configure":
            reply = await store.run(CONFIGURE, ["s"], [*command[1:], "job"])
            answers.append(" ".join(str(part) for part in reply))  # type: ignore[union-attr]
            continue
        entry_id = str(await store.execute(*command))
        [[_, fields]] = await store.execute("XRANGE", "s", entry_id, entry_id)  # type: ignore[misc]
        if entry_id not in made and fields[-1] == command[-1]:
            made[entry_id] = step
        origin = f"step {made[entry_id]}" if entry_id in made else "a copy"
        answers.append(f"token {fields[-1]}, entry of {origin}")  # what a claim reads back
    entries = await store.execute("XRANGE", "s", "-", "+")
    assert isinstance(entries, list)
    answers += [f"{made.get(str(entry[0]), 'a copy')}: {entry[1]}" for entry in entries]  # type: ignore[index]
    info = await store.execute("XINFO", "STREAM", "s")
    assert isinstance(info, list)
    fields = dict(zip(info[::2], info[1::2], strict=True))
    answers.append(f"duration {fields['idmp-duration']} maxsize {fields['idmp-maxsize']}")
    await store.close()
    return answers


async def test_emulated_idmp_runs_the_configure_script_like_redis_8_6(real_server: ServerUnderTest) -> None:
    """fakeredis runs a script's IDMP commands itself, past the emulation, which answers the configure script
    in its place: it must do what the script does on Redis 8.6."""
    if real_server.target != "redis-8.6":
        pytest.skip(f"IDMP exists on redis-8.6 only; {real_server.target} has none to compare with")
    expected, got = await asyncio.gather(
        reconfigure(RedisPyAsync(real_server.async_client())), reconfigure(SimStore((8, 6)).connection())
    )
    assert got == expected
    assert expected[:11] == [  # the program does test what it says
        "0 300 50", "token a, entry of step 1", "token b, entry of step 2", "-1 300 50", "token a, entry of step 1",
        "2 900 50", "token a, entry of a copy", "-1 900 50", "token b, entry of a copy", "2 900 80",
        "token b, entry of a copy",
    ]  # fmt: skip
    assert len(expected) == 11 + 2 + 2 + 2 + 1  # the answers, two runs, copied twice, and the settings
    assert expected[-1] == "duration 900 maxsize 80"


async def skip_and_trim(connection: Connection) -> list[str]:
    """The idmp strategy's skip claim and trim scripts on a stream of 300 s: the answers, entry IDs replaced by the
    step that made them. Its first two entries are older than the stream's duration (written with explicit IDs
    before it was set): claims whose ids the server no longer knows."""
    store = Store(connection, owned=True)
    now = await server_ms(store)
    made: dict[tuple[str, str], int] = {}
    early, unclaimed, forgotten = now + 1_000, now - 5_000, now - 100_000

    def skip(slot: int, token: str) -> tuple[Any, ...]:
        return ("skip", slot, 1000, "slot", slot, "token", token)

    steps: list[tuple[Any, ...]] = [
        ("XADD", "s", f"{now - 700_000}-1", "slot", now - 700_000, "token", "old"),
        ("XADD", "s", f"{now - 350_000}-1", "slot", forgotten, "token", "z"),  # 250 s before its slot
        ("configure", 300, 100),
        ("XADD", "s", "IDMP", "job", early, "*", "slot", early, "token", "a"),  # a claim before its slot
        skip(early, "k1"),  # its id is known: a's entry
        skip(unclaimed, "k2"),  # nobody claimed it: the skip's own entry
        skip(forgotten, "k3"),  # found among the entries of the duration before the slot: z's entry
        ("trim", "s", 1, 1),  # a record's trim, history_ttl_ms 1: the entries of the last two durations (600 s) kept
        skip(unclaimed, "k4"),  # k2's entry
        skip(now - 301_000, "k5"),  # its duration is over by the server's clock: nothing claimed
        ("XADD", "t", f"{now - 700_000}-2", "slot", 1, "token", "t1"),
        ("XADD", "t", f"{now - 690_000}-2", "slot", 2, "token", "t2"),
        ("XADD", "t", "*", "slot", 3, "token", "t3"),
        ("XADD", "t", "*", "slot", 4, "token", "t4"),
        ("XCFGSET", "t", "IDMP-DURATION", 300, "IDMP-MAXSIZE", 1),
        ("trim", "t", 1, 0),  # one entry more than max_size is three, but those of the last 600 s stay: t3, t4
    ]
    answers = []
    for step, command in enumerate(steps):
        if command[0] == "configure":
            reply = await store.run(CONFIGURE, ["s"], [*command[1:], "job"])
        elif command[0] == "skip":
            reply = await store.run(SKIP_CLAIM, ["s"], ["job", *command[1:]])
        elif command[0] == "trim":
            reply = await store.run(TRIM_RUNS, [command[1]], command[2:])
        else:
            reply = await store.execute(*command)
        if isinstance(reply, (str, bytes)) and "-" in str(reply):
            stream = "t" if command[1] == "t" else "s"  # two streams may make equal IDs in the same ms
            answers.append(f"entry of step {made.setdefault((stream, str(reply)), step)}")
        else:
            answers.append(str(reply))
    await store.close()
    return answers


async def test_emulated_idmp_runs_the_skip_claim_and_trim_scripts_like_redis_8_6(real_server: ServerUnderTest) -> None:
    if real_server.target != "redis-8.6":
        pytest.skip(f"IDMP exists on redis-8.6 only; {real_server.target} has none to compare with")
    expected, got = await asyncio.gather(
        skip_and_trim(RedisPyAsync(real_server.async_client())), skip_and_trim(SimStore((8, 6)).connection())
    )
    assert got == expected
    assert expected == [  # the program does test what it says
        "entry of step 0", "entry of step 1", "[0, 300, 100]", "entry of step 3", "entry of step 3",
        "entry of step 5", "entry of step 1", "3", "entry of step 5", "None",
        "entry of step 10", "entry of step 11", "entry of step 12", "entry of step 13", "OK", "2",
    ]  # fmt: skip


# The idmp strategy on the emulation: the contract tests of idmp skip on fake (fakeredis is Redis 7), so these run
# its rules on the IDMP the simulator judges it by, on every test run.


@contextlib.asynccontextmanager
async def emulated_idmp(**settings: Any) -> AsyncIterator[tuple[RedisBackend[Any], Store]]:
    """A started idmp backend on an emulated Redis 8.6, and a store to read it with; both closed after."""
    sim = SimStore((8, 6))
    backend: RedisBackend[Any] = RedisBackend(redis=sim.connection(), strategy={"name": "idmp", **settings})
    await backend.start(["sync"])
    store = Store(sim.connection(), owned=True)
    try:
        yield backend, store
    finally:
        await backend.stop()
        await store.close()


async def ran(backend: RedisBackend[Any], slot: int, token: str, policy: JobPolicy) -> None:
    """``slot`` claimed and run to the end by ``token``."""
    req = request(slot, token)
    won = await claim_one(backend, req, policy)
    assert won.outcome is Outcome.WON
    assert await backend.strategy.finish(backend.store, req, won, policy, record(req, won))


async def test_idmp_on_the_emulation_no_late_skip_beside_a_run_whose_id_max_size_evicted() -> None:
    """max_size 2: two later runs evict the first one's id, and a stalled instance's claim for its skip wins. The
    run's result is there (attempt 1): no skip is recorded beside it."""
    async with emulated_idmp(duration_sec=300, max_size=2) as (backend, store):
        policy = JobPolicy(late_after_ms=100)
        slot = await server_ms(store) - 10_000
        await ran(backend, slot, "ran", policy)
        for later in (slot + 1000, slot + 2000):
            assert (await claim_one(backend, request(later, f"t{later}"), policy)).outcome is Outcome.WON
        late = request(slot, "late")
        assert not await backend.strategy.skip(backend.store, late, policy, "skipped-late", "too late")
        history = await backend.strategy.history(backend.store, "sync", 10)
        assert [r.status for r in history if r.slot == slot] == ["ok"]


async def test_idmp_on_the_emulation_a_late_skip_claims_nothing_once_it_keeps_max_size_ids() -> None:
    """As the contract test on Redis 8.6: a run still going whose id two later runs pushed out, and a run nobody
    claimed, are not recorded skipped, and the skips push out no run's id."""
    async with emulated_idmp(duration_sec=300, max_size=2) as (backend, store):
        policy = JobPolicy(late_after_ms=100)
        base = await server_ms(store) - 10_000
        for slot in (base, base + 1000, base + 2000):
            assert (await claim_one(backend, request(slot, f"t{slot}"), policy)).outcome is Outcome.WON
        for slot in (base, base + 500):
            late = request(slot, f"late{slot}")
            assert not await backend.strategy.skip(backend.store, late, policy, "skipped-late", "too late")
        assert (await claim_one(backend, request(base + 1000, "again"), policy)).outcome is Outcome.LOST
        assert await backend.strategy.history(backend.store, "sync", 10) == []


def _idmp_instances(
    store: SimStore, names: str, max_size: int, work_s: float, ran: Counter[int]
) -> list[Scheduler[Any]]:
    """Instances of a job every second (max_late_ms 1 s) under idmp on ``store``, counting the runs of each slot."""

    async def work(run: RunContext) -> None:
        ran[run.slot] += 1
        await asyncio.sleep(work_s)

    instances = []
    for name in names:
        strategy = {"name": "idmp", "duration_sec": 300, "max_size": max_size}
        scheduler = Scheduler(RedisBackend(redis=Link(store.connection(), name), strategy=strategy),
                              instance_id=name, clock=SimClock(), random=random.Random(name))  # fmt: skip
        scheduler.add_job("j", "* * * * * *", work, max_late_ms=1000)
        instances.append(scheduler)
    return instances


def test_idmp_a_paused_instance_records_no_skip_of_a_run_going_on_whose_id_later_runs_pushed_out() -> None:
    """A job every second that works 20 s, max_size 10. b is paused 15 s; at its resume it skips the slot it had
    due, which a still runs, its id pushed out by the runs since. Before, the skip was recorded beside a's ok."""

    async def main() -> dict[int, list[str]]:
        ran: Counter[int] = Counter()
        a, b = _idmp_instances(SimStore((8, 6)), "ab", 10, 20.0, ran)
        for scheduler in (a, b):
            await scheduler.start()
        await asyncio.sleep(5.5)
        assert isinstance(b.clock, SimClock)
        b.clock.pause()
        await asyncio.sleep(15)
        b.clock.resume()
        await asyncio.sleep(30)
        records: dict[int, list[str]] = {}
        for kept in await a.history("j", limit=1000):
            records.setdefault(kept.slot, []).append(kept.status)
        for scheduler in (a, b):
            await scheduler.stop(timeout=0.1)
        return records

    records = run_virtual(main(), epoch_s=EPOCH_S, seed=1)
    assert {slot: statuses for slot, statuses in records.items() if len(statuses) > 1} == {}


def test_idmp_skips_of_paused_instances_push_out_no_run_a_late_claim_would_win_again() -> None:
    """max_size 2, a job every second: c and d are paused a second apart and resume 0.5 s after the slot at 30 s.
    Each first skips the slot it had due, then claims the slot at 30 s, which a ran. Before, the skips' new ids
    pushed that slot's out, and c ran it again."""

    async def main() -> Counter[int]:
        ran: Counter[int] = Counter()
        a, c, d = _idmp_instances(SimStore((8, 6)), "acd", 2, 0.0, ran)
        for scheduler in (a, c, d):
            await scheduler.start()
        await asyncio.sleep(9.7)
        assert isinstance(c.clock, SimClock)
        assert isinstance(d.clock, SimClock)
        c.clock.pause()
        await asyncio.sleep(1.0)
        d.clock.pause()
        await asyncio.sleep(19.8)
        c.clock.resume()
        d.clock.resume()
        await asyncio.sleep(5)
        for scheduler in (a, c, d):
            await scheduler.stop(timeout=0.1)
        return ran

    ran = run_virtual(main(), epoch_s=EPOCH_S, seed=1)
    assert ran[(EPOCH_S + 30) * 1000] == 1
    assert {slot: count for slot, count in ran.items() if count > 1} == {}


async def test_idmp_on_the_emulation_records_a_late_skip_only_while_it_remembers_the_run() -> None:
    async with emulated_idmp(duration_sec=120, max_size=100) as (backend, store):
        policy = JobPolicy(late_after_ms=100, keep_ms=1_000)
        now = await server_ms(store)
        for slot, recorded in ((now - 121_000, False), (now - 65_000, True), (now - 500, True)):
            req = request(slot, f"t{slot}")
            assert await backend.strategy.skip(backend.store, req, policy, "skipped-late", "too late") is recorded


def test_idmp_on_the_emulation_a_late_skip_finds_the_claim_of_a_clock_two_minutes_ahead() -> None:
    """An instance whose clock ran 2 minutes ahead claimed a slot early and runs it still; the server forgets the
    claim's id 300 s (duration_sec) after it, 180 s after the slot. A late skip at 200 s must not claim the slot
    again and record a skip beside the run. Before, a skip was recorded until a minute before the slot's duration
    ended, which did not cover a clock more than a minute ahead."""

    async def main() -> None:
        async with emulated_idmp(duration_sec=300, max_size=100) as (backend, store):
            policy = JobPolicy(late_after_ms=60_000)
            slot = await server_ms(store) + 120_000
            assert (await claim_one(backend, request(slot, "early"), policy)).outcome is Outcome.WON
            await asyncio.sleep(320)
            late = RunRequest("sync", run_id(slot), slot, "late", "b")
            assert not await backend.strategy.skip(backend.store, late, policy, "skipped-late", "too late")
            assert await backend.strategy.history(backend.store, "sync", 10) == []

    run_virtual(main(), epoch_s=EPOCH_S, seed=1)


async def test_idmp_on_the_emulation_a_late_claim_of_a_run_whose_entry_is_gone_loses() -> None:
    async with emulated_idmp(duration_sec=300, max_size=1000) as (backend, store):
        policy = JobPolicy(history_size=1)
        first = await server_ms(store) - 60_000
        for slot in (first, first + 1000):
            assert (await claim_one(backend, request(slot, f"t{slot}"), policy)).outcome is Outcome.WON
        [[entry_id, _]] = await store.execute("XRANGE", "cron:sync:runs", "-", "+", "COUNT", 1)  # type: ignore[misc]
        assert await store.execute("XDEL", "cron:sync:runs", entry_id) == 1
        assert (await claim_one(backend, request(first, "late"), policy)).outcome is Outcome.LOST


async def test_idmp_on_the_emulation_trim_keeps_history_size_entries_of_claims_sent_together() -> None:
    async with emulated_idmp(**IDMP_TRIMMED_QUICKLY) as (backend, _):
        assert await trimmed_after_claims_sent_together(backend) == 10


async def test_idmp_on_the_emulation_keeps_as_many_runs_as_it_remembers_ids() -> None:
    """history_size 2, max_size 200: a retried claim of a run 150 runs back (more than a stream node), its answer
    lost, reads its entry back and wins."""
    async with emulated_idmp(duration_sec=300, max_size=200) as (backend, store):
        policy = JobPolicy(history_size=2)
        first = await server_ms(store) - 200_000
        assert (await claim_one(backend, request(first, "mine"), policy)).outcome is Outcome.WON
        for i in range(1, 151):
            await ran(backend, first + i * 1000, f"t{i}", policy)
        assert (await claim_one(backend, request(first, "mine"), policy)).outcome is Outcome.WON


async def test_idmp_on_the_emulation_history_ttl_ms_keeps_the_runs_it_remembers() -> None:
    """history_ttl_ms (and keep_ms) 1 s, duration_sec 300: a record's trim keeps the entry of a run claimed 1.5 s
    before, whose retried claim (answer lost) reads it back and wins."""
    async with emulated_idmp(duration_sec=300, max_size=100) as (backend, store):
        policy = JobPolicy(history_ttl_ms=1_000, keep_ms=1_000)
        now = await server_ms(store)
        assert (await claim_one(backend, request(now, "mine"), policy)).outcome is Outcome.WON
        await asyncio.sleep(1.5)
        await ran(backend, await server_ms(store), "next", policy)  # its record trims what is older than 1 s
        assert (await claim_one(backend, request(now, "mine"), policy)).outcome is Outcome.WON


async def test_idmp_on_the_emulation_claims_again_once_its_stream_vanished() -> None:
    """A store restarted empty (here: the stream deleted) still runs the job: the claim makes the stream again
    and configures it, and wins."""
    async with emulated_idmp(duration_sec=300, max_size=100) as (backend, store):
        policy = JobPolicy()
        now = await server_ms(store)
        assert (await claim_one(backend, request(now, "a"), policy)).outcome is Outcome.WON
        assert await store.execute("DEL", "cron:sync:runs") == 1
        assert (await claim_one(backend, request(now + 1000, "b"), policy)).outcome is Outcome.WON
        assert (await claim_one(backend, request(now + 1000, "c"), policy)).outcome is Outcome.LOST


def test_emulated_idmp_forgets_an_id_once_its_duration_passed() -> None:
    """Checked on every run, not only against a Redis 8.6: an id forgotten never, the simulator would show idmp
    (and its late claims) safer than it is."""

    async def main() -> tuple[bool, bool]:
        connection = SimStore((8, 6)).connection()
        await connection.execute(["XADD", "s", "*", "f", "0"])  # XCFGSET needs the stream
        await connection.execute(["XCFGSET", "s", "IDMP-DURATION", 2])
        first = await connection.execute(["XADD", "s", "IDMP", "p", "a", "*", "f", "1"])
        await asyncio.sleep(1.0)
        repeat = await connection.execute(["XADD", "s", "IDMP", "p", "a", "*", "f", "2"])  # within the 2 s
        await asyncio.sleep(1.5)
        again = await connection.execute(["XADD", "s", "IDMP", "p", "a", "*", "f", "3"])  # 2.5 s on
        return repeat == first, again != first

    assert run_virtual(main(), epoch_s=EPOCH_S, seed=1) == (True, True)


class FailsConfigureOnce(Link):
    """The first configure script sent through it fails before it reaches the store."""

    failed = False

    def _fails(self, commands: Sequence[Any]) -> bool:
        if self.failed or not any(CONFIGURE.sha in map(str, command) for command in commands):
            return False
        self.failed = True
        return True

    async def execute(self, command: Any) -> Any:
        if self._fails([command]):
            raise StoreUnavailableError("the connection was reset")
        return await super().execute(command)

    async def execute_many(self, commands: Any) -> Any:
        if self._fails(commands):
            raise StoreUnavailableError("the connection was reset")
        return await super().execute_many(commands)


async def test_idmp_on_the_emulation_a_configuration_that_failed_at_start_is_done_by_the_first_claim() -> None:
    """A deploy that raises duration_sec to 600 s, whose configuration of the stream fails at start (the store out
    of reach a moment): its first claim configures the stream before it adds to it, as start would have."""
    sim = SimStore((8, 6))
    earlier = RedisBackend(redis=sim.connection(), strategy={"name": "idmp", "duration_sec": 300, "max_size": 100})
    await earlier.start(["sync"])
    store = Store(sim.connection(), owned=True)
    now = await server_ms(store)
    await ran(earlier, now - 1000, "a", JobPolicy())
    link = FailsConfigureOnce(sim.connection())
    backend = RedisBackend(redis=link, strategy={"name": "idmp", "duration_sec": 600, "max_size": 100})
    await backend.start(["sync"])
    assert link.failed
    assert (await claim_one(backend, request(now, "b"), JobPolicy())).outcome is Outcome.WON
    info = await store.execute("XINFO", "STREAM", "cron:sync:runs")
    assert isinstance(info, list)
    fields = dict(zip(info[::2], info[1::2], strict=True))
    assert (fields["idmp-duration"], fields["idmp-maxsize"]) == (600, 100)
    for done in (earlier, backend):
        await done.stop()
    await store.close()
