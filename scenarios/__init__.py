"""Scenario files (TOML) and their pytest collection: `pytest -m scenarios`."""
