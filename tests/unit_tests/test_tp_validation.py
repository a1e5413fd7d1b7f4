"""Tensor-parallel shape checks (validate_llama), vocabulary padding and the GPU-only features'
refusals: all run before any process group exists, so they are plain function calls here."""

import dataclasses
import importlib.util

import pytest
import torch

from tests.tolerances import assert_reordered
from torchtitan.config.manager import ConfigError, parse_args, validate_world_size
from torchtitan.config.preflight import build_model_args
from torchtitan.models import get_train_spec
from torchtitan.models.llama.model import ModelArgs, Transformer
from torchtitan.models.llama.parallelize_llama import validate_llama
from torchtitan.models.loss import cross_entropy_loss
from torchtitan.parallelisms.float8 import check_float8_support
from torchtitan.parallelisms.parallel_dims import ParallelDims
from torchtitan.runtime.device_setup import check_device_features

SMALL = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, max_seq_len=16, multiple_of=16)


def tp_dims(tp: int) -> ParallelDims:
    return ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=tp, pp=1, world_size=tp, enable_loss_parallel=True)


def test_shapes_that_divide_pass():
    validate_llama(SMALL, tp_dims(2), None, parse_args([]))
    validate_llama(dataclasses.replace(SMALL, tie_word_embeddings=True), tp_dims(2), None, parse_args([]))  # tied: fine
    validate_llama(SMALL, tp_dims(1), None, parse_args([]))  # nothing to check without TP


@pytest.mark.parametrize("change,fragment", [
    ({"n_heads": 6, "n_kv_heads": 3, "dim": 96}, "must divide the n_kv_heads (3)"),
    ({"n_heads": 3, "n_kv_heads": None, "dim": 48}, "must divide the n_heads (3)"),
    ({"vocab_size": 95}, "must divide the vocabulary (95 tokens); set model.vocab_size_divisible_by to 2"),
])
def test_shapes_that_do_not_divide_are_refused(change, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        validate_llama(dataclasses.replace(SMALL, **change), tp_dims(2), None, parse_args([]))


def test_vocab_padding_from_config():
    spec = get_train_spec("llama3")
    args = build_model_args(spec, parse_args(["--model.vocab_size_divisible_by", "64"]), vocab_size=2256)
    assert (args.vocab_size, args.vocab_padding) == (2256, 48)
    assert build_model_args(spec, parse_args([]), vocab_size=2256).vocab_padding == 0
    validate_llama(dataclasses.replace(args, vocab_size=2255, vocab_padding=1), tp_dims(2), None, parse_args([]))


def test_padded_vocabulary_never_changes_the_loss():
    """Same real weights, with and without 5 padding rows: the same logits, loss and gradients;
    the padding rows get no gradient and are never predicted."""
    torch.manual_seed(0)
    plain = Transformer(SMALL)
    plain.init_weights()
    padded = Transformer(dataclasses.replace(SMALL, vocab_padding=5))
    padded.init_weights()  # random padding rows: they must not matter
    state = plain.state_dict()
    with torch.no_grad():
        for name, p in padded.named_parameters():
            p[: state[name].shape[0]].copy_(state[name]) if p.shape != state[name].shape else p.copy_(state[name])
    tokens = torch.randint(0, SMALL.vocab_size, (2, 16))
    labels = torch.randint(0, SMALL.vocab_size, (2, 16))
    logits = padded(tokens)
    assert logits.shape[-1] == 101 and torch.isneginf(logits[..., 96:]).all()
    # Only the output projection and the loss see the padding, as other shapes (101 columns): their
    # sums (over the dim, the vocabulary, the 32 tokens) may be ordered otherwise, and the blocks'
    # gradients carry that rounding of the hidden state's gradient.
    head_sums = 64 + 101 + 32
    assert_reordered(logits[..., :96], plain(tokens), head_sums)
    loss_plain, loss_padded = cross_entropy_loss(plain(tokens), labels), cross_entropy_loss(logits, labels)
    assert_reordered(loss_padded, loss_plain, head_sums)
    loss_plain.backward()
    loss_padded.backward()
    for name, p in plain.named_parameters():
        grad = dict(padded.named_parameters())[name].grad
        assert_reordered(grad[: p.shape[0]], p.grad, head_sums, msg=name)
        assert torch.count_nonzero(grad[p.shape[0]:]) == 0


def test_async_tp_needs_cuda():
    config = parse_args(["--experimental.enable_async_tensor_parallel", "--training.tensor_parallel_degree", "2",
                         "--training.compile"])
    with pytest.raises(ConfigError, match="needs CUDA GPUs"):
        check_device_features(config, "cpu")
    check_device_features(config, "cuda")  # accepted where symmetric memory exists


def test_vocab_padding_refused_for_a_model_without_the_field():
    @dataclasses.dataclass
    class PlainArgs:
        vocab_size: int = 0

    spec = dataclasses.replace(get_train_spec("llama3"), config={"tiny": PlainArgs()})
    config = parse_args(["--model.flavor", "tiny", "--model.vocab_size_divisible_by", "64"])
    with pytest.raises(ConfigError, match="cannot pad its vocabulary"):
        build_model_args(spec, config, vocab_size=2256)
    assert build_model_args(spec, config, vocab_size=2304).vocab_size == 2304  # already divisible: no padding needed


@pytest.mark.parametrize("args,tp,device,fragment", [
    ([], 1, "cpu", "needs CUDA GPUs with float8 units"),
    (["--float8.emulate"], 2, "cpu", "float8 with tensor and sequence parallelism sends float8 tensors through the TP collectives"),
])
def test_float8_refusals(args, tp, device, fragment):
    with pytest.raises(ConfigError, match=fragment):
        check_float8_support(parse_args(["--float8.enable_float8_linear", *args]), device, tp_enabled=tp > 1)


def test_float8_on_a_gpu_before_ada_is_refused_by_its_capability(monkeypatch):
    """Simulated GPUs (CI has none): an A100 (8.0) is refused, naming it; an H100 (9.0) passes."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ConfigError) as e:
        check_float8_support(parse_args(["--float8.enable_float8_linear"]), "cuda", tp_enabled=False)
    assert str(e.value) == ("float8.enable_float8_linear needs a GPU of compute capability 8.9 or newer; "
                            "NVIDIA A100-SXM4-80GB has 8.0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_float8_support(parse_args(["--float8.enable_float8_linear"]), "cuda", tp_enabled=False)


def test_float8_emulated_runs_where_it_can():
    for extra, tp in ([], False), (["--training.tensor_parallel_degree", "2", "--training.disable_sequence_parallel"], True):
        check_float8_support(parse_args(["--float8.enable_float8_linear", "--float8.emulate", *extra]), "cpu", tp)


def test_float8_without_torchao_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    with pytest.raises(ConfigError, match=r"needs torchao: .*pip install -e '.\[float8\]'"):
        check_float8_support(parse_args(["--float8.enable_float8_linear", "--float8.emulate"]), "cpu", False)


@pytest.mark.parametrize("argv,refused", [
    (["--training.tensor_parallel_degree", "2", "--training.seq_len", "63"], "training.seq_len 63 must divide by"),
    (["--training.tensor_parallel_degree", "4", "--experimental.context_parallel_degree", "2",
      "--training.seq_len", "12"], "training.seq_len 12 / experimental.context_parallel_degree 2 = 6 must divide by "
                                   "training.tensor_parallel_degree 4"),
    (["--training.tensor_parallel_degree", "2", "--training.seq_len", "63", "--training.disable_sequence_parallel"],
     None),
    (["--training.tensor_parallel_degree", "2", "--training.seq_len", "64"], None),
])
def test_sequence_parallelism_needs_positions_that_split_evenly(argv, refused):
    """Sequence parallelism shards each rank's sequence over tp: an uneven split is refused by the
    layout rules (it used to fail in the first forward); without sequence parallelism any length runs."""
    config = parse_args(argv)
    world_size = config.training.tensor_parallel_degree * config.experimental.context_parallel_degree
    if refused is None:
        validate_world_size(config, world_size)
    else:
        with pytest.raises(ConfigError, match=refused):
            validate_world_size(config, world_size)


def test_a_tp_degree_the_ranks_cannot_hold_is_named_before_the_sequence_length():
    with pytest.raises(ConfigError, match=r"^training.tensor_parallel_degree 3 does not divide the world size 2"):
        validate_world_size(parse_args(["--training.tensor_parallel_degree", "3", "--training.seq_len", "64"]), 2)
