"""The simulator's IDMP emulation answers like a real Redis 8.6, command for command."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from anarchon._adapters import RedisPyAsync
from anarchon._errors import StoreReplyError
from anarchon._store import Connection, Store
from anarchon._strategies.idmp import CONFIGURE
from sim.servers.testing import ServerUnderTest
from sim.world import SimStore

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
        ("configure", 900, 50),  # changed: both runs copied
        ("XADD", "s", "IDMP", "job", "1000", "*", "slot", "1000", "token", "d"),  # remembered: the copy of a's
        ("configure", 300, 20),  # and back: one copy of each run again (the first entry of each)
        ("XADD", "s", "IDMP", "job", "2000", "*", "slot", "2000", "token", "e"),
    ]
    answers = []
    for step, command in enumerate(steps):
        if command[0] == "configure":
            answers.append(str(await store.run(CONFIGURE, ["s"], [*command[1:], "job"])))
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
    assert expected[:9] == [  # the program does test what it says
        "0", "token a, entry of step 1", "token b, entry of step 2", "-1", "token a, entry of step 1",
        "2", "token a, entry of a copy", "2", "token b, entry of a copy",
    ]  # fmt: skip
    assert len(expected) == 9 + 2 + 2 + 2 + 1  # the answers, two runs, copied twice, and the settings
    assert expected[-1] == "duration 300 maxsize 20"
