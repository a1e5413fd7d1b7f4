"""training.dataset_infinite false: every rank stops at the same step when the data runs out."""

import json

import pytest

from tests.helpers import TINY_RUN, read_metrics, run_train
from torchtitan.tools.runs import read_validations


@pytest.mark.fast
def test_two_ranks_stop_together_when_data_runs_out(tmp_path):
    # Uneven shards: rank 0's half of the bytes holds the starts of the two long documents, rank 1's
    # the short ones, so rank 1 runs out first and rank 0 must stop with it instead of waiting in a
    # collective.
    docs = ["long document " * 200, "long document " * 200, "short text " * 60, "short text " * 60]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    validation = tmp_path / "validation.jsonl"
    validation.write_text("".join(json.dumps({"text": "held out text " * 40}) + "\n" for _ in range(4)))
    # Logged every 4 steps and validated every 5: the last step is logged and validated all the same.
    result = run_train([*TINY_RUN, "--training.steps", "100", "--training.batch_size", "2",
                        "--training.dataset_path", str(data), "--training.dataset_infinite=false",
                        "--metrics.log_freq", "4", "--validation.enabled", "--validation.freq", "5",
                        "--validation.steps", "1", "--validation.dataset_path", str(validation),
                        "--job.dump_folder", str(tmp_path / "out")], nproc=2, timeout=120)
    last = int(result.stdout.split("the data ran out after step ")[1].split(";")[0])
    assert 0 < last < 100 and last % 4 and last % 5, f"step {last} should be one neither logged nor validated anyway"
    steps = [r["step"] for r in read_metrics(tmp_path / "out")]
    assert steps[-1] == last
    assert read_validations(tmp_path / "out")[-1]["step"] == last
    assert f"run summary (data ran out): {last} steps (steps 1-{last} of 100)" in result.stdout
