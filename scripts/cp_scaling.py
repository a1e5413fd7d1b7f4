#!/usr/bin/env -S sh -c 'exec "${0%/*}/project_python.sh" "$0" "$@"'
"""Context-parallel scaling on CPU: per-rank activation memory and step time for a long sequence.

    .venv/bin/python scripts/cp_scaling.py [--seq-len 16384] [--cps 1 2 4] [--layers 4] [--dim 256]

For each cp degree, runs cp gloo ranks (torchrun) that each train steps of a small Llama on one
sequence of --seq-len tokens, split with the project's load-balanced sharding and ring attention
(`parallelisms/context_parallel.py`). Each rank measures:
- activation memory: the bytes of the distinct tensor storages autograd keeps for backward
  (counted through saved-tensor hooks), which is what context parallelism divides by cp;
- step time (forward + backward), after one warm-up step;
- peak resident memory of the process (includes PyTorch itself, about 0.4 GiB).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def worker(args: argparse.Namespace) -> None:
    import resource

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from torchtitan.models.llama.model import ModelArgs, Transformer
    from torchtitan.models.loss import cross_entropy_loss
    from torchtitan.parallelisms.context_parallel import apply_cp, shard_batch

    cp = int(os.environ.get("WORLD_SIZE", "1"))
    mesh = None
    if cp > 1:
        dist.init_process_group("gloo")
        mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    torch.manual_seed(0)
    model = Transformer(ModelArgs(dim=args.dim, n_layers=args.layers, n_heads=args.dim // 32, vocab_size=2048,
                                  max_seq_len=args.seq_len))
    model.init_weights()
    if mesh is not None:
        apply_cp(model, mesh, args.seq_len)
    tokens = torch.randint(0, 2048, (1, args.seq_len + 1))
    inputs, labels = shard_batch((tokens[:, :-1], tokens[:, 1:]), mesh)

    saved: dict[int, int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return t

    times, activation_bytes = [], 0
    for step in range(args.steps + 1):
        saved.clear()
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = cross_entropy_loss(model(inputs), labels)
        activation_bytes = sum(saved.values())
        loss.backward()
        model.zero_grad(set_to_none=True)
        if step > 0:  # the first step warms up allocators and caches
            times.append(time.perf_counter() - start)
    rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    rank = dist.get_rank() if mesh is not None else 0
    result = {"rank": rank, "activation_mib": activation_bytes / 2**20, "step_s": sum(times) / len(times),
              "rss_gib": rss_gib, "local_tokens": inputs.shape[1]}
    print("RESULT " + json.dumps(result), flush=True)
    if mesh is not None:
        from torchtitan.runtime.process_group import exit_process

        dist.destroy_process_group()
        exit_process(0)  # skips interpreter finalization, where gloo's threads can abort a finished rank


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    print(f"Llama dim {args.dim}, {args.layers} blocks, one sequence of {args.seq_len} tokens, fp32, "
          "OMP_NUM_THREADS=1 per rank\n")
    print("| cp | tokens per rank | activation memory per rank | vs cp 1 | step time | peak RSS per rank |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    base = None
    for cp in args.cps:
        own = [sys.executable, str(Path(__file__).resolve()), "--worker", "--seq-len", str(args.seq_len),
               "--layers", str(args.layers), "--dim", str(args.dim), "--steps", str(args.steps)]
        cmd = own if cp == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                   f"--nproc_per_node={cp}", *own[1:]]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
        result = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
        if result.returncode != 0:
            sys.exit(f"cp_scaling: the run of cp {cp} failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
        rows = [json.loads(line.split("RESULT ", 1)[1]) for line in result.stdout.splitlines() if "RESULT " in line]
        act = max(r["activation_mib"] for r in rows)
        base = base or act
        print(f"| {cp} | {rows[0]['local_tokens']:,} | {act:,.0f} MiB | {act / base:.2f} | "
              f"{max(r['step_s'] for r in rows):.2f} s | {max(r['rss_gib'] for r in rows):.2f} GiB |", flush=True)


if __name__ == "__main__":
    main()
