"""Tests for ParallelDims: degree validation, derived flags and single-process mesh handling."""

import pytest

from torchtitan.config.manager import ConfigError, parse_args
from torchtitan.parallelisms.parallel_dims import ParallelDims, parallel_dims_from_config


def dims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, world_size=1, enable_loss_parallel=True):
    return ParallelDims(
        dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, pp=pp,
        world_size=world_size, enable_loss_parallel=enable_loss_parallel,
    )


@pytest.mark.parametrize(
    "kwargs,expected",
    [
        (dict(tp=2, world_size=8), 4),
        (dict(world_size=8), 8),
        (dict(dp_replicate=2, pp=2, world_size=8), 2),
        (dict(cp=2, tp=2, world_size=4), 1),
    ],
)
def test_dp_shard_minus_one_takes_the_remaining_ranks(kwargs, expected):
    d = dims(dp_shard=-1, **kwargs)
    assert d.dp_shard == expected
    assert d.dp_replicate * d.dp_shard * d.cp * d.tp * d.pp == d.world_size


def test_product_must_equal_world_size():
    with pytest.raises(ConfigError, match="world size 8"):
        dims(dp_shard=2, tp=2, world_size=8)
    with pytest.raises(ConfigError, match="world size 2"):
        dims(dp_shard=2, tp=2, world_size=2)
    dims(dp_shard=2, tp=2, world_size=4)  # consistent degrees are accepted


@pytest.mark.parametrize("tp,world_size", [(4, 6), (8, 4), (3, 8)])
def test_dp_shard_minus_one_without_ranks_left(tp, world_size):
    with pytest.raises(ConfigError, match=str(world_size)):
        dims(dp_shard=-1, tp=tp, world_size=world_size)


@pytest.mark.parametrize(
    "name,option",
    [
        ("tp", "training.tensor_parallel_degree"),
        ("dp_replicate", "training.data_parallel_replicate_degree"),
        ("dp_shard", "training.data_parallel_shard_degree"),
        ("cp", "experimental.context_parallel_degree"),
        ("pp", "experimental.pipeline_parallel_degree"),
    ],
)
@pytest.mark.parametrize("value", [0, -2])
def test_bad_degree_names_the_option(name, option, value):
    with pytest.raises(ConfigError, match=option.replace(".", r"\.")):
        dims(**{name: value})


def test_flags_single_process():
    d = dims()
    assert not d.dp_enabled and not d.fsdp_enabled and not d.tp_enabled
    assert not d.pp_enabled and not d.cp_enabled and not d.loss_parallel_enabled
    assert d.dp_degree == 1


def test_flags_fsdp_and_tp():
    d = dims(dp_shard=-1, tp=2, world_size=8)
    assert d.fsdp_enabled and d.dp_shard_enabled and d.dp_enabled
    assert not d.dp_replicate_enabled
    assert d.tp_enabled and not d.pp_enabled and not d.cp_enabled
    assert d.dp_degree == 4
    assert d.loss_parallel_enabled


def test_flags_hsdp_and_cp():
    d = dims(dp_replicate=2, dp_shard=2, cp=2, world_size=8)
    assert d.dp_degree == 4  # cp peers read the same data
    assert d.dp_replicate_enabled and d.dp_shard_enabled
    assert d.cp_enabled and d.fsdp_enabled
    # cp alone shards parameters too (FSDP over the dp_shard x cp ranks)
    assert dims(cp=2, world_size=2).fsdp_enabled
    assert not dims(dp_replicate=2, dp_shard=1, world_size=2).fsdp_enabled


def test_flags_ddp():
    d = dims(dp_replicate=2, dp_shard=1, world_size=2)
    assert d.ddp_enabled and d.wraps_data_parallel and d.dp_degree == 2
    hsdp = dims(dp_replicate=2, dp_shard=2, world_size=4)
    assert not hsdp.ddp_enabled and hsdp.wraps_data_parallel  # FSDP takes over the replicas
    assert not dims().wraps_data_parallel and not dims(tp=2, world_size=2).wraps_data_parallel


def test_loss_parallel_requires_tp():
    assert not dims(dp_shard=2, world_size=2, enable_loss_parallel=True).loss_parallel_enabled
    assert not dims(tp=2, world_size=2, enable_loss_parallel=False).loss_parallel_enabled
    assert dims(tp=2, world_size=2, enable_loss_parallel=True).loss_parallel_enabled


def test_get_mesh_before_build_mesh_raises():
    with pytest.raises(RuntimeError):
        dims().get_mesh("dp")


def test_single_process_build_mesh():
    d = dims(dp_shard=-1, world_size=1)
    assert d.build_mesh("cpu") is None
    for name in ("world", "dp", "dp_shard", "tp", "dp_shard_cp", "dp_cp"):
        assert d.get_mesh(name) is None
    with pytest.raises(KeyError):
        d.get_mesh("no_such_mesh")


def test_parallel_dims_from_config():
    config = parse_args(["--training.data_parallel_replicate_degree", "2", "--training.disable_loss_parallel"])
    d = parallel_dims_from_config(config, world_size=8)
    assert (d.dp_replicate, d.dp_shard, d.cp, d.tp, d.pp, d.world_size) == (2, 4, 1, 1, 1, 8)
    assert d.enable_loss_parallel is False
    assert parallel_dims_from_config(parse_args([]), world_size=2).enable_loss_parallel is True


def test_non_data_parallel_size_counts_ranks_that_share_tokens():
    assert dims().non_data_parallel_size == 1
    assert dims(dp_shard=2, tp=2, world_size=4).non_data_parallel_size == 2
    assert dims(dp_replicate=2, cp=2, tp=2, pp=2, world_size=16).non_data_parallel_size == 8
