"""The same targets as containers (testcontainers), for machines where a Docker engine answers.

Kept deliberately small: plain servers and replicas. A cluster node behind a published port would announce its
container address in CLUSTER SLOTS, which clients outside the container cannot reach, so `cluster=True` needs
the local binaries.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator, Sequence
from typing import Any

from sim.servers._errors import ServerError
from sim.servers._local import pick_port, release_port
from sim.servers._ops import base_args, pings, reported_version, wait_replica_link, wait_until
from sim.servers._running import RunningServer
from sim.servers._targets import TargetSpec

CONTAINER_PORT = 6379
DEFAULT_SOCKET = "/var/run/docker.sock"


def docker_host() -> str:
    return os.environ.get("DOCKER_HOST") or f"unix://{DEFAULT_SOCKET}"


def _ping_unix(path: str, timeout: float) -> bool:
    if not os.path.exists(path):
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(path)
            sock.sendall(b"GET /_ping HTTP/1.0\r\nHost: docker\r\n\r\n")
            reply = sock.recv(4096)
        except OSError:
            return False
    return reply.startswith(b"HTTP/") and b" 200 " in reply.split(b"\r\n", 1)[0]


def docker_engine_answers(timeout: float = 3.0) -> bool:
    """Whether a Docker engine answers a ping at $DOCKER_HOST (default: the local socket)."""
    host = docker_host()
    if host.startswith("unix://"):
        return _ping_unix(host.removeprefix("unix://"), timeout)
    try:
        import docker  # type: ignore[import-untyped]
    except ImportError:
        return False
    try:
        client = docker.from_env(timeout=int(timeout))
    except docker.errors.DockerException:
        return False
    try:
        return bool(client.ping())
    except docker.errors.DockerException:
        return False
    finally:
        client.close()


class ContainerControl:
    """`ServerControl` over a container: stop/kill/pause/resume/restart of the container itself."""

    def __init__(self, container: Any, host: str, port: int) -> None:
        self._container = container  # testcontainers DockerContainer
        self._host = host
        self._port = port

    def _wrapped(self) -> Any:
        return self._container.get_wrapped_container()

    @property
    def pid(self) -> int | None:
        return None

    @property
    def running(self) -> bool:
        wrapped = self._wrapped()
        wrapped.reload()
        return bool(wrapped.status == "running")

    def stop(self) -> None:
        self._wrapped().stop(timeout=10)

    def kill(self) -> None:
        self._wrapped().kill()

    def pause(self) -> None:
        self._wrapped().pause()

    def resume(self) -> None:
        self._wrapped().unpause()

    def restart(self) -> None:
        self._wrapped().restart(timeout=10)  # the host port is bound explicitly, so it stays the same
        host, port = self._host, self._port
        wait_until(lambda: pings(host, port), f"PING on restarted container {host}:{port}")


@contextlib.contextmanager
def _container(spec: TargetSpec, args: Sequence[str]) -> Iterator[tuple[Any, str, int]]:
    from testcontainers.core.container import DockerContainer  # imported only when a container is wanted

    binary = "valkey-server" if spec.flavour == "valkey" else "redis-server"
    command = [binary, "--save", "", "--appendonly", "no", *args]
    container = DockerContainer(spec.docker_image).with_command(command)
    published = pick_port()
    container.with_bind_ports(CONTAINER_PORT, published)
    try:
        container.start()
    except Exception as exc:
        release_port(published)
        raise ServerError(f"{spec.name}: could not start container {spec.docker_image}: {exc}") from exc
    try:
        host = container.get_container_host_ip()
        port = int(container.get_exposed_port(CONTAINER_PORT))
        wait_until(lambda: pings(host, port), f"PING on {spec.docker_image} at {host}:{port}")
        yield container, host, port
    finally:
        try:
            container.stop()
        finally:
            release_port(published)


@contextlib.contextmanager
def start_docker(
    spec: TargetSpec, *, replica: bool, cluster: bool, extra_args: Sequence[str]
) -> Iterator[RunningServer]:
    """The container counterpart of the local `start_server`; yields a RunningServer."""
    if cluster:
        raise ServerError(f"{spec.name}: cluster=True needs the local binary (see python -m sim.servers)")
    args = [*base_args(spec, cluster=False), *extra_args]
    with _container(spec, args) as (primary, host, port), contextlib.ExitStack() as stack:
        version = reported_version(host, port)
        replica_server = None
        if replica:
            # Containers reach each other on the bridge network, not through the published ports.
            primary_ip = primary.get_docker_client().bridge_ip(primary.get_container_id())
            more = ["--replicaof", primary_ip, str(CONTAINER_PORT)]
            second, r_host, r_port = stack.enter_context(_container(spec, [*args, *more]))
            wait_replica_link(r_host, r_port)
            replica_server = RunningServer(
                target=spec.name,
                version=version,
                host=r_host,
                port=r_port,
                backend="docker",
                control=ContainerControl(second, r_host, r_port),
            )
        yield RunningServer(
            target=spec.name,
            version=version,
            host=host,
            port=port,
            replica=replica_server,
            backend="docker",
            control=ContainerControl(primary, host, port),
        )
