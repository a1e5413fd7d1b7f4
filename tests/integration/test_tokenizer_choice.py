"""The default job trains with the bundled tiktoken tokenizer and, with one override, sentencepiece."""

import pytest

from tests.helpers import TINY_RUN, losses, read_setup, run_train


@pytest.mark.parametrize("tokenizer", ["tokenizer.model", "sentencepiece.model"])
def test_trains_with_each_bundled_tokenizer(tmp_path, tokenizer):
    run_train([*TINY_RUN, "--training.steps", "5", "--job.dump_folder", str(tmp_path),
               "--model.tokenizer_path", f"bundled:stdlib_docs/{tokenizer}"])
    assert read_setup(tmp_path)["model"]["vocab_size"] == 2256
    values = losses(tmp_path)
    assert len(values) == 5 and values[-1] < values[0]
