"""The dry run and the memory estimate against real jobs: the estimate equals what real ranks
measure with the same tracker; the launcher's dry run of a 512-rank layout; the estimate before
training leaves training as it was; the planner's choices pass the dry run and its first trains.
The dry run's own workings (in-process, no real ranks) are tests/unit_tests/test_dry_run.py."""

import json
import os
import subprocess
import sys

import pytest

from scripts.memory_accuracy import compare
from tests.helpers import REPO_ROOT, TINY_RUN, losses
from tests.integration.conftest import UNINTERRUPTED_STEPS
from tests.machinery.warm_launcher import run_warm
from torchtitan.config.manager import parse_args
from torchtitan.estimation.dry_run import dry_run

DEBUG = ["--job.config_file", "bundled:train_configs/debug_model.toml", "--training.seq_len", "256",
         "--training.batch_size", "4", "--metrics.disable_color_printing"]
FSDP2 = ["--training.data_parallel_shard_degree", "2"]

# Layouts whose estimate must be within 5 % of the real ranks' measurement: a pipeline of sharded
# stages (the replay of 1F1B, FSDP under PP), context parallelism with selective checkpointing, TP.
# scripts/memory_accuracy.py measures the rest (docs/memory.md).
ACCURACY = {
    "fsdp2 x pp2": (4, [*FSDP2, "--experimental.pipeline_parallel_degree", "2"]),
    "cp2 selective AC": (2, ["--experimental.context_parallel_degree", "2", "--activation_checkpoint.mode", "selective"]),
    # Loss parallelism: DTensor's shape propagation must not count whole-vocabulary fake logits;
    # op-level selective AC: nor may its policy save the global-shape outputs that propagation
    # computes the first time an op meets a sharding (the tracked step is not a first step).
    "tp2 op-selective AC": (2, ["--training.tensor_parallel_degree", "2", "--activation_checkpoint.mode", "selective",
                                "--activation_checkpoint.selective_ac_option", "op"]),
}


@pytest.mark.parametrize("name", ACCURACY)
def test_the_estimate_is_what_real_ranks_measure(name):
    nproc, options = ACCURACY[name]
    result = compare(name, [*DEBUG, *options], nproc, runner=run_warm)
    assert len(result.ranks) == (2 if "pp2" in name else 1)  # every pipeline stage is simulated
    for rank in result.ranks:
        assert abs(rank.error) < 0.05, result.row()


def test_the_estimate_before_training_leaves_the_losses_alone(tmp_path, uninterrupted):
    """memory_estimation.enabled estimates each rank in-process before the process group exists,
    then trains exactly what the job without it trains; over the device's memory, it warns."""
    run = run_warm([*TINY_RUN, "--training.steps", str(UNINTERRUPTED_STEPS), "--metrics.log_freq", "1",
                    "--memory_estimation.enabled", "--memory_estimation.device_memory_gib", "0.001",
                    "--job.dump_folder", str(tmp_path)], nproc=2)
    assert losses(tmp_path) == uninterrupted
    out = run.stdout + run.stderr
    assert "memory estimate for rank 1" in out and "more than the device's" in out, out[-3000:]


def test_the_planners_choices_pass_the_dry_run_and_the_first_trains(tmp_path):
    """A small case: the debug model on 4 devices of 0.25 GiB (nodes of 4). Every printed choice
    fits by the dry run run afresh from its printed options; the first trains 2 steps on 4 ranks."""
    cmd = [sys.executable, "scripts/plan_layout.py", "--model", "llama3", "--flavor", "debugmodel", "--ngpu", "4",
           "--device-memory", "0.25GiB", "--gpus-per-node", "4", "--seq-len", "512", "--global-batch", "8",
           "--tokenizer", "bundled:stdlib_docs/tokenizer.model", "--top", "2", "--json"]
    result = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert result.returncode == 0, result.stderr[-3000:]
    choices = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(choices) == 2 and choices[0]["tokens_per_second"] >= choices[1]["tokens_per_second"]
    base = ["--job.config_file", "bundled:train_configs/debug_model.toml", "--training.seq_len", "512",
            "--training.compile=false"]
    for choice in choices:
        assert choice["overrides"][0].startswith("--") and "--training.batch_size" in choice["overrides"]
        estimate = dry_run(parse_args([*base, *choice["overrides"], "--job.dry_run", "--job.dry_run_world_size", "4",
                                       "--job.dry_run_device", "cuda", "--training.mixed_precision_param", "auto",
                                       "--memory_estimation.device_memory_gib", "0.25"]))
        assert estimate.fits and estimate.largest.memory.peak / 2**30 == pytest.approx(choice["peak_gib"], rel=1e-6)
    first = choices[0]["overrides"]
    run_warm([*TINY_RUN, *first, "--training.seq_len", "512", "--training.steps", "2", "--metrics.log_freq", "1",
              "--job.dump_folder", str(tmp_path)], nproc=4)
    trained = losses(tmp_path)
    assert len(trained) == 2 and all(loss == loss for loss in trained)
