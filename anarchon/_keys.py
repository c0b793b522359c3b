"""Every key name anarchon uses, built in one place (the layout of the store format below).

lease:      {<prefix><job>}:state | :active | :slots | :runs | :results   (one hash tag per job, for Cluster)
claim-only: <prefix><job>:runs | :manual | :results
all:        <prefix>format
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from ._errors import ConfigError, ConfigTypeError

STORE_FORMAT = 1
"""The store layout this version writes and reads. A store holding a larger number is refused."""

# Braces would move the hash tag, ':' would blur the key layout, whitespace and control characters make keys
# unreadable in tools. What is left covers identifiers, dotted and dashed names and paths.
_JOB_NAME = re.compile(r"[A-Za-z0-9_.\-/@+=]{1,200}")
_PREFIX = re.compile(r"[A-Za-z0-9_.\-/@+=:]{0,100}")

JOB_NAME_RULE = "1 to 200 characters from A-Z a-z 0-9 _ . - / @ + = (no braces, colons, spaces or newlines)"
PREFIX_RULE = "up to 100 characters from A-Z a-z 0-9 _ . - / @ + = : (no braces, spaces or newlines)"


def check_job_name(name: object, option: str = "name") -> str:
    """A job name (or an instance id, which goes into the same records) that keeps the key layout intact."""
    return _check(option, name, _JOB_NAME, JOB_NAME_RULE)


def check_prefix(prefix: object) -> str:
    return _check("prefix", prefix, _PREFIX, PREFIX_RULE)


def _check(option: str, value: object, pattern: re.Pattern[str], rule: str) -> str:
    if not isinstance(value, str):
        raise ConfigTypeError(option, f"must be a string, got {type(value).__name__}", rule)
    if not pattern.fullmatch(value):
        shown = value if len(value) <= 40 else value[:40] + "…"
        raise ConfigError(option, f"{shown!r} would break the key layout", rule)
    return value


@dataclass(frozen=True, slots=True)
class LeaseKeys:
    """The five keys of one job under the lease strategy, in the order the Lua scripts take them."""

    state: str
    active: str
    slots: str
    runs: str
    results: str

    def all(self) -> tuple[str, str, str, str, str]:
        return (self.state, self.active, self.slots, self.runs, self.results)


@dataclass(frozen=True, slots=True)
class ClaimKeys:
    """The three keys of one job under a claim-only strategy."""

    runs: str
    manual: str
    results: str

    def all(self) -> tuple[str, str, str]:
        return (self.runs, self.manual, self.results)


@dataclass(frozen=True, slots=True)
class KeySpace:
    prefix: str = "cron:"

    @property
    def format(self) -> str:
        return f"{self.prefix}format"

    def lease(self, job: str) -> LeaseKeys:
        return _lease_keys(self.prefix, job)

    def claim(self, job: str) -> ClaimKeys:
        return _kept_claim_keys(self.prefix, job)

    def claim_unkept(self, job: str) -> ClaimKeys:
        """claim()'s keys, not kept for the next call: a lease scheduler's look at the claim-only keys of its jobs
        (see RedisBackend.start) must not keep a second set of keys for each job."""
        return _claim_keys(self.prefix, job)


def _lease_keys(prefix: str, job: str) -> LeaseKeys:
    tag = f"{{{prefix}{job}}}"
    return LeaseKeys(f"{tag}:state", f"{tag}:active", f"{tag}:slots", f"{tag}:runs", f"{tag}:results")


def _claim_keys(prefix: str, job: str) -> ClaimKeys:
    base = f"{prefix}{job}"
    return ClaimKeys(f"{base}:runs", f"{base}:manual", f"{base}:results")


# Built once per job: every claim of a burst asks for them.
_kept_claim_keys = functools.lru_cache(maxsize=65_536)(_claim_keys)
