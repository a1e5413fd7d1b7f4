"""The launcher and its ranks. A rank that a peer's hang report names as stuck is killed by the
launcher (torchtitan/runtime/launch.py), but only a child of this launcher, and a rank already gone is no
error; a rank whose launcher is gone ends (runtime/process_group.py)."""

import os
import signal
import subprocess
import threading
import time

import pytest

from torchtitan.runtime import launch, process_group
from torchtitan.runtime.reports import REPORT_DIR_ENV, write_report


@pytest.fixture
def children():
    """Two children of this process, standing for ranks (ended after the test, whatever it patched)."""
    processes = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    yield processes
    for process in processes:
        process.kill()
        process.wait()


@pytest.fixture
def child(children):
    return children[0]


def test_only_this_launchers_children_are_its_ranks(child):
    gone = subprocess.Popen(["true"])
    gone.wait()  # reaped: its /proc entry is gone
    assert launch._is_my_child(child.pid)
    assert not launch._is_my_child(os.getpid())  # this process is its parent's child, not its own
    assert not launch._is_my_child(gone.pid)
    assert launch._started_ranks()


def _hang_report(folder, monkeypatch, *pids: int) -> None:
    monkeypatch.setenv(REPORT_DIR_ENV, str(folder))
    write_report(0, 124, "error: ranks 1 and 2 stopped responding", "hang",
                 stuck=[{"rank": 1 + i, "host": "here", "pid": pid} for i, pid in enumerate(pids)])


def _watch(folder):
    done = threading.Event()
    thread = threading.Thread(target=launch._kill_hung_ranks, args=(str(folder), done), daemon=True)
    thread.start()
    return done, thread


def test_a_stuck_rank_is_killed(child, tmp_path, monkeypatch):
    _hang_report(tmp_path, monkeypatch, child.pid)
    done, thread = _watch(tmp_path)
    try:
        assert child.wait(timeout=10) == -signal.SIGKILL
    finally:
        done.set()
        thread.join(timeout=5)
    assert not thread.is_alive()


def test_stuck_ranks_that_end_before_the_kill_are_no_error(children, tmp_path, monkeypatch):
    """Each exits between the check that it is a child and the kill (forced here): the next one
    named is still tried, and the watch ends only when told."""
    tried = []

    def already_gone(pid, sig):
        tried.append((pid, sig))
        raise ProcessLookupError(3, "No such process")

    _hang_report(tmp_path, monkeypatch, *(c.pid for c in children))
    # os.kill is patched for the whole process: given back before the fixture ends the children.
    with monkeypatch.context() as patched:
        patched.setattr(launch.os, "kill", already_gone)
        done, thread = _watch(tmp_path)
        try:
            deadline = time.monotonic() + 10
            while len(tried) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert tried == [(c.pid, signal.SIGKILL) for c in children]
        finally:
            done.set()
            thread.join(timeout=5)
    assert not thread.is_alive()


def _fork_rank(parents: list[int]) -> int:
    """The exit code of a forked rank of 2 that calls die_with_launcher() and, if that returns, exits
    0; `parents` are what os.getppid() gives it, call by call."""
    pid = os.fork()
    if pid == 0:
        try:
            os.environ["WORLD_SIZE"] = "2"
            answers = iter(parents)
            os.getppid = lambda: next(answers)  # this forked child's only
            process_group.die_with_launcher()
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_a_rank_whose_launcher_died_before_the_death_signal_was_set_ends_at_once():
    """The launcher died between the rank reading its parent and asking the kernel for a SIGKILL
    when the parent dies (forced here: the parent changes to init's 1): the rank ends itself, with
    the code a SIGKILL gives; while the launcher lives, it goes on."""
    assert _fork_rank([4242, 1]) == 128 + signal.SIGKILL
    assert _fork_rank([4242, 4242]) == 0
