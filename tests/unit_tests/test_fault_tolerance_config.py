"""The [fault_tolerance] option rules (torchtitan/config/sections.py:check_fault_tolerance): each
refusal is one ConfigError naming the option, raised by the config parse that the launcher's
pre-check runs too, before any process starts; and torchft missing is one line there."""

from __future__ import annotations

import importlib.util

import pytest

from torchtitan.config import manager
from torchtitan.config.manager import ConfigError, parse_args

LIGHTHOUSE = ["--fault_tolerance.lighthouse", "lighthouse-host:29510"]


def ft(*args: str) -> list[str]:
    """Two replica groups, this one group 0, a lighthouse named: valid until `args` change it."""
    return ["--fault_tolerance.enable", "--fault_tolerance.group_size", "2", *LIGHTHOUSE, *args]


@pytest.fixture(autouse=True)
def no_lighthouse_env(monkeypatch):
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)


@pytest.fixture
def torchft_missing(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchft" else real(name, *a))


def test_valid_options_parse():
    config = parse_args(ft("--fault_tolerance.replica_id", "1", "--fault_tolerance.min_replica_size", "2"))
    assert (config.fault_tolerance.replica_id, config.fault_tolerance.min_replica_size) == (1, 2)


def test_disabled_fault_tolerance_checks_nothing(torchft_missing):
    # Options left at values the rule would refuse, and no torchft: no error while it is off.
    config = parse_args(["--fault_tolerance.replica_id", "5", "--fault_tolerance.min_replica_size", "9"])
    assert not config.fault_tolerance.enable


def test_torchft_missing_is_one_line(torchft_missing):
    with pytest.raises(ConfigError, match=r"^fault_tolerance.enable needs torchft, an optional extra: "
                                          r"pip install 'torchtitan\[ft\]'"):
        parse_args(ft())


def test_torchft_missing_in_the_launchers_precheck(torchft_missing, capsys, monkeypatch):
    """`python -m torchtitan.config.manager --launch-mode ...`, as run_llama_train.sh runs it."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert manager.main(["--launch-mode", *ft()]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: fault_tolerance.enable needs torchft"), err


@pytest.mark.parametrize("option", ["group_size", "min_replica_size", "sync_steps", "timeout_seconds",
                                    "quorum_timeout_seconds"])
def test_counts_must_be_positive(option):
    with pytest.raises(ConfigError, match=rf"^fault_tolerance.{option} must be >= 1, got 0$"):
        parse_args(ft(f"--fault_tolerance.{option}", "0"))


@pytest.mark.parametrize("replica_id", ["2", "-1"])
def test_replica_id_out_of_range(replica_id):
    with pytest.raises(ConfigError, match=rf"replica_id must be a group index 0..1 \(fault_tolerance.group_size 2\), "
                                          rf"got {replica_id}$"):
        parse_args(ft("--fault_tolerance.replica_id", replica_id))


def test_min_replica_size_above_the_groups():
    with pytest.raises(ConfigError, match=r"min_replica_size 3 is more than the 2 replica groups .* no step could be "
                                          r"committed"):
        parse_args(ft("--fault_tolerance.min_replica_size", "3"))


@pytest.mark.parametrize("address", ["", "lighthouse-host", "lighthouse-host:port", ":29510"])
def test_lighthouse_missing_or_malformed(address):
    args = ["--fault_tolerance.enable", "--fault_tolerance.group_size", "2"]
    if address:
        args += ["--fault_tolerance.lighthouse", address]
    with pytest.raises(ConfigError, match=rf"needs the lighthouse's host:port in fault_tolerance.lighthouse or "
                                          rf"\$TORCHFT_LIGHTHOUSE, got '{address}' \(run_llama_train.sh with "
                                          rf"FT_LIGHTHOUSE=start"):
        parse_args(args)


def test_lighthouse_from_the_environment(monkeypatch):
    """run_llama_train.sh's FT_LIGHTHOUSE reaches the ranks as TORCHFT_LIGHTHOUSE; the option wins."""
    from torchtitan.config.sections import lighthouse_address

    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://env-host:29511")
    config = parse_args(["--fault_tolerance.enable", "--fault_tolerance.group_size", "2"])
    assert lighthouse_address(config) == "env-host:29511"
    assert lighthouse_address(parse_args(ft())) == "lighthouse-host:29510"


@pytest.mark.parametrize("option,value", [("outer_lr", "0"), ("outer_lr", "-0.5"), ("outer_momentum", "1"),
                                          ("outer_momentum", "-0.1")])
def test_outer_optimizer_range(option, value):
    with pytest.raises(ConfigError, match=r"outer_lr must be > 0 and outer_momentum in \[0, 1\)"):
        parse_args(ft(f"--fault_tolerance.{option}", value))


@pytest.mark.parametrize("argv", [ft("--optimizer.early_step_in_backward", "--training.max_norm", "0"),
                                  # named first: not the max_norm early stepping needs, nor the lighthouse
                                  ["--fault_tolerance.enable", "--optimizer.early_step_in_backward"]])
def test_early_step_in_backward_refused(argv):
    with pytest.raises(ConfigError) as refused:
        parse_args(argv)
    assert refused.value.line == ("error: fault_tolerance does not combine with optimizer.early_step_in_backward: a "
                                  "step is applied only once the groups have averaged its gradients and agreed to "
                                  "commit it; use one or the other")


def test_moe_bias_updates_refused():
    with pytest.raises(ConfigError, match=r"^fault_tolerance does not combine with moe.bias_update_rate > 0"):
        parse_args(ft("--moe.bias_update_rate", "0.001"))
