"""A signal during the trainer's start-up (torchtitan/train.py): before the first step there is
nothing to save, so Ctrl-C (and SIGTERM for a single process) ends the run at once, with one line
and the shell's code for the signal. Stops once training runs are tests/integration/test_bad_inputs.py's."""

import os
import signal
import time

import pytest

from torchtitan import train


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_start_up_ends_the_run_at_once(monkeypatch, capsys, sig):
    def start_up_that_is_interrupted(job_config, stops):
        os.kill(os.getpid(), sig)  # delivered to this thread's handler before the sleep returns
        time.sleep(10)
        raise AssertionError("the signal did not interrupt the start-up")

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(train, "train", start_up_that_is_interrupted)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    assert train.main([]) == 128 + sig
    name = signal.Signals(sig).name
    assert capsys.readouterr().err == f"stopped: {name} received; stopped during start-up, before the first step\n"
    assert {s: signal.getsignal(s) for s in handlers} == handlers  # a caller in-process gets its own back
