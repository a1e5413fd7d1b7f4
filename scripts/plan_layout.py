#!/usr/bin/env python
"""Plans a parallel layout before queueing: the fastest layouts of a model that fit the cluster.

  python scripts/plan_layout.py --model llama3 --flavor 70B --ngpu 256 --device-memory 80

Enumerates layouts (tensor parallel within a node, pipeline stages, FSDP or HSDP, context parallel
for long sequences, activation checkpointing, gradient accumulation), ranks them by an analytic
step-time model (torchtitan/estimation/planner.py states every assumption), confirms with the dry
run (fake tensors, this process, no GPU) that the fastest fit in the device's memory, and prints
them as ready-to-paste options with their memory and predicted tokens/s. docs/memory.md explains.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's torchtitan, from any folder

from torchtitan.errors import UserError  # noqa: E402
from torchtitan.estimation.planner import GiB, Hardware, Model, as_record, plan  # noqa: E402
from torchtitan.logging import init_logger  # noqa: E402


def gib(text: str) -> float:
    """A memory size in GiB: `80`, `80GiB` or `141 GiB`."""
    number = text.strip().removesuffix("GiB").removesuffix("gib").strip()
    try:
        value = float(number)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected GiB, like 80 or 80GiB, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


def parser() -> argparse.ArgumentParser:
    hw = Hardware()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama3", help="registered model name (model.name)")
    p.add_argument("--flavor", required=True, help="its flavor (model.flavor), e.g. 8B, 70B, 405B")
    p.add_argument("--ngpu", type=int, required=True, help="devices in the job")
    p.add_argument("--device-memory", type=gib, default=hw.device_memory_gib, help="GiB per device")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--global-batch", type=int, default=0, help="sequences per optimizer step (default: --ngpu)")
    p.add_argument("--gpus-per-node", type=int, default=hw.gpus_per_node)
    p.add_argument("--peak-tflops", type=float, default=hw.peak_tflops, help="dense bf16 TFLOP/s per device")
    p.add_argument("--efficiency", type=float, default=hw.efficiency, help="share of the peak the matmuls reach")
    p.add_argument("--intra-node-gbps", type=float, default=hw.intra_node_gbps, help="GB/s per device within a node")
    p.add_argument("--inter-node-gbps", type=float, default=hw.inter_node_gbps, help="GB/s per device across nodes")
    p.add_argument("--config", default="", help="a TOML config whose other options the job uses")
    p.add_argument("--tokenizer", default="", help="tokenizer file (default: the flavor's vocabulary size, no file)")
    p.add_argument("--top", type=int, default=3, help="layouts to print")
    p.add_argument("--max-dry-runs", type=int, default=8, help="dry runs to spend at most")
    p.add_argument("--json", action="store_true", help="also print the choices as one JSON line")
    return p


def main(argv: list[str] | None = None) -> int:
    ns = parser().parse_args(argv)
    init_logger()
    logging.getLogger("torchtitan").setLevel(logging.WARNING)
    start = time.perf_counter()
    try:
        vocab = 0
        if ns.tokenizer:
            from torchtitan.assets import resolve_path
            from torchtitan.datasets.tokenizer import tokenizer_from_file

            vocab = tokenizer_from_file(resolve_path(ns.tokenizer, "--tokenizer", UserError), "--tokenizer").n_words
        model = Model.from_flavor(ns.model, ns.flavor, vocab)
        hw = Hardware(ns.gpus_per_node, ns.device_memory, ns.peak_tflops, ns.efficiency, ns.intra_node_gbps,
                      ns.inter_node_gbps)
        base = ["--job.config_file", ns.config] if ns.config else []
        base += ["--model.name", ns.model, "--model.flavor", ns.flavor, "--training.compile=false",
                 "--training.mixed_precision_param", "auto"]
        base += ["--model.tokenizer_path", ns.tokenizer] if ns.tokenizer else ["--job.dry_run_vocab_size",
                                                                               str(model.vocab_size)]
        choices = plan(model, ns.ngpu, hw, ns.seq_len, ns.global_batch or ns.ngpu, base, ns.top, ns.max_dry_runs)
    except UserError as e:
        print(e.line, file=sys.stderr)
        return 2
    size = f"{model.n_params / 1e9:.1f}B" if model.n_params >= 1e9 else f"{model.n_params / 1e6:.0f}M"
    print(f"\n{model.name} {model.flavor} ({size} parameters) on {ns.ngpu} devices of "
          f"{ns.device_memory:g} GiB, seq {ns.seq_len}, global batch {ns.global_batch or ns.ngpu}: "
          f"{len(choices)} layouts that fit ({time.perf_counter() - start:.0f}s)")
    for i, c in enumerate(choices, 1):
        t = c.timing
        print(f"\n{i}. {c.layout.text()}: {c.peak_bytes / GiB:.1f} GiB at the peak; predicted "
              f"{t.tokens_per_second / ns.ngpu:,.0f} tokens/s per device (step {t.step:.2f}s: compute {t.compute:.2f}, "
              f"TP {t.tp:.2f}, CP {t.cp:.2f}, FSDP {t.fsdp:.2f}, bubble {t.bubble:.2f})")
        print("   " + " ".join(c.layout.overrides()))
    if ns.json:
        print(json.dumps([as_record(c) for c in choices]))
    if not choices:
        print("error: no layout considered fits; raise --ngpu or --device-memory, or lower --seq-len or --global-batch",
              file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
