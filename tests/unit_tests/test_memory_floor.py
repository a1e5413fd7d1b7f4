"""The start-up memory floor: what it counts, how it is split over ranks, and which line it says."""

import os

import pytest

from torchtitan.config.manager import ConfigError, parse_args, validate_world_size
from torchtitan.estimation import memory_floor
from torchtitan.estimation.memory_floor import check_step_fits, state_floor_bytes, step_floor_bytes
from torchtitan.models import get_train_spec

BASE = ["--job.config_file", "train_configs/debug_model.toml", "--training.seq_len", "64"]


def _job(*args, world=1):
    config = parse_args([*BASE, *args])
    return config, validate_world_size(config, world)


def _args(config):
    return get_train_spec("llama3").config[config.model.flavor]


def test_the_state_is_split_by_sharding_not_by_replicas():
    n = 1_000_000
    config, dims = _job()
    assert state_floor_bytes(config, dims, n) == 16 * n  # fp32 weights + grads + two Adam moments
    config, dims = _job("--training.tensor_parallel_degree", "2", world=8)  # FSDP 4 x TP 2
    assert state_floor_bytes(config, dims, n) == 16 * n // 8
    config, dims = _job("--training.data_parallel_replicate_degree", "4", world=4)  # DDP: full copies
    assert state_floor_bytes(config, dims, n) == 16 * n
    config, dims = _job("--training.data_parallel_replicate_degree", "4", "--optimizer.zero1", world=4)
    assert state_floor_bytes(config, dims, n) == (4 + 4 + 2) * n  # ZeRO-1 splits the moments only
    config, dims = _job("--optimizer.early_step_in_backward", "--training.max_norm", "0")
    assert state_floor_bytes(config, dims, n) == 12 * n  # gradients freed as they come


def test_activations_shrink_with_context_and_sequence_parallelism():
    config, dims = _job()
    one = step_floor_bytes(config, dims, _args(config))
    config, dims = _job("--experimental.context_parallel_degree", "2", world=2)
    assert step_floor_bytes(config, dims, _args(config)) == one // 2
    config, dims = _job("--training.batch_size", "16")
    assert step_floor_bytes(config, dims, _args(config)) == 2 * one


@pytest.mark.parametrize("memory, expected", [
    (10 * 2**30, None),  # fits
    (2**20, "model llama3 debugmodel"),  # less than the model's state alone: the model is named
])
def test_the_line_names_what_does_not_fit(monkeypatch, memory, expected):
    monkeypatch.setattr(memory_floor, "rank_memory_bytes", lambda device_type: memory)
    config, dims = _job()
    if expected is None:
        check_step_fits(config, dims, _args(config), "cpu", n_params=10**6)
        return
    with pytest.raises(ConfigError, match=expected):
        check_step_fits(config, dims, _args(config), "cpu", n_params=10**6)


def test_a_batch_that_does_not_fit_beside_a_model_that_does(monkeypatch):
    config, dims = _job("--training.batch_size", "4096")
    state = state_floor_bytes(config, dims, 10**6)
    activations = step_floor_bytes(config, dims, _args(config))
    # Room for the model's state but not for the state plus one step: the batch is named, not the model.
    monkeypatch.setattr(memory_floor, "rank_memory_bytes", lambda device_type: state + activations // 2)
    with pytest.raises(ConfigError, match=r"training.batch_size 4096 x training.seq_len 64 needs at least .* which "
                                          r"with the model's .* is more than"):
        check_step_fits(config, dims, _args(config), "cpu", n_params=10**6)


def test_host_memory_without_proc_falls_back_to_the_physical_memory_then_to_no_check(monkeypatch):
    """Without /proc/meminfo (not Linux, a sandbox): the physical memory, shared by the host's ranks;
    where that cannot be read either, no memory is known and nothing is refused."""
    def no_proc(path, *args, **kwargs):
        raise FileNotFoundError(2, "No such file or directory", path)

    monkeypatch.setattr(memory_floor, "open", no_proc, raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert memory_floor.rank_memory_bytes("cpu") == physical // 2

    def unknown(name):
        raise ValueError("unrecognized configuration name")

    monkeypatch.setattr(memory_floor.os, "sysconf", unknown)
    assert memory_floor.rank_memory_bytes("cpu") is None
    config, dims = _job("--training.batch_size", "4096")
    check_step_fits(config, dims, _args(config), "cpu", n_params=10**12)  # would not fit anywhere: not checked
