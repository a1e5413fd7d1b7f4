#!/usr/bin/env -S sh -c 'exec "${0%/*}/project_python.sh" "$0" "$@"'
"""Peak memory of one ring-attention forward + backward against the local sequence length, per kernel.

Compares the fused block kernel with the materialised-scores ("math") kernel.

    .venv/bin/python scripts/ring_memory.py [--lengths 1024 2048 4096 8192] [--cp 1] [--kernels cpu_flash math]

Each (kernel, length) runs in fresh processes: cp gloo ranks under torchrun, or for cp 1 a single
process with a one-rank gloo group (only the diagonal blocks run then, and no key/value blocks
travel; cp 2 adds both, at twice the processes on the same cores). Each rank holds batch 1, 8 heads, head dim 64,
fp32 q/k/v of the local length, warms up on a short sequence (thread pools, one-time allocations),
then measures one call of ring attention forward + backward.

What is measured: the rise of the process's resident memory at its peak during that call, from
Linux's high-water mark (VmHWM in /proc/self/status, reset to the current RSS just before the
call through /proc/self/clear_refs). It counts every page the call touched: PyTorch's tensors,
the kernels' internal scratch buffers and allocator slack alike, and excludes the inputs, which
exist before the call (and memory the allocator kept from the short warm-up, reused unseen). The reported value is the largest over the cp ranks. OMP_NUM_THREADS=1
per rank, so per-thread kernel buffers do not vary with the machine.

Reading it: a fused kernel never stores a (Sq x Sk) score matrix, so its peak grows like the local
sequence (x2 per doubling); the math kernel stores several fp32 score-sized tensors per block, so
its peak grows like the square (x4 per doubling). "scores" is the size of one fp32 score matrix
of a diagonal block (half the local queries x half the local keys, all heads). Times are of one
call on one thread per rank, for orientation only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
HEADS, HEAD_DIM = 8, 64


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{key}:\s+(\d+) kB", f.read(), re.M).group(1))


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from torchtitan.parallelisms.ring_attention import ring_attention
    from torchtitan.runtime.process_group import exit_process

    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    rank = dist.get_rank()

    def inputs(length: int):
        gen = torch.Generator().manual_seed(rank)
        q, k, v, dout = (torch.randn(1, HEADS, length, HEAD_DIM, generator=gen) for _ in range(4))
        return [t.requires_grad_() for t in (q, k, v)], dout

    def call(qkv, dout):
        ring_attention(*qkv, group=dist.group.WORLD, kernel=args.kernel).backward(dout)

    call(*inputs(256))
    qkv, dout = inputs(args.length)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the high-water mark to the current resident size
    before = _status_kib("VmRSS")
    start = time.perf_counter()
    call(qkv, dout)
    seconds = time.perf_counter() - start
    worst = torch.tensor([(_status_kib("VmHWM") - before) / 1024, seconds], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if rank == 0:
        print("RESULT " + json.dumps({"peak_mib": worst[0].item(), "seconds": worst[1].item()}), flush=True)
    dist.destroy_process_group()
    exit_process(0)  # skips interpreter finalization, where gloo's threads can abort a finished rank


def measure(kernel: str, length: int, cp: int) -> dict:
    own = [str(Path(__file__).resolve()), "--worker", "--kernel", kernel, "--length", str(length)]
    if cp == 1:
        cmd = [sys.executable, *own]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={cp}", *own]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT))
    result = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"ring_memory: the run of {kernel}, local length {length}, cp {cp} failed (exit {result.returncode}):\n"
                 f"{result.stderr[-3000:]}")
    line = next(text for text in result.stdout.splitlines() if "RESULT " in text)
    return json.loads(line.split("RESULT ", 1)[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192],
                        help="local sequence lengths (tokens per rank)")
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--kernels", nargs="+", default=["cpu_flash", "math"])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--kernel", help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    print(f"ring attention forward + backward, cp {args.cp}, batch 1, {HEADS} heads, head dim {HEAD_DIM}, fp32, "
          "OMP_NUM_THREADS=1 per rank; peak resident memory added by the call, largest over ranks\n")
    header = ["local seq", "scores"] + [cell for k in args.kernels for cell in (f"{k} peak", "x prev", "time")]
    print("| " + " | ".join(header) + " |")
    print("| " + " | ".join(["---:"] * (2 + 3 * len(args.kernels))) + " |")
    previous: dict[str, float] = {}
    for length in args.lengths:
        half = length // 2
        cells = [f"{length:,}", f"{HEADS * half * half * 4 / 2**20:,.0f} MiB"]
        for kernel in args.kernels:
            m = measure(kernel, length, args.cp)
            growth = f"x{m['peak_mib'] / previous[kernel]:.1f}" if kernel in previous else ""
            previous[kernel] = m["peak_mib"]
            cells += [f"{m['peak_mib']:,.0f} MiB", growth, f"{m['seconds']:.2f} s"]
        print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
