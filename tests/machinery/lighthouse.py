"""A torchft lighthouse for the fault-tolerance tests, on a free port of this machine."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path


def lighthouse_binary() -> str:
    found = Path(sys.executable).with_name("torchft_lighthouse")
    return str(found) if found.exists() else (shutil.which("torchft_lighthouse") or "torchft_lighthouse")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def lighthouse(min_replicas: int, heartbeat_timeout_ms: int = 2000, join_timeout_ms: int = 1000) -> Iterator[str]:
    """Runs a lighthouse while the block runs; yields its host:port."""
    port = _free_port()
    proc = subprocess.Popen([lighthouse_binary(), "--min_replicas", str(min_replicas), "--bind", f"[::]:{port}",
                             "--heartbeat_timeout_ms", str(heartbeat_timeout_ms), "--join_timeout_ms",
                             str(join_timeout_ms)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("localhost", port), timeout=1):
                break
            time.sleep(0.1)
        yield f"localhost:{port}"
    finally:
        proc.kill()
        proc.wait()
