"""Running at cluster scale, through run_llama_train.sh: preemption, hangs, stragglers.

- Preemption: SIGTERM to one rank, or SIGUSR1 to the launcher (SLURM's warning before a time
  limit), stops every rank after the same step with a checkpoint of it and exit code 75, without a
  torchrun restart; launching again resumes with bitwise the losses of an uninterrupted run.
- Hangs: a rank frozen with SIGSTOP ends the job within comm.train_timeout_seconds and a margin,
  with one line naming it (host, pid) and what the others waited in, and their stack dumps.
- Stragglers: the metrics name the slowest rank's own time per step against the median.
"""

import os
import re
import signal
import subprocess
import time

import pytest

from tests.helpers import REPO_ROOT, TINY_RUN, read_metrics, run_train
from tests.integration.conftest import UNINTERRUPTED_STEPS

STEPS = UNINTERRUPTED_STEPS
BASE = [*TINY_RUN, "--training.steps", str(STEPS), "--metrics.log_freq", "1", "--checkpoint.enable_checkpoint",
        "--checkpoint.interval", "100"]


def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHTITAN_REPORT_DIR", "TORCHELASTIC_RESTART_COUNT")}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def _start(args, folder, **env):
    return subprocess.Popen(["./run_llama_train.sh", *args, "--job.dump_folder", str(folder)], cwd=REPO_ROOT,
                            env=_env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _wait_for_step(folder, step, proc, timeout=180):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the job ended early ({proc.returncode}): {proc.stderr.read()[-3000:]}")
        if any(r["step"] >= step for r in read_metrics(folder)) if (folder / "metrics.jsonl").exists() else False:
            return
        time.sleep(0.2)
    raise AssertionError(f"step {step} not reached in {timeout} s")


def _rank_pid(folder, rank):
    """The pid of the trainer process of `rank` in the job writing to `folder`."""
    found = subprocess.run(["pgrep", "-f", f"torchtitan.train.*{folder}"], capture_output=True, text=True).stdout.split()
    for pid in found:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"RANK={rank}".encode() in f.read().split(b"\0"):
                    return int(pid)
        except OSError:
            continue
    raise AssertionError(f"no process of rank {rank} found")


def _no_rank_left(folder):
    return subprocess.run(["pgrep", "-f", f"torchtitan.train.*{folder}"], capture_output=True, text=True).stdout == ""


@pytest.mark.parametrize("how", ["SIGTERM to rank 1", pytest.param("SIGUSR1 to the launcher", marks=pytest.mark.fast)])
def test_preemption_saves_the_agreed_step_and_the_next_launch_resumes_bitwise(tmp_path, uninterrupted, how):
    # The SIGTERM job logs only its first and last steps: the ranks then read their agreement a step
    # late (trainer/agreement.py), and the stop must still come after the same step on every rank.
    quiet = how.startswith("SIGTERM")
    args = [*BASE, "--metrics.log_freq", "1000"] if quiet else BASE
    # MAX_RESTARTS is on: a preempted job must end, not be restarted by torchrun.
    if quiet:  # rank 1 signals itself during step 3 (tests/faults/checkpoint.py): a quiet step is fast
        proc = _start([*args, "--experimental.custom_import", "tests.faults.checkpoint"], tmp_path, NGPU="2",
                      MAX_RESTARTS="2", TT_SIGTERM_AT_STEP="3:1")
    else:
        proc = _start(args, tmp_path, NGPU="2", MAX_RESTARTS="2")
        _wait_for_step(tmp_path, 3, proc)
        proc.send_signal(signal.SIGUSR1)
    _, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 75, stderr[-3000:]
    name = how.split()[0]
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr[-3000:]
    match = re.fullmatch(rf"stopped: {name} received; stopped after step (\d+) and saved its checkpoint: "
                         rf"{tmp_path}/checkpoint/step-(\d+); launch the job again to resume from it", lines[0])
    assert match and match[1] == match[2], lines[0]
    stopped = int(match[1])
    # Quiet: the signal came after step 3's agreement was issued; step 4's carries it and is read
    # during step 5, so every rank stops after step 5 (one step later than a step that reads at once).
    assert (stopped == 5) if quiet else (3 <= stopped < STEPS)
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == [f"step-{stopped}"]
    assert [r["step"] for r in read_metrics(tmp_path)] == ([1, stopped] if quiet else list(range(1, stopped + 1)))
    assert _no_rank_left(tmp_path)
    if how.startswith("SIGUSR1"):
        return  # the resume below is the same whichever signal saved the step

    resumed = _start(args, tmp_path, NGPU="2")
    _, stderr = resumed.communicate(timeout=180)
    assert resumed.returncode == 0, stderr[-3000:]
    # Bitwise: the preempted step's state was saved whole (every step the runs logged).
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path)] == [
        (r["step"], uninterrupted[r["step"] - 1]) for r in read_metrics(tmp_path)]
    assert read_metrics(tmp_path)[-1]["step"] == STEPS


def test_a_frozen_rank_is_named_and_the_job_ends_within_the_timeout(tmp_path):
    timeout = 5
    proc = _start([*TINY_RUN, "--training.steps", "100000", "--metrics.log_freq", "1", "--comm.train_timeout_seconds",
                   str(timeout)], tmp_path, NGPU="2")
    _wait_for_step(tmp_path, 2, proc)  # past the first step, whose limit is the start-up timeout
    frozen = _rank_pid(tmp_path, 1)
    start = time.monotonic()
    os.kill(frozen, signal.SIGSTOP)
    _, stderr = proc.communicate(timeout=120)
    seconds = time.monotonic() - start
    print(f"SIGSTOP to exit: {seconds:.1f} s (comm.train_timeout_seconds {timeout})")
    assert proc.returncode == 5, stderr[-3000:]
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr[-3000:]
    assert re.match(rf"error: rank 1 \(host \S+, pid {frozen}\) stopped responding: no heartbeat for \d+ s, last in "
                    r"\S+.* of step \d+.*; rank 0 waited in .+ at \w+ \(\w+\.py:\d+\); Python stacks in "
                    rf"{tmp_path}/hang_dumps; if a step can legitimately take this long, raise "
                    r"comm.train_timeout_seconds", lines[0]), lines[0]
    assert seconds < timeout + 15
    dump = (tmp_path / "hang_dumps" / "rank-0.txt").read_text()  # the waiting rank's stacks, main thread included
    assert "most recent call first" in dump and "train_loop" in dump
    assert not (tmp_path / "hang_dumps" / "rank-1.txt").exists()  # a frozen process writes nothing
    assert _no_rank_left(tmp_path)  # the frozen rank too: the launcher killed it


def test_the_slowest_rank_is_reported_against_the_median(tmp_path):
    result = run_train([*TINY_RUN, "--training.steps", "4", "--metrics.log_freq", "1", "--job.dump_folder", str(tmp_path),
                        "--experimental.custom_import", "tests.faults.slow_rank_one"], nproc=2)
    rows = read_metrics(tmp_path)
    for row in rows[1:]:  # the first step's figures include start-up
        assert row["slowest_rank"] == 1
        # Two ranks: the median is their mean, half the injected 0.15 s below the slow one.
        assert 0.06 < row["slowest_rank_own_seconds"] - row["median_rank_own_seconds"] < 0.15
    assert re.search(r"slowest: rank 1 0\.\d{3}s/step vs median 0\.\d{3}s \(\d+\.\dx, data \+ optimizer\)", result.stdout)
