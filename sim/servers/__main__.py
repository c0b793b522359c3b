"""`python -m sim.servers provision [TARGET...] | list | run TARGET [--replica] [--cluster]`."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from sim.servers._api import start_server
from sim.servers._errors import ServerError
from sim.servers._provision import ProvisionError, provision
from sim.servers._targets import TARGETS, installed, spec_of, target_dir


def list_lines() -> list[str]:
    """One line per target: `name version source path ready|missing`."""
    lines = []
    for target in TARGETS:
        found = installed(target)
        if found is not None:
            lines.append(f"{target} {found.version} {found.source} {found.binary} ready")
        else:
            spec = spec_of(target)
            path = target_dir(target) / "bin" / spec.binary_name
            lines.append(f"{target} {spec.series_label} {spec.origin} {path} missing")
    return lines


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m sim.servers", description="Redis/Valkey server targets.")
    commands = parser.add_subparsers(dest="command", required=True)
    prov = commands.add_parser("provision", help="fetch or build the targets' binaries into the cache")
    names = ", ".join(TARGETS)
    prov.add_argument("targets", nargs="*", metavar="TARGET", help=f"any of {names} (default: all)")
    commands.add_parser("list", help="print `name version source path ready|missing` per target")
    run = commands.add_parser("run", help="run a throwaway server until Ctrl-C")
    run.add_argument("target", choices=TARGETS)
    run.add_argument("--replica", action="store_true", help="also start a replica of it")
    run.add_argument("--cluster", action="store_true", help="a cluster of three primaries")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "provision":
        unknown = [target for target in args.targets if target not in TARGETS]
        if unknown:
            parser.error(f"unknown target(s) {', '.join(unknown)}; known: {', '.join(TARGETS)}")
        try:
            provision(args.targets or None)
        except ProvisionError as exc:
            print(f"error: {exc}", file=sys.stderr, flush=True)
            return 1
        except KeyboardInterrupt:
            print("interrupted: the target in progress was not put in place", file=sys.stderr, flush=True)
            return 130
        return 0
    if args.command == "list":
        print("\n".join(list_lines()), flush=True)
        return 0
    try:
        with start_server(args.target, replica=args.replica, cluster=args.cluster) as server:
            print(f"{server.target} {server.version} at {server.url()} (pid {server.pid})", flush=True)
            for host, port in server.shards[1:]:
                print(f"cluster primary at redis://{host}:{port}", flush=True)
            if server.replica is not None:
                replica = server.replica
                print(f"replica at {replica.url()} (pid {replica.pid})", flush=True)
            print("Ctrl-C stops it", flush=True)
            while True:
                time.sleep(3600)
    except ServerError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
