"""A link between one instance and the store that the testbed can cut, heal, or make lose replies.

It wraps any :class:`anarchon._store.Connection` and is one itself, so a backend built on it behaves exactly as
with a real client until the link is cut: then every command fails as if the network were down.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from anarchon import StoreUnavailableError
from anarchon._errors import StoreReplyError
from anarchon._store import Command, Connection, Reply, ServerInfo


class Link:
    """A cuttable connection. ``lose_replies`` sends commands but drops their answers (outcome unknown).

    ``gate``, when given, is awaited before a command leaves and before its reply is handed over: the simulator
    uses it to hold a paused instance's traffic (a reply that arrives during the pause is seen after it).
    """

    def __init__(
        self, inner: Connection, name: str = "link", gate: Callable[[], Awaitable[None]] | None = None
    ) -> None:
        self.inner = inner
        self.name = name
        self.gate = gate
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

    async def _pass(self) -> None:
        if self.gate is not None:
            await self.gate()
        self._check()

    async def execute(self, command: Command) -> Reply:
        await self._pass()
        reply = await self.inner.execute(command)
        if self.lose_replies:
            raise self._lost()
        await self._pass()
        return reply

    async def execute_many(self, commands: Sequence[Command]) -> list[Reply | StoreReplyError]:
        await self._pass()
        replies = await self.inner.execute_many(commands)
        if self.lose_replies:
            raise self._lost()
        await self._pass()
        return replies

    async def server_info(self) -> ServerInfo:
        self._check()
        return await self.inner.server_info()

    async def close(self) -> None:
        await self.inner.close()
