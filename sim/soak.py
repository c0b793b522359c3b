"""python -m sim.soak: many jobs, several instance processes, random crashes, for minutes, on a real server.

    python -m sim.soak [--minutes 10] [--jobs 1000] [--instances 3] [--target redis-7] [--crash-every 30]

Each instance is a separate OS process running the production ``Scheduler`` (lease strategy) with ``--jobs`` jobs
firing every ``--every`` seconds. At random times (on average every ``--crash-every`` seconds) one instance is
killed with SIGKILL and started again a few seconds later; the first ``--steady`` instances (default 1) are
spared, so that one process's memory can be followed over the whole run. Every instance appends one JSON line
per execution that ran to completion to a ledger file of its own (one ``write`` per line, so a killed process
leaves whole lines). The resident memory of each instance and the store's ``used_memory`` are sampled all along.

At the end the ledger is checked:

- P1, no slot executed twice to completion. The lease lets a backup run a slot again only when the winner's
  result never reached the store, which a crash between the end of the job and the result can cause: such
  repeats are counted apart (the earlier runner was killed after its execution ended and before the repeat
  ended, and the repeat is a later attempt); any other repeat is a violation.
- P2, no slot missed while an instance was up: every slot from the warm-up to the end (less the time a backup
  may wait for a crashed winner's lease) ran to completion at least once.
- No leak: from the end of the warm-up to the end, the resident memory of each spared instance grows by at most
  ``--max-rss-growth-mb``, its open file descriptors (sockets included) by at most ``--max-fd-growth``, and the
  store's ``used_memory`` by at most ``--max-store-growth-mb``. A flat line is the goal; the allowances leave
  room for a connection pool meeting a burst it had not met before, not for growth with every run.

Jobs allow overlap: with overlap forbidden, the runs a killed instance held would make the following slots of
the same jobs be skipped (recorded skipped-overlap) until their leases ran out, which P2 would count as missed.
History is kept short (``--history-size``) so that the store's memory reaches its plateau within the run.

Prints the memory after the warm-up and at the end and every verdict; exits 1 if a property is violated, 2 if
the run could not be judged (an instance exited on its own, never started, or the run was too short).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sim.servers import TARGETS, pdeathsig_prefix, start_server

PREFIX = "soak:"


# --- one instance (a child process) --------------------------------------------------------------------------


async def serve_instance(args: argparse.Namespace) -> None:
    """Run one scheduler until SIGTERM, appending every completed execution to the ledger."""
    from anarchon import RedisBackend, RunContext, Scheduler, ValkeyBackend

    ledger = os.open(args.ledger, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    pid = os.getpid()

    def record(entry: dict[str, Any]) -> None:
        os.write(ledger, (json.dumps(entry, separators=(",", ":")) + "\n").encode())

    async def work(run: RunContext) -> None:
        record({"j": run.job, "s": run.slot, "a": run.attempt, "i": args.instance, "p": pid, "t": _now_ms()})

    backend_class: Any = ValkeyBackend if args.target.startswith("valkey") else RedisBackend
    option = "valkey" if backend_class is ValkeyBackend else "redis"
    backend = backend_class(**{option: args.url}, prefix=PREFIX)
    scheduler = Scheduler(backend, instance_id=args.instance, lease_ms=args.lease_ms, history_size=args.history_size)
    for i in range(args.jobs):
        scheduler.add_job(job_name(i), cron_for(args.every), work, overlap=True)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stopping.set)
    loop.add_signal_handler(signal.SIGINT, stopping.set)
    async with scheduler:
        record({"ready": args.instance, "p": pid, "t": _now_ms()})
        await stopping.wait()


def job_name(i: int) -> str:
    return f"job-{i:04d}"


def cron_for(every_s: int) -> str:
    return "* * * * * *" if every_s == 1 else f"*/{every_s} * * * * *"


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


# --- the driver ------------------------------------------------------------------------------------------------


@dataclass
class Incarnation:
    instance: str
    process: subprocess.Popen[bytes]
    started: float  # time.time()
    killed: float | None = None
    rss_kb: list[tuple[float, int]] = field(default_factory=list)
    fds: list[tuple[float, int]] = field(default_factory=list)  # open file descriptors, sockets included


@dataclass
class Soak:
    args: argparse.Namespace
    url: str
    folder: Path
    rng: random.Random
    incarnations: list[Incarnation] = field(default_factory=list)
    store_memory: list[tuple[float, int]] = field(default_factory=list)
    kills: list[tuple[float, str, int]] = field(default_factory=list)  # (time, instance, pid)

    def ledger(self, instance: str) -> Path:
        return self.folder / f"ledger-{instance}.jsonl"

    def launch(self, instance: str) -> Incarnation:
        # SIGTERM when the driver dies without stopping it (SIGKILLed): an orphan would go on claiming from
        # whatever server takes that port next.
        command = [
            *pdeathsig_prefix("TERM"), sys.executable, "-m", "sim.soak", "--serve", instance, "--url", self.url,
            "--ledger", str(self.ledger(instance)), "--jobs", str(self.args.jobs), "--every", str(self.args.every),
            "--lease-ms", str(self.args.lease_ms), "--history-size", str(self.args.history_size),
            "--target", self.args.target,
        ]  # fmt: skip
        log = (self.folder / f"{instance}.log").open("ab")
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        incarnation = Incarnation(instance, process, time.time())
        self.incarnations.append(incarnation)
        return incarnation

    def live(self) -> list[Incarnation]:
        return [i for i in self.incarnations if i.killed is None and i.process.poll() is None]


def open_fds(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def rss_kb(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _terminated(number: int, frame: object) -> None:
    raise SystemExit(128 + number)  # the driver's clean-up (its finally clauses) stops the instances and the server


def drive(args: argparse.Namespace) -> int:
    folder = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="anarchon-soak-"))
    folder.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _terminated)
    rng = random.Random(args.seed)
    duration_s = args.minutes * 60
    warmup_s = min(args.warmup_minutes * 60, duration_s / 2)
    names = [f"i{n}" for n in range(args.instances)]
    steady = steady_instances(args)
    print(
        f"soak: {args.jobs} jobs every {args.every} s x {args.instances} instances on {args.target} for "
        f"{args.minutes:g} min, a crash every ~{args.crash_every:g} s (seed {args.seed}); files in {folder}",
        flush=True,
    )
    with start_server(args.target) as server:
        soak = Soak(args, server.url(), folder, rng)
        admin = server.client(socket_timeout=10)
        restarts: dict[str, float] = {}  # instance -> when to start it again
        try:
            for name in names:
                soak.launch(name)
            began = time.time()
            end = began + duration_s
            next_crash = began + warmup_s / 2 + rng.expovariate(1 / args.crash_every) if args.crash_every else math.inf
            next_sample = began
            last_report = began
            while time.time() < end:
                now = time.time()
                for name, when in list(restarts.items()):
                    if now >= when:
                        del restarts[name]
                        soak.launch(name)
                if now >= next_crash:
                    candidates = [i for i in soak.live() if i.instance not in steady]
                    if candidates and len(soak.live()) > 1:  # keep at least one instance up
                        victim = rng.choice(candidates)
                        victim.process.send_signal(signal.SIGKILL)
                        victim.process.wait()
                        victim.killed = time.time()
                        soak.kills.append((victim.killed, victim.instance, victim.process.pid))
                        restarts[victim.instance] = victim.killed + rng.uniform(1.0, 5.0)
                    next_crash = now + rng.expovariate(1 / args.crash_every)
                if now >= next_sample:
                    for incarnation in soak.live():
                        kb, fds = rss_kb(incarnation.process.pid), open_fds(incarnation.process.pid)
                        if kb is not None and fds is not None:
                            incarnation.rss_kb.append((now, kb))
                            incarnation.fds.append((now, fds))
                    soak.store_memory.append((now, int(admin.info("memory")["used_memory"])))
                    next_sample = now + args.sample_s
                if now - last_report >= 60:
                    last_report = now
                    print(progress(soak, now - began), flush=True)
                dead = [i for i in soak.incarnations if i.killed is None and i.process.poll() is not None]
                if dead:
                    print(f"instance {dead[0].instance} exited on its own: see {folder}", flush=True)
                    return 2
                time.sleep(0.2)
            stopped = time.time()
            for incarnation in soak.live():
                incarnation.process.send_signal(signal.SIGTERM)
            for incarnation in soak.live():
                incarnation.process.wait(timeout=60)
            result = judge(soak, admin, began, warmup_s, stopped)
        except KeyboardInterrupt:
            print(f"\ninterrupted: stopping the instances and the server; files kept in {folder}", flush=True)
            return 130
        finally:
            for incarnation in soak.incarnations:
                if incarnation.process.poll() is None:
                    incarnation.process.kill()
                    incarnation.process.wait()
            admin.close()
    if not args.out and not args.keep and result == 0:
        shutil.rmtree(folder, ignore_errors=True)
    return result


def progress(soak: Soak, elapsed_s: float) -> str:
    rss = ", ".join(
        f"{i.instance} {i.rss_kb[-1][1] / 1024:.0f} MB" for i in soak.live() if i.rss_kb
    )  # the latest sample of each live instance
    store = soak.store_memory[-1][1] / 2**20 if soak.store_memory else 0.0
    return f"  {elapsed_s / 60:4.1f} min: rss {rss}; store {store:.1f} MB; {len(soak.kills)} crashes so far"


def read_ledgers(soak: Soak) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Completed executions, and when each instance process (by pid) reported ready."""
    executions: list[dict[str, Any]] = []
    ready: dict[str, float] = {}
    for path in soak.folder.glob("ledger-*.jsonl"):
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            if "ready" in entry:
                ready[f"{entry['ready']}:{entry['p']}"] = entry["t"]
            else:
                executions.append(entry)
    return executions, ready


def judge(soak: Soak, admin: Any, began: float, warmup_s: float, stopped: float) -> int:
    args = soak.args
    executions, ready = read_ledgers(soak)
    # When each instance was first ready (a first process may have been killed before it was).
    ready_at: dict[str, float] = {}
    for key, t in ready.items():
        name = key.split(":")[0]
        ready_at[name] = min(t, ready_at.get(name, t))
    never = sorted({i.instance for i in soak.incarnations} - set(ready_at))
    if never:
        print(f"not judged: instance {never[0]} never started its scheduler (see {soak.folder})")
        return 2
    first_ready = max(ready_at.values())
    runs: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for entry in executions:
        runs[(entry["j"], entry["s"])].append(entry)

    # P1: slots that ran to completion more than once. A backup gets a later attempt only when the store still
    # holds the run as running with its lease expired: the earlier attempt's result never arrived. That is the
    # lease's answer to a crash (its retry is allowed once the earlier execution has stopped), provided the
    # earlier runner was killed after its execution ended and before the later one ended.
    killed_at = {pid: when * 1000 for when, _, pid in soak.kills}
    crash_reruns: list[tuple[str, int, list[dict[str, Any]]]] = []
    violations: list[tuple[str, int, list[dict[str, Any]]]] = []
    for (job, slot), entries in runs.items():
        if len(entries) < 2:
            continue
        ordered = sorted(entries, key=lambda e: e["a"])
        distinct = len({e["a"] for e in entries}) == len(entries)
        killed_between = all(
            e["p"] in killed_at and e["t"] <= killed_at[e["p"]] <= later["t"]
            for e, later in itertools.pairwise(ordered)
        )
        (crash_reruns if distinct and killed_between else violations).append((job, slot, ordered))

    # P2: every slot from the first one all instances were up for, to the last one a backup had time to rerun.
    step = args.every * 1000
    start = (int(first_ready) // step + 1) * step
    horizon = int(stopped * 1000) - args.lease_ms * 2 - 5_000
    expected = range(start, horizon + 1, step)
    missed = [(job_name(i), slot) for i in range(args.jobs) for slot in expected if (job_name(i), slot) not in runs]

    lines, leaks = resources(soak, began + warmup_s)
    print("\nmemory (MB) and open files   after warm-up   at the end   (followed for)", *lines, sep="\n")
    slots = len(expected) * args.jobs
    per_attempt = Counter(entry["a"] for entry in executions)
    late = sorted(entry["t"] - entry["s"] for entry in executions)
    if late:
        p50, p99, worst = (late[int(q * (len(late) - 1))] for q in (0.5, 0.99, 1.0))
        print(f"\ncompleted after the slot: p50 {p50} ms, p99 {p99} ms, max {worst} ms")
    print(
        f"{len(executions)} executions ({dict(sorted(per_attempt.items()))} by attempt), {len(soak.kills)} crashes, "
        f"{slots} slots checked for P2 ({len(expected)} per job)"
    )
    print(
        f"P1 no slot executed twice to completion: {'valid' if not violations else 'INVALID'} "
        f"({len(violations)} violations; {len(crash_reruns)} slots run again because their winner was killed "
        "before its result reached the store)"
    )
    for job, slot, entries in violations[:5]:
        kills = {e["p"]: killed_at.get(e["p"]) for e in entries}
        print(
            f"  witness: {job} slot {slot}: {entries}; kills (ms) {kills}; stored {stored_statuses(admin, job, slot)}"
        )
    print(f"P2 no slot missed while an instance was up: {'valid' if not missed else 'INVALID'} ({len(missed)} missed)")
    for job, slot in missed[:5]:
        print(f"  witness: {job} slot {slot} never completed; stored {stored_statuses(admin, job, slot)}")
    print(f"no leak: {'valid' if not leaks else 'INVALID'}")
    for leak in leaks:
        print(f"  witness: {leak}")
    if not expected:
        print("not judged: no slot fell between the instances' start and the end less two leases (a longer run)")
        return 2
    return 1 if violations or missed or leaks else 0


def resources(soak: Soak, warm: float) -> tuple[list[str], list[str]]:
    """What each process and the store held after the warm-up (``warm``) and at the end, as lines to print, and a
    witness for each that grew beyond its allowance (judged for the spared instances and the store)."""
    args = soak.args
    lines: list[str] = []
    leaks: list[str] = []
    for incarnation in soak.incarnations:  # a restarted process is left 30 s to load its jobs and connect
        since = max(warm, incarnation.started + 30)
        rss = [(t, kb / 1024) for t, kb in incarnation.rss_kb if t >= since]
        fds = [(t, n) for t, n in incarnation.fds if t >= since]
        if len(rss) < 2:
            continue
        label = f"{incarnation.instance} pid {incarnation.process.pid}"
        lines.append(
            f"  rss {label:<24} {rss[0][1]:8.1f}   {rss[-1][1]:8.1f}   ({(rss[-1][0] - rss[0][0]) / 60:.1f} min)"
        )
        lines.append(f"  fds {label:<24} {fds[0][1]:8d}   {fds[-1][1]:8d}")
        if incarnation.instance in steady_instances(args):  # the others' lives are too short to judge
            leaks += grew(f"{label} resident memory", rss, args.max_rss_growth_mb, "MB")
            leaks += grew(f"{label} open files", fds, args.max_fd_growth, "")
    store = [(t, b / 2**20) for t, b in soak.store_memory if t >= warm]
    if len(store) >= 2:
        lines.append(f"  store used_memory             {store[0][1]:8.1f}   {store[-1][1]:8.1f}")
        leaks += grew("the store's used_memory", store, args.max_store_growth_mb, "MB")
    return lines, leaks


def steady_instances(args: argparse.Namespace) -> set[str]:
    """The instances never killed: their memory is followed over the whole run."""
    return {f"i{n}" for n in range(args.steady)}


def grew(what: str, samples: Sequence[tuple[float, float]], limit: float, unit: str) -> list[str]:
    """A witness if ``samples`` (time, value) end more than ``limit`` above where they began."""
    growth = samples[-1][1] - samples[0][1]
    if growth <= limit:
        return []
    return [f"{what} grew by {growth:g}{' ' + unit if unit else ''} (allowed {limit:g}) in "
            f"{(samples[-1][0] - samples[0][0]) / 60:.1f} min"]  # fmt: skip


def stored_statuses(admin: Any, job: str, slot: int) -> dict[int, str]:
    """The store's record of each attempt of a run (lease: the job's results sorted set)."""
    members = admin.zrangebyscore(f"{{{PREFIX}{job}}}:results", slot * 100, slot * 100 + 99)
    records = [json.loads(member) for member in members]
    return {record["attempt"]: record["status"] for record in records if record["slot"] == slot}


def refuse_nonsense(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Options no soak can run with, each named with what it allows (parser.error exits with status 2)."""
    for option, value in (("--jobs", args.jobs), ("--instances", args.instances), ("--lease-ms", args.lease_ms)):
        if value < 1:
            parser.error(f"{option} must be 1 or more, not {value}")
    for option, value in (("--minutes", args.minutes), ("--sample-s", args.sample_s)):
        if not (value > 0 and math.isfinite(value)):
            parser.error(f"{option} must be a number above 0, not {value:g}")
    for option, value in (("--crash-every", args.crash_every), ("--warmup-minutes", args.warmup_minutes),
                          ("--max-rss-growth-mb", args.max_rss_growth_mb), ("--max-fd-growth", args.max_fd_growth),
                          ("--max-store-growth-mb", args.max_store_growth_mb)):  # fmt: skip
        if not (value >= 0 and math.isfinite(value)):
            parser.error(f"{option} must be 0 or more, not {value:g}")
    if not 0 <= args.steady <= args.instances:
        parser.error(f"--steady must be between 0 and --instances ({args.instances}), not {args.steady}")
    # P2 judges the slots from the instances' start to the end less two leases and 5 s (a backup's wait).
    shortest_s = 2 * args.lease_ms / 1000 + 5 + 10
    if args.minutes * 60 < shortest_s:
        parser.error(f"--minutes must leave slots to judge: at least {shortest_s / 60:.2f} with --lease-ms "
                     f"{args.lease_ms} (two leases, a backup's 5 s, 10 s to start)")  # fmt: skip
    if args.out and Path(args.out).is_dir() and any(Path(args.out).iterdir()):
        parser.error(f"--out {args.out} is not empty: the verdicts would mix in the ledgers of an earlier soak")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sim.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--instances", type=int, default=3)
    parser.add_argument("--target", default="redis-7", choices=TARGETS)
    parser.add_argument("--every", type=int, default=1, help="seconds between two runs of each job (default 1)")
    parser.add_argument("--crash-every", type=float, default=30.0, help="mean seconds between crashes (0: none)")
    parser.add_argument("--steady", type=int, default=1, help="how many instances are never killed (default 1)")
    parser.add_argument("--lease-ms", type=int, default=10_000)
    parser.add_argument("--history-size", type=int, default=100)
    parser.add_argument("--warmup-minutes", type=float, default=3.0)
    parser.add_argument("--sample-s", type=float, default=5.0, help="seconds between memory samples")
    parser.add_argument(
        "--max-rss-growth-mb",
        type=float,
        default=5.0,
        help="a spared instance's memory growth after the warm-up judged a leak (default 5)",
    )
    parser.add_argument(
        "--max-fd-growth",
        type=int,
        default=4,
        help="a spared instance's growth in open files after the warm-up judged a leak (default 4)",
    )
    parser.add_argument("--max-store-growth-mb", type=float, default=5.0,
                        help="the store's used_memory growth after the warm-up judged a leak (default 5)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--out", default=None, help="keep the ledgers and logs in this folder")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder even when all is valid")
    # The instance processes the driver starts:
    parser.add_argument("--serve", dest="instance", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--url", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--ledger", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.instance is not None:
        asyncio.run(serve_instance(args))
        return 0
    if args.every < 1 or 60 % args.every:
        parser.error("--every must divide 60")
    refuse_nonsense(parser, args)
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(2**32)
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
