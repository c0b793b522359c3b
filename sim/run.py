"""Run one scenario with one strategy and one seed, in virtual time, and judge it."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sim.checkers import Judgement, judge
from sim.history import History
from sim.scenario import Scenario
from sim.vtime import run_virtual
from sim.world import EPOCH_S, FaultWindow, World


@dataclass
class Outcome:
    scenario: Scenario
    strategy: str
    seed: int
    history: History
    judgement: Judgement
    fault_windows: list[FaultWindow]
    target: str = ""  # live mode: the server it ran against
    server_version: str = ""

    @property
    def digest(self) -> str:
        return self.history.digest()

    def departures(self, expected: Mapping[str, str] | None = None) -> list[str]:
        """Each verdict this run did not get, with its witness, of those ``expected`` (checker: verdict), by default
        those its scenario declares for its strategy."""
        if expected is None:
            expected = self.scenario.expect.get(self.strategy, {})
        departures = []
        for checker, verdict in expected.items():
            got = self.judgement.verdict(checker)
            if got.status != verdict:
                departures.append(
                    f"{checker} is {got.status}, expected {verdict}{': ' if got.witness else ''}{got.witness}"
                )
        return departures

    def replay_command(self) -> str:
        """The command that replays this run, the scenario's file named from the working directory if it is in
        there (reports are made at the repository's root, and read on other machines)."""
        path = self.scenario.path
        target: Path | str = self.scenario.name
        if path is not None:
            target = path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path
        if self.target:  # a live run: run again on the same kind of server, strategies side by side as before
            return f"python -m sim run {target} --strategy {self.strategy} --server {self.target}"
        return f"python -m sim run {target} --strategy {self.strategy} --seed {self.seed}"

    def as_json(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario.name,
            "strategy": self.strategy,
            "seed": self.seed,
            "digest": self.digest,
            "replay": self.replay_command(),
            **self.judgement.as_json(),
            "executions": len(self.history.executions),
            "events": len(self.history.events),
            "records": None if self.history.records is None else len(self.history.records),
            "departures": self.departures(),
            **({"server": self.target, "server_version": self.server_version} if self.target else {}),
        }


def simulate(scenario: Scenario, strategy: str, seed: int) -> Outcome:
    world = World(scenario, strategy, seed)
    quiet = logging.getLogger("anarchon")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # faults make instances log warnings by design
    try:
        history = run_virtual(world.run(), epoch_s=EPOCH_S, seed=seed, store_ahead_s=lambda: world.store.clock_ahead_s)
    finally:
        quiet.setLevel(level)
    judgement = judge(scenario, strategy, history, world.fault_windows)
    return Outcome(scenario, strategy, seed, history, judgement, world.fault_windows)
