"""profiling.enable_profiling writes a chrome trace every profile_freq steps."""

import pytest

from tests.helpers import TINY_RUN, run_train


@pytest.mark.fast
def test_profiler_writes_traces(tmp_path):
    run_train([*TINY_RUN, "--training.steps", "4", "--job.dump_folder", str(tmp_path),
               "--profiling.enable_profiling", "--profiling.profile_freq", "2"])
    traces = sorted(p.relative_to(tmp_path).as_posix() for p in (tmp_path / "profile_traces").rglob("*.json"))
    assert traces == ["profile_traces/iteration_2/rank0_trace.json", "profile_traces/iteration_4/rank0_trace.json"]


def test_the_traced_collectives_are_the_planners_traffic(tmp_path):
    """TP 2 x FSDP 2 on 4 ranks: every collective kind's calls and bytes in the traced step equal
    what the planner's communication model predicts (docs/memory.md, "The step-time model checked";
    scripts/step_time_check.py runs the other layouts and the step time)."""
    from scripts.step_time_check import _vocab_size, layout_of
    from torchtitan.estimation.planner import Hardware, Model, by_kind, traffic
    from torchtitan.tools.comm_trace import mean_over_ranks, read_rank_traces

    args = [*TINY_RUN, "--training.steps", "3", "--training.batch_size", "2", "--job.dump_folder", str(tmp_path),
            "--profiling.enable_profiling", "--profiling.profile_freq", "3", "--training.tensor_parallel_degree", "2",
            "--training.data_parallel_shard_degree", "2"]
    run_train(args, nproc=4)
    measured = mean_over_ranks(read_rank_traces(sorted((tmp_path / "profile_traces" / "iteration_3").glob("*.json"))))
    layout, precision, named = layout_of(args, 4)
    model = Model.from_flavor(named["name"], named["flavor"], _vocab_size(args))
    predicted = by_kind(traffic(model, layout, Hardware(), named["seq_len"], 0, imbalance=1.0, precision=precision))
    assert {k: v for k, v in measured.items() if v["count"]} == {k: v for k, v in predicted.items() if v["count"]}
