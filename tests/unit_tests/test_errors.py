"""How a run ends: exit codes, rank reports, the launcher's one line, stop signals, out of memory."""

import os
import signal

import pytest
import torch

from torchtitan.config.manager import ConfigError
from torchtitan.errors import EXIT_PREEMPTED, OutOfMemory, Preempted, Stopped, TrainingDiverged, out_of_memory
from torchtitan.runtime.reports import (
    REPORT_DIR_ENV,
    Report,
    mark_attempt,
    read_reports,
    say_how_it_ended,
    summarize,
    write_report,
)
from torchtitan.runtime.signals import StopRequests


@pytest.fixture
def report_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(REPORT_DIR_ENV, str(tmp_path))
    return tmp_path


def test_each_rank_reports_and_the_first_error_is_the_root_cause(report_dir, capsys):
    assert say_how_it_ended(1, ConfigError("bad option on rank 1")) == 2
    try:
        raise RuntimeError("connection closed by peer")  # what rank 0 meets once rank 1 is gone
    except RuntimeError as e:
        assert say_how_it_ended(0, e) == 1
    assert capsys.readouterr().err == ""  # under a launcher the ranks print nothing themselves
    reports = read_reports(str(report_dir))
    assert [(r.rank, r.kind) for r in reports] == [(0, "bug"), (1, "error")]
    assert summarize(reports, {0: 1, 1: 2}) == (2, "error: bad option on rank 1")


def test_a_bug_is_one_traceback_naming_the_rank(report_dir):
    try:
        raise KeyError("surprise")
    except KeyError as e:
        say_how_it_ended(3, e)
    code, text = summarize(read_reports(str(report_dir)), {3: 1})
    assert code == 1 and text.startswith("rank 3 failed with an unexpected error (a bug):\nTraceback")
    assert text.count("Traceback") == 1 and text.rstrip().endswith("KeyError: 'surprise'")


def test_a_stop_outranks_the_errors_it_causes_on_peers(report_dir):
    say_how_it_ended(0, Stopped(signal.SIGINT, 7, "newest checkpoint: out/checkpoint/step-6"))
    say_how_it_ended(1, RuntimeError("gloo: connection reset"), stop_requested=signal.SIGINT)
    code, text = summarize(read_reports(str(report_dir)), {0: 130, 1: 130})
    assert code == 130
    assert text == "stopped: SIGINT received; stopped after step 7; newest checkpoint: out/checkpoint/step-6"


def test_without_a_launcher_the_rank_prints_its_line(monkeypatch, capsys):
    monkeypatch.delenv(REPORT_DIR_ENV, raising=False)
    diverged = TrainingDiverged("non-finite loss at step 3")
    diverged.add_context("no checkpoint saved yet")
    assert say_how_it_ended(0, diverged) == 3
    assert capsys.readouterr().err == "error: non-finite loss at step 3; no checkpoint saved yet\n"
    with pytest.raises(ValueError, match="a bug"):  # a bug keeps Python's own traceback
        say_how_it_ended(0, ValueError("a bug"))


def test_ranks_that_said_nothing(tmp_path):
    assert summarize([], {}) == (0, "")
    code, text = summarize([], {0: -15, 1: -9})
    assert code == 143 and text.startswith("error: rank 0 ended with signal SIGTERM without saying why")
    assert "LOG_RANK" not in text and "dmesg" in text  # a killed rank's output says no more than this
    code, text = summarize([], {0: -15, 1: 1})  # rank 1 failed; rank 0 was stopped because of it
    assert code == 1 and text.startswith("error: rank 1 ended with exit code 1") and "LOG_RANK=1" in text
    assert summarize([], {}, signum=signal.SIGINT)[0] == 130
    # A report cut off mid-write is skipped, not a crash of the launcher.
    (tmp_path / "rank-0.json").write_text('{"rank": 0, "co')
    assert read_reports(str(tmp_path)) == []


def test_real_allocation_failures_become_one_line():
    with pytest.raises(RuntimeError) as info:
        torch.empty(2**62, dtype=torch.uint8)  # more than any machine has
    oom = out_of_memory(info.value)
    assert isinstance(oom, OutOfMemory) and oom.exit_code == 2
    assert oom.line.startswith("error: out of memory: ") and "training.batch_size" in oom.line
    assert "\n" not in oom.line and "alloc_cpu" not in oom.line
    assert out_of_memory(MemoryError()) is not None
    assert out_of_memory(RuntimeError("shapes do not match")) is None


def test_first_signal_asks_second_would_end(monkeypatch, capsys):
    monkeypatch.delenv(REPORT_DIR_ENV, raising=False)
    # What uninstall must give back: Python's handler, or SIG_IGN where the suite runs as a
    # background job of a non-interactive shell (which starts it with SIGINT ignored).
    before = signal.getsignal(signal.SIGINT)
    stops = StopRequests().install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stops.requested == signal.SIGTERM  # noted; the process goes on to the step boundary
        exits = []
        monkeypatch.setattr(os, "_exit", exits.append)
        os.kill(os.getpid(), signal.SIGTERM)  # the same request again at once (SLURM, then the launcher)
        assert exits == [] and stops.requested == signal.SIGTERM
        stops._first_at -= StopRequests.REPEAT_WINDOW_SECONDS  # an insisting signal comes later
        os.kill(os.getpid(), signal.SIGINT)
        assert exits == [128 + signal.SIGINT]
        assert capsys.readouterr().err == ("stopped: SIGINT received again; ended at once, during a step (the newest "
                                           "checkpoint stays)\n")
    finally:
        stops.uninstall()
    assert signal.getsignal(signal.SIGINT) is before


def test_a_report_folder_that_cannot_take_the_report(monkeypatch, tmp_path, capsys):
    """A folder set by hand that does not exist, or one removed with a launcher that ended first:
    the rank says its line itself instead of failing with a second traceback."""
    monkeypatch.setenv(REPORT_DIR_ENV, str(tmp_path / "gone"))
    assert say_how_it_ended(0, ConfigError("bad option")) == 2
    assert capsys.readouterr().err == "error: bad option\n"


def test_report_round_trip(report_dir):
    say_how_it_ended(2, Stopped(signal.SIGTERM, None))
    (report,) = read_reports(str(report_dir))
    assert report == Report(2, 143, "stopped: SIGTERM received; stopped during start-up, before the first step",
                            "stopped", "", report.time)


def test_sigusr1_is_a_stop_request_like_sigterm(monkeypatch):
    monkeypatch.delenv(REPORT_DIR_ENV, raising=False)
    stops = StopRequests().install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)  # SLURM's warning before a time limit (--signal=USR1@...)
        assert stops.requested == signal.SIGUSR1
    finally:
        stops.uninstall()
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL


def test_a_preemption_names_the_checkpoint_of_the_step_it_stopped_after(report_dir):
    preempted = Preempted(signal.SIGUSR1, 12)
    preempted.add_context("newest checkpoint: out/checkpoint/step-12")
    assert say_how_it_ended(1, preempted) == EXIT_PREEMPTED == 75
    say_how_it_ended(0, RuntimeError("gloo: connection closed"), stop_requested=signal.SIGUSR1)
    code, text = summarize(read_reports(str(report_dir)), {})
    assert code == 75
    assert text == ("stopped: SIGUSR1 received; stopped after step 12 and saved its checkpoint: "
                    "out/checkpoint/step-12; launch the job again to resume from it")


def test_after_restarts_only_the_newest_attempt_explains_the_job(report_dir, monkeypatch):
    # Attempt 0: rank 1 was killed, rank 0 failed in a collective because of it.
    say_how_it_ended(0, ConfigError("a failure torchrun restarted from"))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    mark_attempt()  # attempt 1 began; its ranks finished without a report
    assert read_reports(str(report_dir)) == []
    assert summarize(read_reports(str(report_dir)), {}) == (0, "")
    write_report(1, 5, "error: rank 0 stopped responding", "hang", stuck=[{"rank": 0, "host": "h", "pid": 9}])
    (hang,) = read_reports(str(report_dir))
    assert (hang.attempt, hang.kind, hang.stuck) == (1, "hang", [{"rank": 0, "host": "h", "pid": 9}])
    assert summarize([hang], {1: 5}) == (5, "error: rank 0 stopped responding")


def test_a_rank_killed_from_outside_is_the_cause_not_the_peers_it_left(report_dir):
    """Rank 1 is SIGKILLed (out of host memory, say): rank 0 fails in a collective, or is torn
    down by torchrun's SIGTERM first; either way the job's line names rank 1."""
    lost = RuntimeError("[pair.cc:553] Connection closed by peer [10.0.0.2]:3470. This is typically caused by...")
    assert say_how_it_ended(0, lost) == 1
    (report,) = read_reports(str(report_dir))
    assert report.kind == "aborted" and report.line.startswith("error: rank 0 lost a peer in a collective ([pair.cc")
    code, text = summarize([report], {0: 1, 1: -9})
    assert code == 137 and text.startswith("error: rank 1 ended with signal SIGKILL without saying why")
    # On another node, the killed rank is not among this launcher's ranks: the peer loss is the line.
    assert summarize([report], {0: 1}) == (1, report.line)
    # Torn down by torchrun first: the stop it noted was not the user's.
    say_how_it_ended(2, lost, stop_requested=signal.SIGTERM)
    assert summarize(read_reports(str(report_dir)), {0: 1, 1: -9, 2: 143})[1].startswith("error: rank 1 ended with signal SIGKILL")
    # A signal that did reach the launcher (passed on to every rank) stays the explanation.
    stopped = [r for r in read_reports(str(report_dir)) if r.rank == 2]
    assert summarize(stopped, {1: -9}, signum=signal.SIGTERM) == (143, stopped[0].line)


def test_a_line_stays_one_line_whatever_the_message_quotes():
    # Found by the config fuzzing (test_config_fuzz.py): a tokenizer path with a line break in it
    # made the refusal two lines.
    assert ConfigError("tokenizer file not found: a\nb\r (set --model.tokenizer_path)").line == (
        "error: tokenizer file not found: a\\nb\\r (set --model.tokenizer_path)")
