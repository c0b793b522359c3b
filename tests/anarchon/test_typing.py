"""The seed's misuse is a type error under mypy --strict, and correct use type-checks.

Each snippet line marked ``# error`` must get a mypy error on that line, and no other line may get one.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
from mypy import api

SNIPPETS = """
from zoneinfo import ZoneInfo

from anarchon import RedisBackend, RunContext, Scheduler, ValkeyBackend

async def job(run: RunContext) -> None: ...
def sync_job() -> None: ...

lease = RedisBackend(redis="redis://localhost:6379/0")
lease2 = RedisBackend(redis={"host": "cache", "port": 6379, "password": "pw", "db": 1})
idmp = RedisBackend(strategy={"name": "idmp", "duration_sec": 900, "max_size": 5_000})
script = RedisBackend(strategy={"name": "script", "window_ms": 600_000}, prefix="billing:cron:")
valkey = ValkeyBackend(valkey={"host": "localhost", "port": 6390}, strategy="stream-id")
valkey_lease = ValkeyBackend(valkey="redis://localhost:6390")

scheduler = Scheduler(backend=lease, lease_ms=30_000, heartbeat_ms=10_000)
scheduler.add_job("sync", "*/5 * * * *", job, max_attempts=3, catch_up_ms=3_600_000, overlap=False)
scheduler.add_job("tick", "*/10 * * * * *", sync_job, jitter_ms=5, timezone="Europe/Berlin")
claim_only = Scheduler(backend=idmp, history_size=10)
claim_only.add_job("a", "* * * * *", job, jitter_ms=5, max_late_ms=10_000, timezone=ZoneInfo("Asia/Tokyo"))
Scheduler(valkey_lease, lease_ms=1000)

@scheduler.job("deco", "* * * * *", max_attempts=2)
async def decorated(run: RunContext) -> None: ...

ValkeyBackend(strategy="idmp")  # error
ValkeyBackend(strategy={"name": "idmp"})  # error
RedisBackend(strategy={"name": "lease", "window_ms": 1})  # error
RedisBackend(strategy={"name": "script", "duration_sec": 1})  # error
RedisBackend(strategy="paxos")  # error
RedisBackend(redis={"hots": "cache"})  # error
RedisBackend(prefx="x")  # error
ValkeyBackend(redis="redis://x")  # error
Scheduler(backend=idmp, lease_ms=30_000)  # error
Scheduler(backend=valkey, heartbeat_ms=1)  # error
claim_only.add_job("b", "* * * * *", job, max_attempts=3)  # error
claim_only.add_job("c", "* * * * *", job, catch_up_ms=1)  # error
claim_only.add_job("d", "* * * * *", job, overlap=True)  # error
claim_only.job("e", "* * * * *", overlap=True)  # error
scheduler.add_job("f", "* * * * *", 42)  # error
scheduler.add_job("g", "* * * * *", job, timezone=3600)  # error
"""


@pytest.mark.slow
def test_misuse_is_a_type_error_and_use_is_not(tmp_path: Path) -> None:
    source = textwrap.dedent(SNIPPETS)
    path = tmp_path / "snippets.py"
    path.write_text(source)
    expected = {i for i, line in enumerate(source.splitlines(), 1) if line.endswith("# error")}
    stdout, stderr, _ = api.run(
        ["--strict", "--no-incremental", "--no-error-summary", "--hide-error-context", str(path)]
    )
    assert not stderr, stderr
    flagged = {int(m.group(1)) for m in re.finditer(rf"{re.escape(str(path))}:(\d+): error", stdout)}
    assert flagged == expected, stdout
