"""Hugging Face weights in a training run: a folder made from the parity seed checkpoint starts
FSDP 2 and TP 2 jobs that train like the one-process baseline started from the seed itself, and the
same jobs write their final weights as a Hugging Face folder equal to their own final checkpoint."""

import contextlib
import io
from pathlib import Path

import pytest
import torch

from tests.helpers import read_metrics, read_setup, run_ranks_script, run_train
from tests.integration.test_convert_checkpoint import convert_checkpoint
from torchtitan.checkpoint import hf_folder
from torchtitan.checkpoint.hf_training import hf_export_path
from torchtitan.checkpoint.weights import load_model_entries
from torchtitan.models import get_train_spec
from torchtitan.tools.parity import local_batch_size

LAYOUTS = {
    "fsdp2": ("--training.data_parallel_shard_degree", "2"),
    "tp2": ("--training.tensor_parallel_degree", "2"),
}


@pytest.fixture(scope="module")
def seed_hf(parity, tmp_path_factory):
    """The parity seed checkpoint as a Hugging Face folder, made by the converter (in this process)."""
    out = tmp_path_factory.mktemp("hf") / "seed_hf"
    with contextlib.redirect_stdout(io.StringIO()):
        status = convert_checkpoint.main(["dcp-to-hf", str(parity.seed_checkpoint()), str(out),
                                          "--tokenizer", "bundled:stdlib_docs/tokenizer.model"])
    assert status == 0
    return out


def hf_tensors_as_ours(folder):
    adapter = get_train_spec("llama3").hf_adapter
    tensors, _ = hf_folder.read_hf_tensors(str(folder), hf_folder.safetensors_files(str(folder)))
    args = adapter.model_args_from_hf_config(hf_folder.read_json(str(folder / "config.json"), "config"))
    return hf_folder.hf_to_ours(tensors, args, adapter, str(folder))[0]


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_a_job_starts_from_a_hugging_face_folder_and_ends_with_one(name, parity, seed_hf, tmp_path):
    layout = LAYOUTS[name]
    out = tmp_path / name
    args = [*parity.common_args(), "--job.dump_folder", str(out), *layout,
            "--training.batch_size", str(local_batch_size(parity.global_batch, layout, 2)),
            "--checkpoint.initial_load_path", str(seed_hf), "--checkpoint.last_save_in_hf",
            "--checkpoint.enable_checkpoint", "--checkpoint.model_weights_only"]
    result = run_train(args, nproc=2)
    losses = [r["loss"] for r in read_metrics(out)]
    base = parity.baseline().losses
    print(f"{name} from the HF folder, first losses {[round(x, 6) for x in losses[:3]]}; baseline from the DCP seed "
          f"{[round(x, 6) for x in base[:3]]}")
    assert max(abs(a - b) for a, b in zip(losses, base)) <= parity.loss_tolerance and len(losses) == len(base)
    assert read_setup(out)["initial_load"] == {"path": str(seed_hf), "weights_only": True, "step": 0,
                                                "format": "huggingface"}
    assert f"loaded model weights from the Hugging Face folder {seed_hf}" in result.stdout
    # The export holds the final weights exactly: those of the run's own last (weights-only) checkpoint.
    steps = parity.steps
    export = hf_export_path(str(out / "checkpoint"), steps)
    exported = hf_tensors_as_ours(Path(export))
    final = load_model_entries(str(out / "checkpoint" / f"step-{steps}"))
    assert sorted(exported) == sorted(final)
    assert all(torch.equal(exported[k], final[k]) for k in final)
    assert {p.name for p in Path(export).iterdir()} == {"config.json", "model.safetensors", "tokenizer.model"}
    assert f"outputs: checkpoints {out}/checkpoint/step-{steps}; Hugging Face weights {export}" in result.stdout


FAILING_WRITER = r"""
import json, os, sys, types
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torchtitan.checkpoint import hf_folder, hf_training
from torchtitan.checkpoint.folders import CheckpointSaveError
from torchtitan.checkpoint.states import ModelState
from torchtitan.models import get_train_spec
from torchtitan.models.llama.model import ModelArgs, Transformer

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
args = ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=300, multiple_of=32, max_seq_len=32)
model = Transformer(args)
model.init_weights()
fully_shard(model, mesh=mesh)
hf_training.MAX_SHARD_BYTES = 10**5  # many files, so that the write fails between two gathers
safetensors = hf_folder.import_safetensors()
calls = []
def save_file(*a, **k):
    calls.append(1)
    if len(calls) == 2:
        raise safetensors.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
safetensors.torch.save_file = save_file
try:
    hf_training.write_hf_weights(ModelState([model]), get_train_spec("llama3").hf_adapter, args,
                                 types.SimpleNamespace(world_mesh=mesh, pp_enabled=False), sys.argv[1] + "/step-1-hf",
                                 torch.float32, {}, None, "attempt")
    line = None
except CheckpointSaveError as e:
    line = str(e)
if dist.get_rank() == 0:  # the rank that removes the unfinished folder
    print("RESULT " + json.dumps({"line": line, "left": sorted(os.listdir(sys.argv[1]))}))
dist.destroy_process_group()
"""


def test_a_writer_failing_between_two_gathers_stops_every_rank_with_one_line(tmp_path):
    # Rank 0 writes; its second file fails while rank 1 still has parameters to gather with it.
    (tmp_path / "ckpt").mkdir()
    out = run_ranks_script(FAILING_WRITER, 2, tmp_path, str(tmp_path / "ckpt"), timeout=120)
    assert out["line"].startswith("final weights not written as a Hugging Face folder: SafetensorError: Error while "
                                  "serializing: I/O error: No space left on device (os error 28)")
    assert out["left"] == []
