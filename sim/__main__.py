"""python -m sim: the testbed's command line.

- python -m sim run SCENARIO --strategy S --seed N [--json]: one simulated run, judged
- python -m sim run SCENARIO --strategy S --server TARGET [--json]: one live run on a real server, judged
- python -m sim report [--seeds N] [--out DIR]: compare the strategies (report.md, index.html)
- python -m sim search --strategy S --budget SECONDS: find fault schedules that break a checker, shrunk
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

from sim import report as comparison
from sim.run import Outcome, simulate
from sim.scenario import STRATEGIES, Scenario, ScenarioError, load
from sim.servers import available_targets


def _deterministic_hashing() -> None:
    """String hashing is randomised per process; the store iterates sets in hash order. A replay must see the
    same order as the run it replays, so the testbed always runs with one hash seed."""
    if os.environ.get("PYTHONHASHSEED") != "0":
        os.environ["PYTHONHASHSEED"] = "0"
        os.execv(sys.executable, [sys.executable, "-m", "sim", *sys.argv[1:]])


def run(args: argparse.Namespace) -> int:
    try:
        scenario = load(args.scenario)
    except ScenarioError as error:
        print(error, file=sys.stderr)
        return 2
    began = time.perf_counter()
    if args.server:
        outcome = _run_live(scenario, args.strategy, args.server)
        if outcome is None:
            return 2
    else:
        outcome = simulate(scenario, args.strategy, args.seed)
    elapsed = time.perf_counter() - began
    # Exit status 1: the run did not get a verdict its scenario declares for the strategy.
    if args.json:
        judged = outcome.as_json()
        print(json.dumps(judged))
        return 1 if judged["departures"] else 0
    if args.server:
        print(f"{scenario.name} / {args.strategy} / {args.server} {outcome.server_version}: a live run of "
              f"{outcome.scenario.duration_s:.0f} s (the scenario compressed) in {elapsed:.0f} s")  # fmt: skip
    else:
        print(f"{scenario.name} / {args.strategy} / seed {args.seed}: {scenario.duration_s:.0f} s simulated in "
              f"{elapsed:.2f} s ({scenario.duration_s / elapsed:,.0f}x)")  # fmt: skip
    print(f"digest {outcome.digest}; {len(outcome.history.executions)} executions, "
          f"{outcome.judgement.slots_checked} slots checked")  # fmt: skip
    checks = outcome.judgement.checks
    for name, verdict in checks.items():
        line = f"  {name} {verdict.status}"
        if verdict.witness:
            line += f": {verdict.witness}"
        print(line)
        if verdict.figures:
            print(f"    {', '.join(f'{key} {value:g}' for key, value in verdict.figures.items())}")
    if any(v.status == "invalid" for v in checks.values()):
        print(f"replay: {outcome.replay_command()}")
    if departures := outcome.departures():
        print(f"not as {scenario.name} declares for {args.strategy}:", *departures, sep="\n  ")
        return 1
    if declared := scenario.expect.get(args.strategy):
        print(f"as {scenario.name} declares for {args.strategy} ({len(declared)} verdicts)")
    return 0


def _run_live(scenario: Scenario, strategy: str, server: str) -> Outcome | None:
    """One live run of ``scenario`` on a fresh ``server``, every strategy it has side by side as in the live
    report; the outcome of ``strategy``."""
    import asyncio

    from sim.live import has_idmp, run_live
    from sim.servers._targets import SPECS

    if server not in SPECS:
        print(f"--server: {server!r} is not a target (targets: {', '.join(SPECS)})", file=sys.stderr)
        return None
    if server not in available_targets():
        print(f"--server: {server!r} is not provisioned here (provisioned: {', '.join(available_targets())}); "
              f"python -m sim.servers provision {server}", file=sys.stderr)  # fmt: skip
        return None
    spec = SPECS[server]
    series = [int(part) for part in spec.series.strip(".").split(".")]
    if strategy == "idmp" and not has_idmp(spec.flavour == "valkey", series):  # said before a run that cannot help
        print(f"--strategy: {server} has no IDMP (Redis 8.6+ has)", file=sys.stderr)
        return None
    try:  # a scenario live mode cannot compress is refused before a server starts
        return asyncio.run(run_live(scenario, server, list(STRATEGIES)))[strategy]
    except ScenarioError as error:
        print(error, file=sys.stderr)
        return None


def report(args: argparse.Namespace) -> int:
    began = time.monotonic()
    targets = [t for t in args.servers.split(",") if t] if args.servers else list(available_targets())
    if args.mode == "live" and (unknown := [t for t in targets if t not in available_targets()]):
        print(f"--servers: {', '.join(unknown)} not provisioned here (provisioned: {', '.join(available_targets())})",
              file=sys.stderr)  # fmt: skip
        return 2
    markdown, page = comparison.main(args.out, args.seeds, mode=args.mode, targets=targets)
    print(f"written {markdown} and {page} in {time.monotonic() - began:.1f} s")
    return 0


def search(args: argparse.Namespace) -> int:
    # Hypothesis keeps a cache of its own (even with no example database): in a directory that goes with the search,
    # not in the working directory.
    with tempfile.TemporaryDirectory(prefix="anarchon-search-") as scratch:
        os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", scratch)
        from sim import search as property_search  # Hypothesis is a testbed dependency, loaded when used

        findings = property_search.run(args.strategy, args.budget, args.out, seed=args.seed, examples=args.examples)
    return 1 if findings else 0


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"a finite number of seconds above 0, not {text}")
    return value


def _positive_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"1 or more, not {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sim")
    commands = parser.add_subparsers(dest="command", required=True)
    one = commands.add_parser("run", help="simulate one scenario with one strategy and seed, and judge it")
    one.add_argument("scenario", help="a scenario name (scenarios/NAME.toml) or a path")
    one.add_argument("--strategy", choices=STRATEGIES, default="lease")
    one.add_argument("--seed", type=int, default=1)
    one.add_argument("--json", action="store_true", help="one JSON object: digest, verdicts, seed, …")
    live = "run live on a fresh server of this target (e.g. redis-7): strategies side by side, not repeatable"
    one.add_argument("--server", default="", help=live)
    one.set_defaults(handler=run)
    compare = commands.add_parser("report", help="compare the strategies under faults; write report.md")
    compare.add_argument("--out", type=Path, default=Path("reports/latest"))
    compare.add_argument("--seeds", type=_positive_count, default=20, help="runs of each scenario (live: per server)")
    compare.add_argument("--mode", choices=("virtual", "live"), default="virtual")
    compare.add_argument("--servers", default="", help="live mode: comma list (default: every provisioned one)")
    compare.set_defaults(handler=report)
    hunt = commands.add_parser(
        "search", help="generate fault schedules, find and shrink violations (exit status 1 when one is found)"
    )
    hunt.add_argument("--strategy", choices=STRATEGIES, default="lease")
    hunt.add_argument("--budget", type=_positive_seconds, default=60.0, help="seconds to spend, roughly")
    hunt.add_argument("--seed", type=int, default=None, help="repeat the search that printed this seed")
    hunt.add_argument("--examples", type=_positive_count, default=None,
                      help="schedules per checker (default: as many as the budget allows)")  # fmt: skip
    hunt.add_argument("--out", type=Path, default=Path("reports/latest/search"))
    hunt.set_defaults(handler=search)
    args = parser.parse_args(argv)
    _deterministic_hashing()
    return int(args.handler(args))


if __name__ == "__main__":
    sys.exit(main())
