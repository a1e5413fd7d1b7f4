#!/usr/bin/env -S sh -c 'exec "${0%/*}/project_python.sh" "$0" "$@"'
"""This stack against torchtitan 0.3.0 (the anchor) on the same machine: the same Llama 3 shape,
synthetic batches, seq, batch, compile, activation checkpointing and fused AdamW, A and B
alternating, each in its own process (scripts/side_by_side_worker.py says what each side runs).

    scripts/setup_anchor.sh                      # once: the anchor's environment, .venv-anchor
    scripts/side_by_side.py --shapes debug --seq 256 --batch 2 --steps 6 --rounds 3      # CPU
    scripts/side_by_side.py --shapes 1B 3B 8B --seq 8192 --batch 1 --compile --ac selective \\
        --anchor-site /tmp/anchor-site --out side_by_side.json                          # a GPU

Prints a table: tokens/s (on CPU also tokens per CPU-second, the figure a shared machine does not
move), TFLOP/s and MFU against the datasheet (CPU: the measured matmul) peak, the peak allocated
memory, and ours / anchor ratios; the report JSON has every run. The anchor's interpreter is
--anchor-python (default: .venv-anchor/bin/python, else this one with --anchor-site, the folder
of a `pip install --target` of its wheels). A side that fails is reported with its last error
line, and the ratio is left out. Exit status: 1 if any run failed, else 0. A benchmark: it
asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # the checkout's torchtitan (its FLOP peaks), also where it is not installed
WORKER = REPO_ROOT / "scripts" / "side_by_side_worker.py"
RESULT_PREFIX = "SIDE_BY_SIDE "
STACKS = ("anchor", "ours")


def _at_least(low: int):
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value
    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["debug"], choices=("debug", "1B", "3B", "8B"))
    p.add_argument("--seq", type=_at_least(1), default=256)
    p.add_argument("--batch", type=_at_least(1), default=2)
    p.add_argument("--steps", type=_at_least(1), default=6, help="timed steps a run")
    p.add_argument("--warmup", type=_at_least(0), default=2, help="untimed steps first (compilation, allocator warm-up)")
    p.add_argument("--rounds", type=_at_least(1), default=2, help="runs of each side a shape, alternating A/B")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--ac", choices=("none", "full", "selective"), default="none")
    p.add_argument("--float8", choices=("none", "rowwise"), default="none",
                   help="both sides with torchao's float8 rowwise recipe (the anchor has no tensorwise)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default=None)
    p.add_argument("--anchor-attention", choices=("flex", "sdpa"), default=None)
    p.add_argument("--anchor-python", default=None)
    p.add_argument("--anchor-site", default=None)
    p.add_argument("--ours-python", default=sys.executable)
    p.add_argument("--threads", type=int, default=None,
                   help="OMP_NUM_THREADS of each run; default 1 on a CPU-only machine, where a single thread's "
                        "CPU time is its work whatever else runs (more threads spin while they wait, and a busy "
                        "machine bills that spinning to the run), else torch's own default")
    p.add_argument("--timeout", type=float, default=900, help="seconds a run may take")
    p.add_argument("--budget-seconds", type=float, default=None,
                   help="time for all runs: a run is not started with less than --min-seconds left, and none is "
                        "given more than what is left (a lent GPU's call has a limit)")
    p.add_argument("--min-seconds", type=float, default=60)
    p.add_argument("--out", default=None, help="report JSON")
    p.set_defaults(untied=False)  # main() sets it from the anchor's release
    return p.parse_args(argv)


def anchor_python(args: argparse.Namespace) -> str:
    if args.anchor_python:
        return args.anchor_python
    venv = REPO_ROOT / ".venv-anchor" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def anchor_version(args: argparse.Namespace) -> tuple[str | None, str]:
    """The anchor's torchtitan release and where it is, as its interpreter and site see it; (None,
    why) where it has none."""
    site = [f for f in [args.anchor_site, *os.environ.get("PYTHONPATH", "").split(os.pathsep)] if f]
    code = ("import sys; sys.path[:0] = sys.argv[1:]; from importlib import metadata; import torchtitan; "
            "print(metadata.version('torchtitan')); print(torchtitan.__file__)")
    try:
        done = subprocess.run([anchor_python(args), "-I", "-c", code, *site], capture_output=True, text=True,
                              timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, str(e)
    lines = done.stdout.split()
    if done.returncode != 0 or len(lines) < 2:
        return None, last_error(done.stdout + done.stderr)
    if Path(lines[1]).resolve().is_relative_to(REPO_ROOT / "torchtitan"):
        return None, f"its `torchtitan` is this repository ({lines[1]}), not a release"
    return lines[0], lines[1]


def worker_command(stack: str, shape: str, args: argparse.Namespace, seed: int) -> list[str]:
    """The worker's command line; `-I` keeps this repository (and PYTHONPATH) off the anchor's path."""
    python, own = (args.ours_python, str(REPO_ROOT)) if stack == "ours" else (anchor_python(args), args.anchor_site)
    # `-I` drops PYTHONPATH: its folders (the GPU machine's carried wheels) follow the side's own.
    site = os.pathsep.join(filter(None, [own, os.environ.get("PYTHONPATH", "")]))
    cmd = [python, "-I", str(WORKER), "--stack", stack, "--shape", shape, "--seq", str(args.seq),
           "--batch", str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--ac", args.ac, "--float8", args.float8, "--seed", str(seed)]
    for flag, value in (("--site", site), ("--dtype", args.dtype), ("--anchor-attention", args.anchor_attention)):
        if value:
            cmd += [flag, value]
    return cmd + (["--compile"] if args.compile else []) + (["--untied"] if args.untied else [])


def parse_result(output: str) -> dict | None:
    """The worker's result line (the last one) as a dict, None without one."""
    lines = [line for line in output.splitlines() if line.startswith(RESULT_PREFIX)]
    return json.loads(lines[-1][len(RESULT_PREFIX):]) if lines else None


def last_error(output: str) -> str:
    """The line that says why a run failed: the last exception line, else the last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line.split(":")[0] or line.startswith("error:")]
    return (errors or lines or ["no output"])[-1][:400]


def run_side(stack: str, shape: str, args: argparse.Namespace, seed: int, timeout: float | None = None) -> dict:
    """One run of one side: its result, or {"error": ...}."""
    timeout = args.timeout if timeout is None else timeout
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    with tempfile.TemporaryDirectory(prefix=f"side_by_side_{stack}_") as work:
        env["SIDE_BY_SIDE_DUMP"] = work
        # Its own process group, so that a timeout stops what it started too (compile workers).
        proc = subprocess.Popen(worker_command(stack, shape, args, seed), cwd=work, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return {"stack": stack, "shape": shape, "error": f"timed out after {timeout:.0f} s"}
        done = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    output = done.stdout + done.stderr
    result = parse_result(done.stdout) if done.returncode == 0 else None
    if result is not None:
        return result
    if done.returncode < 0:  # a signal: the output's last line is wherever the process was
        why = f"killed by signal {-done.returncode}" + (" (out of memory, most likely)" if done.returncode == -9 else "")
    else:
        why = f"exit {done.returncode}: {last_error(output)}"
    return {"stack": stack, "shape": shape, "error": why}


def peak_flops(device: str, dtype: str) -> tuple[float | None, str]:
    """The peak the MFU divides by: the datasheet's dense figure of a GPU, the measured matmul peak of
    a CPU (this stack's figures, torchtitan.observability.metrics)."""
    import torch

    from torchtitan.observability.metrics import cpu_peak_flops, gpu_peak_flops, measure_cpu_peak_flops, raise_cpu_peak
    torch_dtype = getattr(torch, dtype)
    if device == "cpu":
        # The cached figure may have been measured on a busy machine: measured again (a second), the
        # higher kept, for these runs and later ones.
        cached, source = cpu_peak_flops(torch_dtype)
        now = measure_cpu_peak_flops(torch_dtype)
        if now > cached:
            raise_cpu_peak(torch_dtype, now)
            return now, "measured now (above the cached figure, which it replaces)"
        return cached, source
    peak = gpu_peak_flops(device, torch_dtype)
    return peak, "datasheet" if peak else "unknown GPU"


def summarise(runs: list[dict], peaks: dict[tuple[str, str], tuple[float | None, str]] | None = None) -> list[dict]:
    """One row a shape: each side's median tokens/s (and tokens per CPU-second) over its rounds,
    TFLOP/s and MFU, peak memory; ours / anchor ratios where both ran and have the same parameters."""
    rows = []
    for shape in dict.fromkeys(r["shape"] for r in runs):
        row: dict = {"shape": shape}
        for stack in STACKS:
            ok = [r for r in runs if r["shape"] == shape and r["stack"] == stack and "error" not in r]
            failed = [r["error"] for r in runs if r["shape"] == shape and r["stack"] == stack and "error" in r]
            side: dict = {"runs": len(ok), "errors": failed}
            if ok:
                tps = statistics.median(r["tokens_per_second"] for r in ok)
                cpu = [r["tokens_per_cpu_second"] for r in ok if r.get("tokens_per_cpu_second")]
                mem = [r["memory_peak_gib"] for r in ok if r.get("memory_peak_gib") is not None]
                first = ok[0]
                peak, source = (peaks or {}).get((first["device"], first["dtype"]), (None, "not given"))
                tflops = tps * first["flops_per_token"] / 1e12
                side.update({"tokens_per_second": tps, "tokens_per_cpu_second": statistics.median(cpu) if cpu else None,
                             "tflops": tflops, "mfu_percent": 100 * tflops * 1e12 / peak if peak else None,
                             "peak_source": source, "memory_peak_gib": max(mem) if mem else None,
                             "params": first["params"], "device": first["device"], "dtype": first["dtype"],
                             "attention": first.get("attention"), "version": first.get("stack_version"),
                             "last_loss": statistics.median(r["last_loss"] for r in ok)})
            row[stack] = side
        row.update(ratios(row["anchor"], row["ours"]))
        rows.append(row)
    return rows


def ratios(anchor: dict, ours: dict) -> dict:
    """ours / anchor (memory: ours / anchor too, below 1 is less); none where a side did not run or
    the two built different models (parameter counts differ: not the same shape)."""
    if not anchor.get("runs") or not ours.get("runs"):
        return {"ratio_note": "a side did not run"}
    if anchor["params"] != ours["params"]:
        return {"ratio_note": f"not the same model: {ours['params']:,} parameters in ours, {anchor['params']:,} in the anchor"}
    out = {"tokens_per_second_ratio": ours["tokens_per_second"] / anchor["tokens_per_second"]}
    if ours.get("tokens_per_cpu_second") and anchor.get("tokens_per_cpu_second"):
        out["tokens_per_cpu_second_ratio"] = ours["tokens_per_cpu_second"] / anchor["tokens_per_cpu_second"]
    if ours.get("memory_peak_gib") and anchor.get("memory_peak_gib"):
        out["memory_ratio"] = ours["memory_peak_gib"] / anchor["memory_peak_gib"]
    return out


def table(rows: list[dict]) -> str:
    def fmt(value, spec):
        return format(value, spec) if isinstance(value, (int, float)) else "-"

    lines = ["| shape | stack | tokens/s | tokens/CPU-s | TFLOP/s | MFU % | peak GiB | final loss |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        for stack in STACKS:
            side = row[stack]
            if not side["runs"]:
                lines.append(f"| {row['shape']} | {stack} | failed: {'; '.join(side['errors'])[:200]} | | | | | |")
                continue
            lines.append(f"| {row['shape']} | {stack} {side.get('version') or ''} ({side['attention']}) | "
                         f"{fmt(side['tokens_per_second'], ',.0f')} | {fmt(side['tokens_per_cpu_second'], ',.0f')} | "
                         f"{fmt(side['tflops'], '.2f')} | {fmt(side['mfu_percent'], '.1f')} | "
                         f"{fmt(side['memory_peak_gib'], '.2f')} | {fmt(side['last_loss'], '.4f')} |")
        ratio = [f"{k.replace('_ratio', '').replace('_', ' ')} {v:.3f}" for k, v in row.items() if k.endswith("_ratio")]
        lines.append(f"| {row['shape']} | ours / anchor | {', '.join(ratio) or row.get('ratio_note', '-')} | | | | | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads is None and not _has_cuda():
        args.threads = 1
    version, where = anchor_version(args)
    if version is None:
        print(f"error: no anchor to compare with: {anchor_python(args)} finds no torchtitan release ({where}); "
              "run scripts/setup_anchor.sh, or give --anchor-python / --anchor-site", file=sys.stderr)
        return 2
    # torchtitan 0.2 cannot tie the embedding to the output projection: 1B and 3B run untied on
    # both sides against it (the same model either way; Llama 3.2 itself ties them).
    args.untied = version.startswith(("0.1", "0.2"))
    print(f"anchor: torchtitan {version} ({where}); 1B and 3B {'untied' if args.untied else 'tied'}", flush=True)
    runs, started = [], time.monotonic()
    for shape in args.shapes:
        for round_ in range(args.rounds):
            # A/B alternating, the first side swapped each round, so drift (clocks, heat, other
            # load) falls on both; every run of a round has the same batches (its seed).
            for stack in (STACKS if round_ % 2 == 0 else STACKS[::-1]):
                left = args.budget_seconds - (time.monotonic() - started) if args.budget_seconds else args.timeout
                if args.budget_seconds and left < args.min_seconds:
                    result = {"stack": stack, "shape": shape, "error": "not started: the time budget was spent"}
                else:
                    result = run_side(stack, shape, args, seed=round_, timeout=min(args.timeout, left))
                runs.append(result)
                status = result.get("error") or f"{result['tokens_per_second']:,.0f} tokens/s"
                print(f"{shape} round {round_ + 1} {stack}: {status}", flush=True)
    devices = {(r["device"], r["dtype"]) for r in runs if "error" not in r}
    peaks = {key: peak_flops(*key) for key in devices}
    rows = summarise(runs, peaks)
    print(table(rows))
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows, "runs": runs}, indent=1))
        print(f"report: {args.out}")
    return 1 if any("error" in r for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
