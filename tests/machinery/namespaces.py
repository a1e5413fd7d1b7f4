"""Simulated hosts on one machine: Linux network namespaces joined by a switch (a bridge).

Each host is a namespace with its own loopback, its own interface and address, so processes
started in it can only reach the other "hosts" over the switch, as machines on a network would.
Multi-node launches (NNODES=n, a c10d rendezvous at host 0's address) are tested this way without
a second machine. The switch is a bridge in a namespace of its own, so nothing is added to the
machine's own network. Needs root and iproute2's `ip` (and `tc` for a slowed link); `unavailable()`
says why not, in one line. Test machinery (tests/machinery/netns.py gives tests the hosts as a
fixture), also driven by scripts/sim_cluster.py, scripts/restart_trials.py and scripts/ft_trials.py.

    with SimulatedHosts(4) as hosts:
        proc = hosts.popen(0, ["./run_llama_train.sh"], env=hosts.node_env(0, nproc=2, port=29500))

What a cluster does to a host is done to a namespace's processes: `kill_host` SIGKILLs all of
them (the launcher and its ranks: a node lost), `slow_link` puts a token-bucket rate limit on the
host's interface (`tc ... tbf`; this kernel has no `netem` delay), `throttle` caps the CPU time of
the host's processes with a cgroup quota.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

PREFIX = "ttns"
CGROUP_V1_CPU = Path("/sys/fs/cgroup/cpu")
CGROUP_V2 = Path("/sys/fs/cgroup")
CPU_PERIOD_US = 100_000


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable() -> str | None:
    """Why namespaces cannot be built here (None when they can). Tries to install `ip`
    (iproute2) with the system package manager when it is missing and this process is root."""
    if os.geteuid() != 0:
        return "network namespaces need root (this process is not)"
    if shutil.which("ip") is None:
        for cmd in (["apt-get", "install", "-y", "-q", "iproute2"], ["dnf", "install", "-y", "-q", "iproute"],
                    ["apk", "add", "-q", "iproute2"]):
            if shutil.which(cmd[0]):
                subprocess.run(cmd, capture_output=True, timeout=300, check=False)
                break
        if shutil.which("ip") is None:
            return "iproute2's `ip` is not installed and could not be installed"
    probe = f"{PREFIX}probe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"creating a network namespace is not permitted here: {made.stderr.strip()}"
    bridge = _ip("-n", probe, "link", "add", "ttprobebr", "type", "bridge", check=False)
    _ip("netns", "del", probe, check=False)
    if bridge.returncode != 0:
        return f"creating a bridge is not permitted here: {bridge.stderr.strip()}"
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_leftovers() -> None:
    """Deletes namespaces that a killed earlier run of this module left behind (their veths go with
    them): those whose creating process, named in the namespace's name, is gone. Another process's
    hosts, still in use, are left alone."""
    listed = _ip("netns", "list", check=False).stdout.split("\n")
    for line in listed:
        name = line.split(" ")[0]
        owner = re.match(rf"{PREFIX}(\d+)r", name)
        if name.startswith(PREFIX) and "probe" not in name and (owner is None or not _alive(int(owner[1]))):
            _ip("netns", "del", name, check=False)


class SimulatedHosts:
    """`n` network namespaces, hosts 0 .. n-1 on 10.231.<s>.1 .. n, each with a veth into one bridge."""

    def __init__(self, n: int):
        if not 1 <= n <= 200:
            raise ValueError(f"simulated hosts: 1 to 200, not {n}")
        self.n = n
        tag = f"{os.getpid() % 10000}{random.randrange(100)}"
        self.tag = tag
        # The creating process's pid in the name: remove_leftovers() deletes only the hosts of
        # processes that are gone, never those of another run still using its own.
        owner = f"{PREFIX}{os.getpid()}r{random.randrange(10**6)}"
        self.namespaces = [f"{owner}h{i}" for i in range(n)]
        self.switch = f"{owner}sw"
        # At most 15 characters, as Linux requires: tt + 6 digits + h/s + the host's number.
        self.interfaces = [f"tt{tag}h{i}" for i in range(n)]
        self.ports = [f"tt{tag}s{i}" for i in range(n)]  # the switch's end of each host's veth
        subnet = random.randrange(1, 250)
        self.addresses = [f"10.231.{subnet}.{i + 1}" for i in range(n)]
        self.cgroups: dict[int, Path] = {}

    def __enter__(self) -> SimulatedHosts:
        remove_leftovers()
        bridge = f"tt{self.tag}br"
        try:
            _ip("netns", "add", self.switch)
            _ip("-n", self.switch, "link", "add", bridge, "type", "bridge")
            _ip("-n", self.switch, "link", "set", bridge, "up")
            for ns, ifname, port, addr in zip(self.namespaces, self.interfaces, self.ports, self.addresses):
                _ip("netns", "add", ns)
                _ip("link", "add", ifname, "type", "veth", "peer", "name", port)
                _ip("link", "set", ifname, "netns", ns)
                _ip("link", "set", port, "netns", self.switch)
                _ip("-n", self.switch, "link", "set", port, "master", bridge)
                _ip("-n", self.switch, "link", "set", port, "up")
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", ifname)
                _ip("-n", ns, "link", "set", ifname, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except subprocess.CalledProcessError as e:
            self.__exit__(None, None, None)
            raise RuntimeError(f"could not build {self.n} network namespaces: {' '.join(e.cmd)}: "
                               f"{e.stderr.strip()}") from e
        return self

    def __exit__(self, *exc) -> None:
        for host in range(self.n):
            self.kill_host(host)
        for ns in (*self.namespaces, self.switch):
            _ip("netns", "del", ns, check=False)
        for folder in self.cgroups.values():
            try:
                folder.rmdir()
            except OSError:
                pass

    def node_env(self, host: int, nproc: int, port: int, base: Mapping[str, str] | None = None,
                 **extra: str) -> dict[str, str]:
        """The launcher's environment for `host` as node `host` of an n-node job (RDZV at host 0)."""
        env = dict(os.environ if base is None else base)
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHTITAN_REPORT_DIR", "TORCHELASTIC_RESTART_COUNT"):
            env.pop(name, None)
        env.update(NNODES=str(self.n), NODE_RANK=str(host), RDZV_ENDPOINT=f"{self.addresses[0]}:{port}",
                   NGPU=str(nproc), LOCAL_ADDR=self.addresses[host], GLOO_SOCKET_IFNAME=self.interfaces[host], **extra)
        return env

    def popen(self, host: int, cmd: Sequence[str], env: Mapping[str, str], cwd: str | os.PathLike | None = None,
              **kwargs) -> subprocess.Popen:
        """Starts `cmd` inside host `host`'s namespace."""
        return subprocess.Popen(["ip", "netns", "exec", self.namespaces[host], *cmd], env=dict(env), cwd=cwd, **kwargs)

    def pids(self, host: int) -> list[int]:
        """Every process running in host `host`'s namespace."""
        listed = _ip("netns", "pids", self.namespaces[host], check=False).stdout.split()
        return [int(p) for p in listed if p.isdigit()]

    def kill_host(self, host: int) -> list[int]:
        """SIGKILLs every process of host `host` at once, as a node that loses power; returns their pids."""
        pids = self.pids(host)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids

    def slow_link(self, host: int, mbit: float) -> None:
        """Limits host `host`'s outgoing traffic to `mbit` Mbit/s (a token bucket on its interface)."""
        subprocess.run(["ip", "netns", "exec", self.namespaces[host], "tc", "qdisc", "replace", "dev",
                        self.interfaces[host], "root", "tbf", "rate", f"{mbit}mbit", "burst", "16kb",
                        "limit", "64mb"], check=True, capture_output=True, text=True, timeout=30)

    def throttle(self, host: int, cpus: float) -> None:
        """Caps the CPU time of host `host`'s processes (those running now, and their future
        children) at `cpus` cores, with a cgroup CPU quota (v1 `cpu.cfs_quota_us` or v2 `cpu.max`)."""
        quota = max(1000, int(cpus * CPU_PERIOD_US))
        name = f"{self.namespaces[host]}"
        if (CGROUP_V1_CPU / "cpu.cfs_quota_us").exists():
            folder = CGROUP_V1_CPU / name
            folder.mkdir(exist_ok=True)
            (folder / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
            (folder / "cpu.cfs_quota_us").write_text(str(quota))
        elif (CGROUP_V2 / "cgroup.controllers").exists():
            folder = CGROUP_V2 / name
            folder.mkdir(exist_ok=True)
            (folder / "cpu.max").write_text(f"{quota} {CPU_PERIOD_US}")
        else:
            raise RuntimeError("no cgroup CPU controller to throttle a host with (/sys/fs/cgroup)")
        self.cgroups[host] = folder
        for pid in self.pids(host):
            try:
                (folder / "cgroup.procs").write_text(str(pid))
            except OSError:  # the process ended meanwhile
                pass


class TwoHosts(SimulatedHosts):
    """Two simulated hosts, the shape the two-host tests and trials use."""

    def __init__(self):
        super().__init__(2)
