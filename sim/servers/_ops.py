"""Small operations on a running server over RESP2: INFO, waits, cluster slots, server options."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import redis

from sim.servers._errors import ServerError
from sim.servers._targets import TargetSpec

CLUSTER_SLOTS = 16384
WAIT_TIMEOUT = 30.0


def command(host: str, port: int, *args: Any) -> Any:
    """Run one command on a fresh RESP2 connection (Redis 5 refuses the HELLO 3 of redis-py's default)."""
    client = redis.Redis(host=host, port=port, protocol=2, socket_connect_timeout=2, socket_timeout=10)
    try:
        return client.execute_command(*args)  # type: ignore[no-untyped-call]
    finally:
        client.close()


def pings(host: str, port: int) -> bool:
    client = redis.Redis(host=host, port=port, protocol=2, socket_connect_timeout=1, socket_timeout=2)
    try:
        return bool(client.ping())
    finally:
        client.close()


def info(host: str, port: int, section: str = "server") -> dict[str, Any]:
    reply = command(host, port, "INFO", section)
    if not isinstance(reply, dict):
        raise ServerError(f"unexpected INFO reply from {host}:{port}: {reply!r}")
    return reply


def reported_version(host: str, port: int) -> str:
    """The server's version from INFO: valkey_version on Valkey (which also reports redis_version 7.2.4)."""
    server = info(host, port, "server")
    return str(server.get("valkey_version") or server["redis_version"])


def wait_until(check: Callable[[], bool], what: str, timeout: float = WAIT_TIMEOUT) -> None:
    """Poll `check` until it is true; ServerError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except redis.RedisError as exc:
            last = exc
        time.sleep(0.05)
    suffix = f" (last error: {last})" if last else ""
    raise ServerError(f"timed out after {timeout:.0f} s waiting for {what}{suffix}")


def wait_replica_link(host: str, port: int, timeout: float = WAIT_TIMEOUT) -> None:
    wait_until(
        lambda: info(host, port, "replication").get("master_link_status") == "up",
        f"master_link_status:up on the replica at {host}:{port}",
        timeout,
    )


def _text(reply: Any) -> str:
    return reply.decode() if isinstance(reply, bytes) else str(reply)


def shard_slots(index: int, shards: int) -> range:
    """The slots of a cluster's primary number `index` of `shards`, as `form_cluster` assigns them."""
    return range(CLUSTER_SLOTS * index // shards, CLUSTER_SLOTS * (index + 1) // shards)


def form_cluster(nodes: Sequence[tuple[str, int]], timeout: float = WAIT_TIMEOUT) -> None:
    """Make fresh cluster nodes one cluster, each owning an equal run of the 16384 slots (CLUSTER ADDSLOTS and
    MEET work on 5.0), and wait until it is formed.

    Each node gets its own config epoch before it meets the others, as `redis-cli --cluster create` does. Nodes that
    meet all at epoch 0 part by collision resolution, a few gossip rounds after the cluster reports ok; a slot
    moved meanwhile (SETSLOT NODE bumps the new owner's epoch) can go to a node whose epoch a collision raised
    above the new owner's, and the nodes then disagree on its owner for good."""
    for index, (host, port) in enumerate(nodes):
        command(host, port, "CLUSTER", "SET-CONFIG-EPOCH", index + 1)
        command(host, port, "CLUSTER", "ADDSLOTS", *shard_slots(index, len(nodes)))
    for host, port in nodes[1:]:
        command(host, port, "CLUSTER", "MEET", *nodes[0])
    wait_cluster_formed(nodes, timeout)


def wait_cluster_formed(nodes: Sequence[tuple[str, int]], timeout: float = WAIT_TIMEOUT) -> None:
    """Wait until every one of the nodes knows all of them and who owns each slot (gossip has spread), and
    reports state ok. (With ``cluster-require-full-coverage no`` a node reports ok before it has heard of the
    other nodes' slots: a client that reads its map then would find slots without an owner.)"""

    def formed(host: str, port: int) -> bool:
        text = _text(command(host, port, "CLUSTER", "INFO"))
        known = f"cluster_known_nodes:{len(nodes)}\r" in text
        return "cluster_state:ok" in text and known and f"cluster_slots_assigned:{CLUSTER_SLOTS}\r" in text

    for host, port in nodes:
        wait_until(
            functools.partial(formed, host, port),
            f"a cluster of {len(nodes)} nodes formed, seen from {host}:{port}",
            timeout,
        )


def join_as_cluster_replica(primary: tuple[str, int], replica: tuple[str, int]) -> None:
    """Cluster nodes refuse REPLICAOF: introduce the replica with CLUSTER MEET, then CLUSTER REPLICATE."""
    primary_id = _text(command(*primary, "CLUSTER", "MYID"))
    command(*replica, "CLUSTER", "MEET", *primary)

    def replicate() -> bool:
        # Answers "Unknown node" until the MEET handshake has made the primary's id known.
        try:
            command(*replica, "CLUSTER", "REPLICATE", primary_id)
        except redis.ResponseError:
            return False
        return True

    wait_until(replicate, f"CLUSTER REPLICATE {primary_id} on {replica[0]}:{replica[1]}")


def base_args(spec: TargetSpec, *, cluster: bool) -> list[str]:
    """Server options every started server gets (besides port, bind, dir and no persistence)."""
    # Diskless replication without delay: a replica syncs at once and no RDB file is written.
    args = ["--repl-diskless-sync", "yes", "--repl-diskless-sync-delay", "0"]
    if spec.debug_command_option:
        args += ["--enable-debug-command", "yes"]  # DEBUG SLEEP and friends, for nemeses (7.0+ default: no)
    if cluster:
        args += [
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-node-timeout",
            "5000",
        ]
    return args
