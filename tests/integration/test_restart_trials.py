"""Automatic restart (MAX_RESTARTS) through run_llama_train.sh: a rank killed with SIGKILL at a
random step, or a whole simulated host (its launcher with its ranks, then a replacement launcher),
and the job finishes by itself with bitwise the losses of an uninterrupted run
(scripts/restart_trials.py; CI runs one trial of each)."""

import os
import random
import signal
import subprocess
import sys

import pytest

from scripts import restart_trials as trials
from tests.integration.conftest import UNINTERRUPTED_STEPS
from tests.machinery.namespaces import unavailable


@pytest.mark.budget("a job of 2 ranks killed mid-run, restarted by torchrun (on two hosts: a new launcher, a new "
                    "rendezvous round), imports and a checkpoint load again; 12-25 s")
@pytest.mark.parametrize("hosts", [1, 2], ids=["one host, a random rank", "two hosts, one host lost and replaced"])
def test_a_killed_job_restarts_by_itself_and_logs_the_uninterrupted_losses(tmp_path, uninterrupted, hosts):
    reason = unavailable() if hosts == 2 else None
    if reason:
        pytest.skip(f"two simulated hosts cannot be built here: {reason}")
    # 2 ranks either way (on two hosts, one each): the reference is the uninterrupted 2-rank job on
    # one machine, forked from the warm launcher, whose losses the launched job must reproduce
    # bitwise over loopback or across the hosts' link.
    seed = random.randrange(1000)  # a new kill step and victim every run; the seed is in the failure
    # On two hosts the node is lost whole and a new launcher takes its place: the survivor's restart
    # count is 1 and the newcomer's 0, which only per-round stores (runtime/launch.py) let meet.
    faults = trials.Faults(whole_host=True, replace_after=1) if hosts == 2 else trials.Faults()
    rows = trials.run_trials(tmp_path, trials=1, seed=seed, steps=UNINTERRUPTED_STEPS, hosts=hosts, nproc=2,
                             timeout=300, reference=uninterrupted, flavor="tiny", faults=faults)
    (trial,) = rows
    print(f"seed {seed}: {trials.format_row(1, trial)}")
    assert trial.killed, f"seed {seed}: nothing was killed"
    assert trial.finished, f"seed {seed}: {trial.detail}"
    assert trial.restarts and trial.restarts >= 1, f"seed {seed}: no restart noted"
    assert trial.bitwise_equal, f"seed {seed}: {trial.detail}"
    if hosts == 2:
        assert trial.killed in ([0], [1])  # one host's only rank


# What goes wrong around the trials, in this process: bad options, a job past its timeout, a
# trainer process that ends while its ranks are looked up.


@pytest.mark.fast
@pytest.mark.parametrize("argv,error", [
    (["--steps", "2"], "error: --steps must be at least 3 (a kill step in 1 .. steps-2)"),
    (["--hosts", "2", "--nproc", "3"], "error: --nproc 3 does not split evenly over --hosts 2"),
    (["--hosts", "2"], "error: 2 simulated hosts cannot be built: network namespaces need root (this process is not)"),
    (["--whole-host"], "error: --whole-host needs --hosts 2 or more (host 0 holds the rendezvous and is never the one "
                       "lost)"),
    (["--never-back"], "error: --never-back goes with --whole-host"),
], ids=["too few steps", "odd ranks on two hosts", "no namespaces", "a whole host of one", "never back alone"])
def test_options_that_cannot_run_exit_2_with_one_line(tmp_path, monkeypatch, capsys, argv, error):
    monkeypatch.setattr(trials, "unavailable", lambda: "network namespaces need root (this process is not)")
    monkeypatch.setattr(trials, "Job", None)  # nothing may start
    assert trials.main([*argv, "--workdir", str(tmp_path)]) == 2
    assert capsys.readouterr().err == error + "\n"


@pytest.mark.fast
def test_a_job_past_its_timeout_is_killed_and_says_so():
    class Hangs(subprocess.Popen):
        def communicate(self, input=None, timeout=None):
            if timeout is not None:  # waiting with a deadline: the job does not end by then
                raise subprocess.TimeoutExpired(self.args, timeout)
            return super().communicate(input)

    job = trials.Job.__new__(trials.Job)
    job.procs = [Hangs(["sleep", "30"], start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True)]
    job.lost = []
    assert job.wait(timeout=5) == [(-signal.SIGKILL, "\n(killed by restart_trials after 5 s)")]


@pytest.mark.fast
def test_a_trainer_process_gone_before_its_rank_is_read_is_left_out(tmp_path, monkeypatch):
    # The stand-in says when it runs its own code: Popen can return before the kernel has published a
    # freshly exec'd process's environment, and /proc/<pid>/environ reads empty in that window.
    rank = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(30)"],
                            env={**os.environ, "RANK": "1", "GROUP_RANK": "0"}, stdout=subprocess.PIPE, text=True)
    gone = 2**22 + 1  # above Linux's largest pid: /proc has no such entry
    try:
        assert rank.stdout.readline() == "up\n"
        monkeypatch.setattr(trials.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(
            cmd, 0, f"{gone}\n{rank.pid}\n", ""))
        assert trials.rank_pids(tmp_path) == {1: (rank.pid, 0)}
    finally:
        rank.kill()
        rank.wait()
        rank.stdout.close()
