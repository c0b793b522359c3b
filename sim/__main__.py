"""python -m sim report [--out DIR]: the strategy comparison (currently the real-time demo in sim.demo)."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from sim import demo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sim")
    commands = parser.add_subparsers(dest="command", required=True)
    report = commands.add_parser("report", help="compare the strategies under faults; write report.md")
    report.add_argument("--out", type=Path, default=Path("reports/latest"))
    report.add_argument("--seconds", type=float, default=30.0, help="how long each strategy runs")
    args = parser.parse_args(argv)
    began = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    # The faults make the instances log warnings by design; they go to a file beside the report.
    logging.basicConfig(filename=args.out / "instances.log", level=logging.INFO, force=True)
    path = demo.main(args.out, args.seconds)
    print(path.read_text())
    print(f"written to {path} in {time.monotonic() - began:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
