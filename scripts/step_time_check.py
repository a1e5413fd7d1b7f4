#!/usr/bin/env -S sh -c 'exec "${0%/*}/project_python.sh" "$0" "$@"'
"""The planner's step-time model against real ranks: predicted and measured communication per
collective kind, and the step time, with their errors.

    .venv/bin/python scripts/step_time_check.py --layout fsdp4 --layout tp2_fsdp2 [--json out.json]
    .venv/bin/python scripts/step_time_check.py --nproc 4 -- --training.data_parallel_shard_degree 4

For each layout (a named one of LAYOUTS, or --nproc with trainer options after --) it trains a
short job on the debug model at sequence length 64 (`--steps`, the last step traced by the
trainer's own profiler: profiling.enable_profiling), then
- measures the steady step time: the median gap between consecutive metrics.jsonl rows (log_freq
  1) of steps 2 to steps - 2, before the profiler's warm-up and traced steps;
- measures each rank's collectives in the traced step by kind, their calls and bytes, from its
  trace (torchtitan/tools/comm_trace.py), as the mean over ranks;
- calibrates a `Hardware` for this machine just before the run: the fp32 matmul rate each rank
  reaches while all multiply at once (on an idle machine the peak at the ranks' threads,
  observability/metrics.py, over the ranks per core; both are reported), gloo's bandwidth and
  one call's latency while the peers compute, between the job's ranks (torchtitan/tools/comm_bench.py,
  all ranks at once), and the host's time per block and the kernels' share of the matmul peak at
  the rank's shapes (`probe`: the whole model eager in this process);
- runs the planner's `traffic` and `timing` for the same layout and precision, and prints a
  table: per kind predicted and measured calls and bytes with their relative error, the step
  time with its error (marked beyond TOLERANCE), the terms of the prediction, largest first, and
  the traced step's own split (torchtitan/tools/op_breakdown.py) with the machine's load.

`check(layout_args, nproc, runner=None, hosts=1)` is the same for another tool: `runner` trains
(a torchtitan.tools.runs.Runner, `run_trainer` by default: the launcher run_llama_train.sh execs),
`hosts` says over how many hosts it spreads the `nproc` ranks (nproc / hosts each, consecutive
ranks on one host), and `bench` runs the microbenchmark there (a callable taking the module
arguments and nproc, returning its output; by default torchrun on this host, which with several
hosts measures no link between hosts: the inter-host figures are then the intra-host ones). For
scripts/sim_cluster.py's simulated hosts: `runner=hosts_runner(hosts)`, and a `bench` that starts
`python -m torch.distributed.run --nnodes N --node-rank h --rdzv-backend c10d --rdzv-endpoint ...
--nproc_per_node nproc/N -m <module_args>` on every host as tests/machinery/netns.run_on_hosts
starts run_llama_train.sh, returning host 0's output (rank 0 prints the RESULT line).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's torchtitan, from any folder

from torchtitan.config.manager import parse_args  # noqa: E402
from torchtitan.errors import UserError  # noqa: E402
from torchtitan.estimation.planner import (  # noqa: E402
    KINDS,
    Hardware,
    Layout,
    Model,
    Precision,
    by_kind,
    timing,
    traffic,
)
from torchtitan.parallelisms.parallel_dims import parallel_dims_from_config  # noqa: E402
from torchtitan.tools import comm_trace  # noqa: E402
from torchtitan.tools.op_breakdown import load_breakdown, mean_breakdown  # noqa: E402
from torchtitan.tools.runs import Runner, read_metrics, run_trainer, trainer_env  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
TRACES = "profile_traces"
BASE_ARGS = ("--job.config_file", "bundled:train_configs/debug_model.toml", "--training.seq_len", "64",
             "--training.batch_size", "4", "--training.warmup_steps", "2", "--metrics.log_freq", "1",
             "--metrics.disable_color_printing")
MOE = "--model.name qwen3 --model.flavor tiny_moe"
# (ranks, trainer options): the layouts of docs/memory.md's table.
LAYOUTS = {
    "fsdp4": (4, "--training.data_parallel_shard_degree 4"),
    "tp2_fsdp2": (4, "--training.tensor_parallel_degree 2 --training.data_parallel_shard_degree 2"),
    "pp2_fsdp2": (4, "--experimental.pipeline_parallel_degree 2 --training.data_parallel_shard_degree 2"),
    "cp2_fsdp2": (4, "--experimental.context_parallel_degree 2 --training.data_parallel_shard_degree 2"),
    # EP 2 borrowed from FSDP 8: the experts sharded over the 4 ranks holding the same ones.
    "ep2_fsdp8_moe": (8, f"{MOE} --training.data_parallel_shard_degree 8 --training.expert_parallel_degree 2"),
    "hsdp2x2_tp2": (8, "--training.data_parallel_replicate_degree 2 --training.data_parallel_shard_degree 2 "
                       "--training.tensor_parallel_degree 2"),
}
# Relative errors above this are the model's to explain (docs/memory.md).
TOLERANCE = 0.25


def relative_error(predicted: float, measured: float) -> float | None:
    """(predicted - measured) / measured; None where nothing was measured (0 predicted too: 0)."""
    if measured == 0:
        return 0.0 if predicted == 0 else None
    return (predicted - measured) / measured


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def local_bench(module_args: Sequence[str], nproc: int) -> str:
    """Runs `python -m <module_args>` on `nproc` ranks of this host under torchrun; its output."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m",
           *module_args]
    result = subprocess.run(cmd, cwd=REPO_ROOT, env=trainer_env(), capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise UserError(f"the communication benchmark failed ({result.returncode}): {result.stderr[-2000:]}")
    return result.stdout


def bench_result(output: str) -> dict:
    """The microbenchmark's RESULT line (torchtitan/tools/comm_bench.py)."""
    line = next((text for text in output.splitlines() if text.startswith("RESULT ")), None)
    if line is None:
        raise UserError("the communication benchmark printed no RESULT line")
    return json.loads(line.split(" ", 1)[1])


def probe(model: Model, batch: int, seq: int, threads: int, repeats: int = 5) -> tuple[float, float]:
    """(host ms per block and pass, share of the matmul peak the model's kernels reach) on this
    machine, from the whole model, eager, in this process alone: a forward and backward of one
    token (next to no FLOPs: Python, dispatch and autograd, over the blocks) and of `batch` x `seq`
    (a rank's pass), whose FLOPs over the time beyond the first's measure the matmuls, norms,
    attention, the loss and the rest at the layout's shapes against the matmul peak
    (observability/metrics.py)."""
    import torch

    from torchtitan.models import get_train_spec
    from torchtitan.observability.metrics import cpu_peak_flops

    spec = get_train_spec(model.name)
    args = dataclasses.replace(spec.config[model.flavor], vocab_size=model.vocab_size)
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    net = spec.model_cls.from_model_args(args)
    net.init_weights()

    def seconds(batch: int, seq: int) -> float:
        ids = torch.zeros(batch, seq, dtype=torch.long)
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            net(ids).float().sum().backward()
            times.append(time.perf_counter() - start)
        return statistics.median(times[1:])

    one, many = seconds(1, 1), seconds(batch, seq)
    peak, _ = cpu_peak_flops(torch.float32)
    flops = model.flops_per_token(seq) * batch * seq
    return one * 1e3 / model.n_layers, min(1.0, flops / max(many - one, 1e-9) / peak)


def calibrate(model: Model, nproc: int, hosts: int, threads: int, bench: Callable[[Sequence[str], int], str],
              shape: tuple[int, int], overhead: bool = True) -> tuple[Hardware, dict]:
    """A Hardware for this machine's ranks (module docstring), and where each figure came from.
    `shape`: (sequences, tokens of each) of a rank's pass, for the kernels' efficiency (`probe`)."""
    import torch

    from torchtitan.observability.metrics import cpu_peak_flops

    per_host = nproc // hosts
    ranks_per_core = per_host * threads / _cores()
    torch.set_num_threads(threads)
    peak, source = cpu_peak_flops(torch.float32)
    measured = bench_result(bench(["torchtitan.tools.comm_bench"], nproc))
    # The rate the ranks reached multiplying at once, which also sees other load on the machine;
    # on an idle one it is the peak over the ranks per core.
    per_rank = measured.get("matmul_tflops", 0) * 1e12 or peak / max(1.0, ranks_per_core)
    intra = measured["intra"] or measured["world_fit"] or {"latency_us": 0.0, "gbps": 1e3}
    inter = measured["inter"] or intra
    # One call's wait with busy peers: the mean of pairs and the whole world (it hardly grows with the group).
    calls = [link["busy_call_us"] for link in (measured["intra"], measured["world_fit"]) if link and "busy_call_us" in link]
    intra_call = statistics.mean(calls) if calls else intra["latency_us"]
    inter_call = measured["inter"]["busy_call_us"] if measured["inter"] else intra_call
    layer_ms, efficiency = probe(model, *shape, threads) if overhead else (0.0, 1.0)
    hw = Hardware(gpus_per_node=per_host, device_memory_gib=0.0, peak_tflops=per_rank / 1e12, efficiency=efficiency,
                  intra_node_gbps=intra["gbps"], inter_node_gbps=inter["gbps"], intra_node_latency_us=intra_call,
                  inter_node_latency_us=inter_call, layer_overhead_ms=layer_ms * max(1.0, ranks_per_core),
                  overlap=ranks_per_core < 1, reduce_scatter_as_all_reduce=True, latency_per_call=True)
    return hw, {"peak_tflops": peak / 1e12, "peak_source": source, "ranks_per_core": ranks_per_core,
                "peak_over_ranks_per_core_tflops": peak / max(1.0, ranks_per_core) / 1e12, "bench": measured,
                "layer_overhead_ms_alone": layer_ms, "efficiency": efficiency}


def layout_of(args: Sequence[str], nproc: int) -> tuple[Layout, Precision, dict]:
    """The planner's Layout and Precision of a trainer command line on `nproc` ranks, and its model's
    name and flavor."""
    job = parse_args(list(args))
    dims = parallel_dims_from_config(job, nproc)
    t, e = job.training, job.experimental
    layout = Layout(dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp, dims.cp, job.activation_checkpoint.mode,
                    t.batch_size, t.gradient_accumulation_steps,
                    (e.pipeline_parallel_microbatches if e.pipeline_parallel_microbatches > 0 else dims.pp)
                    if dims.pp > 1 else 0, e.pipeline_parallel_schedule, dims.ep > 1, dims.ep,
                    getattr(job.moe, "capacity_factor", None), t.fsdp_reshard_after_forward)
    precision = Precision.of_job(t.mixed_precision_param, t.mixed_precision_reduce, "cpu")
    return layout, precision, {"name": job.model.name, "flavor": job.model.flavor, "seq_len": t.seq_len}


def steady_step_seconds(rows: list[dict], steps: int) -> list[float]:
    """Gaps between consecutive step rows of steps 2 to steps - 2 (each row written after its step)."""
    times = {r["step"]: r["time"] for r in rows}
    return [times[s] - times[s - 1] for s in range(2, steps - 1) if s in times and s - 1 in times]


def check(layout_args: Sequence[str], nproc: int, runner: Runner | None = None, hosts: int = 1, *, steps: int = 6,
          threads: int = 1, bench: Callable[[Sequence[str], int], str] | None = None, hardware: Hardware | None = None,
          dump: str | Path | None = None, timeout: float = 900) -> dict:
    """Trains `layout_args` (trainer options on top of BASE_ARGS) on `nproc` ranks over `hosts`
    hosts and compares the planner's prediction with what it measured (module docstring).
    `hardware`: use these figures instead of calibrating. Returns the report as a dict."""
    if steps < 4:
        raise UserError(f"--steps must be at least 4 (steady steps 2 to steps - 2, then the profiler's), got {steps}")
    if nproc % hosts:
        raise UserError(f"{nproc} ranks do not spread evenly over {hosts} hosts")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(dump or tmp)
        args = [*BASE_ARGS, *layout_args, "--training.steps", str(steps), "--job.dump_folder", str(folder),
                "--profiling.enable_profiling", "--profiling.profile_freq", str(steps),
                "--profiling.save_traces_folder", TRACES]
        layout, precision, named = layout_of(args, nproc)
        model = Model.from_flavor(named["name"], named["flavor"], _vocab_size(args))
        layout = dataclasses.replace(layout, moe=model.is_moe)
        calibration = {}
        if hardware is None:  # just before the run, so that both meet the same load
            micro = max(1, layout.microbatches) if layout.pp > 1 else 1
            shape = (max(1, layout.batch_size // micro), named["seq_len"] // layout.cp)
            hardware, calibration = calibrate(model, nproc, hosts, threads, bench or local_bench, shape)
        load_before = os.getloadavg()[0]
        (runner or _run_in_repo)(args, nproc, timeout=timeout, check=True,
                                 extra_env={"OMP_NUM_THREADS": str(threads)})
        load_after = os.getloadavg()[0]
        traces = sorted((folder / TRACES / f"iteration_{steps}").glob("rank*_trace.json"),
                        key=lambda p: int(re.findall(r"\d+", p.name)[0]))
        if len(traces) != nproc:
            raise UserError(f"expected {nproc} traces of step {steps} in {folder / TRACES}, found {len(traces)}")
        ranks = comm_trace.read_rank_traces(traces)
        traced = mean_breakdown([load_breakdown(p) for p in traces]).exposure()
        gaps = steady_step_seconds(read_metrics(folder), steps)
    seq = named["seq_len"]
    global_batch = layout.batch_size * layout.accum * layout.dp_replicate * layout.dp_shard
    # Dropless routing: the mean over ranks is the even share (imbalance 1), which the trace's mean shows.
    predicted = by_kind(traffic(model, layout, hardware, seq, global_batch, imbalance=1.0, precision=precision))
    measured = comm_trace.mean_over_ranks(ranks)
    t = timing(model, layout, hardware, seq, global_batch, imbalance=1.0, precision=precision)
    step = statistics.median(gaps) if gaps else math.nan
    collectives = {}
    for kind in dict.fromkeys([*KINDS, *measured]):
        p, m = predicted.get(kind, {"count": 0.0, "bytes": 0.0}), measured.get(kind, {"count": 0.0, "bytes": 0.0})
        collectives[kind] = {"predicted": p, "measured": m, "count_error": relative_error(p["count"], m["count"]),
                             "bytes_error": relative_error(p["bytes"], m["bytes"])}
    terms = t.terms()
    return {"args": list(layout_args), "nproc": nproc, "hosts": hosts, "threads": threads, "layout": layout.text(),
            "precision": dataclasses.asdict(precision), "hardware": dataclasses.asdict(hardware),
            "calibration": calibration, "collectives": collectives, "per_rank": ranks,
            "step": {"predicted_s": t.step, "measured_s": step, "samples_s": gaps,
                     "error": relative_error(t.step, step),
                     "beyond_tolerance": abs(relative_error(t.step, step) or 0.0) > TOLERANCE},
            "traced_step_ms": traced, "load_average": [load_before, load_after],
            "terms_s": terms, "dominant": sorted((k for k in terms if terms[k] > 0), key=lambda k: -terms[k])}


def _vocab_size(args: Sequence[str]) -> int:
    """The vocabulary the trainer builds the model with: its tokenizer's (the flavor's without one)."""
    from torchtitan.assets import resolve_path
    from torchtitan.datasets.tokenizer import tokenizer_from_file

    path = parse_args(list(args)).model.tokenizer_path
    return tokenizer_from_file(resolve_path(path, "model.tokenizer_path", UserError), "model.tokenizer_path").n_words \
        if path else 0


def _run_in_repo(args: Sequence[str], nproc: int = 1, **kwargs):
    return run_trainer(args, nproc, cwd=REPO_ROOT, **kwargs)


def _percent(error: float | None) -> str:
    return "n/a" if error is None else f"{100 * error:+.1f} %"


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.3f}"


def table(report: dict) -> str:
    """The report as markdown: collectives by kind, then the step."""
    lines = [f"**{report['layout']}** ({report['nproc']} ranks"
             + (f" on {report['hosts']} hosts" if report["hosts"] > 1 else "") + ")", "",
             "| kind | calls predicted | calls measured | error | MiB predicted | MiB measured | error |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for kind, row in report["collectives"].items():
        p, m = row["predicted"], row["measured"]
        if p["count"] or m["count"]:
            lines.append(f"| {kind} | {p['count']:g} | {m['count']:g} | {_percent(row['count_error'])} | "
                         f"{_mib(p['bytes'])} | {_mib(m['bytes'])} | {_percent(row['bytes_error'])} |")
    step, terms, traced = report["step"], report["terms_s"], report["traced_step_ms"]
    shares = ", ".join(f"{k} {1e3 * terms[k]:,.1f}" for k in report["dominant"])
    lines += ["", f"step: predicted {1e3 * step['predicted_s']:,.1f} ms, measured {1e3 * step['measured_s']:,.1f} ms "
                  f"(median of {len(step['samples_s'])}), error {_percent(step['error'])}"
                  + (f" (beyond {TOLERANCE:.0%})" if step["beyond_tolerance"] else ""),
              f"predicted terms, ms: {shares}",
              f"the traced step, ms (mean over ranks): compute {traced['compute']:,.1f}, exposed communication "
              f"{traced['exposed_comm']:,.1f}, idle/other {traced['other']:,.1f} (overlapped communication "
              f"{traced['overlapped_comm']:,.1f}); load average {report['load_average'][0]:.1f} before the run, "
              f"{report['load_average'][1]:.1f} after"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[2:]))
    parser.add_argument("--layout", action="append", choices=sorted(LAYOUTS), default=[],
                        help="a named layout (repeatable; default: all of them unless --nproc is given)")
    parser.add_argument("--nproc", type=int, default=0, help="ranks of a layout given by options after --")
    parser.add_argument("--steps", type=int, default=6, help="steps to train; the last is traced (at least 4)")
    parser.add_argument("--threads", type=int, default=1, help="OMP threads per rank")
    parser.add_argument("--json", metavar="PATH", help="also write the reports as JSON to PATH ('-': stdout only)")
    parser.add_argument("overrides", nargs="*", help="trainer options, after --")
    ns = parser.parse_args(argv)
    runs = [(name, *LAYOUTS[name]) for name in ns.layout]
    if ns.nproc:
        runs.append(("custom", ns.nproc, " ".join(ns.overrides)))
    elif ns.overrides:
        parser.error("trainer options after -- need --nproc")
    runs = runs or [(name, *spec) for name, spec in LAYOUTS.items()]
    reports = []
    try:
        for name, nproc, options in runs:
            report = {"name": name, **check(options.split(), nproc, steps=ns.steps, threads=ns.threads)}
            reports.append(report)
            if ns.json != "-":
                print(table(report) + "\n", flush=True)
    except UserError as e:
        print(e.line, file=sys.stderr)
        return 2
    if ns.json:
        text = json.dumps(reports, indent=1)
        if ns.json == "-":
            print(text)
        else:
            Path(ns.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
