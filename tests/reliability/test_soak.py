"""The soak tool (``python -m sim.soak``): what it refuses, what it judges a leak, and that no process of it
outlives it."""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from sim import soak

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--crash-every", "-1"], "--crash-every must be 0 or more, not -1"),
        (["--steady", "4"], "--steady must be between 0 and --instances (3), not 4"),
        (["--steady", "-1"], "--steady must be between 0 and --instances (3), not -1"),
        (["--instances", "0"], "--instances must be 1 or more, not 0"),
        (["--jobs", "0"], "--jobs must be 1 or more, not 0"),
        (["--minutes", "0"], "--minutes must be a number above 0, not 0"),
        (["--sample-s", "nan"], "--sample-s must be a number above 0, not nan"),
        (["--minutes", "0.3"], "--minutes must leave slots to judge: at least 0.58 with --lease-ms 10000"),
    ],
)
def test_options_no_soak_can_run_with_are_refused_by_name(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        soak.main(argv)
    assert exit_.value.code == 2
    assert says in capsys.readouterr().err


def test_the_folder_of_an_earlier_soak_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "ledger-i0.jsonl").write_text('{"j":"job-0000","s":1000,"a":1,"i":"i0","p":1,"t":1001}\n')
    with pytest.raises(SystemExit):
        soak.main(["--out", str(tmp_path)])
    assert "is not empty: the verdicts would mix in the ledgers of an earlier soak" in capsys.readouterr().err


def _soak_with(samples: dict[str, list[tuple[float, int, int]]], store_mb: list[float], steady: int = 1) -> soak.Soak:
    """A finished soak whose instances were sampled as given: (time, resident kB, open files) each."""
    args = argparse.Namespace(steady=steady, max_rss_growth_mb=5.0, max_fd_growth=4, max_store_growth_mb=5.0)
    run = soak.Soak(args, "redis://unused", Path("unused"), random.Random(1))
    for pid, (name, taken) in enumerate(samples.items(), start=100):
        incarnation = soak.Incarnation(name, SimpleNamespace(pid=pid), started=0.0)  # type: ignore[arg-type]
        incarnation.rss_kb = [(t, kb) for t, kb, _ in taken]
        incarnation.fds = [(t, n) for t, _, n in taken]
        run.incarnations.append(incarnation)
    run.store_memory = [(60.0 * i, int(mb * 2**20)) for i, mb in enumerate(store_mb)]
    return run


def test_a_spared_instance_or_a_store_that_keeps_growing_after_the_warm_up_is_a_leak() -> None:
    flat = [(60.0, 40_000, 20), (300.0, 40_500, 22)]
    _, leaks = soak.resources(_soak_with({"i0": flat, "i1": flat}, [70.0, 70.0, 71.0]), warm=60.0)
    assert leaks == []
    # i0 keeps 20 kB a run and a socket every 50th: 22 MB and 30 open files more in 4 minutes.
    leaking = [(60.0, 40_000, 20), (180.0, 51_000, 35), (300.0, 62_528, 50)]
    lines, leaks = soak.resources(_soak_with({"i0": leaking, "i1": flat}, [70.0, 70.0, 80.0]), warm=60.0)
    assert leaks == [
        "i0 pid 100 resident memory grew by 22 MB (allowed 5) in 4.0 min",
        "i0 pid 100 open files grew by 30 (allowed 4) in 4.0 min",
        "the store's used_memory grew by 10 MB (allowed 5) in 1.0 min",
    ]
    assert "  rss i0 pid 100                   39.1       61.1   (4.0 min)" in lines
    # i1 is killed now and then: its short lives are shown, not judged.
    _, leaks = soak.resources(_soak_with({"i0": flat, "i1": leaking}, [70.0, 70.0, 71.0]), warm=60.0)
    assert leaks == []


def _running(pid: int) -> bool:
    """Whether the process runs (a zombie whose parent died, waiting for a reaper, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def _start_soak(target: str, folder: Path, minutes: float, *extra: str) -> subprocess.Popen[bytes]:
    """The driver, its files in ``folder``/out and what it prints in ``folder``/driver.log."""
    command = [sys.executable, "-m", "sim.soak", "--target", target, "--minutes", str(minutes), "--jobs", "20",
               "--lease-ms", "2000", "--warmup-minutes", "0.1", "--seed", "1", "--out", str(folder / "out"),
               *extra]  # fmt: skip
    with (folder / "driver.log").open("wb") as log:
        return subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=os.environ)


def _ready_pids(out: Path, instances: int = 3, within_s: float = 60) -> list[int]:
    """The instance processes, once each has started its scheduler."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        lines = [json.loads(line) for path in out.glob("ledger-*.jsonl") for line in path.read_text().splitlines()]
        pids = [entry["p"] for entry in lines if "ready" in entry]
        if len(pids) == instances:
            return pids
        time.sleep(0.2)
    raise AssertionError(f"the instances were not ready within {within_s} s: {sorted(out.iterdir())}")


def _gone(pids: list[int], within_s: float = 30) -> list[int]:
    """Those of ``pids`` still running after ``within_s`` at most."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and any(map(_running, pids)):
        time.sleep(0.2)
    return [pid for pid in pids if _running(pid)]


@pytest.mark.parametrize("crash_every", ["4", "0"])  # 0: none (it divided by zero)
def test_a_short_soak_judges_every_run_and_exits_0(live_target: str, tmp_path: Path, crash_every: str) -> None:
    driver = _start_soak(live_target, tmp_path, 0.5, "--crash-every", crash_every)
    code = driver.wait(timeout=120)
    text = (tmp_path / "driver.log").read_text()
    assert code == 0, text
    assert "P1 no slot executed twice to completion: valid" in text
    assert "P2 no slot missed while an instance was up: valid" in text
    assert "no leak: valid" in text
    crashes = int(text.split(" crashes, ")[0].rsplit(" ", 1)[1])
    assert crashes >= 1 if crash_every == "4" else crashes == 0, text
    checked = int(text.split(" slots checked for P2")[0].rsplit(" ", 1)[1])
    assert checked >= 20 * 10, text  # 20 jobs, at least 10 of their slots each


@pytest.mark.parametrize("end", [signal.SIGTERM, signal.SIGKILL])
def test_no_instance_outlives_a_soak_that_was_killed(live_target: str, tmp_path: Path, end: signal.Signals) -> None:
    """SIGTERM: the driver stops its instances and its server. SIGKILL leaves it no chance: the kernel tells the
    instances (their parent-death signal), and they stop; left running, they would claim from whatever server
    took their port next."""
    driver = _start_soak(live_target, tmp_path, 2.0, "--crash-every", "0")
    try:
        pids = _ready_pids(tmp_path / "out")
        driver.send_signal(end)
        code = driver.wait(timeout=60)
        assert code == (143 if end == signal.SIGTERM else -9)
        assert _gone(pids) == []
    finally:
        driver.kill()
        driver.wait()
