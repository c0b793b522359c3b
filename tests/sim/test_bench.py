"""The bench's burst, small: its instance processes start every job once between them, and say so. Its count of
a server's instructions per request: each operation's, and in the order of the work they do."""

from __future__ import annotations

import shutil

import pytest

from sim.bench import burst, server_instructions


def test_a_small_burst_starts_every_job_once_across_the_instance_processes(real_target: str) -> None:
    """200 jobs due in the same second across three processes that each import anarchon alone (sim.burst_instance,
    with ValkeyBackend on Valkey): every job started once, by one of them, at that slot. What the bench's burst
    counts, on a scale a test can wait for; its lateness is a figure to print, not to assert."""
    figures = burst(real_target, jobs=200)
    assert (figures["started"], figures["duplicates"], figures["missed"], figures["other_slots"]) == (200, 0, 0, 0)
    assert 0 <= figures["lateness_p50_ms"] <= figures["lateness_p99_ms"]
    assert figures["server_cpu_s"] > 0  # the server's work for 600 claims and 200 finishes, from its INFO
    assert len(figures["instance_cpu_s"]) == 3  # each instance process's own CPU time from the slot on
    assert all(cpu_s > 0 for cpu_s in figures["instance_cpu_s"])


def test_the_server_instructions_per_request_follow_the_work_each_request_does(real_target: str) -> None:
    """Counted by callgrind around each kind of request, over 50 jobs: a PING does less than a SET NX PX, which
    does less than a stream-id claim (one XADD, longer), and a lease claim (a script of five commands) several
    times as much; a losing claim and a finish are counted too. A count taken around the wrong requests, or none,
    breaks the order."""
    if shutil.which("valgrind") is None:
        pytest.skip("valgrind is not installed here (.ci/run installs it)")
    figures = server_instructions([real_target], jobs=50)[real_target]
    assert "skipped" not in figures, figures
    assert 0 < figures["ping"] < figures["set_nx_px"] < figures["stream-id"]["claim"] < figures["lease"]["claim"]
    assert figures["lease"]["claim"] > 5 * figures["set_nx_px"]
    assert figures["lease"]["ratio_to_set_nx_px"] == round(figures["lease"]["claim"] / figures["set_nx_px"], 1)
    assert figures["lease"]["losing_claim"] > figures["set_nx_px"]
    assert figures["lease"]["finish"] > figures["set_nx_px"]
    assert set(figures) >= {"lease", "stream-id", "script"}
