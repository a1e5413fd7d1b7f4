"""LoRA's mistakes end before training with one line and exit code 2 (docs/lora.md): the option rules at
the launcher's torch-free pre-check (`python -m torchtitan.config.manager --launch-mode`, what
run_llama_train.sh runs before any rank); the model rule (lora.target_modules against the model)
and the checkpoint checks in one trainer process, which must leave no metrics and no checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import REPO_ROOT, TINY_RUN, run_train

LORA = ("--lora.rank", "8")
BASE = ("--checkpoint.initial_load_path", "no/such/base")  # never read: every case ends before any load


def one_line(stderr: str, expected: str) -> None:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], stderr[-3000:]


@pytest.mark.parametrize("args,expected", [
    ((*BASE, "--lora.rank", "-1"), "lora.rank must be >= 0 (0 turns LoRA off), got -1"),
    ((*LORA,), "lora.rank 8 needs base weights: set checkpoint.initial_load_path"),
    ((*LORA, *BASE, "--float8.enable_float8_linear"), "lora does not combine with float8.enable_float8_linear"),
    ((*LORA, "--checkpoint.create_seed_checkpoint"), "checkpoint.create_seed_checkpoint writes a freshly initialised base"),
    ((*LORA, *BASE, "--model.name", "deepseek_v3", "--moe.bias_update_rate", "0.001"),
     "moe.bias_update_rate 0.001 trains the routing biases, which belong to the frozen base"),
    ((*LORA, *BASE, "--lora.alpha", "0"), "lora.alpha must be > 0 and lora.dropout in [0, 1), got 0.0 and 0.0"),
    ((*LORA, *BASE, "--lora.target_modules", ""), "lora.target_modules is empty"),
    ((*LORA, *BASE, "--checkpoint.last_save_in_hf"), "checkpoint.last_save_in_hf does not combine with lora yet; "
     "export the final checkpoint with scripts/convert_checkpoint.py dcp-to-hf --lora-merge"),
], ids=["negative rank", "no base", "float8", "seed checkpoint", "routing bias", "alpha", "no targets", "HF export"])
def test_the_pre_check_refuses_lora_options(args, expected):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "WORLD_SIZE": "1"}
    result = subprocess.run([sys.executable, "-m", "torchtitan.config.manager", "--launch-mode", *TINY_RUN, *args],
                            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr[-2000:]
    one_line(result.stderr, expected)


@pytest.mark.parametrize("args,expected", [
    ((*LORA, *BASE, "--lora.target_modules", "wq,foo"), "lora.target_modules 'foo' matches no linear layer of model "
     "llama3 (its linear layers: attention.wq, attention.wk"),
    (("--lora.rank", "100", *BASE), "lora.rank 100 is above what layers.0.attention.wk of model llama3 tiny can use"),
    ((*LORA, *BASE, "--model.name", "qwen3", "--model.flavor", "tiny_moe", "--lora.target_modules", "experts"),
     "lora.target_modules 'experts' names the routed experts of model qwen3"),
    ((*LORA, "--lora.save_adapters_only", "false", "--checkpoint.enable_checkpoint"),
     "lora.rank 8 needs base weights: checkpoint.initial_load_path is unset and"),
], ids=["no match", "rank too large", "experts", "nothing to resume"])
def test_the_trainer_refuses_before_training(args, expected, tmp_path):
    result = run_train([*TINY_RUN, "--job.dump_folder", str(tmp_path / "run"), *args], check=False)
    assert result.returncode == 2, result.stderr[-2000:]
    one_line(result.stderr, expected)
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists() and not (tmp_path / "run" / "checkpoint").exists()


def test_a_lora_checkpoint_of_other_adapters_is_refused(tmp_path):
    """Adapters of rank 8 resumed as rank 4, or with other targets: one line naming the lora option;
    the checkpoint and the metrics stay as they were."""
    seed, run = tmp_path / "seed", tmp_path / "run"
    run_train([*TINY_RUN, "--job.dump_folder", str(seed), "--checkpoint.create_seed_checkpoint"])
    job = [*TINY_RUN, "--job.dump_folder", str(run), "--checkpoint.enable_checkpoint", "--training.steps", "2",
           "--checkpoint.initial_load_path", str(seed / "checkpoint" / "step-0")]
    run_train([*job, *LORA])
    metrics = (run / "metrics.jsonl").read_text()
    result = run_train([*job, "--training.steps", "4", "--lora.rank", "4"], check=False)
    assert result.returncode == 2, result.stderr[-2000:]
    one_line(result.stderr, "layers.0.attention.wq.lora_a.weight is [8, 128] in the checkpoint, [4, 128] in the model: "
                            "its LoRA adapters have rank 8, this run's lora.rank is 4")
    assert "set lora.rank 8 to resume them" in result.stderr
    # Adapters on other layers: fewer (the checkpoint holds more), or more (it lacks some).
    for targets, expected in (("wq,wk", "the checkpoint holds layers.0.attention.wo.lora_a.weight"),
                              ("all-linear,output", "the checkpoint has no output.lora_a.weight")):
        result = run_train([*job, "--training.steps", "4", *LORA, "--lora.target_modules", targets], check=False)
        assert result.returncode == 2, result.stderr[-2000:]
        one_line(result.stderr, f"its LoRA adapters sit on other layers (lora.target_modules all-linear there, {targets} "
                                f"here): {expected}")
    # The adapters' scale: another lora.alpha would make them fit neither run.
    result = run_train([*job, "--training.steps", "4", *LORA, "--lora.alpha", "64"], check=False)
    assert result.returncode == 2, result.stderr[-2000:]
    one_line(result.stderr, "holds adapters trained with lora.alpha 16, but this run's lora.alpha is 64; resume with "
                            "lora.alpha 16")
    # Its adapters-only step as another run's starting point, with LoRA or without: no model to start from.
    for lora in ([], LORA):
        result = run_train([*TINY_RUN, "--job.dump_folder", str(tmp_path / "other"), *lora,
                            "--checkpoint.initial_load_path", str(run / "checkpoint" / "step-2")], check=False)
        assert result.returncode == 2, result.stderr[-2000:]
        one_line(result.stderr, "holds LoRA adapters only (rank 8, trained on")
    assert sorted(p.name for p in (run / "checkpoint").iterdir()) == ["step-2"]
    assert (run / "metrics.jsonl").read_text() == metrics
