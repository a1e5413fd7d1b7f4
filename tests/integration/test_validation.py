"""Validation in a real job: it leaves training bit for bit as it was, a job killed and started again
resumes exactly with it on, and the console explains the run (progress, validation, summary).

That every layout validates to the loss of one process is checked with every parity and
layout-matrix comparison (their runs validate: torchtitan/tools/parity.py COMPARISON_ARGS).
"""

import json

from tests.helpers import TINY_RUN, read_metrics, run_train
from tests.integration.conftest import UNINTERRUPTED_STEPS
from torchtitan.assets import resolve_path
from torchtitan.tools.runs import read_validations


def validation_file(tmp_path, documents: int):
    """A validation set apart from the training data: the last documents of the bundled corpus."""
    with open(resolve_path("bundled:stdlib_docs/corpus.jsonl", "corpus")) as f:
        lines = f.readlines()[-documents:]
    path = tmp_path / "validation.jsonl"
    path.write_text("".join(lines))
    return path


def test_validation_leaves_training_untouched_and_a_killed_job_resumes_exactly(tmp_path, uninterrupted):
    """The 2-rank FSDP job of the `uninterrupted` fixture, validating on data of its own every 3
    steps, killed after step 5 and started again from its step-4 checkpoint: its losses are bit for
    bit those of the job that never validated nor stopped."""
    args = [*TINY_RUN, "--training.steps", str(UNINTERRUPTED_STEPS), "--checkpoint.enable_checkpoint",
            "--checkpoint.interval", "2", "--job.dump_folder", str(tmp_path / "out"),
            "--experimental.custom_import", "tests.checkpoint_faults",
            "--validation.enabled", "--validation.dataset_path", str(validation_file(tmp_path, 40)),
            "--validation.freq", "3", "--validation.steps", "2"]
    killed = run_train(args, nproc=2, check=False, extra_env={"TT_KILL_AFTER_STEP": "5"})
    assert killed.returncode != 0
    resumed = run_train(args, nproc=2)
    out = tmp_path / "out"
    assert [r["loss"] for r in read_metrics(out)] == uninterrupted
    # Step 3's validation is the killed run's (before the checkpoint it resumed from), 6 and 8 the new one's.
    validations = read_validations(out)
    assert [r["step"] for r in validations] == [3, 6, 8]
    # 2 batches of 8 sequences of 64 tokens on each of the 2 ranks
    assert all(r["batches"] == 2 and r["tokens"] == 2 * 8 * 64 * 2 and 0 < r["loss"] < 10 for r in validations)
    # The console: progress on every step line, each validation, then the summary.
    text = resumed.stdout
    assert "step:  8/8  loss:" in text and "eta " in text
    assert f"validation at step 6: loss: {validations[1]['loss']:7.4f}" in text
    best = min(validations, key=lambda r: r["loss"])
    assert "run summary (done): 4 steps (steps 5-8 of 8), 4,096 tokens in " in text
    assert (f"validation loss: final {validations[-1]['loss']:.4f} (step 8), best {best['loss']:.4f} "
            f"(step {best['step']})") in text
    assert f"outputs: checkpoints {out}/checkpoint/step-8; metrics {out}/metrics.jsonl" in text
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = [r for r in rows if r.get("record") == "summary"]
    assert len(summary) == 1 and summary[0]["steps"] == 4 and summary[0]["best_validation_step"] == best["step"]


def test_validation_data_too_small_for_one_batch_is_one_line(tmp_path):
    result = run_train([*TINY_RUN, "--training.steps", "2", "--job.dump_folder", str(tmp_path / "out"),
                        "--validation.enabled", "--validation.dataset_path", str(validation_file(tmp_path, 1)),
                        "--validation.freq", "1"], check=False)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [
        "error: validation: the validation data gives no full batch of 8 x 64 tokens per data-parallel rank; give "
        "more validation data or lower validation.batch_size"]
