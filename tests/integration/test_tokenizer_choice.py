"""The default job trains with the bundled tiktoken tokenizer and, with one override, sentencepiece."""

import pytest

from tests.helpers import TINY_RUN, losses, run_train


@pytest.mark.parametrize("tokenizer", ["tokenizer.model", "sentencepiece.model"])
def test_trains_with_each_bundled_tokenizer(tmp_path, tokenizer):
    result = run_train([*TINY_RUN, "--training.steps", "5", "--job.dump_folder", str(tmp_path),
                        "--model.tokenizer_path", f"tests/assets/stdlib_docs/{tokenizer}"])
    assert "vocab 2256" in result.stdout
    values = losses(tmp_path)
    assert len(values) == 5 and values[-1] < values[0]
