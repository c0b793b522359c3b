"""Benchmarks: claim cost against the floor, burst scale, memory, testbed speed. Ratios come from one run.

    python -m sim.bench [--quick] [--targets redis-7,valkey-9] [--json FILE]

Claim latency: for each target, the same asyncio redis-py client (RESP2) takes turns, in one loop, between
``PING`` (the floor), a per-slot ``SET key token NX PX`` (the textbook lock) and a claim of each strategy; each
lease claim is followed (untimed) by its finish, as in real use. Claims cycle over 100 jobs. The script strategy
scans a job's claims of the last ``window_ms``: each job's window holds 30 of them throughout (a job every 10 s
with the default window of 300 s), each claim followed (untimed) by the trim of the oldest. p50 /
p99 in microseconds, and each strategy's p50 over SET NX PX's. Beside them, ``lua_spin``: a script sent with a
lease claim's keys and arguments that does nothing but spin a Lua loop for as long as the lease claim runs in the
server (``INFO commandstats``), which shows how much of the lease claim's ratio any script told what a claim is
told, of that server time, would cost; what lease takes beyond it is anarchon's work in the client. Pipelined
claims per second are measured on each target, and on a cluster of three primaries of the burst's target, batches
of each operation taking turns, each rate beside the time per claim over pipelined SET NX PX's.

Server instructions: each target's server runs once more under callgrind (valgrind), which counts the
instructions it executes for a request (reading it, running it, writing the reply; not the kernel's part): per
``PING``, ``SET NX PX`` and, for each strategy, a won claim, a losing one and (lease) the run's finish. A count is
not a time: a busy machine barely changes it (two runs agree within about 1 %, 4 % for PING), so these ratios
hold wherever the same server build runs.

Where the bench may (root), the claim latencies are measured a second time while it holds a request for a CPU
wake-up latency of 0 µs (``/dev/cpu_dma_latency``): idle CPUs then poll instead of halting. On a virtual machine
whose guest halts at once when idle, every wait for a reply can end in a wake-up of the vCPU that costs tens of
µs, more often the longer the server works; the second table shows the calls without that cost.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import gc
import json
import math
import multiprocessing
import os
import pathlib
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import tracemalloc
import unittest.mock
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import fakeredis
import redis.asyncio
import redis.asyncio.cluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from anarchon import RedisBackend, RunContext, RunRecord, Scheduler, ValkeyBackend
from anarchon._adapters import RedisPyAsync, adapt
from anarchon._store import Command, Store, as_text
from anarchon._strategies import Claim, JobPolicy, Outcome, RunRequest
from anarchon._strategies.lease import LeaseStrategy
from sim.checkers import percentile
from sim.live import supported
from sim.servers import RunningServer, available_targets, backend_for, start_server

STRATEGIES = ("lease", "stream-id", "idmp", "script")
JOBS = 100
WARM_UP = JOBS  # every job's first claim (lease: it also fixes the job's catch-up moment) is left out
SCRIPT_WINDOW_CLAIMS = 30  # claims in a script job's window while it is measured: one every 10 s for 300 s
# SPIN: spin a Lua loop ARGV[#ARGV] times and nothing else. KEYS and the other ARGV: a lease claim's, unread (what
# the server and the client do with a claim's arguments is not anarchon's to cut). Returns 1.
SPIN = "local x = 0 for i = 1, tonumber(ARGV[#ARGV]) do x = x + i end return 1"
Cleanup = Callable[[], Awaitable[None]] | None
T = TypeVar("T")


def summary(samples_s: Sequence[float]) -> dict[str, float]:
    return {
        "p50_us": round(percentile(samples_s, 50) * 1e6, 1),
        "p99_us": round(percentile(samples_s, 99) * 1e6, 1),
    }


def bench_client(server: RunningServer) -> redis.asyncio.Redis:
    """The bench's asyncio client (RESP2). It makes its connections without retries, as the README advises."""
    return redis.asyncio.Redis(host=server.host, port=server.port, protocol=2, retry=Retry(NoBackoff(), 0))


def make_backend(server: RunningServer, client: Any, strategy: str, prefix: str) -> RedisBackend[Any]:
    if server.is_valkey:
        return ValkeyBackend(valkey=client, strategy=strategy, prefix=prefix)  # type: ignore[call-overload, no-any-return]
    return RedisBackend(redis=client, strategy=strategy, prefix=prefix)  # type: ignore[call-overload, no-any-return]


@dataclass
class ClaimBench:
    server: RunningServer
    iterations: int

    async def run(self) -> dict[str, Any]:
        client = bench_client(self.server)
        store = Store(RedisPyAsync(client), owned=True)
        backends = await _started_backends(self.server, client, store)
        policy = JobPolicy(lease_ms=30_000, history_size=1000)
        ops: dict[str, Callable[[int], Awaitable[Cleanup]]] = {
            "ping": lambda i: self._ping(store),
            "set_nx_px": lambda i: self._set_nx_px(store, i),
        }
        for strategy, backend in backends.items():
            ops[strategy] = self._claimer(backend, policy)
        lease_server_us = await self._lease_server_us(store, backends["lease"], policy)
        spin = await _claim_shaped_spin(store, backends["lease"], policy)
        spin_rounds = await _spin_rounds_for(store, spin, lease_server_us)
        ops["lua_spin"] = lambda i: self._spin(store, spin, spin_rounds)
        samples: dict[str, list[float]] = {name: [] for name in ops}
        for i in range(self.iterations + WARM_UP):  # warm-up rounds fill connection pools and script caches
            for name, op in ops.items():
                began = time.perf_counter()
                cleanup = await op(i)
                elapsed = time.perf_counter() - began
                if cleanup is not None:
                    await cleanup()  # the lease run's finish, as in real use, outside the measurement
                if i >= WARM_UP:
                    samples[name].append(elapsed)
        for backend in backends.values():
            await backend.stop()
        await store.close()
        result: dict[str, Any] = {name: summary(values) for name, values in samples.items()}
        floor = result["set_nx_px"]["p50_us"]
        for name in (*backends, "lua_spin"):
            result[name]["ratio_to_set_nx_px"] = round(result[name]["p50_us"] / floor, 2)
        result["lease"]["server_us"] = result["lua_spin"]["server_us"] = round(lease_server_us, 1)
        result["version"] = self.server.version
        return result

    @staticmethod
    async def _ping(store: Store) -> Cleanup:
        await store.execute("PING")
        return None

    @staticmethod
    async def _spin(store: Store, spin: Command, rounds: int) -> Cleanup:
        await store.execute(*spin, rounds)
        return None

    @staticmethod
    async def _lease_server_us(store: Store, backend: RedisBackend[Any], policy: JobPolicy) -> float:
        """Server µs per lease claim: claims of the bench's jobs for slots before the timed ones, each job's
        previous run finished, as in the timed loop; their finishes run after the counters are read."""
        used_us, calls = 0.0, 0
        for round_ in range(3):
            slot = 1_600_000_000_000 + round_ * 1000
            await store.execute("CONFIG", "RESETSTAT")
            finishes = []
            for j in range(JOBS):
                request = RunRequest(f"job{j}", str(slot), slot, f"calibrate-{round_}-{j}", "bench")
                finishes.append((request, await _claim_as(backend, policy, request, Outcome.WON)))
            round_us, round_calls = await _evalsha_stats(store)
            used_us, calls = used_us + round_us, calls + round_calls
            for request, won in finishes:
                await _finish(backend, policy, request, won)
        return used_us / calls

    @staticmethod
    async def _set_nx_px(store: Store, i: int) -> Cleanup:
        await store.execute("SET", f"bench-lock:{i}", "token", "NX", "PX", 30_000)
        return None

    def _claimer(self, backend: RedisBackend[Any], policy: JobPolicy) -> Callable[[int], Awaitable[Cleanup]]:
        async def claim(i: int) -> Cleanup:
            slot = 1_700_000_000_000 + i // JOBS * 1000
            request = RunRequest(f"job{i % JOBS}", str(slot), slot, f"t{i}", "bench")
            won = await _claim_as(backend, policy, request, Outcome.WON)
            if backend.strategy.name == "script":

                async def keep_the_window() -> None:  # its oldest claim out: SCRIPT_WINDOW_CLAIMS stay
                    await backend.store.execute("XTRIM", backend.keys.claim(request.job).runs, "MAXLEN",
                                                SCRIPT_WINDOW_CLAIMS)  # fmt: skip

                return keep_the_window
            if not backend.leases:
                return None
            return functools.partial(_finish, backend, policy, request, won)

        return claim


async def _started_backends(
    server: RunningServer, client: Any, store: Store, jobs: int = JOBS
) -> dict[str, RedisBackend[Any]]:
    """A started backend of each strategy the server supports, over jobs ``job0``…; script's windows filled."""
    backends = {}
    for strategy in STRATEGIES:
        if supported(strategy, server):
            backend = make_backend(server, client, strategy, f"bench-{strategy}:")
            await backend.start([f"job{j}" for j in range(jobs)])
            backends[strategy] = backend
    if "script" in backends:
        await _fill_script_windows(store, backends["script"], jobs)
    return backends


async def _fill_script_windows(store: Store, backend: RedisBackend[Any], jobs: int) -> None:
    """Give each script job's window its SCRIPT_WINDOW_CLAIMS claims (of earlier slots), which every claim scans."""
    slots = range(1_600_000_000_000, 1_600_000_000_000 + SCRIPT_WINDOW_CLAIMS * 10_000, 10_000)
    await store.execute_many([
        ("XADD", backend.keys.claim(f"job{j}").runs, "*", "slot", slot, "token", "earlier", "runner", "bench")
        for j in range(jobs) for slot in slots
    ])  # fmt: skip


async def _evalsha_stats(store: Store) -> tuple[float, int]:
    """Server µs spent in EVALSHA since the counters were reset, and how many calls."""
    for line in as_text(await store.execute("INFO", "commandstats")).splitlines():
        if line.startswith("cmdstat_evalsha:"):
            fields = dict(field.split("=") for field in line.partition(":")[2].split(","))
            return float(fields["usec"]), int(fields["calls"])
    raise RuntimeError("INFO commandstats counted no EVALSHA: the server time of a script cannot be measured")


async def _claim_shaped_spin(store: Store, backend: RedisBackend[Any], policy: JobPolicy) -> Command:
    """SPIN's EVALSHA with a lease claim's keys and arguments, but for its rounds (the last argument, appended)."""
    sha = as_text(await store.execute("SCRIPT", "LOAD", SPIN))
    assert isinstance(backend.strategy, LeaseStrategy)
    claim = backend.strategy.claim_call(RunRequest("job0", "1700000000000", 1_700_000_000_000, "t0", "bench"), policy)
    return ("EVALSHA", sha, len(claim.keys), *claim.keys, *claim.args)


async def _spin_rounds_for(store: Store, spin: Command, server_us: float) -> int:
    """How many SPIN rounds take ``server_us`` in the server: two measured points, a line through them."""
    points = []
    for rounds in (1000, 4000):
        await store.execute("CONFIG", "RESETSTAT")
        for _ in range(300):
            await store.execute(*spin, rounds)
        used_us, calls = await _evalsha_stats(store)
        points.append((rounds, used_us / calls))
    (low, low_us), (high, high_us) = points
    return max(1, round(low + (server_us - low_us) * (high - low) / max(high_us - low_us, 0.1)))


@contextlib.contextmanager
def idle_cpus_poll() -> Iterator[bool]:
    """Hold a PM QoS request for a CPU wake-up latency of 0 µs while inside, so that idle CPUs poll instead of
    halting (the kernel keeps it while the file stays open). Yields whether it is held: it needs root."""
    try:
        request = os.open("/dev/cpu_dma_latency", os.O_WRONLY)
    except OSError:
        yield False
        return
    try:
        os.write(request, struct.pack("i", 0))
        yield True
    finally:
        os.close(request)


async def claim_latency(targets: Sequence[str], iterations: int) -> dict[str, Any]:
    results = {}
    for target in targets:
        with start_server(target) as server:
            results[target] = await ClaimBench(server, iterations).run()
    return results


def server_instructions(targets: Sequence[str], jobs: int) -> dict[str, Any]:
    """Instructions each target's server executes per operation, counted by callgrind (valgrind): a count, not a
    time, much the same on a busy machine as on an idle one. Per target: ``PING``, ``SET NX PX`` and, for each
    strategy, a won claim (with its ratio to SET NX PX), a losing one (another instance's claim of the same run:
    "running" under lease, "lost" otherwise) and, under lease, the run's finish: one of each on each of ``jobs``
    jobs, one after the other, after each job's first claim (which makes its keys). What the server does for a
    request is counted (reading it, running it, writing the reply), not what the kernel does. A target that
    cannot run under valgrind here gets the reason instead."""
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        return {target: {"skipped": "valgrind is not installed here"} for target in targets}
    results: dict[str, Any] = {}
    for target in targets:
        if backend_for(target) != "local":
            results[target] = {"skipped": "it runs in a container here: callgrind counts a local binary"}
            continue
        with tempfile.TemporaryDirectory(prefix="anarchon-callgrind-") as dumps:
            wrapper = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={dumps}/callgrind.out"]
            # The server's timer work (serverCron) is no request's: once a second instead of ten times.
            with start_server(target, wrapper=wrapper, extra_args=["--hz", "1"]) as server:
                assert server.pid is not None  # a local server process
                counter = _Callgrind(server.pid, pathlib.Path(dumps))
                results[target] = asyncio.run(InstructionBench(server, counter, jobs).run())
    return results


@dataclass
class _Callgrind:
    """Reads the instructions a process under callgrind executed between ``zero()`` and ``count()``."""

    pid: int
    dumps: pathlib.Path
    _dumped: int = 0

    def zero(self) -> None:
        subprocess.run(["callgrind_control", "--zero", str(self.pid)], check=True, capture_output=True)

    def count(self) -> int:
        subprocess.run(["callgrind_control", "--dump", str(self.pid)], check=True, capture_output=True)
        self._dumped += 1  # callgrind numbers its dumps from 1
        text = (self.dumps / f"callgrind.out.{self._dumped}").read_text()
        return int(re.search(r"^totals: (\d+)$", text, re.MULTILINE)[1])  # type: ignore[index]


@dataclass
class InstructionBench:
    """The requests ``server_instructions`` counts, on one server."""

    server: RunningServer
    counter: _Callgrind
    jobs: int

    async def run(self) -> dict[str, Any]:
        client = bench_client(self.server)
        store = Store(RedisPyAsync(client), owned=True)
        backends = await _started_backends(self.server, client, store, self.jobs)
        numbers = range(self.jobs)
        _, ping = await self._per_op([functools.partial(ClaimBench._ping, store) for _ in numbers])
        _, set_nx_px = await self._per_op([functools.partial(ClaimBench._set_nx_px, store, j) for j in numbers])
        result: dict[str, Any] = {"ping": ping, "set_nx_px": set_nx_px}
        for strategy, backend in backends.items():
            result[strategy] = await self._strategy(backend)
            result[strategy]["ratio_to_set_nx_px"] = round(result[strategy]["claim"] / result["set_nx_px"], 1)
            await backend.stop()
        await store.close()
        return result

    async def _strategy(self, backend: RedisBackend[Any]) -> dict[str, Any]:
        policy = JobPolicy(lease_ms=30_000, history_size=1000)
        lost = Outcome.RUNNING if backend.leases else Outcome.LOST
        figures: dict[str, Any] = {}
        for slot in (1_700_000_000_000, 1_700_000_060_000):  # the second's figures: first claims made the keys
            requests = [RunRequest(f"job{j}", str(slot), slot, f"t{slot}-{j}", "bench") for j in range(self.jobs)]
            rivals = [request._replace(token=f"{request.token}-2", runner="bench-2") for request in requests]
            claims, figures["claim"] = await self._per_op([
                functools.partial(_claim_as, backend, policy, request, Outcome.WON) for request in requests
            ])  # fmt: skip
            _, figures["losing_claim"] = await self._per_op([
                functools.partial(_claim_as, backend, policy, rival, lost) for rival in rivals
            ])  # fmt: skip
            if backend.leases:
                _, figures["finish"] = await self._per_op([
                    functools.partial(_finish, backend, policy, request, claim)
                    for request, claim in zip(requests, claims, strict=True)
                ])  # fmt: skip
        return figures

    async def _per_op(self, steps: Sequence[Callable[[], Awaitable[T]]]) -> tuple[list[T], int]:
        """Run the steps one after the other: their results, and the instructions the server executed per step."""
        self.counter.zero()
        results = [await step() for step in steps]
        return results, round(self.counter.count() / len(steps))


async def _claim_as(backend: RedisBackend[Any], policy: JobPolicy, request: RunRequest, expected: Outcome) -> Claim:
    """Claim a run; its answer, which must be ``expected``."""
    [answer] = await backend.strategy.claim(backend.store, [(request, policy)])
    if not isinstance(answer, Claim) or answer.outcome is not expected:
        raise RuntimeError(f"{backend.strategy.name} claim of {request}: {answer}, not {expected}")
    return answer


async def _finish(backend: RedisBackend[Any], policy: JobPolicy, request: RunRequest, claim: Claim) -> None:
    """Record the run as the scheduler would: ok, begun and ended at its slot."""
    record = RunRecord(
        job=request.job, run=request.run, slot=request.slot, attempt=claim.attempt, status="ok",
        runner=request.runner, token=request.token, fence=claim.fence, manual=False, started=request.slot,
        ended=request.slot,
    )  # fmt: skip
    await backend.strategy.finish(backend.store, request, claim, policy, record)


def burst(target: str, jobs: int, instances: int = 3) -> dict[str, Any]:
    """``jobs`` jobs due in the same second across ``instances`` scheduler processes on one server: is every one
    started exactly once, and how late (start - slot, on the machine's clock)?"""
    with start_server(target) as server:
        kind = "valkey" if server.is_valkey else "redis"
        processes = [
            subprocess.Popen(
                [sys.executable, "-m", "sim.burst_instance", server.url(), kind, f"i{i}", str(jobs)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                cwd=pathlib.Path(__file__).parent.parent,  # where sim is
            )
            for i in range(instances)
        ]
        try:
            for process in processes:  # each has imported what it needs
                assert process.stdout is not None
                if process.stdout.readline().strip() != "ready":
                    raise RuntimeError(f"a burst instance failed to start (exit code {process.wait()})")
            # Registering the jobs and starting takes each process a moment: 0.6 s for 200 jobs on 2 busy cores.
            due_in = 2 + jobs // 2000
            slot_ms = math.ceil(time.time() + due_in) * 1000
            cpu_before_s = _cpu_seconds(server)
            for process in processes:
                assert process.stdin is not None
                process.stdin.write(f"{slot_ms}\n")
                process.stdin.flush()
            runs: list[tuple[str, int, float]] = []
            instance_cpu_s = []
            for process in processes:
                output, _ = process.communicate(timeout=due_in + 120)
                if process.returncode:
                    raise RuntimeError(f"a burst instance exited with {process.returncode}")
                served = json.loads(output)
                runs.extend((job, slot, late) for job, slot, late in served["runs"])
                instance_cpu_s.append(round(served["cpu_s"], 3))  # ms: an instance that wins few runs uses little
            server_cpu_s = _cpu_seconds(server) - cpu_before_s
        finally:
            for process in processes:
                if process.poll() is None:  # left behind by an error above
                    process.kill()
                    process.wait()
    counts = collections.Counter(job for job, slot, _ in runs if slot == slot_ms)
    lateness = [late for _, slot, late in runs if slot == slot_ms]
    return {
        "target": target,
        "jobs": jobs,
        "instances": instances,
        "started": len(counts),
        "duplicates": sum(n - 1 for n in counts.values()),
        "missed": jobs - len(counts),
        "other_slots": sum(1 for _, slot, _ in runs if slot != slot_ms),  # a process that began after the slot
        "lateness_p50_ms": round(percentile(lateness, 50), 1) if lateness else None,
        "lateness_p99_ms": round(percentile(lateness, 99), 1) if lateness else None,
        # From the slot until every instance stopped: the claims, the finishes and the instances' stops.
        "server_cpu_s": round(server_cpu_s, 2),
        "instance_cpu_s": instance_cpu_s,  # each process's, from the slot until its scheduler stopped
    }


def _cpu_seconds(server: RunningServer) -> float:
    """CPU time the server has used so far (user and system), by its INFO."""
    cpu = server.info("cpu")
    return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


def scheduler_memory(jobs: int = 1000) -> dict[str, Any]:
    """Python heap per registered job of a started scheduler (tracemalloc): with a realistic mix of schedules
    (120 different ones; jobs with equal schedules share it), and with a schedule of its own for every job."""

    async def noop(run: RunContext) -> None:
        return None

    async def measure(cron: Callable[[int], str]) -> int:
        scheduler = Scheduler(RedisBackend(redis=fakeredis.FakeAsyncRedis()))
        await scheduler.start()
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.take_snapshot()
        for j in range(jobs):
            scheduler.add_job(f"job{j}", cron(j), noop, timezone="Europe/Berlin")
        gc.collect()
        after = tracemalloc.take_snapshot()
        tracemalloc.stop()
        await scheduler.stop()
        return sum(stat.size_diff for stat in after.compare_to(before, "filename"))

    mixed = asyncio.run(measure(lambda j: f"{j % 60} {j % 24} * * *"))
    distinct = asyncio.run(measure(lambda j: f"{j % 60} {j // 60 % 24} * * *"))
    return {
        "jobs": jobs,
        "bytes_per_job": round(mixed / jobs),
        "bytes_per_job_distinct_schedules": round(distinct / jobs),
    }


async def store_memory(target: str, history_size: int = 1000, strategies: Sequence[str] = STRATEGIES) -> dict[str, Any]:
    """Server memory (MEMORY USAGE, every element counted) of one job's keys after more runs than history_size,
    per strategy, and per run kept."""
    result: dict[str, Any] = {"target": target, "history_size": history_size}
    with start_server(target) as server:
        client = bench_client(server)
        policy = JobPolicy(history_size=history_size, keep_ms=0, overlap=True)
        for strategy in strategies:
            if not supported(strategy, server):
                continue
            backend = make_backend(server, client, strategy, f"mem-{strategy}:")
            await backend.start(["job"])
            base = 1_600_000_000_000
            for start in range(0, history_size + 200, 100):
                requests = [
                    RunRequest("job", str(base + k * 1000), base + k * 1000, f"t{k}", "bench")
                    for k in range(start, start + 100)
                ]
                claims = await backend.strategy.claim(backend.store, [(r, policy) for r in requests])
                for request, claim in zip(requests, claims, strict=True):
                    if isinstance(claim, Claim) and claim.outcome is Outcome.WON:
                        record = RunRecord(
                            job="job", run=request.run, slot=request.slot, attempt=1, status="ok", runner="bench",
                            token=request.token, fence=claim.fence, manual=False, started=request.slot,
                            ended=request.slot + 5,
                        )  # fmt: skip
                        await backend.strategy.finish(backend.store, request, claim, policy, record)
            keys = await client.keys(f"*mem-{strategy}:job*")
            total = 0
            for key in keys:
                total += await client.memory_usage(key, samples=0) or 0
            kept = len(await backend.strategy.history(backend.store, "job", 1_000_000))  # about history_size
            result[strategy] = {"bytes": total, "runs_kept": kept, "bytes_per_run": round(total / kept)}
            await backend.stop()
        await client.aclose()
    return result


class _Counting:
    """Counts round trips through a connection."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.round_trips = 0

    async def execute(self, command: Any) -> Any:
        self.round_trips += 1
        return await self.inner.execute(command)

    async def execute_many(self, commands: Any) -> Any:
        self.round_trips += 1
        return await self.inner.execute_many(commands)

    async def server_info(self) -> Any:
        return await self.inner.server_info()

    async def close(self) -> None:
        await self.inner.close()


async def commands_per_claim(targets: Sequence[str], claims: int = 100) -> dict[str, dict[str, dict[str, float]]]:
    """For each target and strategy: round trips and server commands (INFO commandstats) per won claim."""
    results: dict[str, dict[str, dict[str, float]]] = {}
    for target in targets:
        with start_server(target) as server:
            results[target] = {}
            for strategy in STRATEGIES:
                if not supported(strategy, server):
                    continue
                client = bench_client(server)
                counting = _Counting(RedisPyAsync(client))
                backend = make_backend(server, counting, strategy, f"count-{strategy}:")
                await backend.start(["job"])
                policy = JobPolicy(overlap=True)
                before, trips = await _calls(client), counting.round_trips
                for i in range(claims):
                    slot = 1_700_000_000_000 + i * 1000
                    await backend.strategy.claim(
                        backend.store, [(RunRequest("job", str(slot), slot, f"t{i}", "c"), policy)]
                    )
                after = await _calls(client)
                results[target][strategy] = {
                    "round_trips": (counting.round_trips - trips) / claims,
                    "commands": (after - before - 1) / claims,  # the INFO that read the counters
                }
                await backend.stop()
                await client.aclose()
    return results


async def pipelined_claims(
    targets: Sequence[str], claims: int, batch: int = 1000, *, cluster: bool = False
) -> dict[str, dict[str, dict[str, float]]]:
    """Claims per second when many are due together: batches of ``batch`` claims of distinct jobs, each batch one
    pipeline (as the scheduler sends a burst), beside pipelined ``SET NX PX`` with the same client. With
    ``cluster``, on a cluster of three primaries through redis-py's asyncio cluster client (a pipeline per
    primary)."""
    results = {}
    for target in targets:
        with start_server(target, cluster=cluster) as server:
            results[target] = await _pipelined_on(server, claims, batch)
    return results


async def _pipelined_on(server: RunningServer, claims: int, batch: int) -> dict[str, dict[str, float]]:
    client: Any = (
        redis.asyncio.cluster.RedisCluster(host=server.host, port=server.port, protocol=2)
        if server.cluster
        else bench_client(server)
    )
    store = Store(adapt(client), owned=False)

    async def locks(first: int) -> None:
        await store.execute_many([("SET", f"lock:{first + j}", "t", "NX", "PX", 30_000) for j in range(batch)])

    sends: dict[str, Callable[[int], Awaitable[None]]] = {"set_nx_px": locks}
    jobs = [f"job{j}" for j in range(batch)]
    backends = []
    for strategy in STRATEGIES:
        if supported(strategy, server):
            backend = make_backend(server, client, strategy, f"pipe-{strategy}:")
            await backend.start(jobs)
            backends.append(backend)
            sends[strategy] = _claim_batch(backend, jobs)
    rates = await _per_second(sends, claims, batch)
    for backend in backends:
        await backend.stop()
    await client.aclose()
    # The ratio is the time per claim over pipelined SET NX PX's, as the sequential ratios are.
    return {name: {"per_s": round(rate), "ratio_to_set_nx_px": round(rates["set_nx_px"] / rate, 2)}
            for name, rate in rates.items()}  # fmt: skip


def _claim_batch(backend: RedisBackend[Any], jobs: list[str]) -> Callable[[int], Awaitable[None]]:
    """One claim of each job, for the slot that batch number ``first // len(jobs)`` stands for."""
    policy = JobPolicy(overlap=True)

    async def claim(first: int) -> None:
        slot = 1_700_000_000_000 + first // len(jobs) * 1000
        requests = [(RunRequest(job, str(slot), slot, f"t{first}", "b"), policy) for job in jobs]
        answers = await backend.strategy.claim(backend.store, requests)
        if not all(isinstance(a, Claim) and a.outcome is Outcome.WON for a in answers):
            raise RuntimeError(f"pipelined {backend.strategy.name} claims: not every claim was won")

    return claim


async def _per_second(sends: dict[str, Callable[[int], Awaitable[None]]], total: int, batch: int) -> dict[str, float]:
    """Operations per second of each way of sending ``total`` in batches, the batches of each taking turns."""
    for send in sends.values():
        await send(-batch)  # warm-up: connections, script caches
    spent = dict.fromkeys(sends, 0.0)
    for first in range(0, total, batch):
        for name, send in sends.items():
            began = time.perf_counter()
            await send(first)
            spent[name] += time.perf_counter() - began
    return {name: total / seconds for name, seconds in spent.items()}


def explorer_speed(quick: bool) -> dict[str, Any]:
    """States per second of the exhaustive explorer (models/), lease with crashes and skew."""
    from models.explore import MODELS, PROPERTIES, Explorer

    instances, slots, depth = (2, 2, 10) if quick else (3, 3, 12)
    result = Explorer(MODELS["lease"], instances, slots, ["crash", "skew"], list(PROPERTIES)).run(depth)
    return {
        "strategy": "lease", "instances": instances, "slots": slots, "depth": depth, "faults": "crash,skew",
        "states": result.states, "seconds": round(result.seconds, 2),
        "states_per_s": round(result.states / result.seconds) if result.seconds else None,
    }  # fmt: skip


async def _calls(client: Any) -> int:
    text = (await client.execute_command(b"INFO", "commandstats")).decode()
    return sum(int(line.split("calls=")[1].split(",")[0]) for line in text.splitlines() if "calls=" in line)


def simulator_speed(simulated_s: float = 900.0) -> dict[str, Any]:
    """Virtual time: 3 instances × 10 jobs every 10 s (work 1 s, lease strategy); simulated seconds per wall
    second. Measured in a fresh process, as the simulator runs (``python -m sim``): not in one that holds what
    the other benchmarks left behind."""
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_simulator_speed, simulated_s).result()


def _simulator_speed(simulated_s: float) -> dict[str, Any]:
    from sim.run import simulate
    from sim.scenario import parse

    scenario = parse({
        "name": "speed", "duration_s": simulated_s, "scheduler": {"lease_ms": 3000, "heartbeat_ms": 1000},
        "instances": [{"name": n} for n in "abc"],
        "jobs": [{"name": f"job{j}", "cron": "*/10 * * * * *", "work_s": 1.0} for j in range(10)],
    })  # fmt: skip
    began = time.perf_counter()
    outcome = simulate(scenario, "lease", 1)
    wall = time.perf_counter() - began
    store_free_wall, replayed = without_the_store(lambda: simulate(scenario, "lease", 1))
    return {
        "simulated_s": simulated_s,
        "wall_s": round(wall, 2),
        "speedup": round(simulated_s / wall),
        "executions": len(outcome.history.executions),
        "day_estimate_s": round(86_400 / (simulated_s / wall), 1),
        "store_commands": replayed,
        "speedup_store_replayed": round(simulated_s / store_free_wall),
    }


def without_the_store(simulation: Callable[[], object]) -> tuple[float, int]:
    """Wall seconds of ``simulation`` run again with every store reply played back from a first run: what the
    scheduler, the virtual loop and the checkers cost on their own, the bound on the simulator's speed with a
    free store. The replayed run must send the very commands the recorded one sent (it is deterministic)."""
    from sim.fakestore import EmbeddedConnection

    tape: list[tuple[tuple[Any, ...], Any]] = []
    engine = EmbeddedConnection._run

    async def record(self: EmbeddedConnection, command: Any) -> Any:
        reply = await engine(self, command)
        tape.append((tuple(command), reply))
        return reply

    async def play_back(self: EmbeddedConnection, command: Any) -> Any:
        await self._engine()  # its first use yields to the loop: the instances' commands interleave as recorded
        sent, reply = next(replies, (None, None))
        if sent != tuple(command):
            # Raised here it would reach the scheduler as a store error, which it retries: kept for the end.
            departures.append(f"the replayed simulation sent {command!r} where the recorded one sent {sent!r}")
            raise RuntimeError(departures[-1])
        return reply

    with unittest.mock.patch.object(EmbeddedConnection, "_run", record):
        simulation()
    replies = iter(tape)
    departures: list[str] = []
    with unittest.mock.patch.object(EmbeddedConnection, "_run", play_back):
        began = time.perf_counter()
        simulation()
        wall = time.perf_counter() - began
    if departures:
        raise RuntimeError(departures[0])
    if next(replies, None) is not None:
        raise RuntimeError("the replayed simulation sent fewer commands than the recorded one")
    return wall, len(tape)


def print_claims(results: dict[str, Any]) -> None:
    print(f"{'target':<10} {'op':<10} {'p50 µs':>8} {'p99 µs':>8} {'p50 / SET NX PX':>16} {'server µs':>10}")
    for target, ops in results.items():
        for op in ("ping", "set_nx_px", *STRATEGIES, "lua_spin"):
            if op in ops:
                row = ops[op]
                ratio = row.get("ratio_to_set_nx_px", "")
                server = row.get("server_us", "")
                print(f"{target:<10} {op:<10} {row['p50_us']:>8} {row['p99_us']:>8} {ratio!s:>16} {server!s:>10}")


def print_instructions(results: dict[str, Any]) -> None:
    print(f"{'target':<10} {'op':<24} {'instructions':>12} {'/ SET NX PX':>12}")
    for target, ops in results.items():
        if "skipped" in ops:
            print(f"{target:<10} skipped: {ops['skipped']}")
            continue
        for op, figures in ops.items():
            rows = figures.items() if isinstance(figures, dict) else [("", figures)]
            for kind, count in rows:
                if kind != "ratio_to_set_nx_px":
                    ratio = figures.get("ratio_to_set_nx_px", "") if kind == "claim" else ""
                    print(f"{target:<10} {f'{op} {kind}'.strip():<24} {count:>12,} {ratio!s:>12}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sim.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations, a smaller burst")
    parser.add_argument("--targets", default=None, help="comma list (default: every provisioned target)")
    parser.add_argument("--json", dest="json_path", default=None, help="also write the figures as JSON here")
    args = parser.parse_args(argv)
    provisioned = available_targets()
    targets = args.targets.split(",") if args.targets else list(provisioned)
    # Checked before anything runs: a target found missing after an hour of figures would lose them.
    if not targets:
        parser.error("no server is provisioned here: run `python -m sim.servers provision` first")
    if missing := [t for t in targets if t not in provisioned]:
        parser.error(f"--targets: {', '.join(missing)} not available here (available: {', '.join(provisioned)})")
    iterations = 300 if args.quick else 3000
    burst_jobs = 1000 if args.quick else 10_000

    began = time.monotonic()
    out: dict[str, Any] = {}

    def keep(section: str, figures: Any, label: str | None = None) -> None:
        """Record a section's figures (written out at once: a later failure keeps them) and print them."""
        out[section] = figures
        out["seconds"] = round(time.monotonic() - began, 1)
        if args.json_path:
            with open(args.json_path, "w") as handle:
                json.dump(out, handle, indent=2)
        if label:
            print(f"{label}: {json.dumps(figures)}")

    claims = asyncio.run(claim_latency(targets, iterations))
    # Every entry of a target is an operation's figures; the servers' versions go beside them.
    out["versions"] = {target: ops.pop("version") for target, ops in claims.items()}
    keep("targets", claims)
    print_claims(claims)
    with idle_cpus_poll() as polling:
        if polling:
            polled = asyncio.run(claim_latency(targets, iterations))
            for ops in polled.values():
                ops.pop("version")
            keep("targets_idle_polling", polled)
            print("the same, while idle CPUs poll instead of halting (/dev/cpu_dma_latency held at 0 µs):")
            print_claims(polled)
        else:
            print("(no second table: holding /dev/cpu_dma_latency needs root)")
    instructions = server_instructions(targets, 100 if args.quick else 1000)
    keep("server_instructions", instructions)
    print("instructions the server executes per operation (callgrind: much the same on a busy machine):")
    print_instructions(instructions)
    pipelined = 5_000 if args.quick else 50_000
    keep("pipelined", asyncio.run(pipelined_claims(targets, pipelined)), "pipelined claims per second")
    burst_target = "redis-7" if "redis-7" in targets else targets[0]
    keep("pipelined_cluster", asyncio.run(pipelined_claims([burst_target], pipelined, cluster=True)),
         "pipelined claims per second, cluster of three primaries")  # fmt: skip
    keep("burst", burst(burst_target, burst_jobs), "burst")
    memory = {"scheduler": scheduler_memory(), "store": asyncio.run(store_memory(burst_target))}
    if "redis-8.6" in targets and burst_target != "redis-8.6":  # idmp needs Redis 8.6
        memory["store_idmp"] = asyncio.run(store_memory("redis-8.6", strategies=("idmp",)))
    keep("memory", memory, "memory")
    keep("sim", simulator_speed(300.0 if args.quick else 3600.0), "simulator")
    keep("explorer", explorer_speed(args.quick), "explorer")
    if out["burst"]["duplicates"] or out["burst"]["missed"]:
        print(f"the burst ran {out['burst']['duplicates']} runs twice and missed {out['burst']['missed']}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
