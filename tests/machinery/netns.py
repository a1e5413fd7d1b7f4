"""Simulated hosts for tests (namespaces.py), or a skip that says why not.

Building network namespaces needs root and iproute2; where that is not permitted the tests that
need several hosts are skipped with the one-line reason, and run everywhere else (CI runs as root)."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Mapping, Sequence

import pytest

from tests.machinery.namespaces import SimulatedHosts, unavailable
from tests.machinery.warm_launcher import REPO_ROOT
from torchtitan.tools.runs import raise_for_exit

RDZV_PORT = 29741


def simulated_hosts(n: int):
    """A generator for a fixture: `n` hosts, removed afterwards."""
    reason = unavailable()
    if reason:
        pytest.skip(f"{n} simulated hosts cannot be built here: {reason}")
    with SimulatedHosts(n) as hosts:
        yield hosts


def run_on_hosts(hosts: SimulatedHosts, args: Sequence[str], nproc: int, timeout: float = 400,
                 extra_env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """run_llama_train.sh on every host, nproc / n ranks each, as nodes of one job; returns host 0's
    launcher result (with the other hosts' output appended), raising if any launcher failed."""
    env = {"OMP_NUM_THREADS": "1", **(extra_env or {})}
    procs = [hosts.popen(h, ["./run_llama_train.sh", *map(str, args)],
                         hosts.node_env(h, nproc // hosts.n, RDZV_PORT, **env),
                         cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True) for h in range(hosts.n)]
    deadline = time.monotonic() + timeout
    outputs = []
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
    results = [subprocess.CompletedProcess(proc.args, proc.returncode, out, err) for proc, (out, err) in zip(procs, outputs)]
    for result in results:
        raise_for_exit(result)
    return subprocess.CompletedProcess(results[0].args, 0, "".join(r.stdout for r in results),
                                       "".join(r.stderr for r in results))
