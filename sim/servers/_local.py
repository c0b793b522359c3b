"""One server process from a provisioned binary: start, stop, kill, pause, resume, restart.

Each process runs in its own session (so its process group holds the fork children Redis makes for replication
and saves) and is signalled as a group. Three layers make sure nothing outlives its owner: the context manager
in `_api`, an atexit hook over every process still registered here, and (when started from the main thread)
`setpriv --pdeathsig KILL`, which makes the kernel kill the server if the Python process dies without cleanup.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import fcntl
import os
import queue
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import redis

from sim.servers._errors import ServerError
from sim.servers._ops import info

T = TypeVar("T")

HOST = "127.0.0.1"
READY_TIMEOUT = 30.0
STOP_TIMEOUT = 10.0
_BIND_ERRORS = ("Address already in use", "Could not create server TCP listening socket")

_live_lock = threading.Lock()
_live: dict[int, ServerProcess] = {}  # id(handle) -> handle, for the atexit hook
_live_dirs: set[Path] = set()  # temporary folders to delete at exit if their owner did not


def _port_range() -> tuple[int, int]:
    """Ports below the kernel's ephemeral range.

    Outgoing connections take their local port from the ephemeral range; picking servers' ports below it
    means a killed server's port cannot be taken by some client socket before the server restarts on it.
    The cluster bus listens on port + 10000, so the range leaves room for that too.
    """
    low = 32768
    with contextlib.suppress(OSError, ValueError, IndexError):
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    high = min(low, 65536) - 10000
    return (10000, high) if high - 10000 >= 1000 else (20000, 30000)


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((HOST, port))
        except OSError:
            return False
    return True


class _PortBook:
    """Ports held for servers of this process, from the moment they are picked until `release_port`.

    A killed or stopped server frees its port, and its port stays free until the server starts again. Another
    process picking a port meanwhile (another test worker) must not start a server there: a cluster client would
    reconnect to that stranger and send it the lost node's commands. Each held port is a POSIX lock on one byte
    (at the port's offset) of a file every process on the machine shares; the kernel drops a process's locks
    when it exits, however it exits. POSIX locks do not exclude their own process, hence the map beside them.
    """

    def __init__(self, path: Path) -> None:
        self._path = path
        self._fd: int | None = None  # opened once: closing any descriptor of the file drops all our locks
        self._held: dict[int, tuple[int, ...]] = {}  # a server's port -> every port held for it
        self._lock = threading.Lock()

    def take(self, ports: tuple[int, ...]) -> bool:
        """Hold all of `ports` for the server on `ports[0]`, or none of them if anyone holds one already."""
        with self._lock:
            held = {each for group in self._held.values() for each in group}
            if held.intersection(ports):
                return False
            if self._fd is None:
                self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o666)
                with contextlib.suppress(OSError):  # every user's runs share it; the umask took bits away
                    os.fchmod(self._fd, 0o666)
            taken: list[int] = []
            for port in ports:
                try:
                    fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, port)
                except OSError:
                    self._unlock(taken)
                    return False
                taken.append(port)
            self._held[ports[0]] = ports
            return True

    def give_back(self, port: int) -> None:
        """Release every port held for the server on `port`."""
        with self._lock:
            self._unlock(self._held.pop(port, ()))

    def _unlock(self, ports: Sequence[int]) -> None:
        assert self._fd is not None
        for port in ports:
            fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, port)


_ports = _PortBook(Path(tempfile.gettempdir()) / "anarchon-ports.lock")


def pick_port(*, cluster_bus: bool = False, rng: random.Random | None = None) -> int:
    """A loopback port that is free now (and port + 10000 too, for a cluster node's bus), held for this process
    until `release_port`: other processes that pick ports here skip it even while its server is down."""
    chooser = rng or random.SystemRandom()
    low, high = _port_range()
    for _ in range(200):
        port = chooser.randrange(low, high)
        wanted = (port, port + 10000) if cluster_bus else (port,)
        if not _ports.take(wanted):
            continue
        if all(_bindable(each) for each in wanted):
            return port
        _ports.give_back(port)
    raise ServerError(f"no free loopback port found in {low}..{high}")


def release_port(port: int) -> None:
    """Let other servers have `port` (and its cluster bus port) again, once its server is gone for good."""
    _ports.give_back(port)


def pdeathsig_prefix(signal_name: str = "KILL") -> list[str]:
    """A command prefix that has the kernel send the child ``signal_name`` when its parent dies without cleaning
    up (where setpriv exists). PR_SET_PDEATHSIG fires when the *thread* that forked the child ends: servers are
    started by _launch's."""
    setpriv = shutil.which("setpriv")
    return [] if setpriv is None else [setpriv, "--pdeathsig", signal_name, "--"]


class _Launcher:
    """Starts server processes from one daemon thread that lasts as long as the process. A server's parent-death
    signal fires when the thread that started it ends: started from a short-lived thread (a restart sent to
    asyncio.to_thread), it would outlive a test process that was killed, or die when that thread ended."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._work: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = queue.SimpleQueue()

    def run(self, start: Callable[[], T]) -> T:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():  # also in a process forked from this one
                self._work = queue.SimpleQueue()
                self._thread = threading.Thread(target=self._serve, args=(self._work,), name="server-launcher",
                                                daemon=True)  # fmt: skip
                self._thread.start()
            done: concurrent.futures.Future[T] = concurrent.futures.Future()
            self._work.put((start, done))
        return done.result()

    @staticmethod
    def _serve(work: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]]) -> None:
        while True:
            start, done = work.get()
            try:
                done.set_result(start())
            except BaseException as error:  # handed to the caller, in its thread
                done.set_exception(error)


_launch = _Launcher()


class ServerProcess:
    """One server process on a fixed port and folder; can be stopped, killed, paused and started again."""

    def __init__(
        self,
        *,
        target: str,
        binary: Path,
        env: dict[str, str],
        directory: Path,
        port: int,
        args: Sequence[str],
        wrapper: Sequence[str] = (),
    ) -> None:
        self.target = target
        self.binary = binary
        self.env = env
        self.directory = directory
        self.host = HOST
        self.port = port
        self.args = tuple(args)
        self.wrapper = tuple(wrapper)
        self._proc: subprocess.Popen[bytes] | None = None
        self._paused = False

    # --- state --------------------------------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        """The server's pid while it runs (None once stopped or killed)."""
        proc = self._proc
        return proc.pid if proc is not None and proc.returncode is None else None

    @property
    def running(self) -> bool:
        return not self._leader_exited()

    @property
    def log_path(self) -> Path:
        return self.directory / "server.log"

    def log_tail(self, lines: int = 20) -> str:
        chunks = []
        for path in (self.log_path, self.directory / "stdout.log"):
            try:
                chunks.append(path.read_text(errors="replace"))
            except OSError:
                continue
        return "\n".join("\n".join(chunks).strip().splitlines()[-lines:])

    def command(self) -> list[str]:
        return [
            *self.wrapper,
            str(self.binary),
            "--port",
            str(self.port),
            "--bind",
            self.host,
            "--dir",
            str(self.directory),
            "--logfile",
            str(self.log_path),
            "--daemonize",
            "no",
            "--save",
            "",
            "--appendonly",
            "no",
            *self.args,
        ]

    # --- lifecycle ----------------------------------------------------------------------------------------

    def start(self, *, timeout: float = READY_TIMEOUT) -> None:
        """Start the process and wait until it answers. ServerError; BindError when the port is taken."""
        if self.running:
            raise ServerError(f"{self.target} on port {self.port} is already running")
        self.directory.mkdir(parents=True, exist_ok=True)
        with (self.directory / "stdout.log").open("ab") as stdout:
            proc = _launch.run(
                lambda: subprocess.Popen(
                    [*pdeathsig_prefix(), *self.command()],
                    cwd=self.directory,
                    env=self.env,
                    stdin=subprocess.DEVNULL,
                    stdout=stdout,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        self._proc = proc
        self._paused = False
        with _live_lock:
            _live[id(self)] = self
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.kill()
            raise

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            proc = self._proc
            if proc is None or proc.poll() is not None:
                code = None if proc is None else proc.returncode
                tail = self.log_tail()
                error = BindError if any(marker in tail for marker in _BIND_ERRORS) else ServerError
                raise error(f"{self.target} exited (code {code}) while starting on port {self.port}:\n{tail}")
            try:
                # The pid tells our server from another one that took the port meanwhile.
                if info(self.host, self.port, "server").get("process_id") == proc.pid:
                    return
            except redis.RedisError as exc:
                last_error = exc
            time.sleep(0.02)
        raise ServerError(
            f"{self.target} on port {self.port} did not answer within {timeout:.0f} s "
            f"(last error: {last_error}):\n{self.log_tail()}"
        )

    def _signal(self, sig: signal.Signals) -> None:
        proc = self._proc
        # Only while the leader is not reaped: its pid (the group id) cannot have been reused yet.
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)

    def _leader_exited(self) -> bool:
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return True
        # Look without reaping, so the group id stays reserved until the group is cleaned up.
        try:
            status = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # reaped elsewhere
            return True
        return status is not None and status.si_pid == proc.pid

    def _reap(self) -> None:
        proc = self._proc
        if proc is not None:
            self._signal(signal.SIGKILL)  # leftover fork children of the group
            proc.wait()
        with _live_lock:
            _live.pop(id(self), None)
        self._paused = False

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """Graceful shutdown (SIGTERM; SIGKILL after `timeout`). Data is lost: persistence is off."""
        if self._proc is None or self._proc.returncode is not None:
            return
        if self._paused:
            self._signal(signal.SIGCONT)
        self._signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while not self._leader_exited() and time.monotonic() < deadline:
            time.sleep(0.01)
        self._reap()

    def kill(self) -> None:
        """SIGKILL the whole process group (a crash)."""
        if self._proc is None or self._proc.returncode is not None:
            with _live_lock:
                _live.pop(id(self), None)
            return
        self._signal(signal.SIGKILL)
        self._reap()

    def pause(self) -> None:
        """SIGSTOP the process group: the server keeps its connections but stops answering."""
        if not self.running:
            raise ServerError(f"{self.target} on port {self.port} is not running")
        self._signal(signal.SIGSTOP)
        self._paused = True

    def resume(self) -> None:
        """SIGCONT after `pause()`."""
        self._signal(signal.SIGCONT)
        self._paused = False

    def restart(self, *, timeout: float = READY_TIMEOUT) -> None:
        """Stop (gracefully, if running), start again on the same port and folder with an empty dataset."""
        self.stop()
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.start(timeout=max(1.0, deadline - time.monotonic()))
                return
            except BindError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.2)


class BindError(ServerError):
    """The server could not listen on its port (taken by someone else in the meantime)."""


def start_process(
    *,
    target: str,
    binary: Path,
    env: dict[str, str],
    directory: Path,
    args: Sequence[str],
    cluster_bus: bool = False,
    attempts: int = 8,
    wrapper: Sequence[str] = (),
) -> ServerProcess:
    """Start a server on a fresh free port, picking another port when the chosen one is taken meanwhile."""
    last: BindError | None = None
    for _ in range(attempts):
        handle = ServerProcess(
            target=target,
            binary=binary,
            env=env,
            directory=directory,
            port=pick_port(cluster_bus=cluster_bus),
            args=args,
            wrapper=wrapper,
        )
        try:
            handle.start()
        except BindError as exc:
            last = exc
            release_port(handle.port)
            for stale in ("server.log", "stdout.log", "nodes.conf"):
                (directory / stale).unlink(missing_ok=True)
            continue
        except BaseException:  # no handle to tear down: the port would stay held until this process ends
            release_port(handle.port)
            raise
        return handle
    raise ServerError(f"{target}: could not bind a port after {attempts} attempts: {last}")


def server_dir(target: str) -> Path:
    """A new folder for a target's server files, deleted at exit (see `register_dir`). Its name holds this
    process's id, so that the folder of an owner killed before it could delete it (SIGKILL runs no atexit hook)
    is deleted by the next process that starts a server here."""
    for orphan in Path(tempfile.gettempdir()).glob("anarchon-*-pid*-*"):
        owner = orphan.name.rsplit("-", 2)[1].removeprefix("pid")
        if owner.isdigit() and not process_exists(int(owner)):
            shutil.rmtree(orphan, ignore_errors=True)
    path = Path(tempfile.mkdtemp(prefix=f"anarchon-{target}-pid{os.getpid()}-"))
    register_dir(path)
    return path


def process_exists(pid: int) -> bool:
    """Whether a process of that id exists (a zombie too), this user's or another's."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        pass
    return True


def register_dir(path: Path) -> None:
    """Delete `path` at interpreter exit unless `release_dir` was called first."""
    with _live_lock:
        _live_dirs.add(path)


def release_dir(path: Path) -> None:
    """Delete `path` now and forget it."""
    shutil.rmtree(path, ignore_errors=True)
    with _live_lock:
        _live_dirs.discard(path)


@atexit.register
def _kill_leftovers() -> None:
    """Last resort: kill every server still running, and delete their folders, when the interpreter exits."""
    with _live_lock:
        handles = list(_live.values())
        dirs = list(_live_dirs)
    for handle in handles:
        with contextlib.suppress(Exception):
            handle.kill()
    for path in dirs:
        shutil.rmtree(path, ignore_errors=True)
