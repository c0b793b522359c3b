"""Claim strategies: one module each, behind the :class:`Strategy` protocol."""

from __future__ import annotations

from .._config import IdmpConfig, LeaseConfig, ScriptConfig, StrategyConfig, StreamIdConfig
from .._keys import KeySpace
from ._base import Claim, JobPolicy, Outcome, RunRequest, Strategy, run_id
from .idmp import IdmpStrategy
from .lease import LeaseStrategy
from .script import ScriptStrategy
from .stream_id import StreamIdStrategy


def make_strategy(config: StrategyConfig, keys: KeySpace) -> Strategy:
    match config:
        case LeaseConfig():
            return LeaseStrategy(keys)
        case StreamIdConfig():
            return StreamIdStrategy(keys)
        case IdmpConfig(duration_sec=duration_sec, max_size=max_size):
            return IdmpStrategy(keys, duration_sec, max_size)
        case ScriptConfig(window_ms=window_ms):
            return ScriptStrategy(keys, window_ms)


__all__ = ["Claim", "JobPolicy", "Outcome", "RunRequest", "Strategy", "make_strategy", "run_id"]
