"""Drive a strategy on a store under test from synchronous Hypothesis rules, and compare answers with a model.

Every real call is timed with the server's clock: ``TIME`` before (``t0``) and after (``t1``). The model is fed
``t0`` as the server's clock, so answers that count time (lease ms left) may differ by the time a call takes;
rules keep every lease, window and duration either far longer than a test or over by the next call (1 ms ones,
with a sleep in between), and slots that the lease scripts compare with the clock far from each boundary, so no
outcome depends on which side of a boundary the server's clock fell.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Coroutine
from typing import Any, TypeVar

from hypothesis.stateful import RuleBasedStateMachine

from anarchon import RedisBackend
from anarchon._errors import StoreError
from anarchon._strategies import Claim
from tests.anarchon.support import StoreTarget

T = TypeVar("T")
M = TypeVar("M", bound=RuleBasedStateMachine)

SLOT = 1_700_000_000_000  # slots long past: trimming may drop their runs
SETTLE_S = 0.003  # a sleep after which a 1 ms lease or window is over on the server


class Harness:
    """One event loop and one store target for a whole test (every Hypothesis example), so connections are
    opened once; each example works on a job of its own."""

    def __init__(self, server: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self.target = StoreTarget(server)
        self._jobs = itertools.count()
        self._backends: dict[str, RedisBackend[Any]] = {}

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coroutine)

    def backend(self, strategy: Any) -> RedisBackend[Any]:
        """A started backend for this strategy setting (shared by the examples)."""
        key = repr(strategy)
        if key not in self._backends:
            backend = self.target.backend(strategy)
            self.run(backend.start(["sync"]))
            self._backends[key] = backend
        return self._backends[key]

    def new_job(self) -> str:
        return f"job{next(self._jobs)}"

    def timed(self, coroutine: Coroutine[Any, Any, T]) -> tuple[int, T, int]:
        """(server ms before, the result, server ms after)."""

        async def timed() -> tuple[int, T, int]:
            before = await self.target.server_ms()
            result = await coroutine
            return before, result, await self.target.server_ms()

        return self.run(timed())

    def settle(self) -> None:
        self.run(asyncio.sleep(SETTLE_S))

    def close(self) -> None:
        try:
            self.run(self.target.close())
        finally:
            self.loop.close()


def bind(machine: type[M], harness: Harness) -> type[M]:
    """The machine class with the harness its rules use (Hypothesis makes one instance per example)."""
    return type(machine.__name__, (machine,), {"harness": harness})


def one_claim(results: list[Claim | StoreError]) -> Claim:
    [result] = results
    assert isinstance(result, Claim), f"the store failed: {result!r}"
    return result


class FenceMap:
    """Fences come from the server's ms (claim-only strategies: entry ids; lease: where the ms are more than the
    job's last fence + 1): the model's and the store's differ by the time a call takes. They must correspond one to
    one, in the same order."""

    def __init__(self) -> None:
        self.pairs: dict[int, int] = {}

    def check(self, model: int, real: int) -> None:
        if model in self.pairs:
            assert real == self.pairs[model], f"fence {real} where the model's entry had fence {self.pairs[model]}"
            return
        for m, r in self.pairs.items():
            assert (m < model) == (r < real), f"fence {real} out of order (model {model} vs {m} ↔ {r})"
        self.pairs[model] = real


def assert_same_claim(expected: Claim, real: Claim, slack_ms: int, fences: FenceMap | None = None) -> None:
    """Outcome, attempt and whether it gave the run up exactly; the fence exactly, or through ``fences``; lease ms
    left within the slack."""
    assert (real.outcome, real.attempt, real.given_up) == (expected.outcome, expected.attempt, expected.given_up), (
        f"store {real}, model {expected}"
    )
    if fences is not None:
        fences.check(expected.fence, real.fence)
    else:
        assert real.fence == expected.fence, f"store {real}, model {expected}"
    assert abs(real.lease_ms_left - expected.lease_ms_left) <= slack_ms, f"store {real}, model {expected}"
