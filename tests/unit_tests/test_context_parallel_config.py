"""Context-parallel options are checked before any process starts: one clear line per mistake."""

import pytest

from torchtitan.config_manager import ConfigError, parse_args

CP2 = ["--experimental.context_parallel_degree", "2"]


def test_a_valid_cp_layout_parses():
    config = parse_args([*CP2, "--training.seq_len", "64"])
    assert config.experimental.context_parallel_degree == 2 and config.experimental.context_parallel_backend == "ring"


@pytest.mark.parametrize("argv,fragment", [
    (["--training.seq_len", "66"], "training.seq_len 66 must divide by 2 x experimental.context_parallel_degree = 4"),
    (["--experimental.context_parallel_backend", "torch"], "context_parallel_backend 'torch'"),
    (["--training.compile"], "training.compile with context parallelism"),
])
def test_cp_refusals(argv, fragment):
    with pytest.raises(ConfigError) as info:
        parse_args([*CP2, "--training.seq_len", "64", *argv])
    assert fragment in str(info.value)
