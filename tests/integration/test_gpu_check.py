"""scripts/gpu_check.sh: its --dry path end to end on CPU (the report's schema and sane numbers), and
the memory planning that decides how the real models run on a GPU."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from scripts import gpu_check
from tests.helpers import REPO_ROOT, passing_dry_report, trainer_runs_on_the_warm_launcher
from torchtitan.config.manager import parse_args
from torchtitan.config.preflight import preflight
from torchtitan.models.llama.flavors import llama3_configs

GiB = 2**30




@pytest.mark.fast
def test_the_wrapper_runs_the_check_with_the_python_it_is_given(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable}
    result = subprocess.run([str(REPO_ROOT / "scripts" / "gpu_check.sh"), "--help"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.startswith("usage: gpu_check.py"), result.stderr[-2000:]
    env["PYTHON"] = str(tmp_path / "no_python")
    assert subprocess.run([str(REPO_ROOT / "scripts" / "gpu_check.sh"), "--help"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60).returncode != 0


@pytest.mark.budget("the whole GPU check's dry run: every check's trainer runs on the CPU (~15 s on 2 cores)")
def test_dry_run_writes_the_report(tmp_path, monkeypatch, capsys):
    """In-process (the wrapper is the test above), the trainer runs forked from the suite's warm
    launcher: the same trainer the script's own runner starts with `python -m torchtitan.train`."""
    trainer_runs_on_the_warm_launcher(monkeypatch, gpu_check)
    monkeypatch.delenv("OUT", raising=False)
    report = passing_dry_report(gpu_check.main, tmp_path, capsys, "gpu_check --dry")

    assert report["schema"] == gpu_check.SCHEMA_VERSION and report["dry"] is True and report["error"] is None
    assert set(report["checks"]) == set(gpu_check.CHECKS)
    for name, check in report["checks"].items():
        assert check["status"] in gpu_check.STATUSES and "reason" in check and check["seconds"] >= 0, name
    device = report["device"]
    for key in ("name", "count", "memory_gib", "compute_capability", "driver", "cuda", "cudnn", "nccl", "torch",
                "torchao", "python"):
        assert key in device, key
    assert device["memory_gib"] > 0 and device["torch"]

    for name in ("train_1b", "train_3b"):
        run = report["checks"][name]
        assert run["status"] == "ok", run
        # (No upper bound on the MFU: on a CPU it is against a peak measured once, maybe on a busy machine.)
        assert run["tokens_per_second"] > 0 and run["tflops"] > 0 and run["mfu_percent"] > 0
        assert run["memory_peak_gib"] > 0 and run["estimated_peak_gib"] > 0
        assert run["steps_logged"] == 3 and run["steps_averaged"] == 2
        assert math.isfinite(run["loss_first"]) and math.isfinite(run["loss_last"])
        assert run["seq_len"] == 256 and run["compile"] is False and run["compute_dtype"] == "float32"
        assert run["applied"]["model"]["flavor"] == run["flavor"]
    assert report["checks"]["train_1b"]["stand_in_for"] == "1B"
    assert report["checks"]["train_3b"]["flavor"] == "debugmodel_tied"
    for name in ("memory_snapshot", "float8_3b"):
        assert report["checks"][name]["status"] == "skipped" and "no CUDA" in report["checks"][name]["reason"]

    sdpa = report["checks"]["sdpa_exactness"]
    assert sdpa["status"] == "ok"
    for case in sdpa["cases"].values():
        assert 0 < case["max_error"] <= case["tolerance"] < 1e-4
    ring = report["checks"]["ring_attention_kernels"]
    assert ring["status"] == "ok"
    assert ring["results"]["float32"]["max_error"] < 1e-4 and "document_masked" in ring["results"]["float32"]["cases"]
    optimizers = report["checks"]["optimizers"]
    assert optimizers["status"] == "ok", optimizers
    assert set(optimizers["results"]) == {"adamw_fused", "adamw_bf16_nearest", "adamw_bf16_stochastic", "muon_ns_bf16",
                                          "muon_ns_fp32"}
    # bf16 moments hold half of fused AdamW's state; Muon's single momentum as much as that.
    results = optimizers["results"]
    assert results["adamw_bf16_nearest"]["state_mib"] == pytest.approx(results["adamw_fused"]["state_mib"] / 2, rel=0.05)
    assert results["muon_ns_fp32"]["state_mib"] == pytest.approx(results["adamw_fused"]["state_mib"] / 2, rel=0.05)
    offload = report["checks"]["activation_offload"]
    assert offload["status"] == "ok" and offload["bitwise"] and offload["tensors_moved"] > 0 and offload["mib_moved"] > 0


# ---------------------------------------------------------------------------------------------
# Memory planning: what runs where the whole model does not fit


# 28 layers of 50M parameters, 2B in all; its dry run without checkpointing peaks at 60 GiB.
ESTIMATE = {"peak_bytes": 60 * GiB, "at_peak": {"activations": 24 * GiB}, "n_params": 2_000_000_000, "n_layers": 28,
            "layer_params": 50_000_000, "dim": 3072, "tokens": 4096, "seconds": 1.0}


@pytest.mark.fast
def test_the_whole_model_without_checkpointing_first():
    plans = gpu_check.plan_memory(ESTIMATE, 70 * GiB)
    assert plans[0] == gpu_check.Plan("none", 28, 60 * GiB)
    assert [(p.ac, p.n_layers) for p in plans] == [("none", 28), ("selective", 28), ("selective", 27)]


@pytest.mark.fast
def test_selective_checkpointing_when_the_activations_do_not_fit():
    plans = gpu_check.plan_memory(ESTIMATE, 55 * GiB)
    assert plans[0].ac == "selective" and plans[0].n_layers == 28
    # Half the activations kept, plus each checkpointed block's fp32 input and one block recomputed.
    assert plans[0].estimate_bytes == int(60 * GiB - 12 * GiB + 14 * 4096 * 3072 * 4 + 24 * GiB / 28)


@pytest.mark.fast
def test_the_optimizer_step_bounds_what_checkpointing_saves():
    """Weights, gradients and Adam moments at the optimizer step: 16 bytes a parameter."""
    big = dict(ESTIMATE, n_params=3_500_000_000, layer_params=100_000_000)
    assert gpu_check.selective_peak(big, 28) == 56_000_000_000
    assert gpu_check.plan_memory(big, 50 * GiB)[0].n_layers < 28


@pytest.mark.fast
def test_fewer_layers_when_even_that_does_not_fit_and_none_when_one_layer_does_not():
    plans = gpu_check.plan_memory(ESTIMATE, 30 * GiB)
    assert len(plans) == 1
    plan = plans[0]
    assert plan.ac == "selective" and 1 <= plan.n_layers < 28 and plan.estimate_bytes <= 30 * GiB
    assert gpu_check.selective_peak(ESTIMATE, plan.n_layers + 1) > 30 * GiB  # as many layers as fit
    assert f"{plan.n_layers} of 28 layers" in plan.note
    # 28 layers of 1.2B parameters: one alone (weights and Adam moments) is too many.
    huge = dict(ESTIMATE, peak_bytes=600 * GiB, n_params=34_000_000_000, layer_params=1_200_000_000)
    assert gpu_check.plan_memory(huge, 30 * GiB) == []


def runs_with_fake_trainer(tmp_path, monkeypatch, budget: int, outcomes: list[dict]):
    """gpu_check's runs of the 3B model, the trainer replaced by `outcomes` in turn."""
    calls = []

    def train(check, args, timeout, work, left_out, peak):
        calls.append(args)
        return dict(outcomes.pop(0))

    monkeypatch.setattr(gpu_check, "train", train)
    plans = {"3B": (ESTIMATE, gpu_check.plan_memory(ESTIMATE, budget), None)}
    clock = gpu_check.Clock(450, gpu_check.REAL.min_seconds)
    return gpu_check.Runs(gpu_check.REAL, tmp_path, 4096, "bfloat16", clock, budget, plans, 989.0), calls


def option(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


OOM = {"status": "failed", "reason": "torch.OutOfMemoryError: CUDA out of memory", "out_of_memory": True}
OK = {"status": "ok", "reason": None, "tokens_per_second": 1000.0}


@pytest.mark.fast
def test_out_of_memory_tries_the_next_plan_and_float8_keeps_the_bf16_plan(tmp_path, monkeypatch):
    runs, calls = runs_with_fake_trainer(tmp_path, monkeypatch, 70 * GiB, [OOM, OK, OOM])
    bf16 = runs.train("train_3b", "3B")
    assert bf16["status"] == "ok" and bf16["plan_used"] == 2 and bf16["activation_checkpoint"].startswith("selective")
    assert [option(args, "--activation_checkpoint.mode") for args in calls] == ["none", "selective"]
    assert option(calls[1], "--activation_checkpoint.selective_ac_option") == "2"
    assert "--training.compile" in calls[1] and option(calls[1], "--model.vocab_size_divisible_by") == "128256"

    float8 = runs.train("float8_3b", "3B", ["--float8.enable_float8_linear"], like=bf16)
    # The same plan as the run it is compared with, and no other after running out of memory.
    assert float8["status"] == "failed" and float8["plan_used"] == 2 and len(calls) == 3
    assert option(calls[2], "--activation_checkpoint.mode") == "selective" and "--float8.enable_float8_linear" in calls[2]


@pytest.mark.fast
def test_other_failures_are_not_tried_again(tmp_path, monkeypatch):
    broken = {"status": "failed", "reason": "exit code 1: RuntimeError", "out_of_memory": False}
    runs, calls = runs_with_fake_trainer(tmp_path, monkeypatch, 70 * GiB, [broken])
    assert runs.train("train_3b", "3B")["status"] == "failed" and len(calls) == 1


@pytest.mark.fast
def test_fewer_layers_run_as_a_flavor_of_their_own(tmp_path, monkeypatch):
    runs, calls = runs_with_fake_trainer(tmp_path, monkeypatch, 30 * GiB, [OK])
    result = runs.train("train_3b", "3B")
    layers = result["n_layers"]
    assert layers < 28 and result["n_layers_of_flavor"] == 28 and f"{layers} of 28 layers" in result["layers_note"]
    assert option(calls[0], "--model.flavor") == f"3B_{layers}layers"
    assert option(calls[0], "--experimental.custom_import") == "gpu_check_flavors"
    assert f"n_layers={layers}" in (tmp_path / "gpu_check_flavors.py").read_text()


@pytest.mark.fast
def test_a_flavor_with_fewer_layers_is_registered_for_the_trainer(tmp_path, monkeypatch):
    name, args = gpu_check.fewer_layers(tmp_path, "debugmodel", 3)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "gpu_check_flavors", raising=False)
    try:
        config = parse_args(["--job.config_file", "bundled:train_configs/debug_model.toml", "--job.dump_folder",
                             str(tmp_path / "dump"), "--model.flavor", name, *args])
        assert len(preflight(config, 1, device_type="cpu").model.layers) == 3
    finally:
        llama3_configs.pop(name, None)
        sys.modules.pop("gpu_check_flavors", None)


@pytest.mark.fast
@pytest.mark.parametrize("budget,later,expected", [(450, [], 150), (200, ["train", "train"], 80), (100, ["train"], 40)])
def test_each_run_leaves_the_later_ones_their_least_time(budget, later, expected):
    clock = gpu_check.Clock(budget, {"train": 60, "snapshot": 40})
    assert expected - 1 < clock.timeout(150, later) <= expected


# ---------------------------------------------------------------------------------------------
# What breaks: each fault injected in this process, and the report still says what happened


@pytest.mark.fast
def test_missing_versions_and_tools_are_recorded_as_none(monkeypatch):
    import torch

    assert gpu_check._version("torch") and gpu_check._version("torchtitan-no-such-package") is None

    def no_nvidia_smi(*args, **kwargs):
        raise FileNotFoundError(2, "No such file or directory", "nvidia-smi")

    def hung_nvidia_smi(*args, **kwargs):
        raise subprocess.TimeoutExpired("nvidia-smi", 30)

    for fault in (no_nvidia_smi, hung_nvidia_smi):
        monkeypatch.setattr(gpu_check.subprocess, "run", fault)
        assert gpu_check._driver_version() is None

    for error in (AttributeError("module 'torch._C' has no attribute '_nccl_version'"), RuntimeError("no NCCL")):
        def nccl_version(error=error):
            raise error

        monkeypatch.setattr(torch.cuda.nccl, "version", nccl_version)
        assert gpu_check._nccl_version() is None


@pytest.mark.fast
def test_a_broken_check_is_a_failed_check_with_its_error():
    result = gpu_check._timed(lambda: {}["missing"])
    assert result["status"] == "failed" and result["reason"] == "KeyError: 'missing'" and result["seconds"] >= 0


@pytest.mark.fast
def test_bf16_refused_on_one_rank_runs_with_auto_and_says_why(monkeypatch):
    import torchtitan.config.manager
    from torchtitan.errors import ConfigError

    def refuse(config, world_size):
        raise ConfigError("training.mixed_precision_param bfloat16 needs a GPU")

    monkeypatch.setattr(torchtitan.config.manager, "validate_world_size", refuse)
    dtype, note = gpu_check.dtype_to_ask(gpu_check.REAL)
    assert dtype == "auto"
    assert note == ("training.mixed_precision_param bfloat16 is refused on one GPU (training.mixed_precision_param "
                    "bfloat16 needs a GPU); ran with auto")
    assert gpu_check.dtype_to_ask(gpu_check.DRY) == ("float32", None)


@pytest.mark.fast
def test_a_trainer_run_past_its_timeout_is_a_timeout_with_its_log(tmp_path, monkeypatch):
    def hangs(args, **kwargs):
        raise subprocess.TimeoutExpired(args, kwargs["timeout"], output=b"step 1 loss 10.8\n", stderr="stopping\n")

    monkeypatch.setattr(gpu_check, "run_trainer", hangs)
    args = gpu_check.trainer_args(gpu_check.DRY, "debugmodel", 1, 256, tmp_path / "dump", None, "float32", False, 3)
    result = gpu_check.train("train_1b", args, 30, tmp_path, 1, None)
    assert result["status"] == "timeout" and result["reason"] == "stopped after 30s" and result["steps_logged"] == 0
    assert result["log_tail"] == "step 1 loss 10.8\nstopping\n" == (tmp_path / "train_1b.log").read_text()


@pytest.mark.fast
def test_a_child_past_its_timeout_is_killed_and_reported():
    class Hangs:
        returncode, killed = None, False

        def communicate(self, timeout=None):
            if timeout is not None and not self.killed:
                raise subprocess.TimeoutExpired("probe", timeout)
            return "loading torch\n", None

        def kill(self):
            self.killed, self.returncode = True, -9

    proc = Hangs()
    # Given less than a second of the budget, it still waits one.
    assert gpu_check.child_result(proc, Path("/nonexistent/probe.json"), 0.2) == (None, "timed out after 1s: loading torch\n")
    assert proc.killed


@pytest.mark.fast
def test_an_error_in_the_check_is_reported_and_the_report_written(tmp_path, monkeypatch, capsys):
    def probe_fails(setting, seq_len, work, report, clock):
        report["checks"]["sdpa_exactness"] = {"status": "ok", "reason": None, "seconds": 1.0}
        raise RuntimeError("the device probe failed: exit code 1: boom")

    monkeypatch.setattr(gpu_check, "run_check", probe_fails)
    out = tmp_path / "report.json"
    assert gpu_check.main(["--dry", "--out", str(out), "--work-dir", str(tmp_path / "work")]) == 1
    report = json.loads(out.read_text())
    assert report["ok"] is False and report["error"] == "RuntimeError: the device probe failed: exit code 1: boom"
    assert report["checks"]["sdpa_exactness"]["status"] == "ok"
    assert all(report["checks"][name] == {"status": "failed", "reason": "not run (an earlier error)", "seconds": 0.0}
               for name in gpu_check.CHECKS if name != "sdpa_exactness")
    captured = capsys.readouterr()
    assert captured.out.startswith("gpu_check --dry: FAILED")
    assert captured.err == "error: RuntimeError: the device probe failed: exit code 1: boom\n"
