"""Progress line (step x/N, elapsed, estimated time left) and the final summary."""

import pytest

from torchtitan.observability import progress as progress_module
from torchtitan.observability.progress import Progress, duration, summary


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(progress_module.time, "perf_counter", c)
    return c


def test_durations_read_at_a_glance():
    assert duration(3.44) == "3.4s"
    assert duration(125) == "2:05"
    assert duration(3 * 3600 + 7) == "3:00:07"


def test_the_estimate_leaves_out_the_first_step_and_counts_validation_runs_apart(clock):
    p = Progress(total_steps=100, first_step=1, validation_freq=50, start=clock.now)
    clock.now += 30  # the first step pays for start-up
    p.step_done(1)
    assert p.remaining(1) is None and p.text(1).endswith("eta ?")
    clock.now += 10  # steps 2-11: 1 s each
    assert p.remaining(11) == pytest.approx(89 * 1.0)
    p.validation_done(5.0)  # a validation run of 5 s (at step 11, say), not part of the step time
    clock.now += 5
    # Two validation runs are to come (steps 50 and 100), 5 s each.
    assert p.remaining(11) == pytest.approx(89 * 1.0 + 2 * 5.0)
    assert p.text(11) == f"elapsed {duration(45)}  eta {duration(99)}"


def test_the_last_step_is_validated_even_off_the_frequency(clock):
    p = Progress(total_steps=10, first_step=1, validation_freq=4, start=clock.now)
    p.step_done(1)
    clock.now += 2
    p.validation_done(2.0)
    clock.now += 1
    assert p.remaining(2) == pytest.approx(8 * 1.0 + 3 * 2.0)  # steps 4, 8 and 10
    assert p.remaining(10) == 0


def test_a_resumed_run_counts_from_its_own_first_step(clock):
    p = Progress(total_steps=20, first_step=11, start=clock.now)
    clock.now += 7
    p.step_done(11)
    clock.now += 4
    assert p.remaining(15) == pytest.approx(5 * 1.0)


def test_summary_names_steps_tokens_throughput_validation_and_outputs(clock):
    p = Progress(total_steps=20, first_step=11, start=clock.now)
    clock.now += 65
    lines, record = summary(p, 20, 40960, 1234.5, 12.345, {12: 3.1, 16: 2.9, 20: 3.0},
                            {"checkpoints": "out/checkpoint/step-20"})
    assert lines[0] == ("run summary (done): 10 steps (steps 11-20 of 20), 40,960 tokens in 1:05; mean 1,234 "
                        "tokens/s per device, MFU 12.35%")
    assert lines[1] == "validation loss: final 3.0000 (step 20), best 2.9000 (step 16)"
    assert lines[2] == "outputs: checkpoints out/checkpoint/step-20"
    assert record["best_validation_step"] == 16 and record["final_validation_loss"] == 3.0
    assert record["steps"] == 10 and record["wall_seconds"] == 65
    assert "steady_tokens_per_second_per_device" not in record  # a single step line: no steady state


def test_summary_gives_the_steady_state_rate_beside_the_whole_run(clock):
    """The first step line holds compilation; the steady state is what the later ones measured."""
    p = Progress(total_steps=20, first_step=1, start=clock.now)
    clock.now += 30
    lines, record = summary(p, 20, 40960, 1234.5, 12.345, {}, {}, steady=(4321.0, 43.21))
    assert lines[0].endswith("; steady state 4,321 tokens/s per device, MFU 43.21% (after the first step line); "
                             "whole run 1,234 tokens/s, MFU 12.35%")
    assert record["steady_tokens_per_second_per_device"] == 4321.0 and record["steady_mfu_percent"] == 43.21
    assert record["tokens_per_second_per_device"] == 1234.5


@pytest.mark.parametrize("first_step,log_freq,logged", [
    (1, 10, [1, 10, 20]),  # a fresh run: step 1 alone, then every log_freq
    (5, 10, [5, 10, 20]),  # resumed after step 4: its first step alone too (its compilation and warm-up)
    (11, 10, [11, 20]),
])
def test_a_runs_first_step_has_a_line_of_its_own(first_step, log_freq, logged):
    """The summary's steady state leaves out the first step line: that line must hold this run's
    first step only, fresh or resumed."""
    from types import SimpleNamespace

    from torchtitan.trainer.loop import Trainer

    trainer = SimpleNamespace(first_step=first_step, job_config=SimpleNamespace(metrics=SimpleNamespace(log_freq=log_freq)))
    assert [s for s in range(first_step, 21) if Trainer.log_due_at(trainer, s, 0, s == 20)] == logged
