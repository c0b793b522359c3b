"""Strategy settings: the typed shapes users write, and the frozen, validated configs the code reads.

A strategy is a name or a dict ``{"name": …, **settings}``; each strategy's settings live inside it, so a setting
of another strategy is a type error (TypedDict) and, at runtime, an :class:`UnknownOptionError`.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal, Required, TypeAlias, TypedDict

from ._errors import ConfigError, ConfigTypeError, UnknownOptionError

StrategyName: TypeAlias = Literal["lease", "stream-id", "idmp", "script"]
STRATEGY_NAMES: Final = ("lease", "stream-id", "idmp", "script")
VALKEY_STRATEGY_NAMES: Final = ("lease", "stream-id", "script")


class LeaseSettings(TypedDict):
    name: Literal["lease"]


class StreamIdSettings(TypedDict):
    name: Literal["stream-id"]


class IdmpSettings(TypedDict, total=False):
    name: Required[Literal["idmp"]]
    duration_sec: int
    max_size: int


class ScriptSettings(TypedDict, total=False):
    name: Required[Literal["script"]]
    window_ms: int


LeaseStrategy: TypeAlias = Literal["lease"] | LeaseSettings
"""Strategies that give the scheduler leases (only ``lease``)."""

ClaimOnlyStrategy: TypeAlias = Literal["stream-id", "idmp", "script"] | StreamIdSettings | IdmpSettings | ScriptSettings
"""Strategies that only decide who runs each slot, on any server they support."""

ValkeyClaimOnlyStrategy: TypeAlias = Literal["stream-id", "script"] | StreamIdSettings | ScriptSettings
"""Claim-only strategies that Valkey supports (no ``idmp``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LeaseConfig:
    name: Literal["lease"] = "lease"

    @property
    def leases(self) -> bool:
        return True


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamIdConfig:
    name: Literal["stream-id"] = "stream-id"

    @property
    def leases(self) -> bool:
        return False


# The longest an idmp stream may be set to remember a run (IDMP-DURATION), by any deploy.
IDMP_MAX_DURATION_S: Final = 86_400


@dataclass(frozen=True, slots=True, kw_only=True)
class IdmpConfig:
    name: Literal["idmp"] = "idmp"
    duration_sec: int = 300
    max_size: int = 1000

    def __post_init__(self) -> None:
        check_int("strategy.duration_sec", self.duration_sec, 1, IDMP_MAX_DURATION_S)
        check_int("strategy.max_size", self.max_size, 1, 10_000)

    @property
    def leases(self) -> bool:
        return False


@dataclass(frozen=True, slots=True, kw_only=True)
class ScriptConfig:
    name: Literal["script"] = "script"
    window_ms: int = 300_000

    def __post_init__(self) -> None:
        check_int("strategy.window_ms", self.window_ms, 1, 365 * 86_400_000)

    @property
    def leases(self) -> bool:
        return False


StrategyConfig: TypeAlias = LeaseConfig | StreamIdConfig | IdmpConfig | ScriptConfig

_CONFIGS: Final[dict[str, type[StrategyConfig]]] = {
    "lease": LeaseConfig,
    "stream-id": StreamIdConfig,
    "idmp": IdmpConfig,
    "script": ScriptConfig,
}
_SETTINGS: Final[dict[str, tuple[str, ...]]] = {
    "lease": (),
    "stream-id": (),
    "idmp": ("duration_sec", "max_size"),
    "script": ("window_ms",),
}


def parse_strategy(value: object, allowed: tuple[str, ...], backend: str) -> StrategyConfig:
    """Turn a strategy option (name or dict) into its frozen config, refusing anything ``allowed`` lacks."""
    allowed_text = " | ".join(repr(n) for n in allowed) + ', or a dict {"name": …, **settings}'
    if isinstance(value, str):
        name, settings = value, {}
    elif isinstance(value, Mapping):
        if "name" not in value:
            raise ConfigError("strategy", "a strategy dict needs a 'name'", allowed_text)
        name = value["name"]
        settings = {k: v for k, v in value.items() if k != "name"}
    else:
        raise ConfigTypeError("strategy", f"must be a name or a dict, got {type(value).__name__}", allowed_text)
    if not isinstance(name, str) or name not in STRATEGY_NAMES:
        raise ConfigError("strategy", f"unknown strategy {name!r}", allowed_text)
    if name not in allowed:
        raise ConfigError("strategy", f"{name!r} is not available on {backend}", allowed_text)
    for key in settings:
        if key not in _SETTINGS[name]:
            owner = next((n for n, keys in _SETTINGS.items() if key in keys), None)
            hint = f"it is a setting of {owner!r}" if owner else ""
            raise UnknownOptionError(f"strategy.{key}", f"strategy {name!r}", _SETTINGS[name], hint)
    return _CONFIGS[name](**settings)


def is_finite(value: int | float) -> bool:
    """Whether a number is finite as a float: an int too large for one is not (float() would overflow)."""
    return abs(value) <= sys.float_info.max if isinstance(value, int) else math.isfinite(value)


def shown(value: object) -> str:
    """A value for an error message, cut short: a number of 400 digits is not read in full (and one of over 4,300
    digits cannot even be written as text)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    text = repr(value)
    # A string's own length, without the quotes and escapes of its repr
    return text if len(text) <= 24 else f"{text[:20]}… ({len(value if isinstance(value, str) else text)} characters)"


def check_int(option: str, value: object, low: int, high: int, high_is: str = "") -> int:
    """Validate an integer option in ``low..high`` (bools refused) and return it; ``high_is`` says where ``high``
    comes from when another option sets it."""
    allowed = f"{low}..{high}" + (f" ({high} is {high_is})" if high_is else "")
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigTypeError(option, f"must be an integer, got {type(value).__name__}", allowed)
    if not low <= value <= high:
        raise ConfigError(option, f"{shown(value)} is out of range", allowed)
    return value
