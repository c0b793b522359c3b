"""The faults that strike one instance, told once for both modes.

Virtual mode (:mod:`sim.world`) and live mode (:mod:`sim.live`) differ in what a kill, a pause or a clock change
is (a cancelled task or a SIGKILL, a frozen clock or a SIGSTOP), not in what a fault does when: each gives its
instances the actions of :class:`Target` and itself the records of :class:`Run`, and :func:`strike` plays the
fault. Faults that strike the store (failover, replication, store restart) stay with each mode.
"""

from __future__ import annotations

import asyncio
from typing import Protocol, TypeVar

from sim.scenario import FaultSpec, Scenario


class Clock(Protocol):
    offset_ms: float

    def set_drift(self, drift: float) -> None: ...


class Target(Protocol):
    """An instance a fault can strike. Pauses and partitions strike the instance, not one process of it: a
    process restarted within one starts paused or cut off."""

    @property
    def name(self) -> str: ...
    @property
    def label(self) -> str: ...  # how the history names it
    @property
    def clock(self) -> Clock: ...
    @property
    def up(self) -> bool: ...  # a process of it runs, and is not stopping
    @property
    def alive(self) -> bool: ...  # a process of it runs, stopping or not (while one stops, the next may start)
    async def crash(self) -> None: ...
    async def stop(self, timeout_s: float) -> None: ...
    async def restart(self) -> bool: ...  # False when there was nothing to restart
    def pause(self) -> None: ...
    def resume(self) -> None: ...
    def cut_off(self, reply_lost: bool = False) -> None: ...  # reply_lost: its next command's (see Link.cut)
    def reconnect(self) -> None: ...
    def slow_down(self, delay_s: float) -> None: ...  # its replies come delay_s late, until speed_up(delay_s)
    def speed_up(self, delay_s: float) -> None: ...
    async def clock_changed(self) -> None: ...
    def cannot_run_now(self) -> str | None: ...  # why run_now cannot be called on it now ("down", "starting")
    async def run_now(self, job: str) -> str | None: ...  # the error if the manual run's claim failed


T = TypeVar("T", bound=Target)
T_contra = TypeVar("T_contra", bound=Target, contravariant=True)


class Run(Protocol[T_contra]):
    @property
    def scenario(self) -> Scenario: ...
    def now(self) -> float: ...
    def record_fault(self, fault: FaultSpec, detail: str) -> None: ...
    def fault_window(self, fault: FaultSpec, start: float, end: float, target: T_contra) -> None: ...


async def strike(run: Run[T], fault: FaultSpec, target: T) -> None:
    """Play ``fault`` on ``target`` from now: record it, the window in which it counts, and its end."""
    start = run.now()
    detail = target.label
    if fault.kind in ("crash", "stop"):
        # Killing a process that is not running does nothing, and it has nothing to restart. One that is
        # stopping can still be killed, not stopped again.
        if not (target.up if fault.kind == "stop" else target.alive):
            run.record_fault(fault, f"{detail} is down already: nothing struck")
            return
        restart = fault.settings.get("restart_after_s")
        end = run.scenario.duration_s if restart is None else start + float(restart)
        run.fault_window(fault, start, end, target)  # before acting: the run may end meanwhile
        if fault.kind == "crash":
            run.record_fault(fault, f"{detail} killed")
            await target.crash()
        else:
            timeout_s = float(fault.settings.get("timeout_s", 0.0))
            run.record_fault(fault, f"{detail} stopping (stop timeout {timeout_s:g} s)")
            await target.stop(timeout_s)
            run.record_fault(fault, f"{detail} stopped")
        if restart is not None:
            await asyncio.sleep(max(0.0, end - run.now()))  # from the fault's start: a stop takes a while
            if await target.restart():
                run.record_fault(fault, f"{detail} restarted")
                if run.now() > end:  # a stop that waited for its jobs, or a store out of reach: down until now
                    run.fault_window(fault, end, run.now(), target)
    elif fault.kind in ("pause", "partition"):
        pause = fault.kind == "pause"
        if pause:
            run.record_fault(fault, f"{detail} paused")
            target.pause()
        else:
            reply_lost = bool(fault.settings.get("reply_lost", False))
            lost = " (its next command's reply lost)" if reply_lost else ""
            run.record_fault(fault, f"{detail} cut off from the store{lost}")
            target.cut_off(reply_lost)
        run.fault_window(fault, start, start + fault.duration_s, target)
        await asyncio.sleep(fault.duration_s)
        (target.resume if pause else target.reconnect)()
        run.record_fault(fault, f"{detail} {'resumed' if pause else 'reconnected'}")
    elif fault.kind == "slow":
        delay_s = float(fault.settings["delay_ms"]) / 1000
        run.record_fault(fault, f"{detail} hears the store {delay_s * 1000:.0f} ms late")
        target.slow_down(delay_s)
        run.fault_window(fault, start, start + fault.duration_s, target)
        await asyncio.sleep(fault.duration_s)
        target.speed_up(delay_s)
        run.record_fault(fault, f"{detail} hears the store at once again")
    elif fault.kind == "skew":
        target.clock.offset_ms += float(fault.settings["offset_ms"])
        await target.clock_changed()
        run.record_fault(fault, f"{detail} clock jumps {fault.settings['offset_ms']} ms")
        run.fault_window(fault, start, start, target)
    elif fault.kind == "drift":
        target.clock.set_drift(float(fault.settings["drift"]))
        await target.clock_changed()
        run.record_fault(fault, f"{detail} clock drifts {float(fault.settings['drift']):+g}")
        run.fault_window(fault, start, start, target)
    elif fault.kind == "late":
        delay = float(fault.settings["delay_ms"])
        target.clock.offset_ms -= delay
        await target.clock_changed()
        run.record_fault(fault, f"{detail} claims {delay:.0f} ms late")
        run.fault_window(fault, start, start + fault.duration_s, target)
        await asyncio.sleep(fault.duration_s)
        target.clock.offset_ms += delay
        await target.clock_changed()
        run.record_fault(fault, f"{detail} back on time")
    elif fault.kind == "manual":
        job = str(fault.settings["job"])
        reason = target.cannot_run_now()
        if reason is not None:
            run.record_fault(fault, f"{detail} is {reason}: no manual run of {job}")
            return
        run.record_fault(fault, f"{detail} runs {job} now")
        run.fault_window(fault, start, start, target)
        error = await target.run_now(job)
        if error is not None:  # the claim's failure (or unknown outcome) is in the history already
            run.record_fault(fault, f"{detail}'s manual run of {job} failed: {error}")
    else:
        raise ValueError(f"fault {fault.kind!r} does not strike an instance")
