"""A link between one instance and the store that the testbed can cut, heal, slow down, or make lose replies.

It wraps any :class:`anarchon._store.Connection` and is one itself, so a backend built on it behaves exactly as
with a real client until the link is cut: then every command fails as if the network were down.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

from anarchon import StoreUnavailableError
from anarchon._errors import StoreError, StoreReplyError
from anarchon._store import Command, Connection, Reply, ServerInfo


class NotSent(StoreUnavailableError):
    """The link was cut before the command left: the store never saw it (a failure with a known outcome)."""


class Link:
    """A cuttable connection. ``lose_replies`` sends commands but drops their answers (outcome unknown), and so does
    a cut with ``reply_lost`` for the next command, before the link is cut.

    ``gate``, when given, is awaited before a command leaves and before its reply is handed over: the simulator
    uses it to hold a paused instance's traffic (a reply that arrives during the pause is seen after it).
    ``reply_delay_s``: how long after the store ran a command its reply arrives (0: at once).
    """

    def __init__(
        self, inner: Connection, name: str = "link", gate: Callable[[], Awaitable[None]] | None = None
    ) -> None:
        self.inner = inner
        self.name = name
        self.gate = gate
        self.cut_off = False
        self.lose_replies = False
        self.lose_next_reply = False  # then cut
        self.dead = False
        self.reply_delay_s = 0.0

    def cut(self, *, reply_lost: bool = False) -> None:
        """Cut the link; with ``reply_lost``, after the next command, which reaches the store while its reply is lost
        (a cut while a command is on its way)."""
        if reply_lost and not self.cut_off:
            self.lose_next_reply = True
        else:
            self.cut_off = True

    def kill(self) -> None:
        """The process on this side was killed: cut for good, and no command waits for the gate any more."""
        self.cut_off = self.dead = True

    def heal(self) -> None:
        self.cut_off = False
        self.lose_replies = self.lose_next_reply = False

    def _check(self, *, sent: bool) -> None:
        if self.cut_off:
            error = StoreUnavailableError if sent else NotSent
            raise error(f"{self.name}: the link to the store is cut")

    def _lost(self) -> StoreUnavailableError | None:
        """The error of a reply that is lost (None: it is not)."""
        if self.lose_next_reply:
            self.lose_next_reply, self.cut_off = False, True
        elif not self.lose_replies:
            return None
        return StoreUnavailableError(f"{self.name}: the reply was lost")

    async def _pass(self, *, sent: bool) -> None:
        if sent and self.reply_delay_s and not self.dead:
            await asyncio.sleep(self.reply_delay_s)  # on its way back: the store has run the command
        if self.gate is not None and not self.dead:
            await self.gate()
        self._check(sent=sent)

    async def execute(self, command: Command) -> Reply:
        await self._pass(sent=False)
        try:
            reply = await self.inner.execute(command)
        except StoreReplyError:
            # An error reply (NOSCRIPT, a refused XADD) is a reply like any other: it may be the one lost.
            if (lost := self._lost()) is not None:
                raise lost from None
            await self._pass(sent=True)
            raise
        if (lost := self._lost()) is not None:
            raise lost
        await self._pass(sent=True)
        return reply

    async def execute_many(self, commands: Sequence[Command]) -> list[Reply | StoreError]:
        await self._pass(sent=False)
        replies = await self.inner.execute_many(commands)
        if (lost := self._lost()) is not None:
            raise lost
        await self._pass(sent=True)
        return replies

    async def server_info(self) -> ServerInfo:
        self._check(sent=False)
        return await self.inner.server_info()

    async def close(self) -> None:
        await self.inner.close()
