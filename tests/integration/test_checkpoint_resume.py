"""A job that dies and is started again continues exactly where it was: the resumed run logs
bit-for-bit the losses of a run that never stopped, whatever the checkpoint mode, and a job
killed in the middle of writing a checkpoint leaves the previous one intact and loadable.

The failures are real SIGKILLs of rank 0 at chosen moments (tests/faults/checkpoint.py)."""

import json
import shutil

import pytest

from tests.helpers import TINY_RUN, read_metrics, read_setup, run_train
from tests.integration.conftest import UNINTERRUPTED_STEPS
from torchtitan.checkpoint import folders
from torchtitan.observability import goodput

# The jobs of the session's `uninterrupted` fixture (FSDP 2, a checkpoint every 2 steps), whose
# losses every resumed job must reproduce bitwise.
STEPS = UNINTERRUPTED_STEPS
FSDP2 = ["--training.data_parallel_shard_degree", "2"]
FSDP2_TP2_PP2 = ["--training.data_parallel_shard_degree", "2", "--training.tensor_parallel_degree", "2",
                 "--experimental.pipeline_parallel_degree", "2"]


def job(folder, layout, *extra):
    return [*TINY_RUN, "--training.steps", str(STEPS), "--checkpoint.enable_checkpoint", "--checkpoint.interval", "2",
            "--experimental.custom_import", "tests.faults.checkpoint", "--job.dump_folder", str(folder), *layout, *extra]


def killed(folder, layout, nproc, fault: dict, *extra):
    """Runs a job that a fault kills; returns its output."""
    result = run_train(job(folder, layout, *extra), nproc=nproc, check=False, extra_env=fault)
    assert result.returncode != 0, "the fault should have killed the job"
    return result


def resumed(folder, layout, nproc, *extra):
    return run_train(job(folder, layout, *extra), nproc=nproc)


def resumed_after(folder) -> int:
    """The step the newest run's checkpoint held (its setup record's initial load)."""
    load = read_setup(folder)["initial_load"]
    assert load is not None and not load["weights_only"], load
    return load["step"]


def losses(folder):
    records = read_metrics(folder)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), "every step logged once"
    return [r["loss"] for r in records]


def goodput_across_the_restart(folder) -> None:
    """The resumed run's summary splits its wall time (every category, goodput_percent in (0, 100]);
    goodput.jsonl holds both attempts, and the job's figure counts the gap between them and the
    productive time the killed attempt spent on step 5, after the step-4 checkpoint resumed from."""
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    summary = [r for r in rows if r.get("record") == "summary"][-1]
    assert 0 < summary["goodput_percent"] <= 100, summary
    assert set(summary["goodput_seconds"]) == {*goodput.CATEGORIES, "wall"}
    assert all(0 < r["goodput_percent"] <= 100 for r in read_metrics(folder))
    assert [a.resumed_step for a in goodput.read_attempts(str(folder / goodput.FILE_NAME))] == [0, 4]
    job = summary["job_goodput_seconds"]
    assert summary["job_attempts"] == 2 and job["restarts"] > 0 and job["redone"] > 0, job
    assert 0 < summary["job_goodput_percent"] <= 100


# Synchronous saves are covered by the restart trials (test_restart_trials.py): a rank SIGKILLed at
# a random step, torchrun's automatic restart, bitwise the losses of an uninterrupted run.
@pytest.mark.parametrize("mode", [pytest.param("async", marks=pytest.mark.fast), "async_with_pinned_mem"])
def test_a_crashed_job_resumes_exactly(tmp_path, uninterrupted, mode):
    """Killed after step 5 (checkpoints at 2 and 4), then started again: steps 5-8 are
    trained again from the step-4 checkpoint, data position and RNG included."""
    mode_args = ["--checkpoint.async_mode", mode]
    killed(tmp_path, FSDP2, 2, {"TT_KILL_AFTER_STEP": "5"}, *mode_args)
    resumed(tmp_path, FSDP2, 2, *mode_args)
    assert resumed_after(tmp_path) == 4
    assert losses(tmp_path) == uninterrupted
    goodput_across_the_restart(tmp_path)
    # The last save, still being written when training ended, was awaited and published before exit.
    assert folders.problem_with(str(tmp_path / "checkpoint" / f"step-{STEPS}")) is None


def test_a_shuffled_job_reading_with_worker_processes_resumes_exactly_with_any_number_of_them(tmp_path, uninterrupted):
    """Shuffled data (training.dataset_shuffle) read by two workers per rank, killed after step 5,
    resumed without workers: step 5, trained again from the step-4 checkpoint's data position, is
    bitwise the step the killed job trained (the shuffled position is worker-independent), and the
    shuffle did change the data. (In file order, test_shuffle.py and the unit tests of workers show
    the batches equal for any worker count.)"""
    shuffled = ("--training.dataset_shuffle",)
    killed(tmp_path, FSDP2, 2, {"TT_KILL_AFTER_STEP": "5"}, *shuffled, "--training.dataset_num_workers", "2")
    before = {r["step"]: r["loss"] for r in read_metrics(tmp_path)}
    resumed(tmp_path, FSDP2, 2, *shuffled)
    assert resumed_after(tmp_path) == 4
    after = losses(tmp_path)
    assert after[:5] == [before[step] for step in range(1, 6)]
    assert after != uninterrupted


def test_a_job_killed_while_saving_keeps_the_previous_checkpoint(tmp_path, uninterrupted):
    # Killed while DCP writes step 4: step-2 stays the newest checkpoint.
    killed(tmp_path, FSDP2, 2, {"TT_KILL_IN_SAVE": "4:write"})
    assert sorted(p.name.split(".")[0] for p in (tmp_path / "checkpoint").iterdir()) == ["step-2", "step-4"]
    assert not (tmp_path / "checkpoint" / "step-4").exists()  # only the unfinished step-4.partial-* folder
    # The next job resumes from step 2, and is killed after writing the last step's manifest, before publishing it.
    result = killed(tmp_path, FSDP2, 2, {"TT_KILL_IN_SAVE": f"{STEPS}:publish"})
    assert "ignoring" in result.stdout and "a save that never finished" in result.stdout
    assert resumed_after(tmp_path) == 2
    # The third job finds step-6 as the newest complete checkpoint, and finishes.
    result = resumed(tmp_path, FSDP2, 2)
    assert resumed_after(tmp_path) == STEPS - 2
    assert "removing" in result.stdout  # the unfinished saves of the killed jobs are cleaned up
    assert losses(tmp_path) == uninterrupted
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-2", "step-4", "step-6", "step-8"]


def test_a_3d_job_resumes_exactly(tmp_path):
    """FSDP 2 x TP 2 x PP 2 on 8 ranks: a new job started from the step-2 checkpoint of a 4-step
    run logs the same steps 3-4. (The crash itself is exercised above; here the first 2 steps
    are the uninterrupted job's own, which saves on 8 ranks an extra job.)"""
    steps = ("--training.steps", "4")
    run_train(job(tmp_path / "full", FSDP2_TP2_PP2, *steps), nproc=8, timeout=600)
    shutil.copytree(tmp_path / "full" / "checkpoint" / "step-2", tmp_path / "split" / "checkpoint" / "step-2")
    resumed(tmp_path / "split", FSDP2_TP2_PP2, 8, *steps)
    assert resumed_after(tmp_path / "split") == 2
    full = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "full")}
    split = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "split")}
    assert sorted(split) == [3, 4]
    assert split == {step: full[step] for step in split}


def test_a_fine_tuning_job_resumes_exactly(tmp_path):
    """Chat data (sft.format), packed with document masks, shuffled and read by a worker, killed
    after step 5: the resumed job's steps 5-8 are bitwise those of a job never stopped, so the
    packer's saved position (the item and the conversations used of it, the overlong counts)
    restarts the rows where they were. One process: the data position is per data shard, and
    shards over ranks are tests/unit_tests/test_sft_data.py's."""
    sft = ("--model.tokenizer_path", "bundled:chat_tokenizer", "--training.dataset", "reverse_words", "--sft.format",
           "chat", "--training.document_mask", "--training.seq_len", "96", "--training.dataset_shuffle",
           "--training.dataset_num_workers", "1")
    whole = tmp_path / "whole"
    run_train(job(whole, [], *sft))
    killed(tmp_path / "killed", [], 1, {"TT_KILL_AFTER_STEP": "5"}, *sft)
    resumed(tmp_path / "killed", [], 1, *sft)
    assert resumed_after(tmp_path / "killed") == 4
    assert losses(tmp_path / "killed") == losses(whole)
