"""The README's example app runs as written, against a real server."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from sim.servers.testing import ServerUnderTest

README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_example_app_runs(real_server: ServerUnderTest) -> None:
    example = re.search(r"```python\n(.*?)```", README.read_text(), re.DOTALL)
    assert example is not None
    source = example.group(1)
    assert "redis://localhost:6379/0" in source
    assert "await asyncio.Event().wait()" in source
    source = source.replace("redis://localhost:6379/0", real_server.url())
    source = source.replace("await asyncio.Event().wait()", "await asyncio.sleep(0.2)")
    if real_server.is_valkey:
        source = source.replace("RedisBackend(redis=", "ValkeyBackend(valkey=").replace(
            "from anarchon import RedisBackend,", "from anarchon import ValkeyBackend,"
        )
    done = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "syncing for" in done.stdout
    manual = re.search(r"^ok (\d+)$", done.stdout, re.MULTILINE)  # the manual run's status and duration
    assert manual is not None, done.stdout
    assert int(manual.group(1)) >= 2000  # the job sleeps 2 s
