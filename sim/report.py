"""The strategy comparison report: every scenario × strategy × seed, judged, summarised for a reader who has to
choose a strategy.

Writes ``report.md`` (figures as PNG files beside it) and a self-contained ``index.html`` (figures embedded).
"""

from __future__ import annotations

import base64
import io
import math
import platform
import subprocess
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from markdown_it import MarkdownIt
from tqdm import tqdm  # type: ignore[import-untyped]

from anarchon._config import IdmpConfig, ScriptConfig
from anarchon._job import JobOptions
from anarchon._scheduler import DEFAULT_LEASE_MS
from sim.checkers import percentile, true_s
from sim.history import Execution
from sim.live import SCALE, SETTLE_AFTER_FAULTS_S, scaled
from sim.run import Outcome, simulate
from sim.scenario import Scenario, load_all
from sim.world import IDMP_VERSION, STORE_VERSION

STRATEGIES = ("lease", "stream-id", "idmp", "script")
CHECKER_NAMES = {
    "P1": "no duplicate",
    "P2": "no missed slot",
    "P3": "no overlap",
    "P4": "lease safety",
    "P5": "no lost acknowledged claim",
    "P6": "fencing order",
    "P7": "true history",
    "lateness": "on time",
}
# What a violation of each checker means for a job's owner, in the guide's words.
CONSEQUENCES = {
    "P1": "runs a run twice (P1)",
    "P2": "misses slots (P2)",
    "P3": "lets runs of a job overlap (P3)",
    "P4": "two lease holders work at once (P4)",
    "P5": "wins a lost claim again (P5)",
    "P6": "fences out of order (P6)",
    "P7": "keeps a history() that misreports runs (P7)",
    "lateness": "starts runs late",
}
# What each strategy is, whatever the scenarios show (the specification's table).
STRATEGY_FACTS = {
    "works on": {"lease": "Redis 5+, Valkey", "stream-id": "Redis 5+, Valkey", "idmp": "Redis 8.6+ only (not Valkey)",
                 "script": "Redis 5+, Valkey"},
    "remembers a run for": {"lease": "as long as a late claim or a catch-up could ask for it", "stream-id": "forever",
                            "idmp": f"duration_sec ({IdmpConfig().duration_sec} s)",
                            "script": f"window_ms ({ScriptConfig().window_ms // 1000} s)"},
    "backups, retries, overlap protection, catch-up": {"lease": "yes", "stream-id": "no", "idmp": "no",
                                                       "script": "no"},
}  # fmt: skip
# What each checker asks of a run (sim/checkers.py has the exact rules), for the reader choosing a strategy.
CHECKER_RULES = {
    "P1": "A slot, or a run_now, runs at most once. Under lease a later attempt of a slot, within the job's "
    "max_attempts and begun after the earlier one stopped short (a crash, a lost lease), is a retry, not a "
    "duplicate; a run_now is never retried.",
    "P2": "Every slot due while some instance was healthy, from the slot through the time a slot is given to run "
    "(three leases, the jitter, the work and 5 s), runs to its end. A slot that lease skips because the job's "
    "previous run still holds its lease (skipped-overlap, its overlap protection) counts as missed. Under lease, a "
    "job's catch_up_ms also owes the slots due while every instance was down, within that period before one was "
    "started again. A run_now is not a slot: one that lease skips for overlap is not judged here.",
    "P3": "Two runs of a job never execute at once (a job may allow it: none here does); the rates count each "
    "overlapping pair.",
    "P4": "Lease only: two holders of one run's lease (two tokens), a slot's or a run_now's, never execute at once.",
    "P5": "A claim the store acknowledged and then lost (a failover, a restart) is not won again, by another "
    "instance or by a new claim of its own. Judged where a store fault lost writes; elsewhere it holds.",
    "P6": "The fences of a job's runs grow in the order the store accepted their claims, where that order is "
    "known: a claim answered before another was sent was accepted first, and no two claims share a fence "
    "(claim-only strategies: scheduled runs only, as documented). Under lease a claim sent again after its "
    "answer was lost takes the next fence: it counts from the try answered. Each execution runs with the fence "
    "its claim was told.",
    "P7": "What history() says at the end agrees with what ran: a run recorded ok ran to its end, by the "
    "instance, attempt and fence its record names, and no attempt is recorded twice; a run recorded skipped ran "
    "nowhere (unless a failover or restart lost its claim); a run whose end the store heard of (its finish, or "
    "its hand-back once a backup took it over) is recorded, ok or interrupted as it ended, unless a failover or "
    "restart lost the record or trimming dropped it; and a job keeps history_size records, or all it was owed if "
    "fewer.",
    "lateness": "Each scheduled run starts no later than its job's jitter_ms + max_late_ms (catch_up_ms under lease, "
    "if larger) + 1 s after its slot (in scenario seconds: 61 s with the defaults, 6 s in late-claim, 11 s in "
    "lost-reply; a fifth of that live). Judged for the "
    "slots due after the scenario begins: an earlier one, which an instance whose clock is behind runs after it "
    "starts, is P2's to judge. A run that starts early (a clock ahead) is not judged: the lateness table shows how "
    "early.",
}
RATE_CHECKERS = ("P1", "P2", "P3", "P5", "P6")
COLOURS = {"lease": "#1b6ca8", "stream-id": "#d1495b", "script": "#edae49", "idmp": "#66a182"}


def wilson(violations: int, runs: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a rate."""
    if runs == 0:
        return (0.0, 1.0)
    p = violations / runs
    centre = (p + z * z / (2 * runs)) / (1 + z * z / runs)
    spread = z * math.sqrt(p * (1 - p) / runs + z * z / (4 * runs * runs)) / (1 + z * z / runs)
    return (max(0.0, centre - spread), min(1.0, centre + spread))


@dataclass
class Cell:
    """One scenario × strategy over all seeds."""

    runs: int = 0
    violations: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    unknown: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    counts: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    skipped_overlap: int = 0  # of P2's count: slots lease skipped while the previous run held its lease
    slots: int = 0
    first_violation: dict[str, Outcome] = field(default_factory=dict)
    runs_on: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # live: runs per server
    # live: per checker, the runs per server it found violated in
    violations_on: dict[str, dict[str, int]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(int)))

    @property
    def missed_only_by_overlap(self) -> bool:
        """Whether every slot P2 counted missed was one lease skipped on purpose (skipped-overlap)."""
        return bool(self.skipped_overlap) and self.skipped_overlap == self.counts.get("P2", 0)


@dataclass
class Results:
    mode: str  # virtual | live
    seeds: int  # runs of each scenario (per target in live mode)
    targets: list[str]  # live mode: the servers
    scenarios: list[Scenario]
    cells: dict[tuple[str, str], Cell] = field(default_factory=dict)
    lateness: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    late_runs: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # runs judged late, per strategy
    runs: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # per strategy
    margins: list[float] = field(default_factory=list)
    latest: dict[str, tuple[float, str]] = field(default_factory=dict)  # per strategy: the latest start, its scenario
    seconds: float = 0.0
    simulations: int = 0  # simulations run; in live mode each runs every strategy side by side
    simulated_s: float = 0.0  # of scenario time (live mode: of live time, compressed)
    bench: dict[str, Any] = field(default_factory=dict)  # live mode: claim latency and store memory per target
    # The code's commit, read as the runs begin: writing the report (its figures) may change tracked files.
    commit: str = field(default_factory=lambda: _commit())

    def add(self, outcome: Outcome, target: str = "") -> None:
        cell = self.cells.setdefault((outcome.scenario.name, outcome.strategy), Cell())
        cell.runs += 1
        if target:
            cell.runs_on[target] += 1
        cell.slots += outcome.judgement.slots_checked
        for name, verdict in outcome.judgement.checks.items():
            if verdict.status == "invalid":
                cell.violations[name] += 1
                cell.counts[name] += verdict.count
                cell.skipped_overlap += int(verdict.figures.get("skipped_overlap", 0))
                if target:
                    cell.violations_on[name][target] += 1
                shortest = cell.first_violation.get(name)
                if shortest is None or len(outcome.history.events) < len(shortest.history.events):
                    cell.first_violation[name] = outcome
            elif verdict.status == "unknown":
                cell.unknown[name] += 1
        self.lateness[outcome.strategy].extend(outcome.judgement.lateness_ms)
        if outcome.judgement.lateness_ms:
            latest = (max(outcome.judgement.lateness_ms), outcome.scenario.name)
            self.latest[outcome.strategy] = max(self.latest.get(outcome.strategy, latest), latest)
        self.runs[outcome.strategy] += 1
        if outcome.judgement.lateness.status == "invalid":
            self.late_runs[outcome.strategy] += 1
        self.margins.extend(outcome.judgement.lease_margins_ms)


def collect(seeds: int, progress: bool = True) -> Results:
    """Virtual mode: every scenario × strategy × seed on the embedded store."""
    results = Results("virtual", seeds, [], load_all())
    began = time.perf_counter()
    jobs = [(s, strategy, seed) for s in results.scenarios for strategy in STRATEGIES for seed in range(1, seeds + 1)]
    for scenario, strategy, seed in tqdm(jobs, desc="simulating", unit="run", disable=not progress):
        results.add(simulate(scenario, strategy, seed))
        results.simulations += 1
        results.simulated_s += scenario.duration_s
    results.seconds = time.perf_counter() - began
    return results


def collect_live(targets: Sequence[str], runs: int, progress: bool = True) -> Results:
    """Live mode: every scenario on every real server, strategies side by side, ``runs`` times; plus claim
    latency and store memory per target."""
    import asyncio

    from sim import bench
    from sim.live import run_live

    results = Results("live", runs, list(targets), load_all())
    began = time.perf_counter()
    jobs = [(s, target) for s in results.scenarios for target in targets for _ in range(runs)]
    for scenario, target in tqdm(jobs, desc="live runs", unit="run", disable=not progress):
        outcomes = asyncio.run(run_live(scenario, target, list(STRATEGIES))).values()
        for outcome in outcomes:
            results.add(outcome, target)
        results.simulations += 1
        results.simulated_s += max(o.scenario.duration_s for o in outcomes)  # the live scenario, compressed
    results.bench = {
        "claims": asyncio.run(bench.claim_latency(list(targets), 1000)),
        "memory": {target: asyncio.run(bench.store_memory(target, 1000)) for target in targets},
        "commands": asyncio.run(bench.commands_per_claim(list(targets))),
    }
    results.seconds = time.perf_counter() - began
    return results


# --- figures ---------------------------------------------------------------------------------------------------


def _png(figure: Any) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    plt.close(figure)
    return buffer.getvalue()


def _ms(results: Results) -> str:
    """The unit of the report's times: a live run's are compressed with its scenario."""
    return "live ms" if results.mode == "live" else "ms"


def lateness_figure(results: Results) -> bytes:
    figure, axis = plt.subplots(figsize=(7, 3.6))
    for strategy, values in results.lateness.items():
        if values:
            ordered = sorted(values)
            axis.step(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], where="post",
                      label=f"{strategy} (n={len(ordered)})", color=COLOURS[strategy])  # fmt: skip
    axis.set_xscale("symlog", linthresh=10)
    axis.set_xlabel(f"start − slot ({_ms(results)}), runs of all scenarios")
    axis.set_ylabel("fraction of runs")
    axis.set_title("Run lateness")
    axis.grid(alpha=0.3)
    if any(results.lateness.values()):  # a report whose runs never started a job has no line to name
        axis.legend()
    return _png(figure)


def margin_figure(results: Results) -> bytes:
    figure, axis = plt.subplots(figsize=(7, 3.2))
    if results.margins:
        axis.hist(results.margins, bins=30, color=COLOURS["lease"])
    axis.axvline(0, color="black", linewidth=1)
    axis.set_xlabel(
        f"lease expiry as last acknowledged − end of the attempt's work ({_ms(results)}); below 0: past its lease"
    )
    axis.set_ylabel("attempts")
    axis.set_title("Lease margin per attempt (lease)")
    axis.grid(alpha=0.3)
    return _png(figure)


def timeline_figure(outcome: Outcome, *checkers: str) -> bytes:
    """Lanes per instance and for the store: fault bands, claims, and runs as bars, around the first checker's
    violation. Runs of one instance that execute at once (P3's overlaps) are stacked in its lane, not drawn over
    each other."""
    history = outcome.history
    instances = [spec.name for spec in outcome.scenario.instances]
    focus = _focus_time(outcome, checkers[0])
    span = 25 * _scale(outcome)  # the same 50 scenario seconds, live or not
    low = max(0.0, focus - span)
    high = focus + span
    figure, axis = plt.subplots(figsize=(10, 0.7 * len(instances) + 1.6))
    lanes = {name: i + 1 for i, name in enumerate(instances)}
    lanes["store"] = 0
    # A live instance's restart is a window of its own that begins where its crash or stop ends: one fault, one label.
    goes_on = {(w.instance, w.end) for w in outcome.fault_windows}
    for window in outcome.fault_windows:
        end = min(window.end, outcome.scenario.duration_s)
        if end < low or window.start > high:  # drawn outside the axes, it would widen the figure
            continue
        lane = lanes.get(window.instance, 0)
        axis.broken_barh([(window.start, max(end - window.start, 0.2))], (lane - 0.45, 0.9), facecolor="#dddddd",
                         edgecolor="#999999", hatch="//", zorder=0)  # fmt: skip
        if (window.instance, window.start) not in goes_on or window.start < low:
            axis.text(max(window.start, low), lane + 0.32, f" {window.kind}", fontsize=7, zorder=3, clip_on=True)
    shown = [e for e in history.executions if (e.ended is None or e.ended >= low) and e.started <= high]
    for e, level, levels in _stacked(shown):
        end = e.ended if e.ended is not None else high
        colour = "#2a9d8f" if e.completed else "#e76f51"
        height = 0.5 / levels
        bottom = lanes[e.instance] - 0.25 + level * height
        axis.broken_barh([(e.started, max(end - e.started, 0.05))], (bottom, height * 0.9), color=colour, zorder=2)
        label = f" slot {true_s(e.slot, history.epoch_s):.0f} s, attempt {e.attempt}"
        inside = end - e.started > (high - low) / 8  # a short bar gets its label above it
        axis.text(max(e.started, low), bottom + (height * 0.45 if inside else height * 0.9 + 0.02), label,
                  fontsize=6, va="center" if inside else "bottom", color="white" if inside else "black", zorder=3,
                  clip_on=True)  # fmt: skip
    for event in history.events:
        if event.kind == "invoke" or event.op != "claim" or not low <= event.t <= high:
            continue
        answered = "^" if event.value.startswith("won") else "o" if event.value.startswith("overlap") else "."
        marker = {"ok": answered, "fail": "x", "info": "$?$"}[event.kind]
        axis.plot(event.t, lanes[event.process] - 0.42, marker=marker, color="black", markersize=5, linestyle="")
    # A slot no instance ran has no bar: P2's missed slots are marked on the store's lane, which decided them.
    several_jobs = len(outcome.scenario.jobs) > 1
    for job, slot in sorted({s for checker in checkers for s in outcome.judgement.verdict(checker).slots}):
        at = true_s(slot, history.epoch_s)
        if low <= at <= high:
            axis.plot(at, 0, marker="X", color="#c1121f", markersize=7, linestyle="", zorder=3)
            axis.text(at, 0.18, f" {job} missed" if several_jobs else " missed", fontsize=6, zorder=3, clip_on=True)
    axis.set_yticks(list(lanes.values()), list(lanes.keys()))
    axis.set_ylim(-0.6, len(instances) + 0.6)
    axis.set_xlim(low, high)
    axis.set_xlabel(
        "true time (s); bars: runs (green: ran to the end, red: stopped); claims: ^ won, . lost, o skipped-overlap, "
        "x failed, ? unknown; X: a slot missed"
    )
    run = f"on {outcome.target}" if outcome.target else f"seed {outcome.seed}"  # a live run has no seed
    axis.set_title(f"{outcome.scenario.name} / {outcome.strategy} / {run}: {', '.join(checkers)} violated")
    return _png(figure)


def _stacked(executions: Sequence[Execution]) -> list[tuple[Execution, int, int]]:
    """Each execution with its level in its instance's lane (0 at the bottom; an execution takes the lowest level
    free when it starts) and the number of levels that lane needs."""
    placed: list[tuple[Execution, int]] = []
    ends: dict[str, list[float]] = defaultdict(list)  # per instance, per level: when its last execution ends
    for e in sorted(executions, key=lambda e: e.started):
        levels = ends[e.instance]
        level = next((i for i, busy_until in enumerate(levels) if busy_until <= e.started), len(levels))
        if level == len(levels):
            levels.append(0.0)
        levels[level] = math.inf if e.ended is None else e.ended
        placed.append((e, level))
    return [(e, level, len(ends[e.instance])) for e, level in placed]


def _scale(outcome: Outcome) -> float:
    """Its times per scenario second: live runs are compressed."""
    return SCALE if outcome.target else 1.0


def _by_run(first_violation: dict[str, Outcome]) -> list[tuple[Outcome, list[str]]]:
    """The counterexamples of one cell, one per run: the checkers whose smallest run is the same one together."""
    runs: dict[int, tuple[Outcome, list[str]]] = {}
    for checker, outcome in sorted(first_violation.items()):
        runs.setdefault(id(outcome), (outcome, []))[1].append(checker)
    return list(runs.values())


def _focus_time(outcome: Outcome, checker: str) -> float:
    witness = outcome.judgement.verdict(checker).witness
    if "slot at " in witness:
        return float(witness.split("slot at ")[1].split(" s")[0]) + 5 * _scale(outcome)
    if " at " in witness:
        return float(witness.split(" at ")[1].split(" s")[0])
    return outcome.scenario.duration_s / 2


# --- text ------------------------------------------------------------------------------------------------------


def _commit() -> str:
    """The commit the report was made at, and whether the code differed from it."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout.strip()

    try:
        changed = git("status", "--porcelain", "--untracked-files=no")
        return git("rev-parse", "--short", "HEAD") + (" with uncommitted changes" if changed else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _rate(violations: int, runs: int, interval: bool = True) -> str:
    if not interval:
        return f"{violations}/{runs}"
    low, high = wilson(violations, runs)
    return f"{violations}/{runs} ({100 * low:.0f}–{100 * high:.0f}%)"


def _replay(outcome: Outcome, commit: str) -> str:
    version = ".".join(map(str, IDMP_VERSION if outcome.strategy == "idmp" else STORE_VERSION))
    where = f"embedded store (fakeredis, Redis {version} semantics)"
    if outcome.target:
        where = f"{outcome.target} {outcome.server_version}, a live run (timing varies)"
    return f"{outcome.replay_command()}   # commit {commit}, {where}"


def _bench_sections(bench: dict[str, Any]) -> list[str]:
    lines = [
        "",
        "## Claim cost per server",
        "",
        "Sequential claims by one asyncio redis-py client (RESP2), beside PING and a per-slot SET NX PX with the same",
        "client in the same loop; µs, p50 / p99, and p50 over SET NX PX's.",
        "",
        *_head("server", "PING", "SET NX PX", *STRATEGIES),
    ]
    for target, ops in bench["claims"].items():
        cells = [f"{ops[op]['p50_us']:.0f} / {ops[op]['p99_us']:.0f}" for op in ("ping", "set_nx_px")]
        for strategy in STRATEGIES:
            row = ops.get(strategy)
            cells.append(
                f"{row['p50_us']:.0f} / {row['p99_us']:.0f} ({row['ratio_to_set_nx_px']:.2f}×)" if row else "–"
            )
        lines.append(_row(f"{target} {ops.get('version', '')}", *cells))
    lines += ["", "Round trips and server commands per claim (a won claim; lease includes none of its finish):", "",
              *_head("server", *STRATEGIES)]  # fmt: skip
    for target, per in bench["commands"].items():
        cells = [f"{per[s]['round_trips']:g} / {per[s]['commands']:g}" if s in per else "–" for s in STRATEGIES]
        lines.append(_row(target, *cells))
    lines += ["", "Store memory of one job after 1,200 runs with history_size 1,000 (MEMORY USAGE of its keys):", "",
              *_head("server", *STRATEGIES)]  # fmt: skip
    for target, memory in bench["memory"].items():
        cells = [f"{memory[s]['bytes'] / 1024:.0f} KiB ({memory[s]['bytes_per_run']} B/run)" if s in memory else "–"
                 for s in STRATEGIES]  # fmt: skip
        lines.append(_row(target, *cells))
    return lines


def _row(*cells: object) -> str:
    return "| " + " | ".join(map(str, cells)) + " |"


def _head(*columns: str) -> list[str]:
    """A Markdown table's header row and the line under it."""
    return [_row(*columns), "|" + "---|" * len(columns)]


def _rates_by_scenario(results: Results) -> list[str]:
    """Where each strategy's counted violations come from: the scenario and its count, per checker."""
    lines = []
    for strategy in STRATEGIES:
        parts = []
        for checker in RATE_CHECKERS:
            counts = sorted(
                ((cell.counts[checker], name) for (name, s), cell in results.cells.items()
                 if s == strategy and cell.counts.get(checker)),
                reverse=True,
            )  # fmt: skip
            if counts:
                parts.append(f"{checker} in " + ", ".join(f"{name} {n}" for n, name in counts))
        lines.append(f"- {strategy}: {'; '.join(parts) if parts else 'none'}")
    return lines


def _lateness_row(results: Results, strategy: str) -> str:
    values = results.lateness.get(strategy, [])
    if not values:
        return _row(strategy, 0, "–", "–", "–", "–", "–", 0, f"0/{results.runs.get(strategy, 0)}")
    figures = (min(values), percentile(values, 50), percentile(values, 99), max(values))
    early = sum(1 for v in values if v < 0)
    return _row(strategy, len(values), *(f"{v:.0f}" for v in figures), results.latest[strategy][1], early,
                _rate(results.late_runs.get(strategy, 0), results.runs[strategy], results.mode == "live"))  # fmt: skip


def _margin_summary(margins: list[float], unit: str) -> str:
    if not margins:
        return "Lease margins: no lease attempt with an acknowledged lease."
    past = sum(1 for m in margins if m < 0)
    return (f"Lease margin (lease only): each attempt's lease expiry, as its holder last heard it (when its last "
            f"won claim or heartbeat was sent + the lease the reply granted), − the end of its work (an attempt "
            f"still going at the end has none). {len(margins)} attempts, "
            f"{past} worked past their lease; min {min(margins):.0f} {unit}, "
            f"p50 {percentile(margins, 50):.0f} {unit}.")  # fmt: skip


def _seeds(n: int) -> str:
    return f"{n} seed" if n == 1 else f"{n} seeds"


def _verdict_cell(cell: Cell, strategy: str, interval: bool) -> str:
    """The checkers violated (in how many runs, with the rate's interval where runs vary; live, on which servers
    in how many of their runs), then those that could not judge some runs."""
    if not cell.runs:
        return "not run"
    bad = []
    for name, n in sorted(cell.violations.items()):
        by_server = cell.violations_on[name]
        if len(cell.runs_on) > 1 and by_server == cell.runs_on:  # in every run on every server that ran it
            where = ["every server"]
        else:
            where = [f"{target} {k}/{cell.runs_on[target]}" for target, k in sorted(by_server.items())]
        bad.append(f"✗ {name} {_rate(n, cell.runs, interval)}" + (f" on {', '.join(where)}" if where else "")
                   + (_overlap_skips(cell) if name == "P2" else ""))  # fmt: skip
    # P4 is of leases: the other strategies have none to judge, which is no doubt about them.
    unknown = [f"{name} not judged in {n}/{cell.runs}" for name, n in sorted(cell.unknown.items())
               if name != "P4" or strategy == "lease"]  # fmt: skip
    if not bad:
        bad = [f"✓ {'the others' if unknown else 'all'} hold ({cell.runs} runs)"]
    return "<br>".join(bad + unknown)


def _overlap_skips(cell: Cell) -> str:
    """How many of the missed slots lease skipped on purpose, its previous run holding its lease (overlap=False)."""
    missed = cell.counts.get("P2", 0)
    if not cell.skipped_overlap:
        return ""
    if cell.missed_only_by_overlap:
        return " (every missed slot skipped-overlap, by design)"
    # Some were lost to the fault: those skipped were skipped behind a run (a retry) it held up, not by design.
    return f" ({cell.skipped_overlap} of {missed} missed slots skipped-overlap, behind a run still holding its lease)"


def _guide(results: Results) -> list[str]:
    """Which strategy to choose: the advice, what each strategy is, and, for each way a strategy can fail a job,
    the scenarios in which this report saw it fail that way."""
    lines = [
        "## Which strategy?",
        "",
        "Use **lease**, the default, unless you have a reason not to: it is the only strategy with backups, retries,",
        "overlap protection and catch-up. What it can get wrong is running a run twice: a winner frozen for longer",
        "than what is left of its lease (zombie), or whose finish never reaches the store (finish-lost); pass",
        "`run.fence` downstream to refuse the stale writer. And a store slower to answer than about half a lease",
        "costs it runs (slow-store): keep `lease_ms` over twice the slowest answer you expect.",
        "",
        "The others only decide who runs each time: a run whose winner crashes, is stopped or never hears its",
        "claim's answer is lost, and runs of a job may overlap. Choose one where a lost run is better than a second",
        "one and nothing downstream can refuse a stale writer: **stream-id**, one XADD, the cheapest claim, never",
        "runs a slot twice while the store keeps its data; **script** and **idmp** forget a run after their window",
        "(`window_ms`, `duration_sec`), and run it again for a claim that comes later (a clock behind, a pause);",
        "idmp needs Redis 8.6 and two round trips a claim. Under every strategy a store that loses acknowledged",
        "writes can run a slot twice (failover: to a replica that had not received them; store-restart: a restart",
        "without persistence): keep jobs safe to run twice.",
        "",
        "Each scenario strikes at the worst moment on purpose: a scenario named below shows that a failure can",
        "happen, not how often it happens in production.",
        "",
        *_head("", *STRATEGIES),
        *[_row(fact, *(by[strategy] for strategy in STRATEGIES)) for fact, by in STRATEGY_FACTS.items()],
    ]
    for checker, consequence in CONSEQUENCES.items():
        row = []
        for strategy in STRATEGIES:
            where = []
            for scenario in results.scenarios:
                cell = results.cells.get((scenario.name, strategy), Cell())
                if cell.violations.get(checker):
                    by_design = checker == "P2" and cell.missed_only_by_overlap
                    where.append(scenario.name + (" (skipped-overlap, by design)" if by_design else ""))
            row.append(", ".join(where) or "–")
        lines.append(_row(consequence + " in", *row))
    if results.bench:
        ratios = {
            strategy: [
                ops[strategy]["ratio_to_set_nx_px"] for ops in results.bench["claims"].values() if strategy in ops
            ]
            for strategy in STRATEGIES
        }
        lines.append(_row("claim p50 over a SET NX PX lock's",
                          *(f"{min(r):.2f}–{max(r):.2f}×" if r else "–" for r in ratios.values())))  # fmt: skip
    return lines


def _settings(scenario: Scenario, live: bool) -> str:
    """What a scenario sets, to translate its thresholds to production, and how much of it a live run covers."""
    parts = [f"{name} {value}" for name, value in scenario.scheduler.items()]
    for job in scenario.jobs:
        options = "".join(f", {name} {value}" for name, value in job.options.items())
        parts.append(f"job {job.name}: `{job.cron}`, works {job.work_s:g} s{options}")
    parts += [f"{strategy} {name} {value}" for strategy, settings in scenario.strategies.items()
              for name, value in settings.items()]  # fmt: skip
    covered = f"; a live run covers its first {scaled(scenario).duration_s / SCALE:g} s" if live else ""
    return f"Sets: {'; '.join(parts)}{covered}."


def _this_run(results: Results) -> str:
    judged = sum(cell.runs for cell in results.cells.values())
    if results.mode == "virtual":
        return (f"- {judged} simulated runs, {results.simulated_s / 3600:.1f} h of simulated time in "
                f"{results.seconds:.1f} s of wall time")  # fmt: skip
    scenario_h = results.simulated_s / SCALE / 3600
    return (f"- {results.simulations} live runs, each judged once per strategy that ran side by side in it "
            f"({judged} judged); {results.simulated_s / 60:.0f} min of live time ({scenario_h:.1f} h of scenario "
            f"time) in {results.seconds:.0f} s of wall time")  # fmt: skip


def _command(results: Results) -> str:
    """The command line that makes a report like this one (``--out`` aside)."""
    command = f"python -m sim report --mode {results.mode} --seeds {results.seeds}"
    return command + (f" --servers {','.join(results.targets)}" if results.mode == "live" else "")


def render(results: Results, figure: Callable[[str, bytes], str]) -> str:
    """The report in Markdown; ``figure(name, png)`` stores a figure and returns how to reference it."""
    if results.mode == "virtual":
        how = [
            f"{len(results.scenarios)} scenarios × {len(STRATEGIES)} strategies × {_seeds(results.seeds)}, virtual",
            "time on the embedded store (fakeredis running the real Lua scripts; for idmp, Redis 8.6's idempotent",
            "XADD emulated as in its source, since fakeredis's own is incomplete). A scenario's faults come at fixed",
            "moments and virtual time is exact: a seed changes only what is drawn at random (tokens, the order of",
            "large claim batches), so the seeds are replays, not samples, and a cell counts runs without a",
            "rate's interval: a verdict belongs to the scenario's timing. `python -m sim search` varies the timing.",
        ]
    else:
        how = [
            f"{len(results.scenarios)} scenarios × {len(STRATEGIES)} strategies on {', '.join(results.targets)}",
            f"(idmp where the server has IDMP: Redis 8.6), {results.seeds} run(s) each, in real time: instances are",
            "OS processes, crashes SIGKILL, stops Scheduler.stop() told on stdin, pauses SIGSTOP, partitions, slow",
            "replies and failovers go through TCP proxies and a real replica. Durations are compressed "
            f"{1 / SCALE:g}x, the defaults of the time options a scenario",
            "leaves unset included (the library's own retry delays are not). A run ends at the scenario's end or",
            f"{SETTLE_AFTER_FAULTS_S} scenario s after its last fault heals, whichever is sooner (a scenario without",
            f"faults: after its first {SETTLE_AFTER_FAULTS_S} s). Times in witnesses and lateness figures are live",
            "time: a fifth of the scenario's (the slot at 40 s of a scenario's description is the slot at 8 s of its",
            "run).",
        ]
    lines = [
        "# Strategy comparison",
        "",
        *_guide(results),
        "",
        "## How the runs were made",
        "",
        *how,
        "Each run is judged by the checkers P1–P7 and lateness, each valid, invalid or not judged (the run gave it",
        "nothing to judge, or for P2 a run was still going at the end); a cell shows the checkers violated and in "
        "how many runs"
        + (
            ", with the 95% Wilson interval of the violation rate, and on which servers."
            if results.mode == "live"
            else "."
        ),
        "",
        *_head("checker", "holds when"),
        *[_row(f"{name}: {CHECKER_NAMES[name]}", rule) for name, rule in CHECKER_RULES.items()],
        "",
        "## Verdicts",
        "",
        (
            f"Each cell: the checkers violated, in how many of the strategy's live runs ({results.seeds} on each server"
            " that ran it: idmp on Redis 8.6 only), and on which servers. The faults are staged at fixed moments:"
            " n/n says the failure came every time it was staged, not how often it comes in production."
            if results.mode == "live"
            else f"Each cell: the checkers violated, in how many of the {_seeds(results.seeds)} (replays of a timing)."
        ),
        "",
        *_head("scenario", *STRATEGIES),
    ]
    for scenario in results.scenarios:
        row = [f"**{scenario.name}**"]
        for strategy in STRATEGIES:
            cell = results.cells.get((scenario.name, strategy), Cell())
            row.append(_verdict_cell(cell, strategy, interval=results.mode == "live"))
        lines.append(_row(*row))
    lines += ["", "Scenarios (the library's defaults, where a scenario sets its own: "
              f"lease_ms {DEFAULT_LEASE_MS:,}, heartbeat_ms a third of the lease, max_late_ms "
              f"{JobOptions().max_late_ms:,}, window_ms {ScriptConfig().window_ms // 1000} s and duration_sec "
              f"{IdmpConfig().duration_sec} s):", ""]  # fmt: skip
    lines += [f"- **{s.name}**: {' '.join(s.description.split())} {_settings(s, results.mode == 'live')}"
              for s in results.scenarios]  # fmt: skip
    lines += [
        "",
        "## Rates per 1,000 slots",
        "",
        "Violations counted by the checkers, over all scenarios, per 1,000 slots due while some instance was healthy",
        "(the slots P2 examines). P1 and P3 count every run, also those of the first and last moments of a scenario,",
        "so where nearly every run overlaps the next a rate can pass 1,000. Of the missed slots, those lease skipped",
        "on purpose (skipped-overlap: the job's previous run still held its lease) are counted again on their own.",
        "The scenarios aim their faults at each strategy's weak points: these are what a fault staged here costs,",
        "not how often a failure happens in production. The scenarios the counts come from follow.",
        "",
        *_head(
            "strategy",
            "slots",
            "duplicates (P1)",
            "missed (P2)",
            "of them skipped-overlap",
            "overlaps (P3)",
            "lost acknowledged claims (P5)",
            "fences out of order (P6)",
        ),
    ]
    for strategy in STRATEGIES:
        cells = [c for (_, s), c in results.cells.items() if s == strategy]
        slots = sum(c.slots for c in cells)
        per = [1000 * sum(c.counts.get(k, 0) for c in cells) / max(slots, 1) for k in RATE_CHECKERS]
        skipped = 1000 * sum(c.skipped_overlap for c in cells) / max(slots, 1)
        lines.append(_row(strategy, slots, *(f"{v:.1f}" for v in (per[0], per[1], skipped, *per[2:]))))
    lines += ["", *_rates_by_scenario(results)]
    if results.bench:
        lines += _bench_sections(results.bench)
    lines += [
        "",
        "## Lateness and lease margins",
        "",
        "Lateness: a run's start (its earliest execution, of any attempt: one whose first attempt never ran started",
        "with a backup's; a duplicate is P1's to judge) − its slot, true time.",
        "A run is judged late when it starts later than its job's jitter_ms + max_late_ms (catch_up_ms under lease,",
        "if larger) + 1 s"
        + (" of scenario time (0.2 s live), as the compressed options are." if results.mode == "live" else ".")
        + " Below 0, a run started before its slot: an instance whose clock runs ahead claimed it early.",
        "A slot no instance ran (P2) has no start and is not judged here: fewer late runs may mean more missed",
        "slots (stream-id misses the late slot of late-claim that the others run late).",
        "Which scenarios the late runs are in: the Verdicts table (lateness) and the counterexamples; the latest",
        "start of each strategy is named below. An instance whose clock is off (skew, late-claim) starts its runs",
        "early or late by its clock's offset; a run whose claim's answer was lost (lost-reply) starts when the",
        "claim is sent again; under lease, a catch-up runs late the slots that came due while no instance ran",
        "(fleet-down), which the other strategies never run.",
        "",
        *_head(
            "strategy",
            "job runs",
            *(f"{p} ({_ms(results)})" for p in ("min", "p50", "p99", "max")),
            "max in",
            "runs started early",
            "simulations with a late run",
        ),
        *[_lateness_row(results, strategy) for strategy in STRATEGIES],
        "",
        figure("lateness.png", lateness_figure(results)),
        "",
        _margin_summary(results.margins, _ms(results)),
        "",
        figure("lease-margin.png", margin_figure(results)),
        "",
        "## Counterexamples",
        "",
        "For each strategy and checker violated, the smallest run that shows it (fewest history events); the",
        "checkers one run shows share its section and its timeline. Its scenario is described under Verdicts.",
        "",
    ]
    commit = results.commit
    for (name, strategy), cell in sorted(results.cells.items()):
        for outcome, checkers in _by_run(cell.first_violation):
            lines += [
                f"### {strategy} in {name}: " + ", ".join(f"{c} ({CHECKER_NAMES[c]})" for c in checkers),
                "",
                *(f"- {c} witness: {outcome.judgement.verdict(c).witness}" for c in checkers),
                "",
                figure(f"timeline-{name}-{strategy}-{'-'.join(checkers)}.png", timeline_figure(outcome, *checkers)),
                "",
                "```",
                _replay(outcome, commit),
                "```",
                "",
            ]
    lines += [
        "## This run",
        "",
        _this_run(results),
        f"- made by `{_command(results)}`"
        + (f", seeds 1 to {results.seeds}, fakeredis {version('fakeredis')}" if results.mode == "virtual" else ""),
        f"- anarchon {version('anarchon')}, commit {commit}",
        f"- Python {platform.python_version()}, {platform.machine()}, {platform.system()} {platform.release()}",
        "",
    ]
    return "\n".join(lines)


def write(results: Results, out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    figures: dict[str, bytes] = {}

    def as_file(name: str, png: bytes) -> str:
        figures[name] = png
        (out / name).write_bytes(png)
        return f"![{name}]({name})"

    markdown = render(results, as_file)
    (out / "report.md").write_text(markdown)
    (out / "index.html").write_text(_html(markdown, figures))
    return out / "report.md", out / "index.html"


def _html(markdown: str, figures: dict[str, bytes]) -> str:
    """The report as one self-contained page: its Markdown rendered, each figure embedded as a data URI."""
    for name, png in figures.items():
        markdown = markdown.replace(f"]({name})", f"](data:image/png;base64,{base64.b64encode(png).decode()})")
    # Raw HTML on: table cells break their lines with <br> (the report writes no other tag).
    body = MarkdownIt("commonmark", {"html": True}).enable("table").render(markdown)
    style = ("body{font-family:sans-serif;max-width:1100px;margin:2em auto;line-height:1.4}table{border-collapse:"
             "collapse}td,th{border:1px solid #ccc;padding:4px 8px;vertical-align:top}img{max-width:100%}"
             "pre{background:#f4f4f4;padding:8px;overflow-x:auto}")  # fmt: skip
    head = f"<!doctype html><meta charset=utf-8><title>anarchon strategy comparison</title><style>{style}</style>"
    return f"{head}\n{body}"


def main(
    out: Path, seeds: int, progress: bool = True, mode: str = "virtual", targets: Sequence[str] = ()
) -> Sequence[Path]:
    results = collect(seeds, progress) if mode == "virtual" else collect_live(targets, seeds, progress)
    return write(results, out)
