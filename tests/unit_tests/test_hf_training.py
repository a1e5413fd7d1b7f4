"""Reading a Hugging Face folder into a run's model (torchtitan/checkpoint/hf_training.py), in one
process: exact weights, a padded vocabulary, and the one-line refusals of a folder that does not fit."""

import dataclasses

import pytest
import torch

from torchtitan.checkpoint import hf_folder
from torchtitan.checkpoint.folders import CheckpointError
from torchtitan.checkpoint.hf_training import is_hf_folder, load_hf_weights, whole_model_shapes
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
