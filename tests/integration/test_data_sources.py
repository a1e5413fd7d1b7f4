"""Training on pre-tokenized shards and on mixtures, end to end through the trainer.

Pre-tokenized shards made by scripts/tokenize_dataset.py train bit-for-bit like the text they came
from (same token stream, same batches, no tokenizing); a shard folder made with another tokenizer
is refused in one line; a mixture logs each source's tokens over all data-parallel ranks; data whose
every label is masked trains with one warning.
"""

import hashlib
import json
import struct

import pytest

from tests.helpers import REPO_ROOT, TINY_RUN, losses, read_metrics, run_train
from torchtitan.datasets.tokenized import MANIFEST

STEPS = ["--training.steps", "3"]


@pytest.fixture(scope="module")
def token_shards(tmp_path_factory):
    """The bundled corpus, tokenized by the script on 2 workers into 3 parts."""
    from scripts.tokenize_dataset import main

    out = tmp_path_factory.mktemp("tokens")
    assert main(["--input", "stdlib_docs", "--out", str(out), "--workers", "2", "--parts", "3", "--quiet"]) == 0
    return out


@pytest.mark.fast
def test_token_shards_train_like_the_text_they_came_from(tmp_path, token_shards):
    manifest = json.loads((token_shards / MANIFEST).read_text())
    assert manifest["dtype"] == "uint16" and len(manifest["files"]) == 3 and manifest["num_documents"] == 2750
    # One data shard each: the same token stream, hence the same batches and losses.
    common = [*TINY_RUN, *STEPS, "--training.dataset_shards", "1"]
    run_train([*common, "--job.dump_folder", str(tmp_path / "text")])
    run_train([*common, "--job.dump_folder", str(tmp_path / "tokens"), "--training.dataset_path", str(token_shards)])
    assert losses(tmp_path / "tokens") == losses(tmp_path / "text")


def test_token_shards_of_another_tokenizer_are_refused(tmp_path, token_shards):
    result = run_train([*TINY_RUN, *STEPS, "--job.dump_folder", str(tmp_path), "--training.dataset_path",
                        str(token_shards), "--model.tokenizer_path", "bundled:stdlib_docs/sentencepiece.model"],
                       check=False)
    assert result.returncode == 2
    assert f"{token_shards} was tokenized with tokenizer.model (vocabulary 2256" in result.stdout + result.stderr
    assert "set model.tokenizer_path to the tokenizer that made the shards" in result.stdout + result.stderr


def test_a_mixture_logs_each_sources_tokens_over_all_ranks(tmp_path, token_shards):
    mix = f"stdlib_docs:0.75,{token_shards}:0.25"
    run_train([*TINY_RUN, *STEPS, "--job.dump_folder", str(tmp_path), "--training.dataset_mix", mix,
               "--training.data_parallel_shard_degree", "2", "--training.dataset_num_workers", "1"], nproc=2)
    records = read_metrics(tmp_path)
    last = records[-1]
    counts = {k.removeprefix("data_tokens/"): v for k, v in last.items() if k.startswith("data_tokens/")}
    assert set(counts) == {"stdlib_docs", str(token_shards)}
    # 3 steps x global batch 16 rows (8 per rank) x 64 tokens, shared by the two sources.
    assert sum(counts.values()) == 3 * 16 * 64
    assert counts["stdlib_docs"] > counts[str(token_shards)] > 0


def test_data_whose_every_label_is_masked_trains_with_one_warning_and_a_count(tmp_path):
    """End-of-text tokens only, under training.mask_loss_after_eos: no label carries a loss. The run says
    so once, at the first step line (read with it: no host read more per step), and counts the steps."""
    tokenizer = REPO_ROOT / "torchtitan" / "assets" / "stdlib_docs" / "tokenizer.model"
    shards = tmp_path / "tokens"
    shards.mkdir()
    eos, n = 2001, 2000  # the bundled tokenizer's end-of-text id; one document of it
    (shards / "p.bin").write_bytes(struct.pack(f"<{n}H", *[eos] * n))
    (shards / "p.idx").write_bytes(struct.pack("<2q", 0, n))
    (shards / MANIFEST).write_text(json.dumps({
        "format": "torchtitan-tokens", "version": 1, "dtype": "uint16", "vocab_size": 2256,
        "tokenizer": {"name": "tokenizer.model", "sha256": hashlib.sha256(tokenizer.read_bytes()).hexdigest()},
        "files": [{"tokens": "p.bin", "index": "p.idx", "num_tokens": n, "num_documents": 1}]}))
    result = run_train([*TINY_RUN, *STEPS, "--metrics.log_freq", "2", "--training.mask_loss_after_eos",
                        "--training.dataset_path", str(shards), "--job.dump_folder", str(tmp_path / "run")])
    warnings = [line for line in result.stdout.splitlines() if "had no label that carries a loss" in line]
    assert len(warnings) == 1 and "step 1 had no label that carries a loss, on any rank" in warnings[0], result.stdout[-3000:]
    assert "steps without a label that carries a loss: 3 of 3 (they trained nothing)" in result.stdout
    assert {r["loss"] for r in read_metrics(tmp_path / "run")} == {0.0}
