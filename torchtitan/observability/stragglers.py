"""Which node slows a multi-node job: its ranks' own time, their compute, and its network link.

One slow rank slows every rank, since the others wait for it in the next collective, so the step
time says that something is slow but not what. Two measurements name it, both on log steps only:

- **Own time** (trainer/instruments.py): each rank's data loading and optimizer step, where ranks
  do not wait for each other. A throttled or overloaded node shows there as itself; the step line
  names the slowest rank and its node against the median.
- **Compute** (`probe_compute`): own time is only the data and optimizer phases, and a node whose
  processors are throttled (a CPU quota, a GPU clocked down) loses most of its time in forward and
  backward, where it shows only as its peers' waits. Each rank times the same few matrix
  multiplications; each node's median rank is compared with the median node, so that one rank's
  bad luck with the scheduler (many ranks sharing few cores) does not name its node.
- **Links** (`probe_links`): a slowed network link does not show in any rank's own time, as every
  rank waits for it alike. Each rank sends PROBE_BYTES to the rank of the same local rank on the
  next node and receives from the previous node, then the same the other way round, timing when
  its receive completes. A receive waits only for its sender's outgoing link and its own incoming
  one, so a node whose outgoing link is slow delays the receives of both its neighbours, one in
  each direction, and a node whose incoming link is slow delays both of its own. Attributing each
  node the smaller of its two delays names the node both directions agree on.

The probe travels over the CPU process group (gloo, TCP): on GPUs it measures the nodes' TCP
network, not an InfiniBand or NVLink fabric that NCCL may use. With two nodes the two directions
cannot be told apart (each node's neighbour is the other one both ways): the report then names the
link between them. A single node has no links to probe.
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Above the burst a traffic shaper lets through at line rate (tens of KiB), so a rate-limited link
# shows; a healthy link moves it in well under a millisecond.
PROBE_BYTES = 256 * 1024
ROUNDS = 3  # the fastest of a few exchanges: scheduling noise only ever adds time
# A node's link is named when its time exceeds the median node's by this factor and by the floor
# (a quiet link's time is well under a millisecond, where a factor alone would name noise).
SLOW_FACTOR = 3.0
SLOW_FLOOR_SECONDS = 0.002


def stands_out(seconds: float, median_seconds: float) -> bool:
    """Slow enough to name: SLOW_FACTOR times the median's time, and SLOW_FLOOR_SECONDS more."""
    return seconds > SLOW_FACTOR * median_seconds and seconds - median_seconds > SLOW_FLOOR_SECONDS


@dataclass(frozen=True)
class Topology:
    """Where the ranks run: torchrun numbers a node's ranks contiguously (rank = node x per_node +
    local rank); `hosts` is each node's address (LOCAL_ADDR) or host name, gathered once."""

    world: int
    per_node: int
    hosts: tuple[str, ...]

    @property
    def nodes(self) -> int:
        return self.world // self.per_node

    def node_of(self, rank: int) -> int:
        return rank // self.per_node

    def describe(self, rank: int) -> str:
        """`node 2, 10.0.0.3` for the step line; empty on a single node."""
        if self.nodes < 2:
            return ""
        node = self.node_of(rank)
        return f"node {node}, {self.hosts[node]}"

    @classmethod
    def of_this_job(cls) -> Topology | None:
        """The job's topology (a collective: every rank calls it); None on one process."""
        if not dist.is_initialized() or dist.get_world_size() < 2:
            return None
        world = dist.get_world_size()
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if per_node < 1 or world % per_node:
            per_node = world
        names: list[str] = [""] * world
        dist.all_gather_object(names, os.environ.get("LOCAL_ADDR") or socket.gethostname())
        return cls(world, per_node, tuple(names[n * per_node] for n in range(world // per_node)))


@dataclass(frozen=True)
class SlowLink:
    node: int  # -1: the link between the two nodes of a 2-node job
    host: str
    direction: str  # "outgoing", "incoming", or "between the two nodes"
    seconds: float  # the node's probe time
    median_seconds: float  # the median node's

    @property
    def stands_out(self) -> bool:
        return stands_out(self.seconds, self.median_seconds)

    def text(self) -> str:
        kib = PROBE_BYTES // 1024
        where = f"node {self.node} ({self.host}) {self.direction}" if self.node >= 0 else f"the link {self.host}"
        return (f"slow link: {where}: {kib} KiB in {1e3 * self.seconds:.1f} ms vs median "
                f"{1e3 * self.median_seconds:.1f} ms ({self.seconds / max(self.median_seconds, 1e-9):.0f}x)")


COMPUTE_SIZE = {"cpu": 256, "cuda": 4096}  # square matmuls: a few milliseconds on either
COMPUTE_REPEATS = 8
COMPUTE_ROUNDS = 5


@dataclass(frozen=True)
class SlowRank:
    rank: int  # the slowest rank of the slowest node
    where: str  # `node 2, 10.0.0.3`
    seconds: float  # that node's median rank's compute probe time
    median_seconds: float  # the median node's

    @property
    def stands_out(self) -> bool:
        return stands_out(self.seconds, self.median_seconds)

    def text(self) -> str:
        return (f"slow compute: {self.where} (rank {self.rank}) {1e3 * self.seconds:.1f} ms vs median node "
                f"{1e3 * self.median_seconds:.1f} ms for the same matmuls ({self.seconds / max(self.median_seconds, 1e-9):.1f}x)")


def probe_compute(topology: Topology, device: torch.device) -> SlowRank:
    """Every rank times the same COMPUTE_REPEATS matmuls at once (the median of COMPUTE_ROUNDS:
    a quota-throttled process runs at full speed in bursts, which the fastest round would catch);
    the slowest node against the median node (slowest_node). A collective."""
    size = COMPUTE_SIZE.get(device.type, COMPUTE_SIZE["cuda"])
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    a = torch.ones(size, size, dtype=dtype, device=device) / size
    rounds = []
    for _ in range(COMPUTE_ROUNDS):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        b = a
        for _ in range(COMPUTE_REPEATS):
            b = a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        rounds.append(time.perf_counter() - start)
    best = statistics.median(rounds)
    times = [torch.zeros((), dtype=torch.float64) for _ in range(topology.world)]
    dist.all_gather(times, torch.tensor(best, dtype=torch.float64))
    return slowest_node([t.item() for t in times], topology)


def slowest_node(times: list[float], topology: Topology) -> SlowRank:
    """The node whose median rank took longest, against the median node."""
    per = topology.per_node
    nodes = [statistics.median(times[n * per:(n + 1) * per]) for n in range(topology.nodes)]
    node = max(range(topology.nodes), key=nodes.__getitem__)
    rank = max(range(node * per, (node + 1) * per), key=times.__getitem__)
    return SlowRank(rank, topology.describe(rank), nodes[node], statistics.median(nodes))


def _exchange(payload: torch.Tensor, buffer: torch.Tensor, send_to: int, receive_from: int) -> float:
    """Seconds from a common start until this rank's receive completes (its send runs alongside)."""
    dist.barrier()
    start = time.perf_counter()
    sent = dist.isend(payload, send_to)
    received = dist.irecv(buffer, receive_from)
    received.wait()
    seconds = time.perf_counter() - start
    sent.wait()
    return seconds


def probe_links(topology: Topology) -> tuple[list[float], list[float]]:
    """Per node, the median over its ranks of the receive time from the previous node (`from_left`)
    and from the next one (`from_right`), the fastest of ROUNDS exchanges. A collective."""
    rank, per = dist.get_rank(), topology.per_node
    right, left = (rank + per) % topology.world, (rank - per) % topology.world
    payload = torch.ones(PROBE_BYTES // 4, dtype=torch.float32)
    buffer = torch.empty_like(payload)
    from_left = min(_exchange(payload, buffer, right, left) for _ in range(ROUNDS))
    from_right = min(_exchange(payload, buffer, left, right) for _ in range(ROUNDS))
    gathered = [torch.zeros(2, dtype=torch.float64) for _ in range(topology.world)]
    dist.all_gather(gathered, torch.tensor([from_left, from_right], dtype=torch.float64))
    per_node = [[g.tolist() for g in gathered[n * per:(n + 1) * per]] for n in range(topology.nodes)]
    return ([statistics.median(r[0] for r in ranks) for ranks in per_node],
            [statistics.median(r[1] for r in ranks) for ranks in per_node])


def slowest_link(topology: Topology, from_left: list[float], from_right: list[float]) -> SlowLink:
    """The node whose link both probe directions blame most, with the median node's time for
    comparison (`stands_out` says whether it is slow enough to name)."""
    n = topology.nodes
    if n == 2:
        times = [min(from_left[0], from_right[0]), min(from_left[1], from_right[1])]
        return SlowLink(-1, f"between {topology.hosts[0]} and {topology.hosts[1]}", "between the two nodes",
                        max(times), min(times))
    # Node k's outgoing link delays node k+1's receive from the left and node k-1's from the right;
    # its incoming link delays both of its own receives.
    outgoing = [min(from_left[(k + 1) % n], from_right[(k - 1) % n]) for k in range(n)]
    incoming = [min(from_left[k], from_right[k]) for k in range(n)]
    blamed = [max(o, i) for o, i in zip(outgoing, incoming)]
    node = max(range(n), key=blamed.__getitem__)
    direction = "outgoing" if outgoing[node] >= incoming[node] else "incoming"
    return SlowLink(node, topology.hosts[node], direction, blamed[node], statistics.median(blamed))
