"""User mistakes found at start-up end the run with one line on stderr and exit code 2."""

import pytest

from tests.helpers import TINY_RUN, run_train

CASES = {
    "missing tokenizer": (["--model.tokenizer_path", "no/such/tokenizer.model"], "tokenizer file not found: no/such/tokenizer.model"),
    "empty tokenizer": (["--model.tokenizer_path", "{empty}"], "tokenizer file is empty"),
    "corrupt tokenizer": (["--model.tokenizer_path", "{garbage}"], "is not a valid sentencepiece model"),
    "unknown model": (["--model.name", "gpt5"], "unknown model.name 'gpt5'; registered: llama2, llama3"),
    "unknown flavor": (["--model.flavor", "5B"], "unknown model.flavor '5B' for model 'llama3'"),
    "unknown dataset": (["--training.dataset", "c4_nope"], "unknown training.dataset 'c4_nope'; known: c4, stdlib_docs"),
    "missing dataset file": (["--training.dataset_path", "no/such.jsonl"], "dataset file not found: no/such.jsonl"),
    "shards vs batch": (["--training.dataset_shards", "3"], "training.batch_size 8 must be divisible by the 3 data shards"),
    "float8 on CPU": (["--float8.enable_float8_linear"], "float8.enable_float8_linear needs CUDA GPUs"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_start_up_error_is_one_clear_line(name, tmp_path):
    args, expected = CASES[name]
    (tmp_path / "empty.model").write_bytes(b"")
    (tmp_path / "garbage.model").write_bytes(b"this is not a protobuf" * 10)
    args = [a.format(empty=tmp_path / "empty.model", garbage=tmp_path / "garbage.model") for a in args]
    result = run_train([*TINY_RUN, "--job.dump_folder", str(tmp_path), *args], check=False)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr


def test_error_found_on_the_ranks_is_reported_by_rank_zero(tmp_path):
    """A layout problem only the ranks can see (the device): rank 0 alone prints the one line.
    (torchrun then adds its own failure report.)"""
    args = ["--training.data_parallel_replicate_degree", "2", "--training.mixed_precision_reduce", "bfloat16"]
    result = run_train([*TINY_RUN, "--job.dump_folder", str(tmp_path), *args], nproc=2, check=False)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if "error: training.mixed_precision_reduce bfloat16" in line]
    assert len(errors) == 1 and "needs CUDA" in errors[0], result.stderr[-3000:]  # one rank speaks
