"""The measurement scripts (scripts/benchmark.py, checkpoint_bench.py, cp_methods_bench.py, cp_scaling.py,
pipeline_bubble.py, ring_memory.py, step_breakdown.py) when a run fails: each ends with a message that says
what failed and carries the failed run's output, instead of a traceback about missing figures. The runs are stand-ins
(monkeypatched), so nothing trains; what the scripts measure is in docs/performance.md."""

import argparse
import subprocess
import sys

import pytest

from scripts import benchmark, checkpoint_bench, cp_methods_bench, cp_scaling, pipeline_bubble, ring_memory, step_breakdown
from torchtitan.tools.runs import TrainingFailed

FAILED = "training failed (1): python -m torchtitan.train ...\nstep 1 loss 10.8\nValueError: the data is empty"


@pytest.fixture
def trainer_fails(monkeypatch):
    """Makes the product runner of every script fail as run_trainer does with check=True; returns the
    arguments of each run."""
    calls = []

    def run_trainer(args, nproc=1, **kwargs):
        calls.append((list(args), nproc))
        if kwargs.get("check", True):
            raise TrainingFailed(FAILED)
        return subprocess.CompletedProcess(["python", "-m", "torchtitan.train"], 1, "step 1 loss 10.8\n",
                                           "ValueError: the data is empty\n")

    for script in (benchmark, checkpoint_bench, pipeline_bubble, step_breakdown):
        monkeypatch.setattr(script, "run_trainer", run_trainer)
    return calls


@pytest.fixture
def worker_fails(monkeypatch):
    """Makes the worker processes of cp_scaling and ring_memory exit 1 with a traceback; returns the
    commands."""
    commands = []

    def run(cmd, **kwargs):
        commands.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "Traceback (most recent call last):\nRuntimeError: gloo\n")

    monkeypatch.setattr(subprocess, "run", run)
    return commands


def test_benchmark_ends_with_the_output_of_the_failed_run(trainer_fails):
    with pytest.raises(SystemExit) as e:
        benchmark.run("debug_model", 2, 4, ["--training.compile"], threads=1)
    assert e.value.code == FAILED
    (args, nproc), = trainer_fails
    assert nproc == 2 and args[-1] == "--training.compile"


def test_pipeline_bubble_ends_with_the_output_of_the_failed_run(trainer_fails):
    with pytest.raises(SystemExit) as e:
        pipeline_bubble.measure(2, 4, 2, ["--experimental.pipeline_parallel_degree", "2"])
    assert e.value.code == FAILED and trainer_fails[0][1] == 2


def test_step_breakdown_ends_with_the_output_of_the_failed_run(trainer_fails, tmp_path):
    with pytest.raises(SystemExit) as e:
        step_breakdown.profile_run("debug_model", 1, 1, 5, [], tmp_path)
    assert e.value.code == FAILED
    args = trainer_fails[0][0]
    assert args[args.index("--profiling.profile_freq") + 1] == "5"


def test_step_breakdown_without_traces_names_the_folder_it_read(tmp_path):
    with pytest.raises(SystemExit) as e:
        step_breakdown.find_traces(tmp_path)
    assert e.value.code == f"no profiler traces in {tmp_path / 'profile_traces'}"
    (tmp_path / "profile_traces" / "iteration_3").mkdir(parents=True)
    (tmp_path / "profile_traces" / "iteration_3" / "rank0_trace.json").write_text("{}")
    assert step_breakdown.find_traces(tmp_path) == (3, [tmp_path / "profile_traces" / "iteration_3" / "rank0_trace.json"])
    with pytest.raises(SystemExit) as e:  # traces of another step than the one asked for
        step_breakdown.find_traces(tmp_path, 5)
    assert e.value.code == f"no profiler traces of step 5 in {tmp_path / 'profile_traces'}"


def test_checkpoint_bench_names_the_mode_whose_job_failed(trainer_fails, tmp_path):
    args = argparse.Namespace(seq_len=128, batch_size=2, interval=4, nproc=2)
    with pytest.raises(SystemExit) as e:
        checkpoint_bench.run_job(args, tmp_path, tmp_path / "async", 12, "async")
    assert e.value.code == "async: the job failed\nstep 1 loss 10.8\n\nValueError: the data is empty\n"
    run_args = trainer_fails[0][0]
    assert run_args[run_args.index("--checkpoint.async_mode") + 1] == "async"


def test_cp_scaling_names_the_degree_whose_run_failed(worker_fails, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["cp_scaling.py", "--cps", "2", "--steps", "1"])
    with pytest.raises(SystemExit) as e:
        cp_scaling.main()
    assert e.value.code == ("cp_scaling: the run of cp 2 failed (exit 1):\nTraceback (most recent call last):\n"
                            "RuntimeError: gloo\n")
    assert "--nproc_per_node=2" in worker_fails[0] and "| cp |" in capsys.readouterr().out  # the table began


def test_ring_memory_names_the_kernel_length_and_degree_whose_run_failed(worker_fails):
    with pytest.raises(SystemExit) as e:
        ring_memory.measure("math", 1024, 2)
    assert e.value.code == ("ring_memory: the run of math, local length 1024, cp 2 failed (exit 1):\n"
                            "Traceback (most recent call last):\nRuntimeError: gloo\n")
    assert "--nproc_per_node=2" in worker_fails[0]


def test_cp_methods_bench_names_the_degree_whose_run_failed(worker_fails):
    args = argparse.Namespace(seqs=[1024], heads=4, kv_heads=1, head_dim=64, reps=1, tile=512, doc_mean=256,
                              max_case_s=10)
    with pytest.raises(SystemExit) as e:
        cp_methods_bench.run_cp(args, 4)
    assert e.value.code == ("cp_methods_bench: the run of cp 4 failed (exit 1):\nTraceback (most recent call last):\n"
                            "RuntimeError: gloo\n")
    assert "--nproc_per_node=4" in worker_fails[0]
