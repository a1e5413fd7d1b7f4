"""Context-parallel options are checked before any process starts: one clear line per mistake."""

import pytest

from torchtitan.config.manager import ConfigError, main, parse_args, validate_world_size

CP2 = ["--experimental.context_parallel_degree", "2"]


def test_a_valid_cp_layout_parses():
    config = parse_args([*CP2, "--training.seq_len", "64"])
    assert config.experimental.context_parallel_degree == 2 and config.experimental.context_parallel_backend == "ring"
    assert config.experimental.context_parallel_method == "ring"


def test_cp_composes_with_document_masks_compile_and_allgather():
    """Issue 42 lifted the refusals of document masking and compile under CP."""
    config = parse_args([*CP2, "--training.seq_len", "64", "--training.document_mask", "--training.compile",
                         "--experimental.context_parallel_method", "allgather"])
    assert config.training.document_mask and config.training.compile
    assert config.experimental.context_parallel_method == "allgather"


@pytest.mark.parametrize("argv,fragment", [
    (["--training.seq_len", "66"], "training.seq_len 66 must divide by 2 x experimental.context_parallel_degree = 4"),
    (["--experimental.context_parallel_backend", "torch"], "context_parallel_backend 'torch'"),
    (["--experimental.context_parallel_method", "alltoall"], "experimental.context_parallel_method"),
])
def test_cp_refusals(argv, fragment):
    with pytest.raises(ConfigError) as info:
        validate_world_size(parse_args([*CP2, "--training.seq_len", "64", *argv]), 2)
    assert fragment in str(info.value)


@pytest.mark.parametrize("degree", ["3", "4"])
def test_a_cp_degree_the_ranks_cannot_hold_is_named_before_the_sequence_length(degree, monkeypatch, capsys):
    # seq_len 2048 divides by neither 2 x 3 nor (for 4 ranks) matters: the degree does not fit 2 ranks.
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["--experimental.context_parallel_degree", degree]) == 2
    assert capsys.readouterr().err == (f"error: experimental.context_parallel_degree {degree} does not divide the world "
                                       "size 2 (NGPU); change that degree or the number of processes\n")


def test_cp_refuses_an_attention_it_cannot_replace():
    """A registered model whose blocks have no swappable causal kernel gets one line, not a crash."""
    from torch import nn

    from torchtitan.parallelisms.context_parallel import apply_cp

    model = nn.Module()
    model.layers = nn.ModuleDict({"0": nn.Module()})
    model.layers["0"].attention = nn.Linear(2, 2)  # an attention without a `kernel`
    with pytest.raises(ConfigError, match="block layers.0 has none"):
        apply_cp(model, cp_mesh=None, seq_len=8)
