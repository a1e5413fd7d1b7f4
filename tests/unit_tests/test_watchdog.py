"""The hang watchdog's diagnosis: who is stuck, from every rank's newest heartbeat."""

import json
import logging
import threading
import time

import torch

from torchtitan.observability.watchdog import (
    KEY,
    Beat,
    Watchdog,
    _dump_flight_recorder,
    _ranks_text,
    beat_interval,
    collective_timeout,
    diagnose,
    watch_this_rank,
)

NOW = 1000.0
LIMIT, INTERVAL = 10.0, 1.0


def beat(rank, step=5, phase="forward/backward", since=985.0, at=999.5, where="all_reduce (distributed_c10d.py:1)"):
    return Beat(rank, "node0" if rank < 2 else "node1", 100 + rank, step, phase, since, at, where)


def test_a_frozen_rank_is_named_with_its_host_and_pid_and_the_others_say_where_they_wait():
    beats = {0: beat(0), 1: beat(1), 2: beat(2, at=NOW - 12, phase="data loading"), 3: beat(3)}
    line, stuck = diagnose(beats, NOW, LIMIT, INTERVAL, "/out/hang_dumps")
    assert [b.rank for b in stuck] == [2]
    assert line.startswith("rank 2 (host node1, pid 102) stopped responding: no heartbeat for 12 s, last in data "
                           "loading of step 5 at all_reduce (distributed_c10d.py:1); ranks 0, 1, 3 waited in "
                           "forward/backward of step 5 at all_reduce (distributed_c10d.py:1); Python stacks in "
                           "/out/hang_dumps")


def test_a_rank_behind_its_peers_is_stuck_even_while_its_heartbeat_goes_on():
    beats = {r: beat(r, phase="gradient norm") for r in range(4)}
    beats[1] = beat(1, phase="data loading", since=988.0)  # a slow loader, still alive
    line, stuck = diagnose(beats, NOW, LIMIT, INTERVAL, "d")
    assert [b.rank for b in stuck] == [1]
    assert line.startswith("rank 1 (host node0, pid 101) made no progress for 12 s in data loading of step 5")
    assert "ranks 0, 2, 3 waited in gradient norm of step 5" in line
    # An earlier step is further behind than any phase of a later one.
    beats[3] = beat(3, step=4, phase="checkpoint save")
    assert [b.rank for b in diagnose(beats, NOW, LIMIT, INTERVAL, "d")[1]] == [3]


def test_every_rank_in_the_same_place_is_a_collective_that_never_completes():
    beats = {r: beat(r) for r in range(8)}
    line, stuck = diagnose(beats, NOW, LIMIT, INTERVAL, "d")
    assert stuck == []
    assert line.startswith("no progress for 15 s: every rank waits in forward/backward of step 5 at all_reduce")


def test_a_rank_without_heartbeat_is_named():
    line, stuck = diagnose({0: beat(0), 1: None}, NOW, LIMIT, INTERVAL, "d")
    assert "rank 1 never sent a heartbeat" in line and stuck == []


def test_rank_lists_and_timing_rules():
    assert _ranks_text([3]) == "rank 3"
    assert _ranks_text([0, 1, 2, 5, 7, 8]) == "ranks 0-2, 5, 7, 8"
    # The process group's timeout stays beyond the watchdog's limit, so the watchdog speaks first.
    for limit in (5, 100, 300, 3600):
        assert collective_timeout(limit) >= limit + 30
        assert 0.5 <= beat_interval(limit) <= min(10, limit / 3)


class DictStore:
    """The two store calls the watchdog makes, over a dict."""

    def __init__(self):
        self.data = {}

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self.data[key]

    def check(self, keys):
        return all(k in self.data for k in keys)


def test_heartbeats_carry_the_phase_and_where_the_main_thread_is(tmp_path):
    store = DictStore()
    dog = Watchdog(0, 1, store, str(tmp_path), limit_seconds=3600).start()
    try:
        dog.enter("optimizer step", 7)
        dog.set_limit(5.0)  # wakes the thread: beats now come every beat_interval(5) = 0.5 s
        time.sleep(1.2)  # the main thread sleeps here through at least one beat
        published = dog._read()[0]
        assert (published.step, published.phase, published.pid) == (7, "optimizer step", dog.pid)
        assert published.where.startswith("test_heartbeats_carry_the_phase_and_where_the_main_thread_is (test_watchdog.py:")
        assert NOW - 1 < published.at - time.time() + NOW <= NOW
    finally:
        dog.stop()
    assert not any(t.name == "torchtitan-watchdog" for t in threading.enumerate())


class GoneStore(DictStore):
    """A store whose host can go away (the job's rank 0 ended) and come back."""

    def __init__(self):
        super().__init__()
        self.gone, self.refused = False, 0

    def set(self, key, value):
        if self.gone:
            self.refused += 1
            raise ConnectionError("store gone with its host")
        super().set(key, value)


def _wait_for(condition, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_store_gone_with_its_host_does_not_end_the_watchdog(tmp_path, caplog):
    """A failed beat is logged at debug level and the thread beats on; when the store answers
    again, the beats carry on from where the main thread is."""
    caplog.set_level(logging.DEBUG, logger="torchtitan.observability.watchdog")
    store = GoneStore()
    dog = Watchdog(0, 2, store, str(tmp_path), limit_seconds=5)  # a beat every 0.5 s
    dog._fire = lambda: None  # whatever the timing on a busy machine, this process is never ended
    dog.start()
    try:
        store.gone = True
        _wait_for(lambda: store.refused >= 2)
        assert dog._thread.is_alive() and "watchdog: store gone with its host" in caplog.text
        dog.enter("forward/backward", 3)
        store.gone = False
        _wait_for(lambda: json.loads(store.data[f"{KEY}0"])["step"] == 3)
    finally:
        dog.stop()
    assert not dog._thread.is_alive()


def test_a_flight_recorder_that_fails_leaves_no_file_and_no_error(tmp_path, monkeypatch):
    """NCCL's trace dump (simulated: CI has no CUDA) raising must not hide the hang report."""
    def dump():
        raise RuntimeError("the NCCL trace buffer is not enabled")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch._C._distributed_c10d, "_dump_nccl_trace", dump, raising=False)
    path = tmp_path / "nccl-trace-rank-0.pkl"
    _dump_flight_recorder(str(path))
    assert not path.exists()
    monkeypatch.setattr(torch._C._distributed_c10d, "_dump_nccl_trace", lambda: b"trace", raising=False)
    _dump_flight_recorder(str(path))
    assert path.read_bytes() == b"trace"


def test_a_single_process_watchdog_records_the_phase_and_starts_no_thread(tmp_path):
    """Without a process group (one process) there is no peer to wait for: the trainer's marks are
    kept, nothing beats and nothing can end the process."""
    with watch_this_rank(0, 1, str(tmp_path), limit_seconds=0.01) as dog:
        dog.enter("forward/backward", 2)
        dog.set_limit(0.01)
        time.sleep(0.05)
        assert (dog.step, dog.phase) == (2, "forward/backward")
        assert not dog._thread.is_alive() and dog.store is None
    assert not (tmp_path / "hang_dumps").exists()
