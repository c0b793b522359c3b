"""Every scenario against every real server, in real time: the declared verdicts hold (`pytest -m scenarios`).

Live mode (sim.live): instances are OS processes, crashes are SIGKILL, pauses SIGSTOP, partitions and failovers
go through real TCP proxies and a real replica; durations are compressed 5x. lease, stream-id and script run side
by side on one server; idmp runs on its own where the server has IDMP (Redis 8.6+).
"""

from __future__ import annotations

import pytest

from sim.live import run_live
from sim.scenario import Scenario, load_all

pytestmark = [pytest.mark.scenarios, pytest.mark.slow, pytest.mark.timeout(300)]
SCENARIOS = load_all()
GROUPS = {"lease+stream-id+script": ["lease", "stream-id", "script"], "idmp": ["idmp"]}


@pytest.mark.parametrize("group", list(GROUPS))
@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
async def test_declared_verdicts_hold_live(scenario: Scenario, real_target: str, group: str) -> None:
    if group == "idmp" and real_target != "redis-8.6":
        pytest.skip(f"idmp needs Redis 8.6+ (XADD IDMP); {real_target} has none")
    outcomes = await run_live(scenario, real_target, GROUPS[group])
    assert sorted(outcomes) == sorted(GROUPS[group])
    failures = []
    for strategy, outcome in outcomes.items():
        for checker, verdict in scenario.expect.get(strategy, {}).items():
            got = outcome.judgement.verdict(checker)
            if got.status != verdict:
                failures.append(f"{strategy} {checker} is {got.status}, expected {verdict}: {got.witness}")
    assert not failures, "\n".join(failures)
