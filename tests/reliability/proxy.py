"""A TCP proxy between a client and a real server that can lose one reply, as a dropped connection would.

Armed with a marker (bytes of the command to hit: a script's SHA, ``XADD``), the proxy forwards the first request
that contains it to the server, waits for the server's complete reply, keeps it (so a test can see what the store
decided) and closes both sides instead of forwarding it. The client sees its connection closed after the command
went out: the command ran, its outcome is unknown to the client. Armed to hang, the proxy keeps the connection open
and forwards nothing more on it, as a stale connection whose peer is gone: the client waits until it gives up.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any


class Incomplete(Exception):
    """The buffer does not hold a whole reply yet."""


def parse_reply(data: bytes, start: int = 0) -> tuple[Any, int]:
    """One RESP2 reply from ``data[start:]``: (value, end). Errors come back as ``Exception(text)``."""
    end = data.find(b"\r\n", start)
    if end < 0:
        raise Incomplete
    kind, text, after = data[start : start + 1], data[start + 1 : end].decode(), end + 2
    if kind == b"+":
        return text, after
    if kind == b"-":
        return Exception(text), after
    if kind == b":":
        return int(text), after
    if kind == b"$":
        length = int(text)
        if length < 0:
            return None, after
        if len(data) < after + length + 2:
            raise Incomplete
        return data[after : after + length].decode(), after + length + 2
    if kind == b"*":
        items = []
        for _ in range(int(text)):
            item, after = parse_reply(data, after)
            items.append(item)
        return items, after
    raise ValueError(f"not a RESP2 reply: {data[start : start + 20]!r}")


@dataclass
class LossyProxy:
    """Forwards 127.0.0.1:<port> to the server; :meth:`arm` makes it lose the reply to one command."""

    server_host: str
    server_port: int
    port: int = 0
    lost: list[Any] = field(default_factory=list)  # the replies the client never got, as the server sent them
    _marker: bytes | None = None
    _hang = False
    _listener: asyncio.Server | None = None
    _pumps: set[asyncio.Task[None]] = field(default_factory=set)

    async def start(self) -> LossyProxy:
        self._listener = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._listener.sockets[0].getsockname()[1]
        return self

    def url(self, query: str = "") -> str:
        return f"redis://127.0.0.1:{self.port}/0{query}"

    def arm(self, marker: bytes, *, hang: bool = False) -> None:
        """Lose the reply to the next request that contains ``marker``; with ``hang``, leave its connection open
        and silent instead of closing it."""
        self._marker, self._hang = marker, hang

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
        for pump in list(self._pumps):
            pump.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)
        if self._listener is not None:
            await self._listener.wait_closed()

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        server_reader, server_writer = await asyncio.open_connection(self.server_host, self.server_port)
        dropping = asyncio.Event()  # set once the request whose reply is to be lost has gone to the server
        hang = False

        def close_both() -> None:
            client_writer.close()
            server_writer.close()

        async def upstream() -> None:
            nonlocal hang
            while data := await client_reader.read(65536):
                if self._marker is not None and self._marker in data:
                    self._marker, hang = None, self._hang
                    dropping.set()
                server_writer.write(data)
                await server_writer.drain()
            close_both()

        async def downstream() -> None:
            pending = b""
            while data := await server_reader.read(65536):
                if not dropping.is_set():
                    client_writer.write(data)
                    await client_writer.drain()
                    continue
                pending += data
                try:
                    reply, _ = parse_reply(pending)
                except Incomplete:
                    continue
                self.lost.append(reply)
                if hang:  # silent from now on, until the client closes its end
                    while await server_reader.read(65536):
                        pass
                break
            close_both()

        pumps = [asyncio.ensure_future(upstream()), asyncio.ensure_future(downstream())]
        self._pumps.update(pumps)
        try:
            await asyncio.gather(*pumps, return_exceptions=True)
        finally:
            self._pumps.difference_update(pumps)
            close_both()
            for writer in (client_writer, server_writer):
                with contextlib.suppress(Exception):
                    await writer.wait_closed()
