"""Errors raised by sim.servers."""

from __future__ import annotations


class ServerError(RuntimeError):
    """A server could not be started, reached or controlled; the message says which and why."""
