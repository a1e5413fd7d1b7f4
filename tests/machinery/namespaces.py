"""Two "hosts" on one machine: Linux network namespaces joined by a veth pair.

Each namespace has its own loopback, its own interface and address, so processes started in it
can only reach the other "host" over that link, as two machines on a network would. Multi-node
launches (NNODES=2, a c10d rendezvous at host 0's address) are tested this way without a second
machine. Needs root and iproute2's `ip`; `unavailable()` says why not, in one line. Test machinery
(tests/machinery/netns.py gives tests the hosts as a fixture), also driven by scripts/restart_trials.py.

    with TwoHosts() as hosts:
        proc = hosts.popen(0, ["./run_llama_train.sh"], env=hosts.node_env(0, nproc=2, port=29500))
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
from collections.abc import Mapping, Sequence

PREFIX = "ttns"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable() -> str | None:
    """Why two namespaces cannot be built here (None when they can). Tries to install `ip`
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
    _ip("netns", "del", probe, check=False)
    return None


def remove_leftovers() -> None:
    """Deletes namespaces a killed earlier run of this module left behind (their veths go with them)."""
    listed = _ip("netns", "list", check=False).stdout.split("\n")
    for line in listed:
        name = line.split(" ")[0]
        if name.startswith(PREFIX) and "probe" not in name:
            _ip("netns", "del", name, check=False)


class TwoHosts:
    """Two network namespaces, host 0 and host 1, on 10.231.<n>.1 and .2, joined by a veth pair."""

    def __init__(self):
        tag = f"{os.getpid() % 10000}{random.randrange(100)}"
        self.namespaces = [f"{PREFIX}{tag}a", f"{PREFIX}{tag}b"]
        self.interfaces = [f"tt{tag}a", f"tt{tag}b"]  # at most 15 characters, as Linux requires
        subnet = random.randrange(1, 250)
        self.addresses = [f"10.231.{subnet}.1", f"10.231.{subnet}.2"]

    def __enter__(self) -> TwoHosts:
        remove_leftovers()
        try:
            for ns in self.namespaces:
                _ip("netns", "add", ns)
            _ip("link", "add", self.interfaces[0], "type", "veth", "peer", "name", self.interfaces[1])
            for ns, ifname, addr in zip(self.namespaces, self.interfaces, self.addresses):
                _ip("link", "set", ifname, "netns", ns)
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", ifname)
                _ip("-n", ns, "link", "set", ifname, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except subprocess.CalledProcessError as e:
            self.__exit__(None, None, None)
            raise RuntimeError(f"could not build two network namespaces: {' '.join(e.cmd)}: {e.stderr.strip()}") from e
        return self

    def __exit__(self, *exc) -> None:
        for ns in self.namespaces:
            _ip("netns", "del", ns, check=False)

    def node_env(self, host: int, nproc: int, port: int, base: Mapping[str, str] | None = None,
                 **extra: str) -> dict[str, str]:
        """The launcher's environment for `host` as node `host` of a 2-node job (RDZV at host 0)."""
        env = dict(os.environ if base is None else base)
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHTITAN_REPORT_DIR", "TORCHELASTIC_RESTART_COUNT"):
            env.pop(name, None)
        env.update(NNODES="2", NODE_RANK=str(host), RDZV_ENDPOINT=f"{self.addresses[0]}:{port}", NGPU=str(nproc),
                   LOCAL_ADDR=self.addresses[host], GLOO_SOCKET_IFNAME=self.interfaces[host], **extra)
        return env

    def popen(self, host: int, cmd: Sequence[str], env: Mapping[str, str], cwd: str | os.PathLike | None = None,
              **kwargs) -> subprocess.Popen:
        """Starts `cmd` inside host `host`'s namespace."""
        return subprocess.Popen(["ip", "netns", "exec", self.namespaces[host], *cmd], env=dict(env), cwd=cwd, **kwargs)
