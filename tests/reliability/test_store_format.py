"""A store written by a newer anarchon is refused (ANARCHON_STORE_FORMAT) and left exactly as it was.

tests/anarchon/test_contract.py checks this on a store that holds nothing but the format key, through the
backend. Here the store holds a working history (runs, results, leases and streams of every strategy, and keys
this version does not know), the refusal goes through ``Scheduler.start()`` with the options that make a start
write (catch-up, idmp's stream settings), and every key is compared byte for byte (DUMP) and with its TTL.
"""

from __future__ import annotations

from typing import Any

import pytest

from anarchon import Scheduler, StoreFormatError, StoreReplyError
from tests.anarchon.support import StoreTarget


def strategies(target: StoreTarget) -> list[Any]:
    names: list[Any] = ["lease", "stream-id", "script"]
    if target.supports_idmp:
        names.append({"name": "idmp", "duration_sec": 600, "max_size": 100})
    return names


def strategy_name(strategy: Any) -> str:
    return strategy if isinstance(strategy, str) else str(strategy["name"])


async def snapshot(target: StoreTarget) -> dict[str, tuple[Any, Any]]:
    keys = sorted(await target.raw("KEYS", "*"))
    return {key: (await target.raw("DUMP", key), await target.raw("PTTL", key)) for key in keys}


def scheduler_for(target: StoreTarget, strategy: Any) -> Scheduler[Any]:
    name = strategy_name(strategy)
    lease = name == "lease"
    scheduler: Scheduler[Any] = Scheduler(target.backend(strategy, prefix=f"{name}:"), instance_id=f"{name}-old")
    options: dict[str, Any] = {"catch_up_ms": 3_600_000} if lease else {}  # catch-up claims at start
    scheduler.add_job("sync", "* * * * * *", lambda: None, **options)
    scheduler.add_job("report", "0 0 1 1 *", lambda: None)
    return scheduler


async def test_a_newer_store_with_data_is_refused_by_the_scheduler_and_left_untouched(target: StoreTarget) -> None:
    # A store in use: every strategy has run jobs, manually and on schedule (this version writes format 1) …
    for strategy in strategies(target):
        scheduler = scheduler_for(target, strategy)
        async with scheduler:
            await scheduler.run_now("report")
            await scheduler.run_now("sync")
    # … then a newer anarchon took it over: a newer format, and keys this version has never seen.
    for strategy in strategies(target):
        prefix = f"{strategy_name(strategy)}:"
        await target.raw("SET", f"{prefix}format", "2")
        await target.raw("HSET", f"{{{prefix}sync}}:v2-state", "field", "value")
        await target.raw("SET", f"{prefix}v2-marker", "x", "PX", 3_600_000)
    before = await snapshot(target)
    assert len(before) >= 10
    for strategy in strategies(target):
        scheduler = scheduler_for(target, strategy)
        with pytest.raises(StoreFormatError) as caught:
            await scheduler.start()
        assert caught.value.code == "ANARCHON_STORE_FORMAT"
        assert caught.value.found == "2"
        assert "upgrade anarchon" in str(caught.value)
        with pytest.raises(StoreFormatError):
            await scheduler.history("sync")  # nor does it read what it cannot read
    after = await snapshot(target)
    assert after.keys() == before.keys()
    assert {key: value for key, (value, _) in after.items()} == {key: value for key, (value, _) in before.items()}
    for key, (_, ttl) in after.items():  # expiries untouched (a TTL only runs down, never up)
        assert (ttl == -1) == (before[key][1] == -1), key
        assert ttl <= before[key][1] or before[key][1] == -1, key


@pytest.mark.parametrize("stored", ["two", "1.5", "", "-1"])
async def test_an_unreadable_store_format_is_refused_and_left_untouched(target: StoreTarget, stored: str) -> None:
    await target.raw("SET", "lease:format", stored)
    scheduler = scheduler_for(target, "lease")
    with pytest.raises(StoreFormatError, match="prefix of its own") as caught:
        await scheduler.start()
    assert "upgrade" not in str(caught.value)  # no newer anarchon reads it either
    assert await target.raw("KEYS", "*") == ["lease:format"]
    assert await target.raw("GET", "lease:format") == stored


async def test_a_format_key_of_another_type_is_refused_and_left_untouched(target: StoreTarget) -> None:
    await target.raw("HSET", "lease:format", "version", "3")
    scheduler = scheduler_for(target, "lease")
    with pytest.raises(StoreReplyError, match="WRONGTYPE"):
        await scheduler.start()
    assert await target.raw("KEYS", "*") == ["lease:format"]
    assert await target.raw("HGET", "lease:format", "version") == "3"
