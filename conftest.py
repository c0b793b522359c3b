"""Server matrix for the whole suite.

`--servers=fake,redis-5,redis-7,redis-8.6,valkey-9` chooses the stores (default: `fake` plus every target that
can run here, see `python -m sim.servers list`). Fixtures:

- `server`: a `ServerUnderTest` per selected store (test ids are the target names): a fresh in-process
  FakeServer for `fake`, else the session's server of that target, flushed before the test.
- `real_server`: the same over the selected real targets only.
- `real_target`: the name of each selected real target (for tests that start their own servers).
- `server_pool`: the session's `ServerPool`, for replica and cluster servers
  (`server_pool.get(target, replica=True)`).

Under pytest-xdist every worker runs its own servers on its own ports.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from sim.servers import FAKE
from sim.servers.testing import ServerPool, ServerUnderTest, describe, resolve_selection

_SELECTED: pytest.StashKey[tuple[str, ...]] = pytest.StashKey()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.getgroup("anarchon").addoption(
        "--servers",
        default=None,
        metavar="LIST",
        help="comma list of server targets: fake, redis-5, redis-7, redis-8.6, valkey-9 "
        "(default: fake plus every provisioned target)",
    )


def pytest_configure(config: pytest.Config) -> None:
    try:
        selected: tuple[str, ...] = resolve_selection(config.getoption("servers"))
    except ValueError as exc:
        raise pytest.UsageError(f"cannot choose the server targets: {exc}") from exc
    config.stash[_SELECTED] = selected


def selected_targets(config: pytest.Config) -> tuple[str, ...]:
    return config.stash[_SELECTED]


def pytest_report_header(config: pytest.Config) -> str:
    return describe(selected_targets(config))


def _explicitly_parametrized(metafunc: pytest.Metafunc, name: str) -> bool:
    for marker in metafunc.definition.iter_markers("parametrize"):
        argnames = marker.args[0] if marker.args else marker.kwargs.get("argnames", "")
        names = argnames if isinstance(argnames, list | tuple) else str(argnames).replace(" ", "").split(",")
        if name in names:
            return True
    return False


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    selected = selected_targets(metafunc.config)
    real = tuple(target for target in selected if target != FAKE)
    choices = {"server": selected, "real_server": real, "real_target": real}
    for name, targets in choices.items():
        if name in metafunc.fixturenames and not _explicitly_parametrized(metafunc, name):
            metafunc.parametrize(name, targets, indirect=True, ids=list(targets))


@pytest.fixture(scope="session")
def server_pool() -> Iterator[ServerPool]:
    pool = ServerPool()
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture
async def server(request: pytest.FixtureRequest, server_pool: ServerPool) -> AsyncIterator[ServerUnderTest]:
    target: str = request.param
    under_test = ServerUnderTest.fake() if target == FAKE else server_pool.fresh(target)
    try:
        yield under_test
    finally:
        await under_test.aclose()


@pytest.fixture
async def real_server(
    request: pytest.FixtureRequest,
    server_pool: ServerPool,
) -> AsyncIterator[ServerUnderTest]:
    under_test = server_pool.fresh(request.param)
    try:
        yield under_test
    finally:
        await under_test.aclose()


@pytest.fixture
def real_target(request: pytest.FixtureRequest) -> str:
    target: str = request.param
    return target
