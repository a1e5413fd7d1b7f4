#!/usr/bin/env -S sh -c 'exec "${0%/*}/project_python.sh" "$0" "$@"'
"""Context parallelism's two attention methods, ring and all-gather, with and without document masks:
per-rank memory and time of one attention forward + backward, and the attention work masks skip.

    .venv/bin/python scripts/cp_methods_bench.py [--cps 2 4 8] [--seqs 8192 16384 32768 65536] [--json out.json]
    .venv/bin/python scripts/cp_methods_bench.py --quick            # cp 2, seq 1024: does it run
    .venv/bin/python scripts/cp_methods_bench.py --corpus-skip      # the bundled corpus's documents

For each cp degree one torchrun of cp gloo ranks (OMP_NUM_THREADS=1 each) runs every (sequence,
masking) case. Inputs are grouped-query shapes like Llama 3's (default 4 query heads over 1
key/value head, head dim 64, batch 1, fp32 on CPU): q, k, v and the output gradient hold the rank's
load-balanced shard (`ring_attention.shard_sequence`), the call is `cp_attention(...).backward()`.
"masked" cases give a document-id row of documents whose lengths are drawn from a seeded lognormal
distribution (mean --doc-mean tokens, sigma 1: many short documents, a few long ones).

What is measured, per rank, reported as the largest over the ranks:
- peak: the most bytes of tensor storage alive at once during the call that the call itself
  allocated (inputs excluded; saved output and log-sum-exp, received and gathered K/V, gradient
  accumulators, block temporaries and the returned gradients included), counted by a dispatch mode
  that sees every op's outputs and a finaliser on each new storage. Kernels' internal scratch
  buffers that never become tensors are not counted. One call under the counter, which also warms
  the case up.
- time: wall time of the call, median over --reps calls, each started after a barrier; ranks share
  the machine's cores (cp 4 and 8 on a 2-core machine run several ranks per core), so times compare
  methods and masks under the same conditions, not absolute speeds. For each repetition the two
  methods run back to back (interleaved), so a change in the machine's load hits both.
- work: the share of the plain causal score area (seq x seq / 2) the block plan computes (planned
  from the document ids, cp_block_plan.py); 1.0 without masks.
A case whose first calls would take longer than --max-case-s (predicted from the last length, x4 per
doubling) is skipped and listed as such.

--corpus-skip tokenizes the bundled corpus (every document with its begin and end tokens, in file
order, packed into windows of --corpus-seq + 1 tokens as the data loader packs them), takes the
document ids the trainer would give each window (models.common.document_ids), and reports the share
of the causal score area each method's block plan skips, and the share an exact per-token mask
would skip (what tiling leaves on the table).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
import weakref
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
METHODS = ("ring", "allgather")


# Document ids and the work a block plan does (host only, no process group).

def synthetic_documents(seq: int, mean: float, seed: int = 0):
    """(1, seq) int64 document ids of documents with lognormal lengths (sigma 1, mean `mean`)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    sigma = 1.0
    mu = math.log(mean) - sigma ** 2 / 2  # a lognormal's mean is exp(mu + sigma^2 / 2)
    lengths, total = [], 0
    while total < seq:
        length = max(16, int(math.exp(mu + sigma * torch.randn((), generator=gen).item())))
        lengths.append(min(length, seq - total))
        total += lengths[-1]
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).unsqueeze(0)


def planned_blocks(method: str, rank: int, cp: int, seq: int, documents, tile: int):
    """The blocks rank `rank` computes in one forward (the backward computes the same)."""
    from torchtitan.parallelisms.cp_block_plan import Span, plan_blocks
    from torchtitan.parallelisms.ring_attention import chunk_spans, ring_step_blocks

    chunk = seq // (2 * cp)
    if method == "ring":
        return [b for step in range(cp) for b in ring_step_blocks(rank, (rank - step) % cp, cp, chunk, documents, tile)]
    return [b for q in chunk_spans(rank, cp, chunk) for b in plan_blocks(q, Span(0, q.end, 0), documents, tile)]


def block_area(block) -> int:
    """Scores a block computes: a causal diagonal square its lower triangle, any other block in full."""
    rows, cols = block.rows.stop - block.rows.start, block.cols.stop - block.cols.start
    return rows * (rows + 1) // 2 if block.causal else rows * cols


def plan_work(method: str, cp: int, ids, tile: int) -> dict:
    """Over all ranks: the share of the causal score area computed, the most computed by one rank
    (as a share of an even split) and the kernel calls per rank of a forward."""
    from torchtitan.parallelisms.cp_block_plan import DocumentPlan

    seq, plan = ids.shape[1], DocumentPlan(ids)
    areas, calls = [], []
    for rank in range(cp):
        blocks = planned_blocks(method, rank, cp, seq, plan, tile)
        areas.append(sum(block_area(b) for b in blocks))
        calls.append(len(blocks))
    causal = seq * (seq + 1) // 2
    return {"computed": sum(areas) / causal, "imbalance": max(areas) * cp / max(sum(areas), 1),
            "calls": max(calls)}


def exact_mask_share(ids) -> float:
    """The share of the causal score area a per-token document mask keeps."""
    import torch

    lengths = torch.unique_consecutive(ids[0], return_counts=True)[1].double()
    seq = ids.shape[1]
    return float((lengths * (lengths + 1) / 2).sum()) / (seq * (seq + 1) / 2)


# The distributed measurement (one torchrun per cp degree).

class AllocatedBytes:
    """Counts the bytes of tensor storages created inside the context that are alive at once, and
    their peak. Storages that exist on entry (`known`) are never counted, even when ops return views
    of them."""

    def __init__(self, known):
        from torchtitan.runtime.torch_compat.dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                counter._see(out)
                return out

        self.mode, self.live, self.peak = Mode(), 0, 0
        self.seen = weakref.WeakSet(t.untyped_storage() for t in known)

    def _see(self, out) -> None:
        import torch

        from torchtitan.runtime.torch_compat.dispatch import tree_leaves

        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            if storage in self.seen:
                continue
            self.seen.add(storage)
            size = storage.nbytes()
            self.live += size
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, size)

    def _free(self, size: int) -> None:
        self.live -= size

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from torchtitan.parallelisms.cp_attention import cp_attention, register_group
    from torchtitan.parallelisms.ring_attention import shard_sequence
    from torchtitan.runtime.process_group import exit_process

    dist.init_process_group("gloo")
    rank, cp = dist.get_rank(), dist.get_world_size()
    group = register_group(dist.group.WORLD)

    def inputs(seq: int):
        gen = torch.Generator().manual_seed(seq)  # the same full sequence on every rank
        shapes = [(1, args.heads, seq, args.head_dim)] + [(1, args.kv_heads, seq, args.head_dim)] * 2
        full = [torch.randn(s, generator=gen) for s in shapes] + [torch.randn(shapes[0], generator=gen)]
        q, k, v, dout = (shard_sequence(t, rank, cp, dim=2).contiguous() for t in full)
        return [t.requires_grad_() for t in (q, k, v)], dout

    def call(method: str, qkv, dout, documents) -> float:
        for t in qkv:
            t.grad = None
        dist.barrier()
        start = time.perf_counter()
        cp_attention(*qkv, documents, group_name=group, method=method, tile=args.tile).backward(dout)
        return time.perf_counter() - start

    def slowest(value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    for method in METHODS:  # thread pools, gloo's pairs, one-time allocations
        for documents in (None, synthetic_documents(64 * cp, 16)):
            call(method, *inputs(64 * cp), documents)

    last: dict[bool, tuple[int, float]] = {}  # masked -> (seq, seconds of both methods' first calls)
    for masked in (False, True):
        for seq in args.seqs:
            case = {"cp": cp, "seq": seq, "masked": masked}
            if masked in last:
                prev_seq, prev_s = last[masked]
                predicted = prev_s * (seq / prev_seq) ** 2
                if predicted > args.max_case_s:
                    if rank == 0:
                        print("RESULT " + json.dumps({**case, "skipped": f"predicted {predicted:.0f} s"}), flush=True)
                    continue
            documents = synthetic_documents(seq, args.doc_mean) if masked else None
            qkv, dout = inputs(seq)
            row = {**case, "local_seq": seq // cp, "methods": {}}
            first = 0.0
            for method in METHODS:
                with AllocatedBytes([*qkv, dout] + ([documents] if masked else [])) as counter:
                    first += slowest(call(method, qkv, dout, documents))
                peak = torch.tensor([float(counter.peak)], dtype=torch.float64)
                dist.all_reduce(peak, op=dist.ReduceOp.MAX)
                work = plan_work(method, cp, documents if masked else None, args.tile) if masked else \
                    {"computed": 1.0, "imbalance": 1.0, "calls": None}
                row["methods"][method] = {"peak_bytes": int(peak.item()), "seconds": [], **work}
            last[masked] = (seq, first)
            # As many timed repetitions as fit in the case's budget, both methods each time.
            reps = max(1, min(args.reps, int((args.max_case_s - first) // first)))
            for _ in range(reps):
                for method in METHODS:
                    row["methods"][method]["seconds"].append(slowest(call(method, qkv, dout, documents)))
            if rank == 0:
                print("RESULT " + json.dumps(row), flush=True)
    dist.destroy_process_group()
    exit_process(0)  # skips interpreter finalization, where gloo's threads can abort a finished rank


def run_cp(args: argparse.Namespace, cp: int) -> list[dict]:
    own = [str(Path(__file__).resolve()), "--worker", "--seqs", *map(str, args.seqs), "--heads", str(args.heads),
           "--kv-heads", str(args.kv_heads), "--head-dim", str(args.head_dim), "--reps", str(args.reps),
           "--tile", str(args.tile), "--doc-mean", str(args.doc_mean), "--max-case-s", str(args.max_case_s)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={cp}", *own]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT))
    result = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"cp_methods_bench: the run of cp {cp} failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    return [json.loads(line.split("RESULT ", 1)[1]) for line in result.stdout.splitlines() if "RESULT " in line]


def kv_bytes(args: argparse.Namespace, seq: int) -> int:
    """fp32 keys and values of `seq` tokens."""
    return 2 * args.kv_heads * seq * args.head_dim * 4


def table(args: argparse.Namespace, rows: list[dict]) -> str:
    mib = 2 ** 20
    lines = ["| cp | seq | masks | work | K/V share | ring peak | all-gather peak | ring time | all-gather time "
             "| all-gather / ring |",
             "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in rows:
        head = f"| {row['cp']} | {row['seq']:,} | {'docs' if row['masked'] else 'causal'}"
        if "skipped" in row:
            lines.append(f"{head} | skipped ({row['skipped']}) | | | | | | |")
            continue
        ring, ag = row["methods"]["ring"], row["methods"]["allgather"]
        t_ring, t_ag = statistics.median(ring["seconds"]), statistics.median(ag["seconds"])
        lines.append(f"{head} | {ring['computed']:.2f} | {kv_bytes(args, row['local_seq']) / mib:.1f} MiB "
                     f"| {ring['peak_bytes'] / mib:.1f} MiB | {ag['peak_bytes'] / mib:.1f} MiB | {t_ring:.2f} s "
                     f"| {t_ag:.2f} s | {t_ag / t_ring:.2f} |")
    return "\n".join(lines)


def corpus_windows(seq: int):
    """The bundled corpus packed into windows of seq + 1 tokens; yields each window's inputs."""
    import torch

    from torchtitan.assets import resolve_path
    from torchtitan.datasets.tokenizer import tokenizer_from_file

    tokenizer = tokenizer_from_file(resolve_path("bundled:stdlib_docs/tokenizer.model", "model.tokenizer_path"))
    tokens: list[int] = []
    with open(resolve_path("bundled:stdlib_docs/corpus.jsonl", "training.dataset_path")) as f:
        for line in f:
            tokens += tokenizer.encode(json.loads(line)["text"], bos=True, eos=True)
    stream = torch.tensor(tokens)
    for start in range(0, len(tokens) - seq, seq + 1):
        yield stream[start:start + seq].unsqueeze(0), tokenizer.eos_id, len(tokens)


def corpus_skip(args: argparse.Namespace) -> dict:
    from torchtitan.models.common import document_ids

    windows = [(document_ids(inputs, eos), total) for inputs, eos, total in corpus_windows(args.corpus_seq)]
    if not windows:
        sys.exit(f"cp_methods_bench: the bundled corpus has fewer than {args.corpus_seq + 1} tokens")
    ids = [w for w, _ in windows]
    lengths = [n for w in ids for n in w[0].unique_consecutive(return_counts=True)[1].tolist()]
    result = {"seq": args.corpus_seq, "windows": len(ids), "corpus_tokens": windows[0][1], "tile": args.tile,
              "documents_per_window": len(lengths) / len(ids), "mean_document": statistics.mean(lengths),
              "median_document": statistics.median(lengths),
              "exact_mask_skips": 1 - statistics.mean(exact_mask_share(w) for w in ids), "plans": []}
    for cp in args.cps:
        for method in METHODS:
            works = [plan_work(method, cp, w, args.tile) for w in ids]
            result["plans"].append({"cp": cp, "method": method,
                                    "skipped": 1 - statistics.mean(w["computed"] for w in works),
                                    "imbalance": max(w["imbalance"] for w in works),
                                    "calls": max(w["calls"] for w in works)})
    return result


def corpus_table(result: dict) -> str:
    lines = [f"bundled corpus: {result['corpus_tokens']:,} tokens, {result['windows']} windows of "
             f"{result['seq']:,}, {result['documents_per_window']:.1f} documents per window (mean "
             f"{result['mean_document']:,.0f}, median {result['median_document']:,.0f} tokens); an exact "
             f"per-token mask skips {result['exact_mask_skips']:.1%} of the causal scores; tile {result['tile']}\n",
             "| cp | method | causal scores skipped | busiest rank / even share | kernel calls per rank |",
             "| ---: | --- | ---: | ---: | ---: |"]
    for p in result["plans"]:
        lines.append(f"| {p['cp']} | {p['method']} | {p['skipped']:.1%} | {p['imbalance']:.2f} | {p['calls']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cps", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--seqs", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=1)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3, help="timed calls per method and case (median)")
    parser.add_argument("--tile", type=int, default=512, help="query rows per block under document masking")
    parser.add_argument("--doc-mean", type=float, default=2048, help="mean document length of masked cases")
    parser.add_argument("--max-case-s", type=float, default=180, help="skip a case predicted to take longer")
    parser.add_argument("--quick", action="store_true", help="cp 2, seq 1024, 2 repetitions: a smoke run")
    parser.add_argument("--corpus-skip", action="store_true", help="the bundled corpus's skipped blocks instead")
    parser.add_argument("--corpus-seq", type=int, default=65536)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.cps, args.seqs, args.reps, args.doc_mean = [2], [1024], 2, 256
    if args.worker:
        worker(args)
        return
    if args.corpus_skip:
        result = corpus_skip(args)
        print(corpus_table(result))
    else:
        print(f"cp_attention forward + backward, batch 1, {args.heads} heads over {args.kv_heads} K/V heads, head dim "
              f"{args.head_dim}, fp32, gloo, OMP_NUM_THREADS=1 per rank; masked: documents of mean {args.doc_mean:,.0f} "
              f"tokens (lognormal), tile {args.tile}; peak and time: the largest over ranks\n", flush=True)
        rows = []
        for cp in args.cps:
            rows += run_cp(args, cp)
            print(table(args, [r for r in rows if r["cp"] == cp]), flush=True)
        print("\n" + table(args, rows))
        result = {"settings": {k: v for k, v in vars(args).items() if k not in ("json", "worker")}, "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
