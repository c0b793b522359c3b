"""One scheduler instance of a live run: an OS process running the production library against a real server.

Started by :mod:`sim.live` as ``python -m sim.live_instance --config JSON``. It writes what it does as JSON lines
(claims and their answers, job starts and ends) stamped with the machine's monotonic clock, which every process
shares, prints ``ready`` once its scheduler has started, and takes commands on stdin: ``clock JSON`` (its clocks
take the state that :meth:`SkewedClock.state` gave, from the run's copy of them, after a jump or a change of
drift), ``run_now JOB``, ``stop TIMEOUT_S`` (``Scheduler.stop(TIMEOUT_S)``, then the process exits). A process
started ``held`` (the run's first ones) prints ``held`` once it is set up and starts its scheduler when told
``start``: at the scenario's time 0, so that, as in virtual time, no instance runs a slot before it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
from collections.abc import Coroutine
from dataclasses import asdict
from typing import Any

from anarchon import RedisBackend, RunContext, Scheduler, SystemClock, ValkeyBackend
from sim.history import Event, History, RecordingStrategy
from sim.scenario import load
from sim.vtime import Sleepers


class SkewedClock(SystemClock):
    """The machine's clocks, ``offset_ms`` ahead (negative: behind) and running ``1 + drift`` times as fast, timers
    included; both can change while running, without the clocks jumping when the drift does.

    An instance's clocks outlive its processes, as in virtual mode: the live run keeps a copy of each instance's
    clock, changes it with the faults, and hands its :meth:`state` to every process it starts and tells. The
    machine's monotonic clock, which the drift counts from, is the same in every process."""

    def __init__(self, offset_ms: float = 0.0, drift: float = 0.0) -> None:
        self.offset_ms = offset_ms
        self.drift = drift
        self._gained_s = 0.0  # what the drift had added by _since (machine monotonic seconds)
        self._since = time.monotonic()
        self._sleepers = Sleepers()

    def state(self) -> dict[str, float]:
        return {"offset_ms": self.offset_ms, "drift": self.drift, "gained_s": self._gained_s, "since": self._since}

    def take(self, state: dict[str, float]) -> None:
        """Go on from another copy's :meth:`state`."""
        self.offset_ms, self.drift = state["offset_ms"], state["drift"]
        self._gained_s, self._since = state["gained_s"], state["since"]
        self._sleepers.wake()

    def _gain_s(self) -> float:
        return self._gained_s + (time.monotonic() - self._since) * self.drift

    def set_drift(self, drift: float) -> None:
        self._gained_s, self._since = self._gain_s(), time.monotonic()
        self.drift = drift
        self._sleepers.wake()

    def wall_ms(self) -> int:
        return super().wall_ms() + int(self.offset_ms + self._gain_s() * 1000)

    def monotonic(self) -> float:
        return super().monotonic() + self._gain_s()

    async def sleep(self, seconds: float) -> None:
        """Until this clock has run ``seconds``: a drift change meanwhile ends the part slept at the old rate, and
        what is left is slept at the new one, as in virtual mode."""
        left = max(0.0, seconds)
        until = self.monotonic() + left
        while left > 0:
            await self._sleepers.sleep(left / (1 + self.drift))
            left = until - self.monotonic()


class JsonLines(History):
    """A history written to a file as it happens: a process killed with SIGKILL loses nothing it wrote."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, record: dict[str, Any]) -> None:
        os.write(self._fd, (json.dumps(record) + "\n").encode())

    def add(self, event: Event) -> None:
        self.write({"event": asdict(event)})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    config = json.loads(parser.parse_args().config)
    asyncio.run(serve(config))


async def serve(config: dict[str, Any]) -> None:
    scenario = load(config["scenario"])  # already scaled to live time by sim.live
    name, strategy = config["instance"], config["strategy"]
    history = JsonLines(config["log"])
    clock = SkewedClock()
    clock.take(config["clock"])
    options: dict[str, Any] = {"strategy": scenario.strategy_option(strategy), "prefix": config["prefix"]}
    backend: RedisBackend[Any] = (
        ValkeyBackend(valkey=config["url"], **options)
        if config["valkey"]
        else RedisBackend(redis=config["url"], **options)
    )
    recorder = backend.strategy = RecordingStrategy(backend.strategy, history, name, time.monotonic)
    scheduler: Scheduler[Any] = Scheduler(
        backend, clock=clock, instance_id=name, **scenario.scheduler_options(strategy)
    )

    def work(seconds: float) -> Any:
        async def job(run: RunContext) -> None:
            base = {"instance": name, "job": run.job, "slot": run.slot, "run": recorder.runs[run.token],
                    "attempt": run.attempt, "fence": run.fence, "token": run.token, "manual": run.manual,
                    "incarnation": config["incarnation"]}  # fmt: skip
            history.write({"start": {**base, "t": time.monotonic()}})
            try:
                await clock.sleep(seconds)  # the instance's seconds, as in virtual mode: a fast clock works faster
            except asyncio.CancelledError:
                history.write({"end": {"token": run.token, "t": time.monotonic(), "completed": False}})
                raise
            history.write({"end": {"token": run.token, "t": time.monotonic(), "completed": True}})

        return job

    for spec in scenario.jobs:
        scheduler.add_job(spec.name, spec.cron, work(spec.work_s), **scenario.job_options(spec, strategy))
    loop = asyncio.get_running_loop()
    commanded: set[asyncio.Task[Any]] = set()
    told_to_start = asyncio.Event()

    async def stop_and_exit(timeout_s: float) -> None:
        await scheduler.stop(timeout=timeout_s)
        os._exit(0)  # what it wrote is written (os.write); nothing else of it needs an orderly end

    def keep(coroutine: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.ensure_future(coroutine)
        commanded.add(task)  # held until done: the loop keeps only weak references to tasks
        task.add_done_callback(commanded.discard)

    def command(line: str) -> None:
        word, _, argument = line.strip().partition(" ")
        if word == "start":
            told_to_start.set()
        elif word == "clock":
            clock.take(json.loads(argument))
        elif word == "stop":
            keep(stop_and_exit(float(argument)))
        elif word == "run_now":
            keep(scheduler.run_now(argument))

    def read_commands() -> None:
        for line in sys.stdin:
            loop.call_soon_threadsafe(command, line)
        # Its stdin closed: the run that started this process is gone without killing it (the run's own process
        # was killed). Ended here, it cannot claim on through whatever later listens on its proxy's old port.
        os._exit(0)

    threading.Thread(target=read_commands, daemon=True).start()
    if config["held"]:
        print("held", flush=True)
        await told_to_start.wait()
    await scheduler.start()
    print("ready", flush=True)
    await asyncio.Event().wait()  # until killed: the end of a live run is a SIGKILL, like a crash


if __name__ == "__main__":
    main()
