"""The comparison report: its statistics and what it writes."""

from __future__ import annotations

from pathlib import Path

import pytest

from sim import report


def test_wilson_interval_matches_the_textbook_values() -> None:
    low, high = report.wilson(3, 3)
    assert (round(low, 3), high) == (0.438, 1.0)
    low, high = report.wilson(0, 20)
    assert (low, round(high, 3)) == (0.0, 0.161)
    low, high = report.wilson(10, 20)
    assert (round(low, 3), round(high, 3)) == (0.299, 0.701)


@pytest.mark.slow
def test_a_report_names_every_scenario_and_shows_each_violation(tmp_path: Path) -> None:
    markdown, page = report.main(tmp_path, seeds=1, progress=False)
    text = markdown.read_text()
    for scenario in ("steady", "zombie", "failover", "late-claim"):
        assert f"**{scenario}**" in text
    assert "### lease: P1 (no duplicate) in zombie" in text
    assert "### script: P1 (no duplicate) in late-claim" in text
    assert "### stream-id: P2 (no missed slot) in late-claim" in text
    assert "python -m sim run" in text
    html = page.read_text()
    assert html.count("data:image/png;base64,") == text.count("![")  # every figure embedded
    assert (tmp_path / "lateness.png").stat().st_size > 1000
