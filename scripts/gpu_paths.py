#!/usr/bin/env -S sh -c 'exec "${0%/*}/project_python.sh" "$0" "$@"'
"""The GPU paths check: every CUDA path of the stack that no GPU has run yet, run once, with a
pass/fail line and a figure each, and the one-GPU scale runs (8B, 3B at 2 x 8192, float8 rowwise,
a profile of the 3B step). Written like scripts/gpu_check.py (it reuses its trainer runs, memory
estimates and report conventions) and documented beside it in docs/gpu_check.md.

    scripts/gpu_paths.py --part scale [--out gpu_paths.json] [--budget-seconds 540]
    scripts/gpu_paths.py --part paths
    scripts/gpu_paths.py --dry [--part all]       # the same checks on CPU with tiny stand-ins (CI)

Parts (each fits one call of a lent GPU; `all` runs both, in this order):
  scale  train_8b          Llama 3 8B on one GPU: seq 8192, bf16 optimizer state, activation
                           checkpointing (selective by op where the dry run says it fits, else
                           full), compiled; tokens/s, MFU, peak memory against the dry run of the
                           same configuration (`estimate_error_percent`, within 10 % or say why)
         float8_rowwise_8b the 8B run with float8.recipe rowwise; `speedup_vs_bf16`
         train_3b_2x8k     Llama 3.2 3B at 2 x 8192 tokens, compiled, profiled at its last step:
                           the step's time by category (torchtitan/tools/op_breakdown.py) and the
                           three largest costs outside matmuls and attention (`largest_other`)
         float8_rowwise_3b_2x8k, float8_tensorwise_3b_2x8k: the 3B run in float8; `speedup_vs_bf16`
  paths  step_agreement_2_ranks  trainer/agreement.py on two processes sharing the GPU (gloo with
                           CUDA tensors: pinned copy and event): both ranks agree on one rank's stop
                           signal and the other's non-finite loss
         flex_docmask_compiled   document masks (FlexAttention on CUDA) under torch.compile
         chunked_loss_compiled   training.loss_chunk_size with Llama 3's 128K vocabulary, compiled
         offload_pinned    activation_checkpoint.offload all in a compiled run (pinned copies on a side stream)
         qwen3_moe_compiled_dropless, qwen3_moe_compiled_capacity, dsv3_compiled_dropless,
         dsv3_compiled_capacity: the MoE debug models compiled, dropless and with moe.capacity_factor 1.25

Runs go in priority order within --budget-seconds (540 by default: one call of the device tool,
with a minute for the last run to stop); what the budget leaves no time for is recorded as
`timeout` ("not started"). Exit status 1 if any check failed or timed out. --dry: tiny models,
seq 128, 3 steps, fp32, no compile, float8 emulated; the step agreement on CPU tensors.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check as base  # noqa: E402 - the GPU check's runs, estimates and report conventions

from torchtitan.tools.runs import read_metrics  # noqa: E402

GiB = base.GiB
SCHEMA_VERSION = 1
PARTS = {"scale": ("train_8b", "float8_rowwise_8b", "train_3b_2x8k", "float8_rowwise_3b_2x8k",
                   "float8_tensorwise_3b_2x8k"),
         "paths": ("step_agreement_2_ranks", "flex_docmask_compiled", "chunked_loss_compiled", "offload_pinned",
                   "qwen3_moe_compiled_dropless", "qwen3_moe_compiled_capacity", "dsv3_compiled_dropless",
                   "dsv3_compiled_capacity")}
PARTS["all"] = PARTS["scale"] + PARTS["paths"]
# Outside matmuls and attention: the categories whose time a profile can point at as ours to cut.
NOT_COMPUTE = ("elementwise", "copy", "loss", "communication", "optimizer", "other")


@dataclasses.dataclass(frozen=True)
class Setting:
    dry: bool
    seq_len: int  # the long runs' sequence
    steps: int
    left_out: int  # first steps not averaged
    compile: bool
    dtype: str
    flavors: dict[str, str]  # role -> flavor: "8B", "3B", "debug" (Llama 3 path runs)
    moe_flavors: dict[str, str]  # qwen3 / deepseek_v3 -> flavor
    float8_extra: tuple[str, ...]
    budget_seconds: float
    cap: float  # longest timeout of a scale run
    path_cap: float  # of a path run
    min_seconds: dict[str, float]


REAL = Setting(False, 8192, 12, 4, True, "bfloat16", {"8B": "8B", "3B": "3B", "debug": "debugmodel"},
               {"qwen3": "debugmodel_moe", "deepseek_v3": "debugmodel"}, (), 540, 240, 120,
               {"train": 60, "path": 30})
DRY = Setting(True, 128, 3, 1, False, "float32", {"8B": "tiny", "3B": "tiny_tied", "debug": "tiny"},
              {"qwen3": "tiny_moe", "deepseek_v3": "tiny"}, ("--float8.emulate",), 300, 90, 90,
              {"train": 8, "path": 6})


def trainer_args(setting: Setting, name: str, flavor: str, batch: int, seq_len: int, work: Path,
                 config: str = "debug_model", pad_vocab: bool = False, extra: tuple[str, ...] = ()) -> list[str]:
    """A trainer run's options: the bundled config of its model family, this check's sizes."""
    args = ["--job.config_file", f"bundled:train_configs/{config}.toml", "--job.dump_folder", str(work / name),
            "--model.flavor", flavor, "--training.seq_len", str(seq_len), "--training.batch_size", str(batch),
            "--training.steps", str(setting.steps), "--training.warmup_steps", "2", "--metrics.log_freq", "1",
            "--metrics.disable_color_printing", "--training.mixed_precision_param", setting.dtype]
    if pad_vocab and not setting.dry:
        args += ["--model.vocab_size_divisible_by", str(base.LLAMA3_VOCAB)]  # Llama 3's vocabulary (gpu_check.md)
    if setting.compile:
        args.append("--training.compile")
    return args + list(extra)


def scale_args(setting: Setting, role: str, work: Path, name: str, ac: str, extra: tuple[str, ...] = ()) -> list[str]:
    """8B: one sequence, bf16 moments; 3B: two sequences."""
    batch = 1 if role == "8B" else 2
    extra = (("--optimizer.state_dtype", "bfloat16") if role == "8B" else ()) + ac_args(ac) + extra
    return trainer_args(setting, name, setting.flavors[role], batch, setting.seq_len, work, pad_vocab=True, extra=extra)


def ac_args(ac: str) -> tuple[str, ...]:
    return ("--activation_checkpoint.mode", ac) + (("--activation_checkpoint.selective_ac_option", "op")
                                                   if ac == "selective" else ())


def choose_ac(estimates: dict[str, dict | None], budget: int) -> tuple[str | None, str | None]:
    """Selective checkpointing (by op) where its dry run fits the usable memory, else full where
    that fits; None where neither does (the run is skipped, not sent out of memory). The note says why."""
    selective, full = estimates.get("selective"), estimates.get("full")
    if selective is not None and selective["peak_bytes"] <= budget:
        return "selective", None
    if selective is None and full is None:
        return "full", "no estimate: full activation checkpointing, the smallest"
    if full is None or full["peak_bytes"] <= budget:
        return "full", (f"selective checkpointing is estimated at {selective['peak_bytes'] / GiB:.1f} GiB, more than "
                        f"the {budget / GiB:.1f} GiB usable: full checkpointing" if selective else
                        "selective checkpointing has no estimate: full checkpointing")
    return None, (f"does not fit: estimated at {full['peak_bytes'] / GiB:.1f} GiB with full checkpointing, more than "
                  f"the {budget / GiB:.1f} GiB usable here")


def with_estimate(result: dict, est: dict | None, error: str | None) -> dict:
    """The dry run's peak beside the measured one: the error in percent of the measured."""
    if est is None:
        return {**result, "estimated_peak_gib": None, "estimate_error": error}
    estimated = est["peak_bytes"] / GiB
    measured = result.get("memory_peak_gib")
    error = None if not measured else round(100 * (estimated - measured) / measured, 1)
    out = {**result, "estimated_peak_gib": round(estimated, 2), "estimate_seconds": est.get("seconds"),
           "estimate_error_percent": error, "estimate_within_10_percent": None if error is None else abs(error) <= 10}
    if error is not None and abs(error) > 10 and result.get("compile"):
        # Not a failure: the estimate is an upper bound there (docs/gpu_check.md, Memory).
        out["estimate_note"] = ("the dry run estimates eager execution; compiled blocks keep fewer temporaries, so the "
                                "compiled peak sits below it (20-31 % for 1B and 3B on an H100)")
    return out


def speedup(result: dict, bf16: dict) -> dict:
    if result.get("tokens_per_second") and bf16.get("tokens_per_second"):
        result["speedup_vs_bf16"] = result["tokens_per_second"] / bf16["tokens_per_second"]
    return result


def float8_skip(device: dict) -> str | None:
    """Why float8 cannot run here, None where it can (emulated in the dry run)."""
    if device.get("dry"):
        return None
    if not device["cuda_available"]:
        return "no CUDA: float8 needs a GPU with float8 units"
    if tuple(device["compute_capability"]) < (8, 9):
        return f"compute capability {device['compute_capability']} has no float8 units (8.9 or newer)"
    if device["torchao"] is None:
        return "torchao not installed (docs/gpu_check.md)"
    return None


def profile_summary(dump: Path, step: int) -> dict[str, Any]:
    """The profiled step's time by category and the three largest outside matmuls and attention."""
    from torchtitan.tools.op_breakdown import LABELS, load_breakdown

    traces = sorted((dump / "profile_traces" / f"iteration_{step}").glob("rank0_trace.json*"))
    if not traces:
        return {"profile": None, "profile_error": f"no trace in {dump / 'profile_traces'}"}
    b = load_breakdown(traces[0])
    largest = sorted(((c, b.ms[c]) for c in NOT_COMPUTE if b.ms.get(c)), key=lambda item: -item[1])[:3]
    return {"profile": {"timeline": b.timeline, "step_ms": round(b.step_ms, 2),
                        "ms": {c: round(ms, 2) for c, ms in b.ms.items()},
                        "top_ops": {c: [(name, round(ms, 2)) for name, ms in ops[:3]] for c, ops in b.top.items()}},
            "largest_other": [{"category": LABELS[c], "ms": round(ms, 2), "percent": round(100 * ms / b.step_ms, 1),
                               "top_ops": [name for name, _ in b.top.get(c, [])[:3]]} for c, ms in largest]}


def without_profiled_step(result: dict, dump: Path, setting: Setting, peak_tflops: float | None) -> dict:
    """The run's figures over the steps before the profiled last one (the profiler slows that step)."""
    rows = [r for r in read_metrics(dump) if "tokens_per_second" in r] if (dump / "metrics.jsonl").exists() else []
    if len(rows) > setting.left_out + 1:
        result.update(base.figures(rows[:-1], setting.left_out, peak_tflops))
    return result


# ---------------------------------------------------------------------------------------------
# The step agreement on two processes sharing one device


def _agreement_rank(rank: int, port: int, device_type: str, out: "multiprocessing.Queue") -> None:
    import torch
    import torch.distributed as dist

    from torchtitan.trainer.agreement import StepAgreement

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
        agreement = StepAgreement(device, check_finite=True)
        # Rank 1 received a stop signal; rank 0's loss is not finite; rank 0's save is still running.
        loss = torch.tensor(float("nan") if rank == 0 else 1.0, device=device)
        issued = agreement.issue(7, 15 if rank == 1 else 0, (rank == 0, 3), loss, torch.tensor(1.0, device=device))
        pinned = bool(issued.host.is_pinned()) if device_type == "cuda" else None
        agreed = agreement.read(issued, deferred=True)
        out.put({"rank": rank, "stop_signal": agreed.stop_signal, "nonfinite": agreed.nonfinite,
                 "saves_done": agreed.saves_done, "found_inf": float(issued.found_inf), "pinned": pinned,
                 "event": issued.event is not None})
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - reported as the check's reason
        out.put({"rank": rank, "error": f"{type(e).__name__}: {e}"})


def step_agreement(device_type: str, timeout: float = 60) -> dict[str, Any]:
    """Both ranks must agree: stop signal 15 (rank 1's), non-finite (rank 0's), a save still running
    (rank 0's), and on CUDA the copy pinned and an event recorded. NCCL refuses two ranks on one GPU;
    gloo carries CUDA tensors by staging them through the host, which is what runs here."""
    from torchtitan.tools.replica_groups import free_port

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_agreement_rank, args=(r, port, device_type, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = []
    try:
        for _ in procs:
            results.append(queue.get(timeout=timeout))
    except Exception:  # noqa: BLE001 - a rank that never answered
        results.append({"error": f"a rank did not answer within {timeout:.0f}s"})
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
    return agreement_verdict(results, device_type)


def agreement_verdict(results: list[dict], device_type: str) -> dict[str, Any]:
    """The check's result from the ranks' answers."""
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        return {"status": "failed", "reason": f"cannot run two ranks on this device with gloo: {errors[0]}",
                "ranks": results}
    expected = {"stop_signal": 15, "nonfinite": True, "saves_done": False, "found_inf": 1.0}
    wrong = [f"rank {r['rank']} {k}={r[k]}" for r in results for k, v in expected.items() if r[k] != v]
    if device_type == "cuda":
        wrong += [f"rank {r['rank']} copy not pinned or no event" for r in results if not (r["pinned"] and r["event"])]
    return {"status": "failed" if wrong else "ok", "reason": "; ".join(wrong) or None, "device": device_type,
            "backend": "gloo", "ranks": sorted(results, key=lambda r: r["rank"])}


# ---------------------------------------------------------------------------------------------
# The check


class Check:
    def __init__(self, setting: Setting, work: Path, report: dict, clock: base.Clock, parts: tuple[str, ...]):
        self.setting, self.work, self.report, self.clock, self.parts = setting, work, report, clock, parts
        self.checks = report["checks"]

    def later(self, name: str) -> list[str]:
        """The runs after `name`, whose least time its timeout must leave."""
        rest = self.parts[self.parts.index(name) + 1:]
        return ["path" if n in PARTS["paths"] else "train" for n in rest]

    def train(self, name: str, args: list[str], cap: float, extra_env: dict | None = None) -> dict[str, Any]:
        timeout = self.clock.timeout(cap, self.later(name))
        peak = self.report["device"].get("bf16_peak_tflops")
        if self.setting.dry:  # two runs at once: a thread each, or their thread pools fight over the cores
            extra_env = {**(extra_env or {}), "OMP_NUM_THREADS": "1"}
        result = base.train(name, args, timeout, self.work, self.setting.left_out, peak, extra_env)
        return {**result, "seq_len": int(args[args.index("--training.seq_len") + 1]),
                "batch_size": int(args[args.index("--training.batch_size") + 1]),
                "flavor": args[args.index("--model.flavor") + 1], "compile": "--training.compile" in args}

    def run(self, estimates: dict[str, tuple], workers: int = 1) -> None:
        """The checks in priority order, one at a time on a GPU. The dry run's are mostly process
        start-up, so it runs `workers` at once: first those that compare with nothing, then the
        float8 runs, which compare with a bf16 run of the first wave."""
        first = [n for n in self.parts if not n.startswith("float8_")]
        waves = [first, [n for n in self.parts if n not in first]] if workers > 1 else [list(self.parts)]
        with ThreadPoolExecutor(workers) as pool:
            for wave in waves:
                list(pool.map(lambda name: self.run_one(name, estimates), wave))
        self.checks.update({name: self.checks.pop(name) for name in self.parts})  # the report in priority order

    def run_one(self, name: str, estimates: dict[str, tuple]) -> None:
        started = time.perf_counter()
        method = getattr(self, f"check_{name}", None) or (self.check_float8 if name.startswith("float8_") else None)
        try:
            self.checks[name] = method(name, estimates) if method else self.path(name)
        except Exception as e:  # noqa: BLE001 - a broken check is a failed check; the others still run
            self.checks[name] = {"status": "failed", "reason": f"{type(e).__name__}: {e}"}
        self.checks[name].setdefault("seconds", round(time.perf_counter() - started, 1))

    # scale -------------------------------------------------------------------------------------
    def check_train_8b(self, name: str, estimates: dict) -> dict:
        est, error, ac, note = estimates["8B"]
        if ac is None:
            return {"status": "skipped", "reason": note}
        result = self.train(name, scale_args(self.setting, "8B", self.work, name, ac), self.setting.cap)
        return {**with_estimate(result, est, error), "activation_checkpoint": ac, "ac_note": note,
                "optimizer_state_dtype": "bfloat16"}

    def check_train_3b_2x8k(self, name: str, estimates: dict) -> dict:
        est, error, ac, note = estimates["3B"]
        if ac is None:
            return {"status": "skipped", "reason": note}
        step = self.setting.steps
        args = scale_args(self.setting, "3B", self.work, name, ac,
                          ("--profiling.enable_profiling", "--profiling.profile_freq", str(step)))
        result = self.train(name, args, self.setting.cap)
        dump = self.work / name
        result = without_profiled_step(result, dump, self.setting, self.report["device"].get("bf16_peak_tflops"))
        if result["status"] == "ok":
            result.update(profile_summary(dump, step))
        return {**with_estimate(result, est, error), "activation_checkpoint": ac, "ac_note": note}

    def check_float8(self, name: str, estimates: dict) -> dict:
        """float8_<recipe>_<model>: the bf16 run of the same model again with float8."""
        recipe = name.split("_")[1]
        role, bf16_name = ("8B", "train_8b") if name.endswith("_8b") else ("3B", "train_3b_2x8k")
        skip = float8_skip(self.report["device"])
        bf16 = self.checks.get(bf16_name, {})
        if skip:
            return {"status": "skipped", "reason": skip}
        if bf16.get("status") != "ok":
            return {"status": "skipped", "reason": f"the bf16 run it is compared with ({bf16_name}) did not succeed"}
        ac = bf16["activation_checkpoint"]
        extra = ("--float8.enable_float8_linear", "--float8.recipe", recipe) + self.setting.float8_extra
        result = self.train(name, scale_args(self.setting, role, self.work, name, ac, extra), self.setting.cap)
        return {**speedup(result, bf16), "recipe": recipe, "activation_checkpoint": ac}

    # paths -------------------------------------------------------------------------------------
    def check_step_agreement_2_ranks(self, name: str, estimates: dict) -> dict:
        return step_agreement("cuda" if self.report["device"]["cuda_available"] else "cpu")

    def path(self, name: str) -> dict:
        s = self.setting
        seq = 4096 if not s.dry else s.seq_len
        debug = s.flavors["debug"]
        runs = {
            "flex_docmask_compiled": lambda: trainer_args(s, name, debug, 2, seq, self.work,
                                                          extra=("--training.document_mask",)),
            "chunked_loss_compiled": lambda: trainer_args(s, name, debug, 2, seq, self.work, pad_vocab=True,
                                                          extra=("--training.loss_chunk_size", str(seq // 4))),
            "offload_pinned": lambda: trainer_args(s, name, debug, 2, seq, self.work,
                                                   extra=("--activation_checkpoint.mode", "full",
                                                          "--activation_checkpoint.offload", "all")),
        }
        for family, config in (("qwen3_moe", "qwen3_moe_debug"), ("dsv3", "deepseek_v3_debug")):
            flavor = s.moe_flavors["qwen3" if family == "qwen3_moe" else "deepseek_v3"]
            for kind, extra in (("dropless", ()), ("capacity", ("--moe.capacity_factor", "1.25"))):
                runs[f"{family}_compiled_{kind}"] = (lambda flavor=flavor, config=config, extra=extra:
                                                     trainer_args(s, name, flavor, 2, min(seq, 2048), self.work,
                                                                  config=config, extra=extra))
        return self.train(name, runs[name](), s.path_cap)


def estimates_for(setting: Setting, work: Path, parts: tuple[str, ...], clock: base.Clock, budget: int,
                  started: dict[tuple[str, str], tuple]) -> dict[str, tuple]:
    """Each scale model's dry runs (started at the beginning, in child processes on the CPU) and the
    activation checkpointing they lead to: model -> (estimate of that checkpointing, error, ac, note)."""
    done: dict[str, dict] = {}
    errors: dict[str, str] = {}
    for (role, ac), (proc, path) in started.items():
        est, why = base.child_result(proc, path, min(240, clock.left()))
        done.setdefault(role, {})[ac] = est
        if est is None:
            errors[role] = why[-1500:]
    out = {}
    for role, by_ac in done.items():
        ac, note = choose_ac(by_ac, budget)
        out[role] = (by_ac.get(ac) if ac else by_ac.get("full"), errors.get(role), ac, note)
    return out


def start_estimates(setting: Setting, work: Path, parts: tuple[str, ...]) -> dict[tuple[str, str], tuple]:
    started = {}
    for role, check in (("8B", "train_8b"), ("3B", "train_3b_2x8k")):
        if check not in parts:
            continue
        for ac in ("selective",) if setting.dry else ("selective", "full"):  # tiny stand-ins always fit
            path = work / f"estimate_{role}_{ac}.json"
            args = scale_args(setting, role, work, f"estimate_{role}_{ac}", ac)
            started[(role, ac)] = (base.start_child(["--estimate", str(path), "--", *args]), path)
    return started


def probe(setting: Setting, work: Path, clock: base.Clock) -> tuple[dict, dict]:
    """The device (gpu_check's probe, in a child that holds the CUDA context apart from the runs)
    and its kernel checks, which are CUDA paths too (optimizers: Muon's bf16 Newton-Schulz, bf16
    moments against fused AdamW in ms a step; activation offload's pinned copies). The dry run
    describes the CPU in-process and leaves those checks to gpu_check --dry, which runs them."""
    if setting.dry:
        from importlib.util import find_spec

        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return ({"name": "CPU", "cuda_available": False, "dry": True,
                 "torchao": "present" if find_spec("torchao") else None,
                 "memory_bytes": memory, "memory_gib": round(memory / GiB, 2), "bf16_peak_tflops": None,
                 "compute_capability": None}, {})
    prober = base.start_child(["--probe", str(work / "probe.json")])
    probed, why = base.child_result(prober, work / "probe.json", min(120, clock.left()))
    if probed is None:
        raise RuntimeError(f"the device probe failed: {why}")
    if not probed["device"]["cuda_available"]:
        raise RuntimeError("this machine has no CUDA GPU; --dry runs the check's CPU stand-ins")
    return {**probed["device"], "dry": False}, probed["checks"]


def cuda_available() -> bool:
    """Whether this machine has a CUDA GPU, asked of a child, which leaves the CUDA context to the runs."""
    done = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                          capture_output=True, text=True, timeout=120)
    return done.stdout.strip() == "True"


def summary(report: dict[str, Any]) -> list[str]:
    lines = [f"gpu_paths{' --dry' if report['dry'] else ''} ({report['part']}): "
             f"{'all checks passed' if report['ok'] else 'FAILED'} in {report['seconds']:.0f}s; report {report['out']}"]
    for name, c in report["checks"].items():
        text = f"  {name:28} {c['status']:8}"
        if c.get("tokens_per_second"):
            text += (f" {c.get('flavor')} {c.get('batch_size')}x{c.get('seq_len')}: {c['tokens_per_second']:,.0f} tokens/s, "
                     f"MFU {c.get('mfu_percent', 0):.1f}%, peak {c.get('memory_peak_gib', 0):.1f} GiB")
        if c.get("estimated_peak_gib") is not None:
            text += f" (estimated {c['estimated_peak_gib']} GiB, {c.get('estimate_error_percent')} %)"
        if "speedup_vs_bf16" in c:
            text += f", {c['speedup_vs_bf16']:.2f}x bf16"
        if c.get("largest_other"):
            text += " largest outside matmul/attention: " + ", ".join(
                f"{o['category']} {o['percent']}%" for o in c["largest_other"])
        if c.get("ranks"):
            text += f" {len(c['ranks'])} ranks on {c.get('device')} ({c.get('backend')})"
        if c.get("reason"):
            text += f" - {c['reason']}"
        lines.append(text[:600])
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=tuple(PARTS), default=None, help="scale, paths or all (default: all with "
                                                                           "--dry, else scale)")
    parser.add_argument("--out", help="report path (default: $OUT/gpu_paths.json if $OUT is set, else ./gpu_paths.json)")
    parser.add_argument("--budget-seconds", type=float, default=None)
    parser.add_argument("--work-dir")
    parser.add_argument("--dry", action="store_true")
    parser.add_argument("--only", nargs="+", default=None, choices=PARTS["all"], metavar="CHECK",
                        help="these checks of the part, in its order (a float8 check needs the bf16 run it compares "
                             "with)")
    args = parser.parse_args(argv)
    setting = DRY if args.dry else REAL
    part = args.part or ("all" if args.dry else "scale")
    parts = tuple(n for n in PARTS[part] if not args.only or n in args.only)
    if not parts:
        parser.error(f"none of --only {' '.join(args.only)} is in --part {part} ({', '.join(PARTS[part])})")
    for name in parts:
        bf16 = "train_8b" if name.endswith("_8b") else "train_3b_2x8k"
        if name.startswith("float8_") and bf16 not in parts:
            parser.error(f"{name} compares with {bf16}: select both")
    if not setting.dry and not cuda_available():
        parser.error("this machine has no CUDA GPU; --dry runs the check's CPU stand-ins")
    default_out = Path(os.environ["OUT"]) / "gpu_paths.json" if os.environ.get("OUT") else Path("gpu_paths.json")
    out = Path(args.out) if args.out else default_out
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="gpu_paths_"))
    work.mkdir(parents=True, exist_ok=True)
    clock = base.Clock(args.budget_seconds or setting.budget_seconds, setting.min_seconds)
    report: dict[str, Any] = {"schema": SCHEMA_VERSION, "dry": setting.dry, "part": part, "out": str(out),
                              "work_dir": str(work), "budget_seconds": clock.budget, "device": {}, "checks": {},
                              "error": None}
    started: dict = {}
    try:
        started = start_estimates(setting, work, parts)
        report["device"], report["probe_checks"] = probe(setting, work, clock)
        device = report["device"]
        estimates = estimates_for(setting, work, parts, clock, base.usable_memory(device), started)
        Check(setting, work, report, clock, parts).run(estimates, workers=2 if setting.dry else 1)
    except Exception as e:  # noqa: BLE001 - the report is written whatever broke
        report["error"] = f"{type(e).__name__}: {e}"
    finally:
        for proc, _ in started.values():  # estimates still running when something broke
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        base.close_report(report, parts, clock, out)
    return base.print_report(report, summary(report))


if __name__ == "__main__":
    sys.exit(main())
