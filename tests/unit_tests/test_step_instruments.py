"""What the Trainer attaches around a step (torchtitan/trainer/instruments.py): phase marks for the
watchdog, and the step line's own-time and data-time."""

import time

import torch

from torchtitan.observability.watchdog import Watchdog
from torchtitan.trainer.instruments import StepInstruments


def instruments(tmp_path) -> StepInstruments:
    return StepInstruments(Watchdog(0, 1, None, str(tmp_path), limit_seconds=60).start(), first_step=1)


def test_a_phase_is_marked_once_and_its_limit_counts_from_the_first_entry(tmp_path):
    mark = instruments(tmp_path)
    with mark.phase("logging", 3):
        since = mark.watchdog.since
    time.sleep(0.01)
    with mark.phase("logging"):  # the same phase of the same step: not a new start
        assert (mark.watchdog.phase, mark.watchdog.step, mark.watchdog.since) == ("logging", 3, since)
    with mark.phase("checkpoint save"):
        assert (mark.watchdog.phase, mark.watchdog.step) == ("checkpoint save", 3) and mark.watchdog.since > since
    with mark.phase("logging", 2):  # the data ran out: the last step trained ends its tail again
        assert (mark.watchdog.phase, mark.watchdog.step) == ("logging", 2)


def test_own_time_and_data_time_go_into_the_window(tmp_path):
    mark = instruments(tmp_path)
    with mark.own_time(loading_data=True):
        time.sleep(0.02)
    with mark.own_time():
        time.sleep(0.01)
    assert 0.02 <= mark.window.data_seconds < mark.window.own_seconds
    mark.count_tokens([(torch.zeros(2, 8), torch.zeros(2, 8)), (torch.zeros(2, 8), torch.zeros(2, 8))])
    assert mark.window.tokens == 32
    before = mark.window.start
    mark.leave_out(1.5)  # a validation's time
    assert mark.window.start == before + 1.5
