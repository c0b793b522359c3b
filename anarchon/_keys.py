"""Every key name anarchon uses, built in one place (the layout of the store format below).

lease:      {<prefix><job>}:state | :active | :slots | :runs | :results   (one hash tag per job, for Cluster)
claim-only: <prefix><job>:runs | :manual | :results
all:        <prefix>format
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from ._errors import ConfigError

STORE_FORMAT = 1
"""The store layout this version writes and reads. A store holding a larger number is refused."""

# Braces would move the hash tag, ':' would blur the key layout, whitespace and control characters make keys
# unreadable in tools. What is left covers identifiers, dotted and dashed names and paths.
_JOB_NAME = re.compile(r"[A-Za-z0-9_.\-/@+=]{1,200}")
_PREFIX = re.compile(r"[A-Za-z0-9_.\-/@+=:]{0,100}")

JOB_NAME_RULE = "1 to 200 characters from A-Z a-z 0-9 _ . - / @ + = (no braces, colons, spaces or newlines)"
PREFIX_RULE = "up to 100 characters from A-Z a-z 0-9 _ . - / @ + = : (no braces, spaces or newlines)"


def check_job_name(name: object) -> str:
    if not isinstance(name, str):
        raise ConfigError("name", f"must be a string, got {type(name).__name__}", JOB_NAME_RULE)
    if not _JOB_NAME.fullmatch(name):
        shown = name if len(name) <= 40 else name[:40] + "…"
        raise ConfigError("name", f"{shown!r} would break the key layout", JOB_NAME_RULE)
    return name


def check_prefix(prefix: object) -> str:
    if not isinstance(prefix, str):
        raise ConfigError("prefix", f"must be a string, got {type(prefix).__name__}", PREFIX_RULE)
    if not _PREFIX.fullmatch(prefix):
        shown = prefix if len(prefix) <= 40 else prefix[:40] + "…"
        raise ConfigError("prefix", f"{shown!r} would break the key layout", PREFIX_RULE)
    return prefix


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


@dataclass(frozen=True, slots=True)
class KeySpace:
    prefix: str = "cron:"

    @property
    def format(self) -> str:
        return f"{self.prefix}format"

    def lease(self, job: str) -> LeaseKeys:
        return _lease_keys(self.prefix, job)

    def claim(self, job: str) -> ClaimKeys:
        return _claim_keys(self.prefix, job)


# Built once per job: every claim of a burst asks for them.
@functools.lru_cache(maxsize=65_536)
def _lease_keys(prefix: str, job: str) -> LeaseKeys:
    tag = f"{{{prefix}{job}}}"
    return LeaseKeys(f"{tag}:state", f"{tag}:active", f"{tag}:slots", f"{tag}:runs", f"{tag}:results")


@functools.lru_cache(maxsize=65_536)
def _claim_keys(prefix: str, job: str) -> ClaimKeys:
    base = f"{prefix}{job}"
    return ClaimKeys(f"{base}:runs", f"{base}:manual", f"{base}:results")
