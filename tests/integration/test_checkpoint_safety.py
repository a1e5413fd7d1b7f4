"""Checkpoints are never lost or misused: damaged ones are skipped, a NaN state is never saved,
retention keeps what is needed, every bad checkpoint input (a model it does not fit included)
ends the run with one line, exit code 2 and nothing on disk changed, and a save the disk cannot
take stops every rank with one line and exit code 4, keeping the earlier checkpoints; a disk too full for
the metrics files costs them, not the run."""

import hashlib
import json
import os
import pickle
import shutil

import pytest

from tests.helpers import TINY_RUN, read_metrics, read_setup, run_train
from torchtitan.checkpoint.safe_load import read_metadata


class Payload:
    """Unpickling this runs a shell command: what a malicious checkpoint file would carry."""

    def __reduce__(self):
        return (os.system, ("echo pwned",))


SAVED = ["--training.steps", "4", "--checkpoint.enable_checkpoint", "--checkpoint.interval", "2",
         "--training.dataset_shards", "2"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A job folder with checkpoints step-2 and step-4 (one process, 2 data shards)."""
    folder = tmp_path_factory.mktemp("saved")
    run_train([*TINY_RUN, *SAVED, "--job.dump_folder", str(folder)])
    return folder


def snapshot(root):
    return {str(p.relative_to(root)): hashlib.sha1(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


def prepare(case, tmp_path, saved):
    """Builds the case's files under tmp_path; returns the trainer arguments."""
    job = tmp_path / "job"
    shutil.copytree(saved, job)
    ckpt = job / "checkpoint"
    if case == "truncated file":
        data = ckpt / "step-4" / "__0_0.distcp"
        data.write_bytes(data.read_bytes()[:1000])
    if case == "flipped bits":  # the size is unchanged, so only reading the data finds it
        data = ckpt / "step-4" / "__0_0.distcp"
        raw = bytearray(data.read_bytes())
        raw[-30] ^= 0xFF  # inside the zip directory of the non-tensor entries
        data.write_bytes(bytes(raw))
    if case == "garbage metadata":
        metadata = ckpt / "step-4" / ".metadata"
        metadata.write_bytes(os.urandom(metadata.stat().st_size))
    if case == "not a checkpoint":
        (tmp_path / "notes").mkdir()
        (tmp_path / "notes" / "readme.txt").write_text("not a checkpoint")
    if case == "unsafe metadata":
        shutil.copytree(ckpt / "step-2", tmp_path / "foreign")
        (tmp_path / "foreign" / "manifest.json").unlink()  # a plain DCP folder, as other tools write
        (tmp_path / "foreign" / ".metadata").write_bytes(pickle.dumps(Payload()))
    return [a.format(tmp=tmp_path, job=job) for a in CASES[case][0]]


RESUME = ["--job.dump_folder", "{job}", "--checkpoint.enable_checkpoint"]
CASES = {  # name: (arguments, expected line)
    "missing folder": (["--job.dump_folder", "{tmp}/run", "--checkpoint.initial_load_path", "{tmp}/no/such"],
                       "checkpoint.initial_load_path {tmp}/no/such does not exist"),
    "missing job folder": (["--job.dump_folder", "{tmp}/new", "--checkpoint.enable_checkpoint", "--checkpoint.load_step", "2"],
                           "checkpoint.load_step 2: there is no step-2 in {tmp}/new/checkpoint (the folder does not exist)"),
    "wrong load_step": ([*RESUME, "--checkpoint.load_step", "3"],
                        "checkpoint.load_step 3: there is no step-3 in {job}/checkpoint (complete checkpoints: 2, 4)"),
    "other model flavor": ([*RESUME, "--experimental.custom_import", "tests.faults.checkpoint", "--model.flavor",
                            "tiny_narrow", "--training.dataset_shards", "2"],
                           "checkpoint {job}/checkpoint/step-4 (written by llama3 tiny) does not fit llama3 "
                           "tiny_narrow: tok_embeddings.weight is [2256, 128] in the checkpoint, [2256, 64] in "
                           "the model (dim 128 vs 64, n_heads 16 vs 8, n_kv_heads 8 vs 4)"),
    "untied into tied": ([*RESUME, "--model.flavor", "tiny_tied", "--training.dataset_shards", "2"],
                         "checkpoint {job}/checkpoint/step-4 (written by llama3 tiny) does not fit llama3 "
                         "tiny_tied: output.weight is its own weight in the checkpoint, but this model ties it to "
                         "tok_embeddings.weight (checkpoint is untied, model is tied)"),
    "other model": (["--job.dump_folder", "{tmp}/run", "--model.name", "llama2", "--checkpoint.initial_load_path",
                     "{job}/checkpoint/step-2"],
                    "checkpoint {job}/checkpoint/step-2 (written by llama3 tiny) does not fit llama2 tiny: "
                    "it holds a llama3 model, this run trains llama2; set model.name llama3"),
    "exclusion of nothing": ([*RESUME, "--checkpoint.exclude_from_loading", "outptu"],
                             "checkpoint.exclude_from_loading 'outptu' names nothing in {job}/checkpoint/step-4"),
    "flipped bits": ([*RESUME, "--checkpoint.load_step", "4"],
                     "checkpoint {job}/checkpoint/step-4 cannot be loaded: RuntimeError: PytorchStreamReader failed "
                     "reading zip archive: not a ZIP archive (rank 0)"),
    "garbage metadata": ([*RESUME, "--checkpoint.load_step", "4"],
                         "{job}/checkpoint/step-4 cannot be read safely: its DCP metadata is unreadable"),
    "not a checkpoint": (["--job.dump_folder", "{tmp}/run", "--checkpoint.initial_load_path", "{tmp}/notes"],
                         "checkpoint.initial_load_path {tmp}/notes is not a checkpoint (no manifest.json and no DCP "
                         ".metadata file)"),
    "truncated file": ([*RESUME, "--checkpoint.load_step", "4"],
                       "checkpoint.load_step 4: {job}/checkpoint/step-4 is damaged: its file __0_0.distcp has 1000 bytes"),
    "other data shards": ([*RESUME, "--training.dataset_shards", "4"],
                          "{job}/checkpoint/step-4 keeps the data position of 2 data shards, but training.dataset_shards "
                          "is 4; set it to 2 (or -1)"),
    "a mixture of more sources": ([*RESUME, "--training.dataset_shards", "2", "--training.dataset_mix",
                                   "stdlib_docs:1,bundled:stdlib_docs/corpus.jsonl:1"],
                                  "its data position does not match this run's data: the checkpoint has no "
                                  "dataloader.shard_0.source_1.counted"),
    "unsafe metadata": (["--job.dump_folder", "{tmp}/run", "--checkpoint.initial_load_path", "{tmp}/foreign"],
                        "{tmp}/foreign cannot be read safely: its DCP metadata is unreadable (refusing to load posix.system"),
}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.fast) if c in ("missing folder", "truncated file") else c
                                  for c in CASES])
def test_bad_checkpoint_input_is_one_line_and_changes_nothing(case, tmp_path, saved):
    args = prepare(case, tmp_path, saved)
    before = snapshot(tmp_path)
    result = run_train([*TINY_RUN, *args], check=False)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    expected = CASES[case][1].format(tmp=tmp_path, job=tmp_path / "job")
    assert len(lines) == 1 and expected in lines[0], result.stderr[-3000:]
    assert len(lines[0]) < 600, lines[0]  # one readable line, not a stack per rank
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("case", ["truncated file", "garbage metadata"])
def test_a_damaged_newest_checkpoint_is_skipped_with_a_warning(case, tmp_path, saved):
    args = prepare(case, tmp_path, saved)[:-2]  # no load_step: auto-resume
    result = run_train([*TINY_RUN, *SAVED, *args])
    problem = "it is damaged" if case == "truncated file" else "its DCP metadata is unreadable"
    assert f"skipping checkpoint {tmp_path}/job/checkpoint/step-4: {problem}" in result.stdout
    assert read_setup(tmp_path / "job")["initial_load"] == {"path": f"{tmp_path}/job/checkpoint/step-2",
                                                            "weights_only": False, "step": 2}
    assert [r["step"] for r in read_metrics(tmp_path / "job")] == [1, 2, 3, 4]


@pytest.mark.fast
def test_an_untied_checkpoint_resumes_as_tied_without_its_output_projection(tmp_path, saved):
    """A deliberate partial load: the output projection (and its optimizer state) is left out and
    logged; the tied model starts it from the checkpoint's embedding."""
    job = tmp_path / "job"
    shutil.copytree(saved, job)
    result = run_train([*TINY_RUN, *SAVED, "--training.steps", "5", "--job.dump_folder", str(job), "--model.flavor",
                        "tiny_tied", "--checkpoint.exclude_from_loading", "output"])
    assert f"not loading output from {job}/checkpoint/step-4 (checkpoint.exclude_from_loading)" in result.stdout
    assert read_setup(job)["initial_load"]["step"] == 4
    assert [r["step"] for r in read_metrics(job)][-1] == 5


WRITE_FAULT = ["--training.steps", "6", "--checkpoint.enable_checkpoint", "--checkpoint.interval", "2",
               "--experimental.custom_import", "tests.faults.checkpoint"]


@pytest.mark.parametrize("mode, nproc, fault, cause", [
    pytest.param("disabled", 1, "4:0:EROFS", "Read-only file system", marks=pytest.mark.fast),
    ("async", 2, "4:1:ENOSPC", "No space left on device"),  # one rank fails in the background: both stop
])
def test_a_save_that_cannot_be_written_stops_every_rank_and_keeps_the_earlier_checkpoints(mode, nproc, fault, cause,
                                                                                             tmp_path):
    rank = fault.split(":")[1]
    result = run_train([*TINY_RUN, *WRITE_FAULT, "--checkpoint.async_mode", mode, "--job.dump_folder", str(tmp_path)],
                       nproc=nproc, check=False, extra_env={"TT_WRITE_FAILS": fault})
    assert result.returncode == 4, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: checkpoint of step 4 not saved: " + cause), result.stderr
    assert f"(rank {rank})" in lines[0]
    assert lines[0].endswith(f"the newest checkpoint stays {tmp_path}/checkpoint/step-2")
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-2"]  # the unfinished one is gone


def test_a_disk_full_for_the_metrics_files_warns_once_each_and_the_run_trains_and_saves_on(tmp_path):
    """metrics.jsonl and TensorBoard's event file meet ENOSPC from step 2 on (tests/faults/free_space.py): one
    warning each, the run trains to its end, saves its checkpoints and exits 0 (docs/operations.md, "A full disk")."""
    result = run_train([*TINY_RUN, "--training.steps", "4", "--checkpoint.enable_checkpoint", "--checkpoint.interval", "2",
                        "--metrics.enable_tensorboard", "--experimental.custom_import", "tests.faults.free_space",
                        "--job.dump_folder", str(tmp_path)], check=False, extra_env={"TT_METRICS_DISK_FULL_AT_STEP": "2"})
    assert result.returncode == 0 and "Traceback" not in result.stderr + result.stdout, result.stderr[-3000:]
    warnings = [line for line in result.stdout.splitlines() if "cannot write" in line]
    assert len(warnings) == 2, result.stdout[-3000:]
    assert "cannot write the TensorBoard event file" in warnings[0] and "cannot write the metrics file" in warnings[1]
    assert all("at step 2: No space left on device" in w and "which trains on" in w for w in warnings)
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-2", "step-4"]
    assert [r["step"] for r in read_metrics(tmp_path)] == [1]
    assert "(not written since a failed write at step 2: No space left on device" in result.stdout  # the summary


def test_a_nan_loss_is_never_checkpointed(tmp_path):
    args = [*TINY_RUN, "--training.steps", "6", "--checkpoint.enable_checkpoint", "--checkpoint.interval", "2",
            "--experimental.custom_import", "tests.faults.checkpoint", "--model.name", "llama3_nan"]
    # By default the run stops at the first non-finite loss, before applying it, naming the
    # newest (good) checkpoint.
    result = run_train([*args, "--job.dump_folder", str(tmp_path / "stop")], extra_env={"TT_NAN_FROM_STEP": "3"},
                       check=False)
    assert result.returncode == 3, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [
        f"error: non-finite loss at step 3 (loss nan, gradient norm nan); the step was not applied; lower optimizer.lr "
        f"or raise training.warmup_steps, then resume; newest checkpoint: {tmp_path / 'stop' / 'checkpoint' / 'step-2'}"]
    assert sorted(p.name for p in (tmp_path / "stop" / "checkpoint").iterdir()) == ["step-2"]
    # Told to go on, the run still never saves a non-finite state.
    result = run_train([*args, "--training.on_nonfinite_loss", "continue", "--job.dump_folder", str(tmp_path / "go")],
                       extra_env={"TT_NAN_FROM_STEP": "3"})
    assert sorted(p.name for p in (tmp_path / "go" / "checkpoint").iterdir()) == ["step-2"]
    for step in (4, 6):
        assert f"step {step}: the loss or gradient norm is not finite; no checkpoint is saved" in result.stdout


def test_keep_latest_k_and_a_weights_only_export(tmp_path):
    args = [*TINY_RUN, "--training.steps", "8", "--checkpoint.enable_checkpoint", "--checkpoint.interval", "2",
            "--checkpoint.keep_latest_k", "1", "--checkpoint.model_weights_only", "--checkpoint.export_dtype", "bfloat16",
            "--job.dump_folder", str(tmp_path / "job")]
    run_train(args)
    ckpt = tmp_path / "job" / "checkpoint"
    # k = 1 keeps the newest checkpoint (the step-8 export) and the newest resumable one (step 6).
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-6", "step-8"]
    export = json.loads((ckpt / "step-8" / "manifest.json").read_text())
    assert export["contents"] == ["model"] and export["dtype"] == "bfloat16"
    dtypes = {m.properties.dtype for m in read_metadata(ckpt / "step-8").state_dict_metadata.values()}
    assert {str(d) for d in dtypes} == {"torch.bfloat16"}
    # The export starts a new run (any layout; fp32 training from bf16 weights).
    run_train([*TINY_RUN, "--training.steps", "1", "--training.warmup_steps", "1",
               "--checkpoint.initial_load_path", str(ckpt / "step-8"), "--job.dump_folder", str(tmp_path / "next")],
              nproc=2)
    assert read_setup(tmp_path / "next")["initial_load"] == {"path": str(ckpt / "step-8"), "weights_only": True,
                                                             "step": 0}
