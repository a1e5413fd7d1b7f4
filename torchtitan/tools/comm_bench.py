"""A short microbenchmark of the process group's collectives between a job's ranks: the per-hop latency
and the bandwidth the step-time model (torchtitan/estimation/step_time.py) needs, within a host
and across hosts.

    python -m torch.distributed.run --standalone --nproc_per_node 4 -m torchtitan.tools.comm_bench

Run on every rank (torchrun, or any launcher that sets RANK, WORLD_SIZE, LOCAL_WORLD_SIZE and the
rendezvous variables). All ranks take part at once, as in training, so ranks that share cores
compete for them as they do then. Each measurement is a set of disjoint groups working
concurrently: pairs of ranks on one host ("intra"), pairs of the same local rank on two hosts
("inter", with several hosts), and the whole world. In each, all-reduces and all-gathers of 1 KiB
to 4 MiB (fp32) are timed (the slowest rank's time, median of a few rounds); latency per hop and
bandwidth are the least-squares fit of

    seconds = hops x latency + bytes on the wire / bandwidth

with the step-time model's hops and wire bytes ((n - 1)/n of the payload per hop-ring, twice for
an all-reduce). Pairs and the world also measure `busy_call_us`: what a small call costs while
every rank computes between calls (`busy_latency`), which on ranks that share cores is mostly the
wait for the peers' turns on a core, and hardly grows with the hops. First, every rank multiplies fp32 matrices at once for a second
(`matmul_tflops`): the compute rate a rank gets beside the others. Rank 0 prints one line,
`RESULT {json}`: {"intra": {"latency_us", "gbps", "busy_call_us"}, "inter": {...} or null,
"world_fit": {...} or null, "world", "hosts", "matmul_tflops" (the median over ranks)}.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import torch
import torch.distributed as dist

SIZES = (256, 16_384, 262_144, 1_048_576)  # fp32 elements: 1 KiB to 4 MiB
ROUNDS = 5


def _time(kind: str, elements: int, group: dist.ProcessGroup | None, size: int) -> float:
    """The slowest rank's seconds for one call, the median of ROUNDS after one warm-up."""
    tensor = torch.ones(elements)
    gathered = torch.empty(elements * size)
    rounds = []
    for i in range(ROUNDS + 1):
        dist.barrier()
        start = time.perf_counter()
        if kind == "all_reduce":
            dist.all_reduce(tensor, group=group)
        else:
            dist.all_gather_into_tensor(gathered, tensor, group=group)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if i:
            rounds.append(elapsed.item())
    return statistics.median(rounds)


def _samples(group: dist.ProcessGroup | None, size: int) -> list[tuple[float, float, float]]:
    """(hops, wire bytes, seconds) of each kind and size over `group` (`size` ranks)."""
    samples = []
    for kind, twice in (("all_reduce", 2), ("all_gather", 1)):
        for elements in SIZES:
            payload = elements * 4 * (size if kind == "all_gather" else 1)
            samples.append(((size - 1) * twice, payload * (size - 1) / size * twice, _time(kind, elements, group, size)))
    return samples


def fit(samples: list[tuple[float, float, float]]) -> dict[str, float]:
    """Least-squares latency per hop and bandwidth of `seconds = hops x a + bytes / b` (both > 0)."""
    shh = sum(h * h for h, _, _ in samples)
    sbb = sum(b * b for _, b, _ in samples)
    shb = sum(h * b for h, b, _ in samples)
    sht = sum(h * t for h, _, t in samples)
    sbt = sum(b * t for _, b, t in samples)
    det = shh * sbb - shb * shb
    latency = (sht * sbb - sbt * shb) / det if det else 0.0
    per_byte = (shh * sbt - shb * sht) / det if det else 0.0
    if latency <= 0 or per_byte <= 0:  # one term alone explains the samples: fit the other on its own
        latency = max(latency, 0.0)
        per_byte = max(sum(b * (t - h * latency) for h, b, t in samples) / sbb, 1e-15)
    return {"latency_us": latency * 1e6, "gbps": 1 / per_byte / 1e9}


def busy_latency(group: dist.ProcessGroup | None, calls: int = 30) -> float:
    """Seconds a small all-reduce adds per call when every rank computes between calls, as in
    training: where ranks share cores, a peer is then often not on a core when the call starts,
    and the call waits for its turn. The difference of `calls` rounds of a ~1 ms matmul with and
    without an all-reduce after each, over the slowest rank, per call."""
    a = torch.randn(384, 384)
    small = torch.ones(8)

    def rounds(communicate: bool) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            a @ a
            if communicate:
                dist.all_reduce(small, group=group)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return elapsed.item()

    rounds(True)  # warm-up
    extra = statistics.median(rounds(True) - rounds(False) for _ in range(3))
    return max(extra, 0.0) / calls


def matmul_tflops(seconds: float = 1.0, n: int = 512) -> float:
    """fp32 matmul TFLOP/s this rank reaches while every rank multiplies at once (its products'
    FLOPs over `seconds`): the compute rate of ranks sharing the cores, other load included."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm-up
    dist.barrier()
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        done += 1
    elapsed = time.perf_counter() - start
    dist.barrier()
    return done * 2 * n**3 / elapsed / 1e12


def _pairs(world: int, local: int, across: bool) -> list[list[int]]:
    """Disjoint pairs: neighbours on one host, or the same local rank on hosts 2h and 2h + 1."""
    hosts = world // local
    if not across:
        return [[h * local + i, h * local + i + 1] for h in range(hosts) for i in range(0, local - 1, 2)]
    return [[h * local + i, (h + 1) * local + i] for h in range(0, hosts - 1, 2) for i in range(local)]


def _measure_pairs(world: int, local: int, across: bool) -> dict[str, float] | None:
    pairs = _pairs(world, local, across)
    groups = [dist.new_group(pair) for pair in pairs]  # every rank creates every group
    mine = next((g for g, pair in zip(groups, pairs) if dist.get_rank() in pair), None)
    if not pairs:
        return None
    if mine is None:  # a rank without a partner keeps pace with the barriers and maxima only
        for _ in range(2 * len(SIZES) * (ROUNDS + 1) + 7):  # _samples' rounds, then busy_latency's
            dist.barrier()
            dist.all_reduce(torch.zeros(1, dtype=torch.float64), op=dist.ReduceOp.MAX)
        return None
    figures = fit(_samples(mine, 2))
    figures["busy_call_us"] = busy_latency(mine) * 1e6
    return figures


def main() -> None:
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    rate = torch.tensor([matmul_tflops()], dtype=torch.float64)
    rates = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(rates, rate)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    hosts = max(1, world // local)
    intra = _measure_pairs(world, local, across=False) if local > 1 else None
    inter = _measure_pairs(world, local, across=True) if hosts > 1 else None
    whole = fit(_samples(None, world)) if world > 2 else None
    if whole is not None:
        whole["busy_call_us"] = busy_latency(None) * 1e6
    # A rank without a pair (odd counts) sends None: rank 0 always has one where pairs exist.
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"intra": intra or whole, "inter": inter, "world_fit": whole, "world": world,
                                      "hosts": hosts, "matmul_tflops": statistics.median(r.item() for r in rates)}),
              flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
