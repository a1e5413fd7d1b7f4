"""profiling.enable_profiling writes a chrome trace every profile_freq steps."""

import pytest

from tests.helpers import TINY_RUN, run_train


@pytest.mark.fast
def test_profiler_writes_traces(tmp_path):
    run_train([*TINY_RUN, "--training.steps", "4", "--job.dump_folder", str(tmp_path),
               "--profiling.enable_profiling", "--profiling.profile_freq", "2"])
    traces = sorted(p.relative_to(tmp_path).as_posix() for p in (tmp_path / "profile_traces").rglob("*.json"))
    assert traces == ["profile_traces/iteration_2/rank0_trace.json", "profile_traces/iteration_4/rank0_trace.json"]
