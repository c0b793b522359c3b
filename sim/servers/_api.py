"""`start_server(target)`: throwaway servers of a target, from local binaries or containers."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import Literal

from sim.servers._docker import docker_engine_answers, docker_host, start_docker
from sim.servers._errors import ServerError
from sim.servers._local import ServerProcess, release_dir, release_port, server_dir, start_process
from sim.servers._ops import (
    base_args,
    form_cluster,
    join_as_cluster_replica,
    reported_version,
    wait_cluster_formed,
    wait_replica_link,
)
from sim.servers._running import Backend, RunningServer
from sim.servers._targets import FAKE, TARGETS, TargetSpec, installed, spec_of

MODE_ENV = "ANARCHON_SERVERS"
Mode = Literal["auto", "local", "docker"]
# A cluster has several primaries, so that keys of different jobs live on different nodes, as in production.
CLUSTER_PRIMARIES = 3


def server_mode() -> Mode:
    """$ANARCHON_SERVERS: `auto` (default), `local` (provisioned binaries only) or `docker`."""
    value = os.environ.get(MODE_ENV, "auto").strip().lower() or "auto"
    if value == "auto":
        return "auto"
    if value == "local":
        return "local"
    if value == "docker":
        return "docker"
    raise ServerError(f"{MODE_ENV}={value!r} is not one of auto, local, docker")


def backend_for(target: str) -> Backend:
    """Where `start_server(target)` takes the server from; ServerError when from nowhere.

    `auto`: the provisioned binary, else a container if a Docker engine answers. `local`: the binary only.
    `docker`: containers only.
    """
    spec_of(target)
    mode = server_mode()
    if mode == "docker":
        if not docker_engine_answers():
            raise ServerError(f"{MODE_ENV}=docker, but no Docker engine answers at {docker_host()}")
        return "docker"
    if installed(target, verify=False) is not None:
        return "local"
    hint = f"provision it with `python -m sim.servers provision {target}`"
    if mode == "local":
        raise ServerError(f"{target} is not provisioned; {hint}")
    if docker_engine_answers():
        return "docker"
    raise ServerError(f"{target} is not provisioned and no Docker engine answers at {docker_host()}; {hint}")


def available_targets() -> tuple[str, ...]:
    """The targets `start_server` can run here (per $ANARCHON_SERVERS), in TARGETS order.

    Raises ServerError when $ANARCHON_SERVERS is invalid, or is `docker` and no Docker engine answers.
    """
    if server_mode() == "docker" and not docker_engine_answers():
        raise ServerError(f"{MODE_ENV}=docker, but no Docker engine answers at {docker_host()}")
    result = []
    for target in TARGETS:
        try:
            backend_for(target)
        except ServerError:
            continue
        result.append(target)
    return tuple(result)


@contextlib.contextmanager
def _start_local(
    spec: TargetSpec, *, replica: bool, cluster: bool, extra_args: Sequence[str], wrapper: Sequence[str]
) -> Iterator[RunningServer]:
    found = installed(spec.name, verify=False)
    if found is None:
        raise ServerError(f"{spec.name} is not provisioned: python -m sim.servers provision {spec.name}")
    root = server_dir(spec.name)
    handles: list[ServerProcess] = []
    try:
        args = [*base_args(spec, cluster=cluster), *extra_args]

        def launch(name: str, more: Sequence[str] = ()) -> ServerProcess:
            handle = start_process(
                target=spec.name,
                binary=found.binary,
                env=found.env(),
                directory=root / name,
                args=[*args, *more],
                cluster_bus=cluster,
                wrapper=wrapper,
            )
            handles.append(handle)
            return handle

        primary = launch("primary")
        shards: tuple[tuple[str, int], ...] = ()
        if cluster:
            others = [launch(f"primary-{index}") for index in range(2, CLUSTER_PRIMARIES + 1)]
            shards = tuple((node.host, node.port) for node in (primary, *others))
            form_cluster(shards)
        version = reported_version(primary.host, primary.port)
        replica_server: RunningServer | None = None
        if replica:
            if cluster:
                second = launch("replica")
                join_as_cluster_replica((primary.host, primary.port), (second.host, second.port))
                wait_cluster_formed((*shards, (second.host, second.port)))  # a failover needs the others' votes
            else:
                # A startup option, not a REPLICAOF command: a restarted replica replicates again.
                second = launch("replica", ["--replicaof", primary.host, str(primary.port)])
            wait_replica_link(second.host, second.port)
            replica_server = RunningServer(
                target=spec.name,
                version=version,
                host=second.host,
                port=second.port,
                cluster=cluster,
                directory=second.directory,
                control=second,
            )
        yield RunningServer(
            target=spec.name,
            version=version,
            host=primary.host,
            port=primary.port,
            replica=replica_server,
            cluster=cluster,
            shards=shards,
            directory=primary.directory,
            control=primary,
        )
    finally:
        for handle in reversed(handles):
            try:
                handle.kill()
            finally:
                release_port(handle.port)
        release_dir(root)


def start_server(
    target: str,
    *,
    replica: bool = False,
    cluster: bool = False,
    extra_args: Sequence[str] = (),
    wrapper: Sequence[str] = (),
) -> contextlib.AbstractContextManager[RunningServer]:
    """Start a throwaway server of `target` on a free loopback port; everything is removed on exit.

    - `replica=True` adds a replica of it (`.replica`), returned once `master_link_status:up`.
    - `cluster=True` makes it the first of a Redis Cluster's three primaries, each owning a third of the 16384
      slots (`.shards`), returned once every node reports `cluster_state:ok`; a replica replicates the first.
    - `extra_args` are appended to the server's command line (e.g. `["--maxmemory", "10mb"]`).
    - `wrapper` is a command the server runs under, which must keep its process id (e.g. `["valgrind",
      "--tool=callgrind"]`); local binaries only.

    No persistence (`save ""`, `appendonly no`), bound to 127.0.0.1. Local binaries come from
    `python -m sim.servers provision`; with $ANARCHON_SERVERS=docker (or `auto` and the binary missing) the
    same versions run as containers where a Docker engine answers.
    """
    if target == FAKE:
        raise ValueError("`fake` is the in-process store (fakeredis.FakeServer); it has no server process")
    spec = spec_of(target)
    if backend_for(target) == "docker":
        if wrapper:
            raise ServerError(f"{target} runs in a container here: a wrapper ({wrapper[0]}) runs local binaries only")
        return start_docker(spec, replica=replica, cluster=cluster, extra_args=extra_args)
    return _start_local(spec, replica=replica, cluster=cluster, extra_args=extra_args, wrapper=wrapper)
