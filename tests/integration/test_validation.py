"""Validation in a real job: it leaves training bit for bit as it was, a job killed and started again
resumes exactly with it on, and the console explains the run (progress, validation, summary).

That every layout validates to the loss of one process is checked with every parity and
layout-matrix comparison (their runs validate: torchtitan/tools/parity.py COMPARISON_ARGS).
"""

import json

import pytest

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


@pytest.mark.fast
def test_validation_leaves_training_untouched_and_a_killed_job_resumes_exactly(tmp_path, uninterrupted):
    """The 2-rank FSDP job of the `uninterrupted` fixture, validating on data of its own every 3
    steps, killed right after saving step 6, before validating it, and started again: the resumed
    run validates step 6 first, and the job's losses are bit for bit those of the job that never
    validated nor stopped. Started once more with the export asked for, it has nothing to train
    and writes the export of its last step."""
    args = [*TINY_RUN, "--training.steps", str(UNINTERRUPTED_STEPS), "--checkpoint.enable_checkpoint",
            "--checkpoint.interval", "2", "--job.dump_folder", str(tmp_path / "out"),
            "--experimental.custom_import", "tests.faults.checkpoint",
            "--validation.enabled", "--validation.dataset_path", str(validation_file(tmp_path, 40)),
            "--validation.freq", "3", "--validation.steps", "2"]
    killed = run_train(args, nproc=2, check=False, extra_env={"TT_KILL_AFTER_STEP": "6"})
    assert killed.returncode != 0 and "validation at step 6" not in killed.stdout
    resumed = run_train(args, nproc=2)
    out = tmp_path / "out"
    assert [r["loss"] for r in read_metrics(out)] == uninterrupted
    # Step 3's validation is the killed run's, 6 (caught up before training on) and 8 the new one's.
    validations = read_validations(out)
    assert [r["step"] for r in validations] == [3, 6, 8]
    assert resumed.stdout.index("validation at step 6") < resumed.stdout.index("step:  7/8")
    # 2 batches of 8 sequences of 64 tokens on each of the 2 ranks
    assert all(r["batches"] == 2 and r["tokens"] == 2 * 8 * 64 * 2 and 0 < r["loss"] < 10 for r in validations)
    # The console: progress on every step line, each validation, then the summary.
    text = resumed.stdout
    assert "step:  8/8  loss:" in text and "eta " in text
    assert f"validation at step 6: loss: {validations[1]['loss']:7.4f}" in text
    best = min(validations, key=lambda r: r["loss"])
    assert "run summary (done): 2 steps (steps 7-8 of 8), 2,048 tokens in " in text
    assert (f"validation loss: final {validations[-1]['loss']:.4f} (step 8), best {best['loss']:.4f} "
            f"(step {best['step']})") in text
    assert f"outputs: checkpoints {out}/checkpoint/step-8; metrics {out}/metrics.jsonl" in text
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = [r for r in rows if r.get("record") == "summary"]
    assert len(summary) == 1 and summary[0]["steps"] == 2 and summary[0]["best_validation_step"] == best["step"]
    # Nothing left to train: the export a finished job lacks is written, nothing is validated again.
    again = run_train([*args, "--checkpoint.last_save_in_hf"], nproc=2)
    assert ("nothing left to train: the checkpoint resumed from is at step 8 and training.steps is 8" in again.stdout
            and "validation at step" not in again.stdout)
    assert (out / "checkpoint" / "step-8-hf" / "config.json").is_file()
    assert [r["step"] for r in read_validations(out)] == [3, 6, 8]


def test_validation_data_too_small_for_one_batch_is_one_line_at_start_up(tmp_path):
    """Found before the first step, not at the first validation (here the last step)."""
    result = run_train([*TINY_RUN, "--training.steps", "2", "--job.dump_folder", str(tmp_path / "out"),
                        "--validation.enabled", "--validation.dataset_path", str(validation_file(tmp_path, 1)),
                        "--validation.freq", "100"], check=False)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "step:" not in result.stdout
    assert result.stderr.strip().splitlines() == [
        "error: validation: the validation data gives no full batch of 8 x 64 tokens per data-parallel rank; give "
        "more validation data or lower validation.batch_size"]


def test_a_preemption_during_validation_abandons_it_and_stops_after_the_next_step(tmp_path):
    """SIGTERM while step 2 is validated (on the whole held-out split): the validation is given up
    at its next batch, and the job stops as a preemption does, after one more step, with its
    checkpoint; validating to the end first could outlast the grace period before the kill."""
    out = tmp_path / "out"
    result = run_train([*TINY_RUN, "--training.steps", "6", "--job.dump_folder", str(out),
                        "--checkpoint.enable_checkpoint", "--experimental.custom_import", "tests.faults.checkpoint",
                        "--validation.enabled", "--validation.freq", "2", "--validation.steps", "-1",
                        "--validation.held_out_fraction", "0.3"],
                       check=False, extra_env={"TT_SIGTERM_IN_VALIDATION": "2"})
    assert result.returncode == 75, result.stderr[-2000:]
    assert "validation at step 2 abandoned after 1 batch: a stop was requested" in result.stdout
    assert read_validations(out) == [] and [r["step"] for r in read_metrics(out)] == [1, 2, 3]
    assert (out / "checkpoint" / "step-3").is_dir()
