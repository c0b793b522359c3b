"""A link between one instance and the store that the testbed can cut, heal, or make lose replies.

It wraps any :class:`anarchon._store.Connection` and is one itself, so a backend built on it behaves exactly as
with a real client until the link is cut: then every command fails as if the network were down.
"""

from __future__ import annotations

from collections.abc import Sequence

from anarchon import StoreUnavailableError
from anarchon._errors import StoreReplyError
from anarchon._store import Command, Connection, Reply, ServerInfo


class Link:
    """A cuttable connection. ``lose_replies`` sends commands but drops their answers (outcome unknown)."""

    def __init__(self, inner: Connection, name: str = "link") -> None:
        self.inner = inner
        self.name = name
        self.cut_off = False
        self.lose_replies = False

    def cut(self) -> None:
        self.cut_off = True

    def heal(self) -> None:
        self.cut_off = False
        self.lose_replies = False

    def _check(self) -> None:
        if self.cut_off:
            raise StoreUnavailableError(f"{self.name}: the link to the store is cut")

    def _lost(self) -> StoreUnavailableError:
        return StoreUnavailableError(f"{self.name}: the reply was lost")

    async def execute(self, command: Command) -> Reply:
        self._check()
        reply = await self.inner.execute(command)
        if self.lose_replies:
            raise self._lost()
        self._check()
        return reply

    async def execute_many(self, commands: Sequence[Command]) -> list[Reply | StoreReplyError]:
        self._check()
        replies = await self.inner.execute_many(commands)
        if self.lose_replies:
            raise self._lost()
        self._check()
        return replies

    async def server_info(self) -> ServerInfo:
        self._check()
        return await self.inner.server_info()

    async def close(self) -> None:
        await self.inner.close()
