"""torchtitan/tools/replica_groups.py without a trainer: the groups run at once, each told its
replica id, and one group's failure is raised once every group has ended."""

import threading
import time

import pytest

from torchtitan.tools.replica_groups import run_replica_groups


def test_groups_run_at_once_and_a_failure_is_raised_after_all_end():
    started, ended = [], []
    both_running = threading.Barrier(2, timeout=10)

    def runner(args, nproc=1, timeout=None):
        group = int(args[args.index("--fault_tolerance.replica_id") + 1])
        started.append(group)
        both_running.wait()  # deadlocks (and times out) unless the groups run at the same time
        if group == 0:
            raise RuntimeError("group 0 failed")
        time.sleep(0.2)
        ended.append(group)
        return group

    with pytest.raises(RuntimeError, match="group 0 failed"):
        run_replica_groups(["--x"], groups=2, runner=runner)
    assert sorted(started) == [0, 1] and ended == [1]
    assert run_replica_groups(["--x"], groups=2, runner=lambda args, nproc, timeout: args[-1]) == ["0", "1"]
