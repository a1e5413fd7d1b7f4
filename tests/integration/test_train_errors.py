"""User mistakes found at start-up end the run with one line on stderr and exit code 2."""

import pytest

from tests.helpers import TINY_RUN, run_train

CASES = {
    "missing tokenizer": (["--model.tokenizer_path", "no/such/tokenizer.model"], "tokenizer file not found: no/such/tokenizer.model"),
    "empty tokenizer": (["--model.tokenizer_path", "{empty}"], "tokenizer file is empty"),
    "corrupt tokenizer": (["--model.tokenizer_path", "{garbage}"], "is not a valid sentencepiece model"),
    "unknown model": (["--model.name", "gpt5"], "unknown model.name 'gpt5'; registered: deepseek_v3, gpt_oss, llama2, llama3, qwen3"),
    "unknown flavor": (["--model.flavor", "5B"], "unknown model.flavor '5B' for model 'llama3'"),
    "unknown dataset": (["--training.dataset", "c4_nope"], "unknown training.dataset 'c4_nope'; known: c4, reverse_words, stdlib_docs"),
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


def test_error_found_on_the_ranks_is_one_line(tmp_path):
    """A layout problem every rank finds (the device) is said once, not once per rank."""
    args = ["--training.data_parallel_replicate_degree", "2", "--training.mixed_precision_reduce", "bfloat16"]
    result = run_train([*TINY_RUN, "--job.dump_folder", str(tmp_path), *args], nproc=2, check=False)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: training.mixed_precision_reduce bfloat16"), result.stderr[-3000:]
    assert "needs CUDA" in lines[0]


@pytest.mark.fast
def test_error_found_only_on_rank_one_reaches_the_console(tmp_path):
    """One long document: rank 0's shard trains, rank 1's is empty. The one line comes from rank 1
    (before, only rank 0 printed errors and this run ended with exit code 1 and no word)."""
    data = tmp_path / "docs.jsonl"
    data.write_text('{"text": "%s"}\n' % ("a long single document " * 400))
    result = run_train([*TINY_RUN, "--job.dump_folder", str(tmp_path), "--training.dataset_path", str(data)],
                       nproc=2, check=False)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "no documents for data shard 1 of 2" in lines[0], \
        result.stderr[-3000:]
    assert "Traceback" not in result.stdout + result.stderr


@pytest.mark.fast
def test_a_bug_on_one_rank_is_one_traceback(tmp_path, monkeypatch):
    """Not a user error: the launcher prints the failing rank's traceback once, naming the rank."""
    result = run_train([*TINY_RUN, "--job.dump_folder", str(tmp_path), "--experimental.custom_import",
                        "tests.faults.crash_on_rank_one"], nproc=2, check=False)
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stderr.count("Traceback") == 1, result.stderr[-3000:]
    assert "rank 1 failed with an unexpected error (a bug)" in result.stderr
    assert "RuntimeError: deliberate failure on rank 1" in result.stderr
