"""Reading a Hugging Face folder into a run's model (torchtitan/checkpoint/hf_training.py), in one
process: exact weights, a padded vocabulary, and the one-line refusals of a folder that does not fit."""

import dataclasses
import errno
import json
import os
import types

import pytest
import torch

from torchtitan.checkpoint import hf_folder, hf_training, resume
from torchtitan.checkpoint.folders import CheckpointError, CheckpointSaveError
from torchtitan.checkpoint.hf_training import is_hf_folder, load_hf_weights, whole_model_shapes, write_hf_weights
from torchtitan.checkpoint.states import ModelState
from torchtitan.models import get_train_spec
from torchtitan.models.llama.model import ModelArgs, Transformer

ADAPTER = get_train_spec("llama3").hf_adapter
ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=300, multiple_of=32, max_seq_len=32)


def model_of(args: ModelArgs, seed: int) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(args)
    model.init_weights()
    return model


def hf_folder_of(tmp_path, model: Transformer, drop: str | None = None):
    """`model` written as a Hugging Face folder (as an export would), less tensor `drop`."""
    hf = hf_folder.to_hf({k: v.detach() for k, v in model.state_dict().items()}, model.args, ADAPTER)
    hf.pop(drop, None)
    folder = tmp_path / "hf"
    folder.mkdir()
    hf_folder.write_fresh(str(folder), hf, ADAPTER.hf_config(model.args), 10**9)
    return folder


def load(folder, args: ModelArgs, exclude=(), allow_partial=False) -> Transformer:
    model = model_of(args, seed=1)
    with torch.device("meta"):
        whole = whole_model_shapes(Transformer(args))
    load_hf_weights(str(folder), ModelState([model]), ADAPTER, args, whole, list(exclude), allow_partial)
    return model


def test_weights_come_back_exactly(tmp_path):
    source = model_of(ARGS, seed=0)
    folder = hf_folder_of(tmp_path, source)
    assert is_hf_folder(str(folder)) and not is_hf_folder(str(tmp_path))
    loaded = load(folder, ARGS)
    for name, tensor in source.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_a_padded_vocabulary_takes_the_folder_rows_and_zero_padding(tmp_path):
    source = model_of(ARGS, seed=0)
    padded = dataclasses.replace(ARGS, vocab_padding=4)
    loaded = load(hf_folder_of(tmp_path, source), padded)
    assert torch.equal(loaded.tok_embeddings.weight[:300], source.tok_embeddings.weight)
    assert not loaded.tok_embeddings.weight[300:].any()


@pytest.mark.parametrize("change,expected", [
    (dict(n_layers=3), "its config.json differs: n_layers 2 (config.json) vs 3 (this run)): it has no tensor for "
                       "layers.2.attention.wq.weight; and 8 more problems"),
    (dict(vocab_size=400), "its config.json differs: vocab_size 300 (config.json) vs 400 (this run)): "
                           "tok_embeddings.weight is [300, 64] there, [400, 64] in this run's model; and 1 more problems"),
    (dict(n_layers=1), "it holds layers.1.attention.wk.weight and 8 more that this run's model does not have"),
])
def test_a_folder_of_another_shape_is_refused_in_one_line_before_reading(tmp_path, change, expected):
    folder = hf_folder_of(tmp_path, model_of(ARGS, seed=0))
    with pytest.raises(CheckpointError) as raised:
        load(folder, dataclasses.replace(ARGS, **change))
    message = str(raised.value)
    assert message.startswith(f"checkpoint.initial_load_path {folder} does not fit this run's model") and "\n" not in message
    assert expected in message
    assert message.endswith("use a folder of this model, or set checkpoint.allow_partial_load")


def test_a_missing_tensor_is_named_and_a_partial_load_keeps_it_initialised(tmp_path, caplog):
    source = model_of(ARGS, seed=0)
    folder = hf_folder_of(tmp_path, source, drop="model.layers.1.mlp.down_proj.weight")
    with pytest.raises(CheckpointError, match="it has no tensor for layers.1.feed_forward.w2.weight;"):
        load(folder, ARGS)
    loaded = load(folder, ARGS, allow_partial=True)
    fresh = model_of(ARGS, seed=1)
    assert torch.equal(loaded.layers["1"].feed_forward.w2.weight, fresh.layers["1"].feed_forward.w2.weight)
    assert torch.equal(loaded.layers["0"].feed_forward.w2.weight, source.layers["0"].feed_forward.w2.weight)
    assert "left as initialised (checkpoint.allow_partial_load)" in caplog.text


def test_excluded_prefixes_keep_their_initial_values(tmp_path):
    source = model_of(ARGS, seed=0)
    loaded = load(hf_folder_of(tmp_path, source), ARGS, exclude=["output"])
    assert torch.equal(loaded.output.weight, model_of(ARGS, seed=1).output.weight)
    assert torch.equal(loaded.norm.weight, source.norm.weight)


def test_a_damaged_weight_file_is_one_line(tmp_path):
    folder = hf_folder_of(tmp_path, model_of(ARGS, seed=0))
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model.safetensors is not a valid safetensors file \("):
        load(folder, ARGS)


def test_a_tensor_stored_in_two_files_is_one_line(tmp_path):
    folder = hf_folder_of(tmp_path, model_of(ARGS, seed=0))
    safetensors = hf_folder.import_safetensors()
    tensors = safetensors.torch.load_file(str(folder / "model.safetensors"))
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    safetensors.torch.save_file({"model.norm.weight": tensors["model.norm.weight"]}, str(folder / first))
    (folder / "model.safetensors").rename(folder / second)  # which holds the norm too
    index = {"weight_map": {**dict.fromkeys(tensors, second), "model.norm.weight": first}}
    (folder / hf_folder.INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"^{folder}: tensor model.norm.weight is stored twice$"):
        load(folder, ARGS)


def test_a_config_that_is_no_json_object_is_one_line(tmp_path):
    folder = hf_folder_of(tmp_path, model_of(ARGS, seed=0))
    (folder / "config.json").write_text("[]\n")
    with pytest.raises(CheckpointError, match=rf"^{folder}/config.json is not a JSON object$"):
        load(folder, ARGS)


def test_a_read_that_fails_inside_safetensors_is_one_line(tmp_path, monkeypatch):
    """A disk error while a tensor's bytes are read (after the header was): one line naming the tensor."""
    folder = hf_folder_of(tmp_path, model_of(ARGS, seed=0))
    safetensors = hf_folder.import_safetensors()
    open_file = safetensors.safe_open

    class FailingReads:
        def __init__(self, handle):
            self.handle = handle

        def keys(self):
            return self.handle.keys()

        def get_slice(self, name):
            return self.handle.get_slice(name)

        def get_tensor(self, name):
            raise safetensors.SafetensorError("Error while deserializing: I/O error: Input/output error (os error 5)")

    monkeypatch.setattr(safetensors, "safe_open", lambda *args, **kwargs: FailingReads(open_file(*args, **kwargs)))
    with pytest.raises(CheckpointError) as raised:
        load(folder, ARGS)
    assert str(raised.value) == f"{folder}: tensor model.embed_tokens.weight cannot be read (Error while deserializing: " \
                                "I/O error: Input/output error (os error 5))"


def test_experts_beyond_the_config_are_refused_before_reading(tmp_path):
    """The shapes are worked out on the meta device through the adapter, which refuses what it cannot convert."""
    qwen3 = get_train_spec("qwen3")
    args = dataclasses.replace(qwen3.config["tiny_moe"], n_layers=1, vocab_size=300)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in qwen3.model_cls.from_model_args(args).state_dict().items()}
    hf = hf_folder.to_hf({k: torch.zeros(v) for k, v in shapes.items()}, args, qwen3.hf_adapter)
    hf["model.layers.0.mlp.experts.8.up_proj.weight"] = hf["model.layers.0.mlp.experts.7.up_proj.weight"].clone()
    folder = tmp_path / "hf"
    folder.mkdir()
    hf_folder.write_fresh(str(folder), hf, qwen3.hf_adapter.hf_config(args), 10**9)
    with pytest.raises(CheckpointError) as raised:
        load_hf_weights(str(folder), ModelState([]), qwen3.hf_adapter, args, {k: tuple(v) for k, v in shapes.items()},
                        [], False)
    assert str(raised.value) == f"{folder}: model.layers.0.mlp.experts.8.up_proj.weight is beyond config.json's 8 experts"


# --- attacks: folders that would load silently wrong, and exports that cannot be written ----------

TIED = dataclasses.replace(ARGS, tie_word_embeddings=True)


def test_another_head_layout_is_refused_even_where_every_shape_agrees(tmp_path):
    # dim 64 as 2 heads of 32: every tensor has the shape of the 4-head model, but RoPE's row order differs.
    folder = hf_folder_of(tmp_path, model_of(dataclasses.replace(ARGS, n_heads=2, n_kv_heads=None), seed=0))
    with pytest.raises(CheckpointError) as raised:
        load(folder, dataclasses.replace(ARGS, n_kv_heads=None), allow_partial=True)
    assert str(raised.value) == (
        f"checkpoint.initial_load_path {folder} does not fit this run's model (its config.json differs: n_heads 2 "
        "(config.json) vs 4 (this run), n_kv_heads 2 (config.json) vs 4 (this run)): its attention heads are laid "
        "out differently, and the query and key rows are ordered per head; use a folder of this model")


def test_an_untied_folder_is_refused_by_a_tied_model_unless_the_output_is_excluded(tmp_path):
    source = model_of(ARGS, seed=0)
    folder = hf_folder_of(tmp_path, source)
    with pytest.raises(CheckpointError) as raised:
        load(folder, TIED)
    assert "(its config.json differs: tie_word_embeddings False (config.json) vs True (this run)): output.weight " \
           "is a tensor of its own there (lm_head.weight), but this run's model ties it to tok_embeddings.weight; use " \
           "an untied model.flavor, or set checkpoint.exclude_from_loading output to load the embedding alone" \
           in str(raised.value)
    loaded = load(folder, TIED, exclude=["output"])
    assert torch.equal(loaded.tok_embeddings.weight, source.tok_embeddings.weight)
    assert loaded.output.weight is loaded.tok_embeddings.weight


def test_a_tied_folder_loads_into_a_tied_model_and_is_refused_by_an_untied_one(tmp_path):
    source = model_of(TIED, seed=0)
    folder = hf_folder_of(tmp_path, source, drop="lm_head.weight")  # as exports of tied models are
    loaded = load(folder, TIED)
    assert torch.equal(loaded.output.weight, source.tok_embeddings.weight)
    with pytest.raises(CheckpointError, match=r"tie_word_embeddings True \(config.json\) vs False \(this run\)\): it "
                                              r"has no tensor for output.weight; use a folder of this model"):
        load(folder, ARGS)


def test_a_folder_of_another_family_is_named_by_its_config(tmp_path):
    folder = hf_folder_of(tmp_path, model_of(ARGS, seed=0))
    qwen3 = get_train_spec("qwen3")
    with pytest.raises(CheckpointError) as raised:
        load_hf_weights(str(folder), ModelState([]), qwen3.hf_adapter, qwen3.config["debugmodel"], {}, [], False)
    assert str(raised.value) == f"checkpoint.initial_load_path {folder}: config.json: model_type 'llama' is not " \
                                "qwen3 or qwen3_moe"


def test_a_family_without_hf_adapter_and_a_folder_without_safetensors_are_one_line(tmp_path, monkeypatch):
    folder = hf_folder_of(tmp_path, model_of(ARGS, seed=0))
    spec = dataclasses.replace(get_train_spec("llama3"), hf_adapter=None)
    monkeypatch.setattr(resume, "get_train_spec", lambda name: spec)
    with pytest.raises(CheckpointError) as raised:
        resume.initial_weights(str(folder), "llama3")
    assert str(raised.value) == f"checkpoint.initial_load_path {folder} is a Hugging Face folder, but model " \
                                "'llama3' has no Hugging Face conversion (TrainSpec.hf_adapter)"
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="has a config.json but neither model.safetensors nor "):
        resume.initial_weights(str(folder), "llama3")


NO_PARALLELISM = types.SimpleNamespace(world_mesh=None, pp_enabled=False)


def export(model: Transformer, out, **kwargs) -> str:
    return write_hf_weights(ModelState([model]), ADAPTER, model.args, NO_PARALLELISM, str(out), torch.float32,
                            {"bos_token_id": 1, "eos_token_id": 2}, None, "attempt", **kwargs)


def test_an_export_holds_the_weights_and_loads_back(tmp_path):
    source = model_of(TIED, seed=0)
    out = tmp_path / "ckpt" / "step-3-hf"
    assert export(source, out).startswith(f"wrote the final weights as a Hugging Face folder {out} (")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-3-hf"]
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == 2
    loaded = load(out, TIED)
    for name, tensor in source.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


@pytest.mark.parametrize("failure", ["full disk while writing", "full disk before writing", "full disk at config.json"])
def test_an_export_that_cannot_be_written_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, failure):
    safetensors = hf_folder.import_safetensors()
    if failure == "full disk while writing":  # safetensors reports it as SafetensorError, not OSError
        def save_file(*args, **kwargs):
            raise safetensors.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        monkeypatch.setattr(safetensors.torch, "save_file", save_file)
        expected = "SafetensorError: Error while serializing: I/O error: No space left on device (os error 28) ("
    elif failure == "full disk at config.json":  # the weights are written; rank 0 fails while finishing the folder
        def open_or_fail(path, *args, **kwargs):
            if os.path.basename(path) == "config.json":
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
            return open(path, *args, **kwargs)
        monkeypatch.setattr(hf_training, "open", open_or_fail, raising=False)  # the module's own open only
        expected = f"No space left on device: {tmp_path}/ckpt/step-3-hf.partial-attempt/config.json ("
    else:
        monkeypatch.setattr(hf_training, "free_bytes", lambda path: 1000)
        expected = "not enough space for the checkpoint: it needs 0.5 MiB, the disk holding"
    out = tmp_path / "ckpt" / "step-3-hf"
    with pytest.raises(CheckpointSaveError) as raised:
        export(model_of(ARGS, seed=0), out)
    message = str(raised.value)
    assert message.startswith(f"final weights not written as a Hugging Face folder: {expected}") and "\n" not in message
    assert list((tmp_path / "ckpt").iterdir()) == []


def test_a_folder_of_the_padded_vocabulary_size_is_refused(tmp_path):
    """A folder with 304 rows into a 300-token model padded to 304: the shapes agree, but its rows
    are another vocabulary's, not this tokenizer's plus padding."""
    folder = hf_folder_of(tmp_path, model_of(dataclasses.replace(ARGS, vocab_size=304), seed=0))
    with pytest.raises(CheckpointError) as raised:
        load(folder, dataclasses.replace(ARGS, vocab_padding=4))
    assert ("vocab_size 304 (config.json) vs 300 (this run)): tok_embeddings.weight is [304, 64] there, [300, 64] in "
            "this run's model (plus 4 padding rows)") in str(raised.value)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bool, torch.int8])
def test_weights_of_a_dtype_that_cannot_be_converted_are_one_line(tmp_path, dtype):
    folder = hf_folder_of(tmp_path, model_of(ARGS, seed=0))
    safetensors = hf_folder.import_safetensors()
    tensors = safetensors.torch.load_file(str(folder / "model.safetensors"))
    name = "model.layers.1.mlp.up_proj.weight"
    tensors[name] = tensors[name].to(dtype)
    safetensors.torch.save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"{folder}: tensor {name} is stored as \w+; weights are read from F64, "
                                              r"F32, F16, BF16 only \(dequantize the folder first\)$"):
        load(folder, ARGS)


def test_excluding_a_tied_output_says_the_embedding_is_loaded_for_both(tmp_path, caplog):
    source = model_of(TIED, seed=0)
    with caplog.at_level("INFO"):
        loaded = load(hf_folder_of(tmp_path, source), TIED, exclude=["output"])
    assert torch.equal(loaded.output.weight, source.tok_embeddings.weight)
    assert "this run's model ties it to tok_embeddings.weight, so the folder's own output.weight (if any) is not read" \
        in caplog.text


def test_an_export_killed_while_replacing_an_older_one_gives_the_older_one_back(tmp_path):
    """Killed between moving the older export aside and publishing the new one: the next export
    (of any step) restores the older one instead of deleting the only complete copy."""
    ckpt = tmp_path / "ckpt"
    export(model_of(ARGS, seed=0), ckpt / "step-3-hf")
    (ckpt / "step-3-hf").rename(ckpt / "step-3-hf.replaced-123")
    (ckpt / "step-3-hf.partial-attempt0").mkdir()
    export(model_of(ARGS, seed=1), ckpt / "step-5-hf")
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-3-hf", "step-5-hf"]
    assert torch.equal(load(ckpt / "step-3-hf", ARGS).norm.weight, model_of(ARGS, seed=0).norm.weight)


def test_an_export_that_would_replace_the_folder_the_run_starts_from_is_refused(tmp_path):
    from torchtitan.config.manager import parse_args

    dump = tmp_path / "run"
    own_export = dump / "checkpoint" / "step-4-hf"
    own_export.mkdir(parents=True)
    args = ["--job.dump_folder", str(dump), "--training.steps", "4", "--checkpoint.last_save_in_hf",
            "--training.warmup_steps", "1"]
    with pytest.raises(CheckpointError, match=rf"checkpoint.last_save_in_hf would write the final weights over "
                                              rf"{own_export}, the folder this run starts from"):
        hf_training.check_export_target(parse_args([*args, "--checkpoint.initial_load_path", str(own_export)]))
    hf_training.check_export_target(parse_args([*args, "--training.steps", "8", "--checkpoint.initial_load_path",
                                                str(own_export)]))  # another step's export: fine
