"""The bench's burst, small: its instance processes start every job once between them, and say so."""

from __future__ import annotations

from sim.bench import burst


def test_a_small_burst_starts_every_job_once_across_the_instance_processes(real_target: str) -> None:
    """200 jobs due in the same second across three processes that each import anarchon alone (sim.burst_instance,
    with ValkeyBackend on Valkey): every job started once, by one of them, at that slot. What the bench's burst
    counts, on a scale a test can wait for; its lateness is a figure to print, not to assert."""
    figures = burst(real_target, jobs=200)
    assert (figures["started"], figures["duplicates"], figures["missed"], figures["other_slots"]) == (200, 0, 0, 0)
    assert 0 <= figures["lateness_p50_ms"] <= figures["lateness_p99_ms"]
