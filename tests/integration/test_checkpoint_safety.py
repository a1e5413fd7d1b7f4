"""Checkpoints are never lost or misused: damaged ones are skipped, a NaN state is never saved,
retention keeps what is needed, and every bad checkpoint input ends the run with one line,
exit code 2 and nothing on disk changed."""

import hashlib
import json
import os
import pickle
import shutil

import pytest

from tests.helpers import TINY_RUN, read_metrics, run_train
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
    "other model flavor": ([*RESUME, "--experimental.custom_import", "tests.checkpoint_faults", "--model.flavor",
                            "debugmodel_narrow", "--training.dataset_shards", "2"],
                           "checkpoint {job}/checkpoint/step-4 (written by llama3 debugmodel) does not fit llama3 "
                           "debugmodel_narrow: it holds model.tok_embeddings.weight with shape [2256, 256], but this "
                           "run's is [2256, 128]"),
    "not a checkpoint": (["--job.dump_folder", "{tmp}/run", "--checkpoint.initial_load_path", "{tmp}/notes"],
                         "checkpoint.initial_load_path {tmp}/notes is not a checkpoint (no manifest.json and no DCP "
                         ".metadata file)"),
    "truncated file": ([*RESUME, "--checkpoint.load_step", "4"],
                       "checkpoint.load_step 4: {job}/checkpoint/step-4 is damaged: its file __0_0.distcp has 1000 bytes"),
    "other data shards": ([*RESUME, "--training.dataset_shards", "4"],
                          "{job}/checkpoint/step-4 keeps the data position of 2 data shards, but training.dataset_shards "
                          "is 4; set it to 2 (or -1)"),
    "unsafe metadata": (["--job.dump_folder", "{tmp}/run", "--checkpoint.initial_load_path", "{tmp}/foreign"],
                        "{tmp}/foreign cannot be read safely: its DCP metadata is unreadable (refusing to load posix.system"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_checkpoint_input_is_one_line_and_changes_nothing(case, tmp_path, saved):
    args = prepare(case, tmp_path, saved)
    before = snapshot(tmp_path)
    result = run_train([*TINY_RUN, *args], check=False)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    expected = CASES[case][1].format(tmp=tmp_path, job=tmp_path / "job")
    assert len(lines) == 1 and expected in lines[0], result.stderr[-3000:]
    assert snapshot(tmp_path) == before


def test_a_damaged_newest_checkpoint_is_skipped_with_a_warning(tmp_path, saved):
    args = prepare("truncated file", tmp_path, saved)[:-2]  # no load_step: auto-resume
    result = run_train([*TINY_RUN, *SAVED, *args])
    assert f"skipping checkpoint {tmp_path}/job/checkpoint/step-4: it is damaged" in result.stdout
    assert "resuming after step 2" in result.stdout
    assert [r["step"] for r in read_metrics(tmp_path / "job")] == [1, 2, 3, 4]


def test_a_nan_loss_is_never_checkpointed(tmp_path):
    args = [*TINY_RUN, "--training.steps", "6", "--checkpoint.enable_checkpoint", "--checkpoint.interval", "2",
            "--experimental.custom_import", "tests.checkpoint_faults", "--model.name", "llama3_nan",
            "--job.dump_folder", str(tmp_path)]
    result = run_train(args, extra_env={"TT_NAN_FROM_STEP": "3"})
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-2"]
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
    result = run_train([*TINY_RUN, "--training.steps", "1", "--checkpoint.initial_load_path", str(ckpt / "step-8"),
                        "--job.dump_folder", str(tmp_path / "next")], nproc=2)
    assert f"loaded model from {ckpt / 'step-8'}" in result.stdout
