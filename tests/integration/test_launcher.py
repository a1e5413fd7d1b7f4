"""End to end through run_llama_train.sh: 2 CPU ranks with FSDP, overrides passed through."""

import os
import subprocess

from tests.helpers import REPO_ROOT, read_metrics


def _launch(args, **env):
    full_env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    full_env.update(env)
    return subprocess.run(["./run_llama_train.sh", *args], cwd=REPO_ROOT, env=full_env,
                          capture_output=True, text=True, timeout=600)


def test_two_rank_fsdp_run_through_launcher(tmp_path):
    result = _launch(["--training.steps", "6", "--training.seq_len", "64", "--metrics.log_freq", "1",
                      "--metrics.enable_tensorboard", "--job.dump_folder", str(tmp_path)], NGPU="2")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "applied FSDP over mesh {'dp_shard_cp': 2}" in result.stdout
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert records[-1]["loss"] < records[0]["loss"]
    assert all(r["tokens_per_second"] > 0 and 0 < r["mfu_percent"] < 100 for r in records)
    assert any((tmp_path / "tb").iterdir()), "TensorBoard events expected"
    # LOG_RANK defaults to 0: only rank 0's lines are shown.
    assert "[rank0]:" in result.stdout and "[rank1]:" not in result.stdout


def test_launcher_rejects_bad_option_before_starting_ranks():
    result = _launch(["--training.stepz", "3"], NGPU="2")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines == ["config error: unknown option --training.stepz; did you mean 'steps'?"], result.stderr
    assert "Traceback" not in result.stdout + result.stderr


def test_launcher_help_lists_options():
    result = _launch(["--help"])
    assert result.returncode == 0
    assert "--training.tensor_parallel_degree" in result.stdout



def test_launcher_refuses_a_pipeline_that_would_hang():
    """Too few microbatches for 1F1B's warm-up is refused by the pre-flight check, without torch."""
    result = _launch(["--experimental.pipeline_parallel_degree", "4", "--experimental.pipeline_parallel_microbatches",
                      "2"], NGPU="4")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "config error: pipeline schedule 1F1B needs at least 4 microbatches for 4 ranks x 1 stages, got 2; "
        "raise training.batch_size or experimental.pipeline_parallel_microbatches"], result.stderr
