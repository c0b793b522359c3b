"""Property search finds known failures and shrinks them to schedules that replay."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from sim import search
from sim.run import simulate
from sim.scenario import load

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_search_finds_the_paused_winner_and_writes_a_replayable_schedule(tmp_path: Path) -> None:
    finding = search.search_checker("lease", "P4", examples=100, derandomize=True)
    assert finding is not None
    assert {fault["kind"] for fault in finding.faults} & {"pause", "partition", "late", "skew"}
    path = tmp_path / "found.toml"
    path.write_text(search.to_toml(finding, "lease"))
    replayed = simulate(load(path), "lease", finding.seed)
    assert replayed.digest == finding.outcome.digest
    assert replayed.judgement.verdicts["P4"].status == "invalid"
    # Shrunk: without any one of its faults, the schedule no longer breaks P4.
    for i in range(len(finding.faults)):
        fewer = replace(finding, faults=finding.faults[:i] + finding.faults[i + 1 :])
        smaller = tmp_path / f"without-{i}.toml"
        smaller.write_text(search.to_toml(fewer, "lease"))
        assert simulate(load(smaller), "lease", finding.seed).judgement.verdicts["P4"].status != "invalid"
    command = [sys.executable, "-m", "sim", "run", str(path), "--strategy", "lease", "--seed", str(finding.seed)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120, check=True)
    assert "P4 invalid" in done.stdout


def test_a_guarantee_that_holds_yields_no_finding() -> None:
    # Runs of a 2 s job every 10 s never overlap under lease, whatever the faults.
    assert search.search_checker("lease", "P3", examples=10, derandomize=True) is None
