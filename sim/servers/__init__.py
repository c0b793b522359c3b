"""Real Redis and Valkey servers for tests and the live simulator.

Targets: `redis-5` (5.0.x), `redis-7` (7.0.x), `redis-8.6` (8.6.x), `valkey-9` (9.x). `python -m sim.servers
provision` puts their binaries into a cache outside the repository ($ANARCHON_SERVER_CACHE, default
~/.cache/anarchon/servers); `start_server(target)` runs a throwaway one on a free loopback port::

    with start_server("redis-5", replica=True) as server:
        client = server.client()  # RESP2: Redis 5 refuses HELLO 3
        ...
        server.kill(); server.restart()  # outages; server.replica is the replica

With $ANARCHON_SERVERS=docker (or `auto`, the default, when a binary is missing) the same versions run as
containers where a Docker engine answers.
"""

from sim.servers._api import MODE_ENV, available_targets, backend_for, server_mode, start_server
from sim.servers._docker import docker_engine_answers
from sim.servers._errors import ServerError
from sim.servers._local import ServerProcess, pdeathsig_prefix
from sim.servers._provision import ProvisionError, provision
from sim.servers._running import RunningServer, ServerControl
from sim.servers._targets import (
    CACHE_ENV,
    FAKE,
    SPECS,
    TARGETS,
    Installed,
    TargetSpec,
    cache_dir,
    installed,
    provisioned_targets,
    spec_of,
)

__all__ = [
    "CACHE_ENV",
    "FAKE",
    "MODE_ENV",
    "SPECS",
    "TARGETS",
    "Installed",
    "ProvisionError",
    "RunningServer",
    "ServerControl",
    "ServerError",
    "ServerProcess",
    "TargetSpec",
    "available_targets",
    "backend_for",
    "cache_dir",
    "docker_engine_answers",
    "installed",
    "pdeathsig_prefix",
    "provision",
    "provisioned_targets",
    "server_mode",
    "spec_of",
    "start_server",
]
