#!/usr/bin/env -S sh -c 'exec "${0%/*}/project_python.sh" "$0" "$@"'
"""Plans a parallel layout before queueing: the fastest layouts of a model that fit the cluster.

  python scripts/plan_layout.py --model llama3 --flavor 70B --ngpu 256 --device-memory 80

Enumerates layouts (tensor parallel within a node, pipeline stages, FSDP or HSDP, context parallel
for long sequences, activation checkpointing, gradient accumulation; for mixture-of-experts models
expert parallelism and dropless vs capacity-factor routing), ranks them by an analytic step-time
model (torchtitan/estimation/planner.py states every assumption), confirms with the dry run (fake
tensors, this process, no GPU) that the fastest fit in the device's memory, and prints them as
ready-to-paste options with their memory by category and predicted tokens/s. docs/memory.md and
docs/moe.md explain.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's torchtitan, from any folder

from torchtitan.errors import UserError
from torchtitan.estimation.planner import (  # noqa: E402
    EXPERT_IMBALANCE,
    SCREEN_MARGIN,
    GiB,
    Hardware,
    Model,
    NothingFits,
    as_record,
    capacity_option_available,
    plan,
)
from torchtitan.estimation.tracker import CATEGORIES  # noqa: E402
from torchtitan.observability.logging import init_logger  # noqa: E402

MAX_NGPU = 1 << 20  # beyond any cluster; keeps a mistyped count from enumerating for hours


class _OneLineParser(argparse.ArgumentParser):
    """argparse that reports a mistake as one `error:` line (exit 2), as the trainer does."""

    def error(self, message: str):
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def _number(kind: type, low: float, high: float = math.inf, low_inclusive: bool = False):
    def parse(text: str):
        try:
            value = kind(text.strip().removesuffix("GiB").removesuffix("gib").strip() if kind is float else text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value) or value > high or (value < low if low_inclusive else value <= low):
            bound = f">= {low:g}" if low_inclusive else f"> {low:g}"
            raise argparse.ArgumentTypeError(f"must be {bound}{f' and <= {high:,.10g}' if high < math.inf else ''}, "
                                             f"got {text!r}")
        return value
    return parse


positive_int = _number(int, 0)


def _capacity_factors(text: str) -> tuple[float, ...]:
    """`1.25` or `1.0,1.25`; `none` (or empty) compares no dropping mode with dropless."""
    if text.strip().lower() in ("", "none"):
        return ()
    parse = _number(float, 0)
    return tuple(parse(part) for part in text.split(","))
gib = _number(float, 0)  # 80, 80GiB or 141 GiB


def parser() -> argparse.ArgumentParser:
    hw = Hardware()
    p = _OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama3", help="registered model name (model.name)")
    p.add_argument("--flavor", required=True, help="its flavor (model.flavor), e.g. 8B, 70B, 405B")
    p.add_argument("--ngpu", type=_number(int, 0, MAX_NGPU), required=True, help="devices in the job")
    p.add_argument("--device-memory", type=gib, default=hw.device_memory_gib, help="GiB per device (80 or 80GiB)")
    p.add_argument("--seq-len", type=positive_int, default=8192)
    p.add_argument("--global-batch", type=_number(int, 0, low_inclusive=True), default=0,
                   help="sequences per optimizer step (default: --ngpu)")
    p.add_argument("--gpus-per-node", type=positive_int, default=hw.gpus_per_node)
    p.add_argument("--peak-tflops", type=_number(float, 0), default=hw.peak_tflops, help="dense bf16 TFLOP/s per device")
    p.add_argument("--efficiency", type=_number(float, 0, 1), default=hw.efficiency,
                   help="share of the peak the matmuls reach (0 to 1)")
    p.add_argument("--intra-node-gbps", type=_number(float, 0), default=hw.intra_node_gbps,
                   help="GB/s per device within a node")
    p.add_argument("--inter-node-gbps", type=_number(float, 0), default=hw.inter_node_gbps,
                   help="GB/s per device across nodes")
    p.add_argument("--config", default="", help="a TOML config whose other options the job uses")
    p.add_argument("--tokenizer", default="", help="tokenizer file (default: the flavor's vocabulary size, no file)")
    p.add_argument("--top", type=positive_int, default=3, help="layouts to print")
    p.add_argument("--max-dry-runs", type=positive_int, default=8, help="dry runs to spend at most")
    p.add_argument("--capacity-factors", type=_capacity_factors, default=None,
                   help="MoE models: moe.capacity_factor values compared with dropless routing, comma-separated "
                        "(default 1.25; none: dropless only); needs a build with moe.capacity_factor")
    p.add_argument("--expert-imbalance", type=_number(float, 1, low_inclusive=True), default=EXPERT_IMBALANCE,
                   help="MoE models, dropless routing under expert parallelism: the busiest rank's tokens over the "
                        "even share, budgeted in memory and time (>= 1; a run logs `experts max/mean`)")
    p.add_argument("--json", action="store_true", help="also print the choices as one JSON line")
    return p


def job_options(ns: argparse.Namespace) -> list[str]:
    """What the printed layouts assume of the job besides the layout: model, sequence, config and
    tokenizer (the plan is for GPUs: mixed_precision_param auto computes in bf16 there)."""
    options = ["--job.config_file", ns.config] if ns.config else []
    options += ["--model.name", ns.model, "--model.flavor", ns.flavor, "--training.seq_len", str(ns.seq_len)]
    return options + (["--model.tokenizer_path", ns.tokenizer] if ns.tokenizer else [])


def memory_lines(choice) -> list[str]:
    """The most loaded simulated rank's memory at its peak, by category (and the experts' share)."""
    rank = choice.estimate.largest
    m = rank.memory
    lines = [f"rank {rank.rank} at its peak, GiB: " + ", ".join(f"{c} {m.at_peak[c] / GiB:.2f}" for c in CATEGORIES)]
    if m.experts:
        e = {k: v / GiB for k, v in m.experts.items()}
        lines.append(f"of which experts: parameters {e['expert parameters']:.2f}, optimizer {e['expert optimizer']:.2f}; "
                     f"one MoE layer's dispatch buffers {e['dispatch buffers']:.2f}")
    return lines


def why_none_fit(ns: argparse.Namespace, model: Model, nothing: NothingFits) -> str:
    """The line for a plan where no layout fits: what stopped it, and the options that would change that."""
    larger = "raise --ngpu or --device-memory, or lower --seq-len or --global-batch"
    choices, dry_runs = nothing.choices, nothing.dry_runs
    under = [c for c in choices if c.screened_bytes <= ns.device_memory * GiB * SCREEN_MARGIN]
    if not under:
        least = min(choices, key=lambda c: c.screened_bytes)
        return (f"no layout of {model.name} {model.flavor} on {ns.ngpu} devices fits {ns.device_memory:g} GiB by the "
                f"rough memory figure (the smallest, {least.layout.text()}, needs about "
                f"{least.screened_bytes / GiB:.3g} GiB), so none was dry-run: {larger}")
    if not dry_runs:
        first = next(c.refused for c in choices if c.refused)
        return f"the config checks refused every layout tried, the first with: {first}"
    untried = sum(1 for c in under if c.estimate is None and not c.refused)
    if untried and dry_runs == ns.max_dry_runs:
        return (f"none of the {dry_runs} layouts dry-run fits, and {untried} more pass the rough memory figure: raise "
                f"--max-dry-runs to try them, or {larger}")
    least = min((c for c in under if c.estimate is not None), key=lambda c: c.peak_bytes)
    return (f"none of the {len(under)} layouts under the rough memory figure fits by the dry run (the smallest, "
            f"{least.layout.text()}, needs {least.peak_bytes / GiB:.3g} GiB): {larger}")


def main(argv: list[str] | None = None) -> int:
    ns = parser().parse_args(argv)
    init_logger()
    logging.getLogger("torchtitan").setLevel(logging.WARNING)
    start = time.perf_counter()
    try:
        vocab = 0
        if ns.config:
            from torchtitan.assets import resolve_path

            if not Path(resolve_path(ns.config, "--config", UserError)).is_file():
                raise UserError(f"--config file not found: {ns.config}")
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
        if ns.capacity_factors and not capacity_option_available():
            raise UserError("--capacity-factors needs a build with moe.capacity_factor (the dropping mode); this one "
                            "routes dropless only: leave the option out")
        choices = plan(model, ns.ngpu, hw, ns.seq_len, ns.global_batch or ns.ngpu, base, ns.top, ns.max_dry_runs,
                       capacity_factors=ns.capacity_factors, imbalance=ns.expert_imbalance)
    except NothingFits as e:
        print(f"error: {why_none_fit(ns, model, e)}", file=sys.stderr)
        return 2
    except UserError as e:
        print(e.line, file=sys.stderr)
        return 2
    size = f"{model.n_params / 1e9:.1f}B" if model.n_params >= 1e9 else f"{model.n_params / 1e6:.0f}M"
    print(f"\n{model.name} {model.flavor} ({size} parameters) on {ns.ngpu} devices of "
          f"{ns.device_memory:g} GiB, seq {ns.seq_len}, global batch {ns.global_batch or ns.ngpu}: "
          f"{len(choices)} layouts that fit ({time.perf_counter() - start:.0f}s)")
    for i, c in enumerate(choices, 1):
        t = c.timing
        terms = ", ".join(f"{name} {seconds:.3g}" for name, seconds in t.terms().items() if seconds)
        print(f"\n{i}. {c.layout.text()}: {c.peak_bytes / GiB:.3g} GiB at the peak; predicted "
              f"{t.tokens_per_second / ns.ngpu:,.0f} tokens/s per device (step {t.step:.3g}s: {terms})")
        for line in memory_lines(c):
            print("   " + line)
        print("   " + " ".join(job_options(ns) + c.layout.overrides()))
    if ns.json:
        print(json.dumps([{**as_record(c), "options": job_options(ns) + c.layout.overrides()} for c in choices]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
