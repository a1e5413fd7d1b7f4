"""The data shards each data-parallel rank reads (torchtitan/datasets/shards.py)."""

import pytest

from torchtitan.datasets.shards import DataShards, decide_data_shards
from torchtitan.errors import ConfigError


def test_one_shard_per_rank_by_default_and_a_count_that_splits_evenly():
    assert decide_data_shards(-1, 1, 4) == DataShards(1, 4, 4)
    assert decide_data_shards(8, 1, 4).owned == [2, 3]


def test_a_count_the_ranks_cannot_split_is_one_line_naming_the_option():
    with pytest.raises(ConfigError) as e:
        decide_data_shards(6, 0, 4)
    assert str(e.value) == ("training.dataset_shards 6 must be a multiple of the data-parallel degree 4 "
                            "(training.data_parallel_replicate_degree x data_parallel_shard_degree)")


def test_a_resumed_checkpoints_count_wins_over_the_configured_one():
    """The saved data position refers to the checkpoint's count; a configured 6 is then not checked."""
    assert decide_data_shards(6, 0, 4, resumed=8) == DataShards(0, 4, 8)
    assert decide_data_shards(-1, 3, 4, resumed=16).owned == [12, 13, 14, 15]
