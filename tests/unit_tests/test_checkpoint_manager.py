"""The CheckpointManager in one process, on a one-rank gloo group (its collectives run as on any rank):
a save whose publication fails, an old checkpoint that cannot be removed, a final export that
fails after the step's checkpoint was written; and the resume point's own refusals."""

import dataclasses
import errno
import logging
import os
import types

import pytest
import torch.distributed as dist

from torchtitan.checkpoint import folders, hf_training
from torchtitan.checkpoint.folders import CheckpointError, CheckpointSaveError, Manifest
from torchtitan.checkpoint.manager import CheckpointManager, tokenizer_record
from torchtitan.checkpoint.resume import ResumePoint, decide_on_rank0
from torchtitan.checkpoint.states import TrainState
from torchtitan.config.manager import parse_args
from torchtitan.models import get_train_spec
from torchtitan.parallelisms.parallel_dims import ParallelDims

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class Nothing:
    """An optimizer, scheduler or dataset with no state: the model is what these tests save."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        pass


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def manager_of(tmp_path, *options: str) -> CheckpointManager:
    """A manager of the llama3 tiny model saving under tmp_path/run/checkpoint."""
    job = parse_args(["--model.flavor", "tiny", "--job.dump_folder", str(tmp_path / "run"), "--checkpoint.enable_checkpoint",
                      *options])
    spec = get_train_spec("llama3")
    # The vocabulary of the bundled tokenizer, as the run sets it (the flavor's own is Llama 3's 128,256).
    model = spec.model_cls.from_model_args(dataclasses.replace(spec.config["tiny"], vocab_size=2256, max_seq_len=64))
    model.init_weights()
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, world_size=1, enable_loss_parallel=False)
    dims.build_mesh("cpu")
    return CheckpointManager(job, dims, [model], Nothing(), Nothing(), types.SimpleNamespace(dataset=Nothing()),
                             TrainState(), data_shards=1)


def test_a_manifest_that_cannot_be_written_stops_the_save_and_removes_it(tmp_path, monkeypatch, one_rank):
    manager = manager_of(tmp_path)
    manager.save(2, force=True)

    def open_or_fail(path, *args, **kwargs):
        if os.path.basename(path) == folders.MANIFEST + ".tmp" and "step-4" in path:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return open(path, *args, **kwargs)

    monkeypatch.setattr(folders, "open", open_or_fail, raising=False)  # the module's own open only
    with pytest.raises(CheckpointSaveError) as raised:
        manager.save(4, force=True)
    message = str(raised.value)
    assert message.startswith(f"checkpoint of step 4 not saved: No space left on device: {manager.folder}/step-4.partial-")
    assert f"MiB free on the disk holding {manager.folder}); the newest checkpoint stays {manager.folder}/step-2" in message
    assert "\n" not in message
    assert sorted(os.listdir(manager.folder)) == ["step-2"]


def test_an_old_checkpoint_that_cannot_be_removed_is_a_warning(tmp_path, monkeypatch, one_rank, caplog):
    manager = manager_of(tmp_path, "--checkpoint.keep_latest_k", "1")
    manager.save(2, force=True)
    rename = os.rename

    def rename_or_fail(src, dst, *args, **kwargs):
        if str(src) == os.path.join(manager.folder, "step-2"):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(src))
        return rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "rename", rename_or_fail)
    with caplog.at_level(logging.WARNING):
        manager.save(4, force=True)
    assert sorted(os.listdir(manager.folder)) == ["step-2", "step-4"]  # the new one is safe; the old one costs space
    assert f"could not remove {manager.folder}/step-2 (checkpoint.keep_latest_k): Permission denied: " \
           f"{manager.folder}/step-2" in caplog.text


def test_a_final_export_that_fails_says_the_checkpoints_are_untouched(tmp_path, monkeypatch, one_rank):
    manager = manager_of(tmp_path, "--checkpoint.last_save_in_hf")
    monkeypatch.setattr(hf_training, "free_bytes", lambda path: 1000)
    with pytest.raises(CheckpointSaveError) as raised:
        manager.save(3, last=True)
    assert str(raised.value).startswith("final weights not written as a Hugging Face folder: not enough space for the "
                                        "checkpoint: it needs ")
    assert str(raised.value).endswith(f"; the checkpoints in {manager.folder} are untouched")
    assert sorted(os.listdir(manager.folder)) == ["step-3"]


def test_a_tokenizer_that_cannot_be_read_is_not_recorded(tmp_path):
    """The run itself refuses such a tokenizer, with the line that names it; the manifest just has no record."""
    assert tokenizer_record(str(tmp_path / "gone.model")) is None
    assert tokenizer_record("bundled:stdlib_docs/gone.model") is None
    assert tokenizer_record("bundled:stdlib_docs/tokenizer.model")["path"] == "bundled:stdlib_docs/tokenizer.model"


def test_a_data_position_that_the_data_parallel_ranks_cannot_split_is_refused():
    manifest = Manifest(step=8, contents=["model", "dataloader"], model={"name": "llama3", "flavor": "tiny"}, data_shards=3)
    resume = ResumePoint("ckpt/step-8", weights_only=False, manifest=manifest)
    assert resume.data_shards(-1, 3) == 3
    with pytest.raises(CheckpointError, match=r"^ckpt/step-8 keeps the data position of 3 data shards, which 2 "
                                              r"data-parallel ranks cannot split evenly; use a data-parallel degree "
                                              r"that divides 3$"):
        resume.data_shards(-1, 2)


def test_another_global_batch_is_one_warning_naming_the_batch_size_that_continues_the_run():
    """batch_size is per data-parallel rank: a PP 2 run's checkpoint (4 sequences on one
    data-parallel rank) resumed by two FSDP ranks with the same options trains on 8."""
    manifest = Manifest(step=2, contents=["model", "dataloader"], model={"name": "llama3", "flavor": "tiny"},
                        data_shards=2, global_batch={"sequences": 4, "seq_len": 128})
    resume = ResumePoint("ckpt/step-2", weights_only=False, manifest=manifest)
    training = parse_args(["--training.batch_size", "4", "--training.seq_len", "128"]).training
    assert resume.batch_change(training, 1) is None
    assert resume.batch_change(training, 2) == (
        "ckpt/step-2 was trained with a global batch of 4 x 128 tokens, this run's is 8 x 128 (training.batch_size 4 on each "
        "of 2 data-parallel ranks, gradient_accumulation_steps 1): it trains on other batches, so its losses do not continue the "
        "saved run's; to continue it, set training.batch_size 2")
    assert resume.batch_change(dataclasses.replace(training, batch_size=2), 2) is None
    assert resume.batch_change(dataclasses.replace(training, seq_len=64), 1).endswith("set training.seq_len 128")
    assert resume.batch_change(training, 3).endswith("gradient_accumulation_steps of 4")
    # A checkpoint written before the batch was recorded, and weights only: nothing to compare.
    assert ResumePoint("old", False, dataclasses.replace(manifest, global_batch=None)).batch_change(training, 2) is None
    assert ResumePoint("w", True, manifest).batch_change(training, 2) is None


def test_rank0s_refusal_reaches_every_rank(one_rank):
    def refuse():
        raise CheckpointError("checkpoint.load_step 7: there is no step-7")

    with pytest.raises(CheckpointError, match="^checkpoint.load_step 7: there is no step-7$"):
        decide_on_rank0(refuse)
    assert decide_on_rank0(lambda: "step-6") == "step-6"
