"""training.dataset_infinite false: every rank stops at the same step when the data runs out."""

import json

from tests.helpers import TINY_RUN, read_metrics, run_train


def test_two_ranks_stop_together_when_data_runs_out(tmp_path):
    # Uneven shards: rank 0 gets the two long documents, rank 1 the short ones, so rank 1 runs
    # out first and rank 0 must stop with it instead of waiting in a collective.
    docs = ["long document " * 200, "short text " * 60, "long document " * 200, "short text " * 60]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    result = run_train([*TINY_RUN, "--training.steps", "100", "--training.batch_size", "2",
                        "--training.dataset_path", str(data), "--training.dataset_infinite=false",
                        "--job.dump_folder", str(tmp_path / "out")], nproc=2, timeout=120)
    assert "the data ran out after step" in result.stdout
    steps = [r["step"] for r in read_metrics(tmp_path / "out")]
    assert 0 < steps[-1] < 100
