"""One scheduler process of the bench's burst (sim.bench.burst): registers the jobs, runs until they are due and
done, and prints as JSON each run it started, with its start lateness, and the CPU time it used from the slot on.

    python -m sim.burst_instance URL redis|valkey NAME JOBS

Once it has imported what it needs it prints a line, and reads the slot (epoch ms) from its standard input: the
bench picks the slot once every instance is that far, so that a machine slow to start processes does not make
them miss it. A program of its own, which imports anarchon alone, as an app would: a process started by
multiprocessing imports the bench's main module again, and the bench's imports (the testbed, fakeredis, the
servers) would add some 20,000 objects for every full collection of the garbage collector to walk in the burst.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from anarchon import RedisBackend, RunContext, Scheduler, ValkeyBackend

RUN_ON_S = 5.0  # how long after the slot the scheduler runs: every run of the burst has started by then


async def serve(url: str, valkey: bool, name: str, jobs: int, slot_ms: int) -> dict[str, Any]:
    """Run ``jobs`` jobs due at ``slot_ms`` on the server at ``url``: (job, slot, lateness ms) of each run this
    instance started, and the CPU seconds the process used from the slot until its scheduler stopped."""
    runs: list[tuple[str, int, float]] = []

    async def work(run: RunContext) -> None:
        runs.append((run.job, run.slot, time.time() * 1000 - run.slot))

    backend = ValkeyBackend(valkey=url) if valkey else RedisBackend(redis=url)
    scheduler = Scheduler(backend, instance_id=name)
    for j in range(jobs):
        scheduler.add_job(f"job{j}", f"{slot_ms // 1000 % 60} * * * * *", work)
    async with scheduler:
        await asyncio.sleep(max(0.0, slot_ms / 1000 - time.time()))
        cpu_at_slot = time.process_time()
        await asyncio.sleep(RUN_ON_S)
    return {"runs": runs, "cpu_s": time.process_time() - cpu_at_slot}


def main(argv: Sequence[str]) -> None:
    url, kind, name, jobs = argv
    print("ready", flush=True)
    slot_ms = int(sys.stdin.readline())
    json.dump(asyncio.run(serve(url, kind == "valkey", name, int(jobs), slot_ms)), sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1:])
