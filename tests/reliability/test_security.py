"""Security, live on redis-7 (Debian's build has TLS): ``rediss://`` with a self-signed CA, ACL users with
passwords and key patterns, secrets kept out of logs, reprs and errors, user text kept out of Lua source, and
prefixes kept apart.

The server listens on its plain port (used only by the test itself, as the admin) and on a TLS port that the
schedulers use. The CA and the server certificate (for 127.0.0.1) are made at test time with the openssl CLI.
The ACL users have the least a scheduler needs: reads, writes and scripts on the keys of their prefix, plus INFO
(server detection) and TIME, and nothing of ``@dangerous`` besides INFO.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import subprocess
import traceback
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio

from anarchon import ConfigError, RedisBackend, RunContext, Scheduler, StoreError, StoreReplyError
from anarchon._adapters import adapt
from anarchon._backend import FORMAT
from anarchon._strategies.idmp import IdmpStrategy
from anarchon._strategies.lease import LeaseStrategy
from anarchon._strategies.script import ScriptStrategy
from anarchon._strategies.stream_id import StreamIdStrategy
from sim.servers import start_server
from sim.servers._local import pick_port, release_port
from sim.servers._running import RunningServer
from sim.servers.testing import resolve_selection
from tests.support import Ledger, Recording, eventually, second_from_now

TARGET = "redis-7"
PASSWORDS = {"alice": "s3cr3t-Alice-pw", "bob": "s3cr3t-Bob-pw"}
WRONG_PASSWORD = "wr0ng-Guess-pw"
# alice may touch the keys of prefix "a:", bob those of "b:" (claim-only keys "a:…", lease keys "{a:…}").
ACL_RULES = ["+@read", "+@write", "+@scripting", "+@connection", "-@dangerous", "+info", "+time"]
SCRIPTS = (
    FORMAT,
    *(s for strategy in (LeaseStrategy, StreamIdStrategy, IdmpStrategy, ScriptStrategy) for s in strategy.scripts),
)


@dataclass(frozen=True)
class TlsServer:
    server: RunningServer
    tls_port: int
    ca: Path

    def url(self, user: str, password: str) -> str:
        return f"rediss://{user}:{password}@127.0.0.1:{self.tls_port}/0?ssl_ca_certs={self.ca}"

    def options(self, user: str, password: str) -> dict[str, Any]:
        return {
            "host": "127.0.0.1", "port": self.tls_port, "username": user, "password": password, "ssl": True,
            "ssl_ca_certs": str(self.ca),
        }  # fmt: skip

    def admin(self) -> redis.Redis:
        return self.server.client(socket_timeout=10)


def make_certificates(folder: Path) -> tuple[Path, Path, Path]:
    """A CA, and a server certificate it signed for 127.0.0.1 and localhost (EC keys: quick to make)."""

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True, timeout=60)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=anarchon test CA")
    openssl("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost")
    (folder / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    openssl(
        "x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "server.crt", "-days", "2", "-extfile", "san.ext",
    )  # fmt: skip
    return folder / "ca.crt", folder / "server.crt", folder / "server.key"


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config) -> Iterator[TlsServer]:
    if TARGET not in resolve_selection(pytestconfig.getoption("servers")):
        pytest.skip(f"{TARGET} is not among the selected servers (--servers)")
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command line tool is needed to make the test certificates")
    ca, cert, key = make_certificates(tmp_path_factory.mktemp("tls"))
    tls_port = pick_port()
    tls = ["--tls-port", str(tls_port), "--tls-cert-file", str(cert), "--tls-key-file", str(key)]
    tls += ["--tls-ca-cert-file", str(ca), "--tls-auth-clients", "no"]
    try:
        with start_server(TARGET, extra_args=tls) as server:
            admin = server.client(socket_timeout=10)
            try:
                for user, prefix in (("alice", "a:"), ("bob", "b:")):
                    patterns = [f"~{prefix}*", f"~{{{prefix}*"]
                    admin.execute_command(
                        "ACL", "SETUSER", user, "reset", "on", f">{PASSWORDS[user]}", *patterns, *ACL_RULES
                    )
            finally:
                admin.close()
            yield TlsServer(server, tls_port, ca)
    finally:
        release_port(tls_port)


@pytest.fixture
def secure(tls_server: TlsServer) -> Iterator[TlsServer]:
    admin = tls_server.admin()
    try:
        admin.flushall()
        admin.execute_command("ACL", "LOG", "RESET")
        yield tls_server
    finally:
        admin.close()


def secrets_in(text: str) -> list[str]:
    return [secret for secret in (*PASSWORDS.values(), WRONG_PASSWORD) if secret in text]


def logged_text(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(f"{r.getMessage()} {r.args!r} {r.exc_text or ''}" for r in caplog.records)


@pytest.mark.parametrize("given_as", ["url", "options"])
async def test_tls_and_an_acl_user_schedule_and_run(
    secure: TlsServer, given_as: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    ledger = Ledger()
    password = PASSWORDS["alice"]
    connection: Any = secure.url("alice", password) if given_as == "url" else secure.options("alice", password)
    schedulers = []
    tick = second_from_now(2)  # once: a second that began between two instances would give each its own slot
    for i in range(2):
        scheduler = Scheduler(RedisBackend(redis=connection, prefix="a:"), instance_id=f"i{i}", lease_ms=5_000)
        scheduler.add_job("tick", tick, ledger.job(f"i{i}"))
        scheduler.add_job("sync", "0 0 1 1 *", ledger.job(f"i{i}"))
        schedulers.append(scheduler)
    await asyncio.gather(*(s.start() for s in schedulers))
    try:
        record = await schedulers[0].run_now("sync")
        await eventually(lambda: bool(ledger.of("tick")), 5)
        await asyncio.sleep(0.3)  # a second execution of the slot, were there one
        admin = secure.admin()
        try:
            clients = admin.execute_command("CLIENT", "LIST").decode()
            denied = admin.execute_command("ACL", "LOG")
        finally:
            admin.close()
        history = await schedulers[1].history("tick")
        reprs = [repr(s) for s in schedulers] + [repr(s.backend) for s in schedulers]
    finally:
        await asyncio.gather(*(s.stop() for s in schedulers))
    assert (record.status, record.manual) == ("ok", True)
    assert len(ledger.of("tick")) == 1
    assert [(r.status, r.attempt) for r in history] == [("ok", 1)]
    assert "user=alice" in clients  # the schedulers are connected as alice …
    assert f"laddr=127.0.0.1:{secure.tls_port}" in clients  # … on the TLS port
    assert denied == []  # and alice's rights were enough for everything they did
    assert secrets_in("\n".join(reprs)) == []
    assert secrets_in(logged_text(caplog)) == []


@pytest.mark.parametrize("given_as", ["url", "options"])
async def test_a_wrong_password_is_refused_and_no_password_is_shown(
    secure: TlsServer, given_as: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    connection: Any = (
        secure.url("alice", WRONG_PASSWORD) if given_as == "url" else secure.options("alice", WRONG_PASSWORD)
    )
    scheduler = Scheduler(RedisBackend(redis=connection, prefix="a:"))
    scheduler.add_job("sync", "0 0 1 1 *", Ledger().job("a"))
    with pytest.raises(StoreError) as caught:
        await scheduler.start()
    shown = [str(caught.value), repr(caught.value), "".join(traceback.format_exception(caught.value))]
    shown += [repr(scheduler), repr(scheduler.backend), logged_text(caplog)]
    assert "invalid username-password pair" in str(caught.value)
    assert secrets_in("\n".join(shown)) == []


@pytest.mark.parametrize(
    "url",
    [
        "redis://:abc/defSECRET@cache:6379/0",  # the rest read as the database
        "redis://user:12345/SECRET@cache:6379",
        "redis://:SEC#RET@cache:6379/1",  # the rest read as a fragment, "SEC" as the port
        "rediss://user:SE?CRET@cache:6380",
    ],
)
def test_a_password_not_percent_encoded_is_refused_without_quoting_it(url: str) -> None:
    """A generated password often holds '/', '?' or '#'. Not percent-encoded, it ends the URL's host part early,
    and what follows was read as the port or the database, and quoted in the error: part of the password."""
    with pytest.raises(ConfigError) as refused:
        RedisBackend(redis=url)
    shown = str(refused.value) + "".join(traceback.format_exception(refused.value))
    assert "percent-encoded" in str(refused.value)
    assert not any(part in shown for part in ("SEC", "RET", "abc", "12345"))


@pytest.fixture
async def alice_client(secure: TlsServer) -> AsyncIterator[redis.asyncio.Redis]:
    client = redis.asyncio.Redis(**secure.options("alice", PASSWORDS["alice"]), protocol=2)
    try:
        yield client
    finally:
        await client.aclose()


LUA_LOOKING = (
    "quotes \" and ' ; brackets ]] [[ ]=] [==[ ; comment --[[ ; newline \n carriage return \r\n tab \t"
    " backslash \\ ; nul \x00 ; unicode ✓ ; \" .. redis.call('FLUSHALL') .. \" ; end) return 1 -- ]]"
)


@pytest.mark.parametrize("strategy", ["lease", "script", "stream-id"])
async def test_user_text_reaches_the_store_only_as_arguments_and_comes_back_verbatim(
    secure: TlsServer, alice_client: redis.asyncio.Redis, strategy: str
) -> None:
    admin = secure.admin()
    admin.set("a:sentinel", "still here")
    recording = Recording(adapt(alice_client))
    instance_id = "lua--=@+/.call--"  # Lua-looking, within the characters instance ids allow

    async def fails(run: RunContext) -> None:
        raise RuntimeError(LUA_LOOKING)

    scheduler: Scheduler[Any] = Scheduler(
        RedisBackend(redis=recording, strategy=strategy, prefix="a:"), instance_id=instance_id
    )
    scheduler.add_job("job.with-all_the/allowed@chars+=", "0 0 1 1 *", fails)
    async with scheduler:
        record = await scheduler.run_now("job.with-all_the/allowed@chars+=")
        [stored] = await scheduler.history("job.with-all_the/allowed@chars+=")
    try:
        assert admin.get("a:sentinel") == b"still here"
    finally:
        admin.close()
    expected = f"RuntimeError: {LUA_LOOKING}"
    assert (record.status, record.message) == ("error", expected)
    assert (stored.status, stored.message, stored.runner) == ("error", expected, instance_id)
    # Every script the store ran is one anarchon ships: user text was only ever an argument.
    known = {s.sha for s in SCRIPTS}
    sources = {s.source for s in SCRIPTS}
    for command in recording.sent:
        name = str(command[0]).upper()
        if name == "EVALSHA":
            assert command[1] in known
        elif name == "EVAL":
            assert command[1] in sources
        elif name == "SCRIPT":
            assert command[1] == "LOAD"
            assert command[2] in sources
    arguments = [arg for command in recording.sent for arg in command[1:] if isinstance(arg, str)]
    assert any(json.dumps(expected) in arg or expected in arg for arg in arguments)


async def test_two_prefixes_on_one_store_keep_runs_history_and_manual_runs_apart(secure: TlsServer) -> None:
    ledger = Ledger()
    schedulers: dict[str, Scheduler[Any]] = {}
    tick = second_from_now(2)  # once: both prefixes run the same slot
    for user, prefix in (("alice", "a:"), ("bob", "b:")):
        scheduler = Scheduler(RedisBackend(redis=secure.url(user, PASSWORDS[user]), prefix=prefix), instance_id=user)
        scheduler.add_job("tick", tick, ledger.job(user))
        scheduler.add_job("sync", "0 0 1 1 *", ledger.job(user))
        schedulers[prefix] = scheduler
    await asyncio.gather(*(s.start() for s in schedulers.values()))
    try:
        manual = await schedulers["a:"].run_now("sync")
        await eventually(lambda: len(ledger.of("tick")) == 2, 5)
        sync_history = {p: await s.history("sync") for p, s in schedulers.items()}
        tick_history = {p: await s.history("tick") for p, s in schedulers.items()}
    finally:
        await asyncio.gather(*(s.stop() for s in schedulers.values()))
    admin = secure.admin()
    try:
        keys = sorted(k.decode() for k in admin.keys("*"))
        denied = admin.execute_command("ACL", "LOG")
    finally:
        admin.close()
    # The same slot of the same job name ran once under each prefix: two stores in one.
    assert sorted(e.instance for e in ledger.of("tick")) == ["alice", "bob"]
    assert len({e.slot for e in ledger.of("tick")}) == 1
    assert [r.token for r in sync_history["a:"]] == [manual.token]
    assert sync_history["b:"] == []
    assert [len(tick_history["a:"]), len(tick_history["b:"])] == [1, 1]
    assert all(k.startswith(("a:", "{a:", "b:", "{b:")) for k in keys), keys
    assert denied == []


async def test_an_acl_user_cannot_reach_another_prefix(secure: TlsServer) -> None:
    """alice's key patterns cover prefix "a:" only: a backend of hers on prefix "b:" is refused by the store
    before it writes anything, and so is any command of hers on b's keys."""
    admin = secure.admin()
    admin.set("b:format", "1")
    try:
        trespasser = RedisBackend(redis=secure.url("alice", PASSWORDS["alice"]), prefix="b:")
        with pytest.raises(StoreReplyError) as caught:
            await trespasser.start(["sync"])
        assert caught.value.reply.startswith("NOPERM")
        own = RedisBackend(redis=secure.url("alice", PASSWORDS["alice"]), prefix="a:")
        await own.start(["sync"])
        try:
            for command in (("GET", "b:format"), ("XADD", "{b:sync}:runs", "*", "f", "v"), ("DEL", "b:format")):
                with pytest.raises(StoreReplyError, match=r"^NOPERM"):
                    await own.store.execute(*command)
        finally:
            await own.stop()
        assert sorted(k.decode() for k in admin.keys("*")) == ["a:format", "b:format"]
        assert admin.get("b:format") == b"1"
    finally:
        admin.close()
