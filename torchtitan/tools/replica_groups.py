"""Fault-tolerant replica groups on one machine, as the tests, scripts/ft_trials.py and
scripts/ft_semi_sync_compare.py run them: a torchft lighthouse on a free port, and several groups
of the trainer launched at once (docs/fault_tolerance.md)."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from torchtitan.tools.runs import Runner, run_trainer


def lighthouse_binary() -> str:
    """torchft's `torchft_lighthouse`, beside this interpreter (a virtual environment) or on PATH."""
    found = Path(sys.executable).with_name("torchft_lighthouse")
    return str(found) if found.exists() else (shutil.which("torchft_lighthouse") or "torchft_lighthouse")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def lighthouse(min_replicas: int, port: int = 0, heartbeat_timeout_ms: int = 2000,
               join_timeout_ms: int = 1000) -> Iterator[str]:
    """Runs a lighthouse (on `port`, or a free one) while the block runs; yields its host:port. A short
    heartbeat timeout lets a dead group leave the quorum in about that time."""
    port = port or free_port()
    proc = subprocess.Popen([lighthouse_binary(), "--min_replicas", str(min_replicas), "--bind", f"[::]:{port}",
                             "--heartbeat_timeout_ms", str(heartbeat_timeout_ms), "--join_timeout_ms",
                             str(join_timeout_ms)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("localhost", port), timeout=1):
                break
            time.sleep(0.1)
        else:
            raise RuntimeError(f"the torchft lighthouse did not open port {port} within 20 s")
        yield f"localhost:{port}"
    finally:
        proc.kill()
        proc.wait()


def run_replica_groups(args: Sequence[str], groups: int, nproc: int = 1, timeout: float = 300,
                       runner: Runner = run_trainer) -> list[subprocess.CompletedProcess[str]]:
    """Trains `groups` replica groups of `nproc` ranks at once, group g with `args` and
    --fault_tolerance.replica_id g; raises the first group's failure after every group has ended."""
    results: list = [None] * groups

    def one(group: int) -> None:
        try:
            results[group] = runner([*args, "--fault_tolerance.replica_id", str(group)], nproc=nproc, timeout=timeout)
        except BaseException as e:  # noqa: BLE001 - raised below, once the other groups have ended
            results[group] = e

    threads = [threading.Thread(target=one, args=(g,)) for g in range(groups)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results
