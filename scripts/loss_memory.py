#!/usr/bin/env -S sh -c 'exec "${0%/*}/project_python.sh" "$0" "$@"'
"""Peak memory (and time) of the loss's forward + backward: the whole logits against the chunked
cross-entropy (training.loss_chunk_size), at a Llama 3 vocabulary.

    .venv/bin/python scripts/loss_memory.py [--vocab 128256] [--dims 512 2048 4096] [--seqs 2048 8192]
        [--chunks 0 512 1024 2048] [--dtype bfloat16] [--real] [--repeat 2]

One rank's output projection and loss, batch 1: hidden states (1, seq, dim) and the output weight
(vocab, dim) in `--dtype` (bf16: what FSDP's policy or autocast gives on a GPU), labels with a
tenth of them ignored (-100). Chunk 0 is today's path: the whole logits, upcast to fp32, the
cross-entropy's mean (models/loss.py); a chunk size runs torchtitan's ChunkedLossHead (parallelisms/
chunked_loss.py). Memory is counted by the project's StepTracker (PyTorch's MemTracker, every
tensor alive, by category) around loss forward + backward, the inputs and the weight included;
"loss peak" is the peak less the weight, its gradient and the hidden states with their gradient
(what the loss itself adds). By default on fake tensors (shapes only: any size in seconds, no
time); `--real` runs real CPU tensors and reports the time of forward + backward too (the best of
`--repeat`, on OMP_NUM_THREADS threads).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time

import torch
from torch import nn

from torchtitan.estimation.tracker import StepTracker
from torchtitan.models.loss import cross_entropy_loss
from torchtitan.parallelisms.chunked_loss import ChunkedLossHead
from torchtitan.runtime.torch_compat import fake as torch_compat_fake

GIB = 2**30


class WholeLogitsLoss(nn.Module):
    """Today's path: the output projection, then the trainer's loss over the whole logits."""

    def __init__(self, output: nn.Linear):
        super().__init__()
        self.output = output

    def forward(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return cross_entropy_loss(self.output(h), labels)


class HeadLoss(nn.Module):
    """The chunked head, given its labels as the model's pre-hook would."""

    def __init__(self, output: nn.Linear, chunk: int):
        super().__init__()
        self.output = ChunkedLossHead(output, None, chunk)

    def forward(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        self.output.labels = labels
        return self.output(h)


def measure(vocab: int, dim: int, seq: int, chunk: int, dtype: torch.dtype, real: bool, repeat: int) -> dict:
    mode = contextlib.nullcontext() if real else torch_compat_fake.FakeTensorMode()
    with mode:
        output = nn.Linear(dim, vocab, bias=False, dtype=dtype)
        module = HeadLoss(output, chunk) if chunk else WholeLogitsLoss(output)
        labels = torch.randint(0, vocab, (1, seq))
        if real:
            labels[:, ::10] = -100
        best, peak, at_peak = float("inf"), 0, {}
        for _ in range(repeat if real else 1):
            h = torch.randn(1, seq, dim, dtype=dtype, requires_grad=True)
            output.weight.grad = None
            tracker = StepTracker([module], [])
            tracker.track_inputs(h, labels)
            start = time.perf_counter()
            with tracker.tracking():
                loss = module(h, labels)
                loss.backward()
            best = min(best, time.perf_counter() - start)
            result = tracker.result()
            peak, at_peak = result.peak, result.at_peak
    weights = 2 * vocab * dim * dtype.itemsize + 2 * seq * dim * dtype.itemsize  # weight + grad, h + grad
    row = {"vocab": vocab, "dim": dim, "seq": seq, "chunk": chunk, "dtype": str(dtype).removeprefix("torch."),
           "peak_bytes": peak, "loss_peak_bytes": peak - weights,
           "peak_gib": round(peak / GIB, 3), "loss_peak_gib": round((peak - weights) / GIB, 3),
           "at_peak": {k: round(v / GIB, 3) for k, v in at_peak.items()}}
    if real:
        row["seconds"] = round(best, 3)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--dims", type=int, nargs="+", default=[512, 2048, 4096])
    parser.add_argument("--seqs", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--chunks", type=int, nargs="+", default=[0, 512, 1024, 2048])
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--real", action="store_true", help="real CPU tensors, timed (slow at large sizes)")
    parser.add_argument("--repeat", type=int, default=2, help="timed repetitions with --real (the best is kept)")
    parser.add_argument("--json", action="store_true", help="one JSON line per row instead of the table")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    print(f"{'dim':>5} {'seq':>6} {'chunk':>6} {'peak GiB':>9} {'loss peak GiB':>14}" + ("  seconds" if args.real else ""))
    for dim in args.dims:
        for seq in args.seqs:
            for chunk in args.chunks:
                row = measure(args.vocab, dim, seq, chunk, dtype, args.real, args.repeat)
                if args.json:
                    print(json.dumps(row), flush=True)
                    continue
                timed = f"  {row['seconds']:7.2f}" if args.real else ""
                print(f"{dim:>5} {seq:>6} {chunk or 'whole':>6} {row['peak_gib']:>9.3f} {row['loss_peak_gib']:>14.3f}{timed}",
                      flush=True)


if __name__ == "__main__":
    main()
