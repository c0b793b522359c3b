from __future__ import annotations

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
