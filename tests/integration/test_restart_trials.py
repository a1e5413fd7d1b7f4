"""Automatic restart (MAX_RESTARTS) through run_llama_train.sh: a rank killed with SIGKILL at a
random step, or every rank of one of two simulated hosts, and the job finishes by itself with
bitwise the losses of an uninterrupted run (scripts/restart_trials.py; CI runs one trial of each)."""

import random

import pytest

from scripts import restart_trials as trials
from tests.integration.conftest import UNINTERRUPTED_STEPS
from torchtitan.tools.netns import unavailable


@pytest.mark.parametrize("hosts", [1, 2], ids=["one host, a random rank", "two hosts, one host's ranks"])
def test_a_killed_job_restarts_by_itself_and_logs_the_uninterrupted_losses(tmp_path, uninterrupted, hosts):
    reason = unavailable() if hosts == 2 else None
    if reason:
        pytest.skip(f"two simulated hosts cannot be built here: {reason}")
    # 2 ranks either way (on two hosts, one each): the reference is the uninterrupted 2-rank job on
    # one machine, forked from the warm launcher, whose losses the launched job must reproduce
    # bitwise over loopback or across the hosts' link.
    seed = random.randrange(1000)  # a new kill step and victim every run; the seed is in the failure
    rows = trials.run_trials(tmp_path, trials=1, seed=seed, steps=UNINTERRUPTED_STEPS, hosts=hosts, nproc=2,
                             timeout=300, reference=uninterrupted, flavor="tiny")
    (trial,) = rows
    print(f"seed {seed}: {trials.format_row(1, trial)}")
    assert trial.killed, f"seed {seed}: nothing was killed"
    assert trial.finished, f"seed {seed}: {trial.detail}"
    assert trial.restarts and trial.restarts >= 1, f"seed {seed}: no restart noted"
    assert trial.bitwise_equal, f"seed {seed}: {trial.detail}"
    if hosts == 2:
        assert trial.killed in ([0], [1])  # one host's only rank
