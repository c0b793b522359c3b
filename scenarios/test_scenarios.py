"""Every scenario with every strategy: each declared verdict holds (`pytest -m scenarios`).

Virtual mode, on the embedded store (Redis 8.6's IDMP emulated for idmp), three seeds each. A failing run prints
the command that replays it.
"""

from __future__ import annotations

import pytest

from sim.scenario import STRATEGIES, Scenario, load_all
from tests.support import assert_virtual_verdicts

pytestmark = pytest.mark.scenarios
SCENARIOS = load_all()


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_declared_verdicts_hold_in_virtual_time(scenario: Scenario, strategy: str) -> None:
    expected = scenario.expect.get(strategy, {})
    assert expected, f"{scenario.name} declares no verdict for {strategy}"
    assert_virtual_verdicts(scenario, strategy, expected)
