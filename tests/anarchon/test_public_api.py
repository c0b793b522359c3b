from __future__ import annotations

import pickle

import pytest

import anarchon


def test_all_names_exist_and_are_public() -> None:
    for name in anarchon.__all__:
        assert hasattr(anarchon, name), name
        assert not name.startswith("_")
    assert sorted(anarchon.__all__) == anarchon.__all__


def test_contract_names_are_exported() -> None:
    for name in ("Scheduler", "RedisBackend", "ValkeyBackend", "RunContext", "AnarchonError"):
        assert name in anarchon.__all__


def test_the_wheel_ships_types() -> None:
    from importlib import resources

    assert resources.files("anarchon").joinpath("py.typed").is_file()


@pytest.mark.parametrize(
    "error",
    [
        anarchon.ConfigError("lease_ms", "is 0", "1 or more"),
        anarchon.ConfigTypeError("lease_ms", "has type str", "int"),
        anarchon.UnknownOptionError("windw_ms", "the script strategy", ["window_ms"]),
        anarchon.UnsupportedStrategyError("idmp", "valkey 9.1.2", ["lease", "script"]),
        anarchon.StoreFormatError("cron:format", "9", 1),
        anarchon.StoreReplyError("WRONGTYPE Operation against a key"),
        anarchon.StoreUnavailableError("store unavailable: connection refused"),
        anarchon.JobNotFoundError("nightly", ["hourly"]),
        anarchon.SchedulerStateError("run_now needs a started scheduler"),
    ],
    ids=lambda error: type(error).__name__,
)
def test_errors_cross_processes_whole(error: anarchon.AnarchonError) -> None:
    """An error sent to another process (a task queue's worker, a process pool) is pickled: it arrives as the
    same class, with its message and its fields (the subclasses take fields, not a message, to be made)."""
    arrived = pickle.loads(pickle.dumps(error))
    assert type(arrived) is type(error)
    assert (str(arrived), arrived.code, vars(arrived)) == (str(error), error.code, vars(error))
