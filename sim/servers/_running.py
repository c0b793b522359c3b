"""`RunningServer`: what `start_server` yields, and the process control behind it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import redis
import redis.asyncio
from redis.crc import key_slot

from sim.servers._ops import info, shard_slots
from sim.servers._targets import spec_of

Backend = Literal["local", "docker"]


class ServerControl(Protocol):
    """Process control of one server (a local process or a container)."""

    @property
    def pid(self) -> int | None: ...

    @property
    def running(self) -> bool: ...

    def stop(self) -> None: ...

    def kill(self) -> None: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def restart(self) -> None: ...


@dataclass(frozen=True, kw_only=True)
class RunningServer:
    """A server started by `start_server`, valid inside its `with` block."""

    target: str  # "redis-5", "redis-7", "redis-8.6" or "valkey-9"
    version: str  # what INFO reports: redis_version, or valkey_version on Valkey
    host: str
    port: int
    replica: RunningServer | None = None
    cluster: bool = False
    shards: tuple[tuple[str, int], ...] = ()  # a cluster's primaries (host, port), this one first
    backend: Backend = "local"
    directory: Path | None = None  # the server's working folder (log: server.log); None for a container
    control: ServerControl = field(repr=False, compare=False)

    @property
    def pid(self) -> int | None:
        """The current server pid (None for a container, or while stopped)."""
        return self.control.pid

    def shard_of(self, key: str) -> tuple[str, int]:
        """The primary of this cluster that owns `key` (host, port)."""
        slot = key_slot(key.encode())
        [owner] = [node for index, node in enumerate(self.shards) if slot in shard_slots(index, len(self.shards))]
        return owner

    @property
    def version_info(self) -> tuple[int, ...]:
        return tuple(int(part) for part in self.version.split("."))

    @property
    def is_valkey(self) -> bool:
        return spec_of(self.target).flavour == "valkey"

    def url(self, db: int = 0) -> str:
        return f"redis://{self.host}:{self.port}/{db}"

    def client(self, **kwargs: Any) -> redis.Redis:
        """A redis-py client speaking RESP2 (Redis 5 refuses HELLO 3); the caller closes it."""
        kwargs.setdefault("protocol", 2)
        return redis.Redis(host=self.host, port=self.port, **kwargs)

    def async_client(self, **kwargs: Any) -> redis.asyncio.Redis:
        """An asyncio redis-py client speaking RESP2; the caller closes it (`await client.aclose()`)."""
        kwargs.setdefault("protocol", 2)
        return redis.asyncio.Redis(host=self.host, port=self.port, **kwargs)

    def info(self, section: str = "server") -> dict[str, Any]:
        return info(self.host, self.port, section)

    # Process control, for outage and failover tests.
    def stop(self) -> None:
        """Graceful shutdown; the server stays down until `restart()`."""
        self.control.stop()

    def kill(self) -> None:
        """SIGKILL (a crash); the server stays down until `restart()`."""
        self.control.kill()

    def pause(self) -> None:
        """SIGSTOP: connections stay open, nothing is answered until `resume()`."""
        self.control.pause()

    def resume(self) -> None:
        self.control.resume()

    def restart(self) -> None:
        """Start again on the same port with an empty dataset (no persistence); wait until it answers."""
        self.control.restart()
