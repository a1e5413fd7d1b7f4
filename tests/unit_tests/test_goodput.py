"""Goodput accounting (torchtitan/observability/goodput.py): a run's categories sum to its wall time,
the compilation estimate, the job's figure across attempts from goodput.jsonl (restarts, steps
redone after the checkpoint resumed from), and a file that is missing, garbled or unwritable never
ends a run."""

import json
import logging
import os

import pytest

from torchtitan.observability import goodput
from torchtitan.observability.goodput import Attempt, Goodput, job_split, percent, read_attempts
from torchtitan.observability.setup_record import _slowest_startup
from torchtitan.observability.watchdog import Watchdog
from torchtitan.trainer.instruments import StepInstruments


class Clock:
    """Both of the ledger's clocks, moved by hand: the monotonic one and Unix time, 1e9 s apart."""

    def __init__(self):
        self.now = 100.0

    def perf(self) -> float:
        return self.now

    def wall(self) -> float:
        return self.now + 1e9

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(goodput.time, "perf_counter", c.perf)
    monkeypatch.setattr(goodput.time, "time", c.wall)
    return c


def step(ledger: Goodput, clock: Clock, seconds: float, data: float = 0.0, save: float = 0.0) -> None:
    """One training step of `seconds` in all, of which `data` waiting for its batch and `save`
    writing a checkpoint after it."""
    ledger.add("data_waiting", data)
    clock.advance(seconds - save)
    with ledger.counting("checkpoint_save"):
        clock.advance(save)
    ledger.step_done()


def test_a_runs_categories_sum_to_its_wall_time_and_the_first_steps_excess_is_compilation(clock):
    ledger = Goodput(started=clock.wall() - 1.0)  # the process started a second ago: the imports
    ledger.mark("imports")
    clock.advance(2.0)
    ledger.mark("preflight")
    clock.advance(3.0)
    ledger.mark("checkpoint_load")
    clock.advance(0.5)
    ledger.add("validation", 0.5)  # the validation a resumed step missed, before the loop
    ledger.loop_started()
    step(ledger, clock, 5.0, data=0.2)  # compiles: 4.8 s net against 0.8 s for a steady step
    step(ledger, clock, 1.0, data=0.2)
    step(ledger, clock, 1.4, data=0.2, save=0.4)
    split = ledger.split()
    assert split == pytest.approx({"productive": 2.4, "startup": 3.0, "compilation": 4.0, "checkpoint_load": 3.0,
                                   "checkpoint_save": 0.4, "data_waiting": 0.6, "validation": 0.5, "wall": 13.9})
    assert sum(v for k, v in split.items() if k != "wall") == pytest.approx(split["wall"])
    assert ledger.percent() == pytest.approx(100 * 2.4 / 13.9)
    assert ledger.startup_phases() == pytest.approx({"imports": 1.0, "preflight": 2.0, "checkpoint_load": 3.0,
                                                     "before_first_step": 0.5, "first_step": 5.0})


def test_compilation_needs_a_later_step_and_is_never_negative(clock):
    ledger = Goodput(started=clock.wall())
    ledger.loop_started()
    step(ledger, clock, 1.0)
    assert ledger.compilation() == 0.0  # one step alone: its warm-up cannot be told from its work
    step(ledger, clock, 3.0)  # a later step slower than the first
    assert ledger.compilation() == 0.0
    split = ledger.split()
    assert split["productive"] == pytest.approx(4.0) and split["wall"] == pytest.approx(4.0)


def test_a_run_still_starting_up_counts_its_time_as_start_up(clock):
    ledger = Goodput(started=clock.wall())
    clock.advance(2.0)
    ledger.mark("checkpoint_load")
    clock.advance(1.0)
    split = ledger.split()
    assert (split["startup"], split["checkpoint_load"], split["productive"]) == pytest.approx((1.0, 2.0, 0.0))


def test_the_launch_starts_the_clock_for_the_first_attempt_only(clock, monkeypatch):
    ledger = Goodput(started=clock.wall(), launched=clock.wall() - 4.0)
    assert ledger.phases == {"rendezvous_and_spawn": 4.0} and ledger.split()["wall"] == pytest.approx(4.0)
    assert Goodput(started=clock.wall(), launched=clock.wall() + 1.0).launched is None  # not a launch of this process
    monkeypatch.setenv(goodput.LAUNCH_TIME_ENV, "1700000000.5")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert goodput.launch_time() == 1700000000.5
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # the launcher started before the failed attempt
    assert goodput.launch_time() is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv(goodput.LAUNCH_TIME_ENV, "soon")
    assert goodput.launch_time() is None


def test_the_first_run_of_a_process_counts_from_its_start_and_a_fork_starts_anew(monkeypatch):
    monkeypatch.setattr(goodput, "_process_start", 5.0)
    assert goodput.run_start() == 5.0
    assert goodput.run_start() > 5.0  # a second run in the same process: from its own call
    goodput._forked()  # what os.fork runs in the child
    assert goodput._process_start is not None and goodput._process_start > 5.0


def write_rows(path, *rows):
    with open(path, "a") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")


def progress(attempt, step, time, productive, **other):
    return {"record": "progress", "attempt": attempt, "step": step, "time": time,
            "seconds": {"productive": productive, **other}}


def test_the_job_counts_the_restart_gap_and_the_steps_redone_after_the_resumed_checkpoint(tmp_path, clock, monkeypatch):
    """Attempt 0 trained to step 5 and was killed; attempt 1 resumes from the checkpoint of step 4:
    the productive time attempt 0 spent on step 5 is redone, the gap until attempt 1 is a restart."""
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    start0 = clock.wall() - 100.0
    path = tmp_path / goodput.FILE_NAME
    write_rows(path, {"record": "attempt", "attempt": 0, "start": start0, "resumed_step": 0, "time": start0 + 5},
               progress(0, 2, start0 + 10, 4.0, startup=5.0, checkpoint_save=1.0),
               progress(0, 4, start0 + 14, 6.0, startup=5.0, checkpoint_save=3.0),
               progress(0, 5, start0 + 16, 7.5, startup=5.0, checkpoint_save=3.5))
    ledger = Goodput(started=start0 + 30.0)  # attempt 1's process started 14 s after attempt 0's last row
    ledger.join_job(str(tmp_path), resumed_step=4, write=True)
    ledger.loop_started()
    step(ledger, clock, 1.0)
    lines, record = ledger.summary(last_step=5, ended="done")
    ledger.close()
    job = record["job_goodput_seconds"]
    assert (job["restarts"], job["redone"]) == pytest.approx((14.0, 1.5), abs=1e-3)
    assert job["productive"] == pytest.approx(6.0 + record["goodput_seconds"]["productive"], abs=1e-3)
    assert job["wall"] == pytest.approx(101.0, abs=1e-3)  # from attempt 0's start to now
    assert sum(v for k, v in job.items() if k != "wall") == pytest.approx(job["wall"], abs=1e-2)
    assert record["job_attempts"] == 2 and record["job_goodput_percent"] == pytest.approx(percent(job), abs=1e-3)
    assert lines[0].startswith(f"goodput {record['goodput_percent']:.1f} % of ")
    assert lines[1].startswith(f"job goodput {percent(job):.1f} % of 1:41 over 2 attempts: restarts 14.0s, redone 1.5s; ")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["record"], r["attempt"]) for r in rows[4:]] == [("attempt", 1), ("progress", 1)]
    assert rows[4]["resumed_step"] == 4 and rows[-1]["ended"] == "done" and rows[-1]["step"] == 5


def test_a_resume_below_an_earlier_attempts_start_makes_all_its_work_redone():
    """Attempt 1 resumed step 4 and trained to 8 without saving; attempt 2 resumes step 3, for which
    attempt 0 has no row: its nearest row below (step 2) stands for it."""
    attempts = [Attempt(0.0, 0, [(2, 10.0, {"productive": 4.0}), (4, 14.0, {"productive": 6.0})]),
                Attempt(20.0, 4, [(8, 30.0, {"productive": 5.0})]),
                Attempt(35.0, 3, [(10, 50.0, {"productive": 9.0, "startup": 6.0})])]
    job = job_split(attempts)
    assert job["redone"] == pytest.approx(5.0 + 2.0)
    assert job["productive"] == pytest.approx(4.0 + 9.0)
    assert job["restarts"] == pytest.approx(6.0 + 5.0)
    assert job["wall"] == 50.0
    assert attempts[1].productive_kept_at(4) == 0.0  # it resumed there: nothing of it survives


def test_what_is_redone_does_not_move_with_the_compilation_estimate():
    """Between the rows of steps 2 and 4 the estimate grew by 0.5 s, taken from productive: the two
    steps after the checkpoint of step 2 cost 2 s of step time, not the 1.5 s productive moved."""
    killed = Attempt(0.0, 0, [(2, 10.0, {"productive": 4.0, "compilation": 1.0}),
                              (4, 13.0, {"productive": 5.5, "compilation": 1.5})])
    assert killed.productive_kept_at(2) == pytest.approx(3.5)
    assert killed.productive_kept_at(1) == 0.0  # no row at or below it: every step after the first is lost
    job = job_split([killed, Attempt(15.0, 2, [(4, 20.0, {"productive": 2.0})])])
    assert (job["redone"], job["productive"], job["compilation"]) == pytest.approx((2.0, 5.5, 1.5))


def test_a_garbled_file_loses_only_its_bad_lines_with_one_warning(tmp_path, caplog):
    path = tmp_path / goodput.FILE_NAME
    write_rows(path, {"record": "attempt", "attempt": 0, "start": 1.0, "resumed_step": 0, "time": 2.0},
               progress(0, 2, 3.0, 1.0), "{not json", ["a list"], progress(0, "three", 4.0, 2.0))
    with open(path, "a") as f:
        f.write('{"record": "progress", "attem')  # the row a killed attempt left half-written
    with caplog.at_level(logging.WARNING):
        (attempt,) = read_attempts(str(path))
    assert attempt.rows == [(2, 3.0, {"productive": 1.0})]
    assert "left out 4 lines" in caplog.text
    file = goodput.GoodputFile(str(path), new_job=False)
    file.write({"record": "attempt", "attempt": 1, "start": 5.0, "resumed_step": 2}, None)
    file.close()
    assert len(read_attempts(str(path))) == 2  # the next row started a line of its own


def test_a_missing_or_unreadable_file_starts_the_job_figure_with_this_attempt(tmp_path, clock, caplog, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    with caplog.at_level(logging.WARNING):
        ledger = Goodput(started=clock.wall())
        ledger.join_job(str(tmp_path / "fresh"), resumed_step=6, write=True)
        assert "holds no earlier attempt of this job although this run resumes step 6" in caplog.text
        lines, record = ledger.summary(6, "done")
        assert len(lines) == 1 and "job_goodput_percent" not in record
        ledger.close()
        (tmp_path / "dir" / goodput.FILE_NAME).mkdir(parents=True)  # neither readable nor writable as a file
        caplog.clear()
        ledger = Goodput(started=clock.wall())
        ledger.join_job(str(tmp_path / "dir"), resumed_step=6, write=True)
        ledger.note(7)
        assert "cannot read" in caplog.text and "cannot write the goodput file" in caplog.text
        assert ledger.file.stopped is not None and ledger.percent() >= 0.0


def test_a_write_that_fails_stops_the_file_not_the_run(clock, caplog):
    ledger = Goodput(started=clock.wall())
    ledger.file = goodput.GoodputFile("/dev/full", new_job=False)  # every write fails with ENOSPC
    with caplog.at_level(logging.WARNING):
        ledger.note(1)
        ledger.note(2)
        lines, _ = ledger.summary(2, "done")
    assert caplog.text.count("cannot write the goodput file /dev/full at step 1: No space left on device") == 1
    assert lines[0].startswith("goodput ")


def test_a_new_job_sets_the_earlier_jobs_file_aside(tmp_path, clock, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    path = tmp_path / goodput.FILE_NAME
    write_rows(path, {"record": "attempt", "attempt": 0, "start": 1.0, "resumed_step": 0, "time": 2.0})
    ledger = Goodput(started=clock.wall())
    ledger.join_job(str(tmp_path), resumed_step=0, write=True)  # from step 0, not a torchrun restart
    ledger.close()
    assert (tmp_path / "goodput.1.jsonl").exists() and ledger.attempt == 0
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # a restart without a checkpoint: the same job
    ledger = Goodput(started=clock.wall())
    ledger.join_job(str(tmp_path), resumed_step=0, write=True)
    ledger.close()
    assert ledger.attempt == 1 and len(read_attempts(str(path))) == 2
    assert not (tmp_path / "goodput.2.jsonl").exists()


def test_the_instruments_feed_the_ledger(tmp_path, clock):
    ledger = Goodput(started=clock.wall())
    mark = StepInstruments(Watchdog(0, 1, None, str(tmp_path), limit_seconds=60).start(), first_step=1, goodput=ledger)
    assert "before_first_step" in ledger.phases  # the loop starts as the instruments are made
    with mark.phase("data loading", 1), mark.own_time(loading_data=True):
        clock.advance(0.25)
    with mark.phase("checkpoint save", 1):
        clock.advance(0.5)
    with mark.phase("logging", 1):
        clock.advance(2.0)
    mark.step_done()
    assert ledger.seconds["data_waiting"] == 0.25 and ledger.seconds["checkpoint_save"] == 0.5
    assert ledger.startup_phases()["first_step"] == pytest.approx(2.75)


def test_the_setup_records_start_up_is_the_slowest_ranks_per_phase():
    ranks = [{"rank": 0, "startup_seconds": {"imports": 3.0, "process_group": 1.0}},
             {"rank": 1, "startup_seconds": {"imports": 2.5, "process_group": 4.0, "rendezvous_and_spawn": 0.5}},
             {"rank": 2}]
    assert _slowest_startup(ranks) == {"imports": 3.0, "process_group": 4.0, "rendezvous_and_spawn": 0.5}


def test_the_process_clock_is_read_before_torch_is_imported():
    source = open(os.path.join(os.path.dirname(goodput.__file__), "..", "train.py")).read()
    assert source.index("from torchtitan.observability.goodput import") < source.index("import torch\n")
