#!/usr/bin/env -S sh -c 'exec "${0%/*}/project_python.sh" "$0" "$@"'
"""Activation offload on CPU: what the forward keeps for backward on the device and on the host, and
the step time, with activation_checkpoint.offload none and all, per AC mode and sequence length.

    .venv/bin/python scripts/offload_bench.py [--lengths 2048 4096] [--batch 1] [--steps 3] [--ac none full]

Runs the debug model (llama3 debugmodel: dim 256, 8 blocks, the bundled 2,256-token vocabulary)
in this process, fp32, one thread. For each point it builds the model as the trainer does
(apply_ac_and_compile, without compile), takes one warm-up step, then --steps steps of forward +
backward, and reports:
- kept: bytes of the distinct tensor storages alive after the forward, other than the parameters
  and inputs: what autograd keeps for backward, host copies included;
- host: the offloaded copies' bytes (the offloader's count), so device = kept - host is what a GPU
  would hold;
- the step time in CPU seconds of this process (time.process_time: on a shared machine the wall
  time measures the other processes' load as much as this one's work): the best of --steps, the two
  models stepping in turns. On the CPU the "device" is host memory too: the copies free nothing here,
  and their cost is one memcpy per saved tensor; on a GPU the copies run on a side stream.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import time
import weakref

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from torchtitan.models.llama.flavors import llama3_configs  # noqa: E402
from torchtitan.models.llama.model import Transformer  # noqa: E402
from torchtitan.models.loss import cross_entropy_loss  # noqa: E402
from torchtitan.parallelisms.activation_offload import OffloadStats, offload_wrappers  # noqa: E402
from torchtitan.parallelisms.tensor_parallel import apply_ac_and_compile  # noqa: E402
from torchtitan.runtime.torch_compat.dispatch import TorchDispatchMode, tree_leaves  # noqa: E402

VOCAB = 2256


class _Storages(TorchDispatchMode):
    """Weak references to the storage of every tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.refs: list[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.refs.extend(weakref.ref(t.untyped_storage()) for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


def kept_bytes(storages: _Storages, exclude: set) -> int:
    gc.collect()
    alive = {}
    for ref in storages.refs:
        st = ref()
        if st is not None and st not in exclude:
            alive[id(st)] = st.nbytes()
    return sum(alive.values())


def build(seq_len: int, ac: str, offload: str) -> tuple[Transformer, OffloadStats]:
    torch.manual_seed(0)
    args = dataclasses.replace(llama3_configs["debugmodel"], vocab_size=VOCAB, max_seq_len=seq_len)
    model = Transformer(args)
    model.init_weights()
    apply_ac_and_compile(model, False, ac, "2", False, offload=offload)
    wrappers = offload_wrappers([model])
    return model, wrappers[0].offloader.stats if wrappers else OffloadStats()


def step(model: Transformer, inputs: torch.Tensor, labels: torch.Tensor) -> float:
    model.zero_grad(set_to_none=True)
    start = time.process_time()
    cross_entropy_loss(model(inputs), labels).backward()
    return time.process_time() - start


def measure(seq_len: int, batch: int, ac: str, steps: int) -> list[dict]:
    """Offload none and all at one point: memory from one forward each, then the step time as the
    best of `steps` steps taken in turns."""
    tokens = torch.randint(0, VOCAB, (batch, seq_len + 1), generator=torch.Generator().manual_seed(1))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    rows = []
    for offload in ("none", "all"):
        model, stats = build(seq_len, ac, offload)
        step(model, inputs, labels)  # warm-up: thread pools, the allocator's first blocks
        exclude = {t.untyped_storage() for t in (*model.parameters(), *model.buffers(), inputs, labels)}
        before = stats.bytes
        with _Storages() as storages:
            loss = cross_entropy_loss(model(inputs), labels)
        kept, host = kept_bytes(storages, exclude), stats.host_bytes
        del storages
        loss.backward()
        rows.append({"model": model, "ac": ac, "offload": offload, "device": kept - host, "host": host,
                     "moved": stats.bytes - before, "times": []})
    for _ in range(steps):
        for row in rows:
            row["times"].append(step(row["model"], inputs, labels))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--ac", nargs="+", default=["none", "full"], choices=["none", "full", "selective"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    mib = 1 << 20
    print(f"debugmodel, batch {args.batch}, fp32, 1 thread; MiB; step = CPU seconds of forward + backward, best of {args.steps}")
    print("| seq | AC | offload | device MiB | host MiB | moved per step MiB | step CPU s |")
    print("|---|---|---|---|---|---|---|")
    for seq in args.lengths:
        for ac in args.ac:
            for r in measure(seq, args.batch, ac, args.steps):
                print(f"| {seq} | {ac} | {r['offload']} | {r['device'] / mib:.0f} | {r['host'] / mib:.0f} | "
                      f"{r['moved'] / mib:.0f} | {min(r['times']):.2f} |", flush=True)

if __name__ == "__main__":
    main()
