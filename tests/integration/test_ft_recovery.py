"""Training through a killed replica group (fault_tolerance, scripts/ft_trials.py): two groups of
one rank, one SIGKILLed early; the other keeps committing alone, the killed one is restarted by
torchrun, recovers live from its peer, and both end with bitwise the same parameters."""

import random
import signal
import socket
import subprocess
import time

import pytest

from scripts import ft_trials as trials
from torchtitan.tools.runs import read_metrics

STEPS = 80  # enough that the survivor still trains when the killed group is back (~10 s of restart)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@pytest.mark.budget("two torchrun jobs and a lighthouse; a kill, a torchrun restart (imports, checkpoint load) and a "
                    "live recovery")
def test_a_killed_group_restarts_recovers_live_and_ends_equal(tmp_path):
    pytest.importorskip("torchft")
    seed = random.randrange(1000)  # which group dies, and at which early step; the seed is in the failure
    trial = trials.run_trial(tmp_path / "trial", random.Random(seed), groups=2, ranks=1, port=_free_port(),
                             steps=STEPS, interval=STEPS // 2, flavor="debugmodel", seq_len=128, timeout=240,
                             kill_range=(2, 4))
    print(f"seed {seed}: {trials.format_row(1, trial)}")
    assert trial.kill_step >= 2, f"seed {seed}: nothing was killed: {trial.detail}"
    assert trial.exit_codes == [0, 0], f"seed {seed}: {trial.detail}"
    survivor = 1 - trial.victim_group
    steps = [row["step"] for row in read_metrics(tmp_path / "trial" / f"replica_{survivor}")]
    # From its first step on (a later one than 1 when the other group started first and the survivor
    # recovered from it at start-up), every step once, in order, to the last.
    assert steps == list(range(steps[0], STEPS + 1)), f"seed {seed}: the survivor went back or skipped: {steps}"
    replicas = [row["replicas"] for row in read_metrics(tmp_path / "trial" / f"replica_{survivor}")]
    assert 1 in replicas[trial.kill_step:], f"seed {seed}: the survivor never committed alone: {replicas}"
    assert replicas[-1] == 2, f"seed {seed}: the killed group never rejoined: {replicas}"
    assert trial.recovered_live, f"seed {seed}: the restarted group did not recover from its peer"
    assert trial.final_steps == [STEPS, STEPS]
    assert trial.params_equal, f"seed {seed}: {trial.detail}"


@pytest.mark.fast
@pytest.mark.parametrize("argv", [["--groups", "1"], ["--ranks", "0"], ["--steps", "5"]])
def test_options_that_cannot_run_exit_2_with_one_line(monkeypatch, capsys, argv):
    monkeypatch.setattr(trials, "Cluster", None)  # nothing may start
    assert trials.main(argv) == 2
    assert capsys.readouterr().err == "error: --groups must be at least 2, --ranks at least 1 and --steps at least 9\n"


@pytest.mark.fast
def test_a_trial_past_its_timeout_is_killed():
    cluster = trials.Cluster.__new__(trials.Cluster)
    cluster.procs = [subprocess.Popen(["sleep", "30"], start_new_session=True)]
    assert cluster.wait(time.monotonic()) == [-signal.SIGKILL]
