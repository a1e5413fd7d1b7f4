"""Tiktoken (Llama 3) and sentencepiece (Llama 2) tokenizers: ids, round trips, bad files."""

import base64

import pytest

from tests.helpers import REPO_ROOT
from torchtitan.config.manager import JobConfig
from torchtitan.datasets.tokenizer import (
    LLAMA3_SPECIAL_TOKENS,
    SentencePieceTokenizer,
    TikTokenizer,
    TokenizerError,
    build_tokenizer,
)

ASSETS = REPO_ROOT / "torchtitan" / "assets" / "stdlib_docs"
TEXT = "Return the naïve café's 東京 timestamp 🙂.\n\tdef f(x):\n        return x ** 2  # 12345"


def _tokenizer(path):
    config = JobConfig()
    config.model.tokenizer_path = str(path)
    return build_tokenizer(config)


def test_bundled_tiktoken_has_llama3_special_token_layout():
    tok = _tokenizer(ASSETS / "tokenizer.model")
    assert isinstance(tok, TikTokenizer)
    n_base = sum(1 for line in open(ASSETS / "tokenizer.model", "rb") if line.strip())
    assert tok.n_words == n_base + 256 == 2256
    # Same offsets as Meta's file, where n_base is 128,000.
    assert (tok.bos_id, tok.eos_id) == (n_base, n_base + 1)
    assert tok.special_tokens["<|start_header_id|>"] == n_base + 6
    assert tok.special_tokens["<|end_header_id|>"] == n_base + 7
    assert tok.special_tokens["<|eot_id|>"] == n_base + 9
    assert len(set(LLAMA3_SPECIAL_TOKENS)) == 256 and tok.pad_id == -1


def test_tiktoken_round_trip_and_bos_eos():
    tok = _tokenizer(ASSETS / "tokenizer.model")
    ids = tok.encode(TEXT, bos=True, eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert all(0 <= i < tok.n_words for i in ids)
    assert tok.decode(ids[1:-1]) == TEXT
    assert len(ids) < len(TEXT.encode()), "BPE should compress English below one token per byte"


def test_special_token_text_in_data_is_plain_text():
    tok = _tokenizer(ASSETS / "tokenizer.model")
    ids = tok.encode("a <|begin_of_text|> b <|eot_id|>", bos=False, eos=False)
    assert tok.bos_id not in ids and tok.special_tokens["<|eot_id|>"] not in ids
    assert tok.decode(ids) == "a <|begin_of_text|> b <|eot_id|>"


def test_very_long_runs_encode_and_round_trip():
    tok = _tokenizer(ASSETS / "tokenizer.model")
    text = "x" * 60_000 + " " * 30_000 + "end"
    assert tok.decode(tok.encode(text, bos=False, eos=False)) == text


def test_bundled_sentencepiece_round_trip():
    tok = _tokenizer(ASSETS / "sentencepiece.model")
    assert isinstance(tok, SentencePieceTokenizer)
    assert tok.n_words == 2256 and (tok.bos_id, tok.eos_id) == (1, 2)
    ids = tok.encode(TEXT, bos=True, eos=True)
    assert ids[0] == 1 and ids[-1] == 2
    # sentencepiece normalises whitespace runs; words and non-ASCII text survive.
    decoded = tok.decode(ids[1:-1])
    for word in ("naïve", "café's", "東京", "🙂", "timestamp", "12345"):
        assert word in decoded


def _rank_file(tmp_path, lines):
    path = tmp_path / "ranks.model"
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path


def test_tiktoken_file_of_single_bytes_is_a_byte_tokenizer(tmp_path):
    path = _rank_file(tmp_path, [base64.b64encode(bytes([i])) + b" %d" % i for i in range(256)])
    tok = _tokenizer(path)
    assert tok.n_words == 512 and tok.bos_id == 256
    assert tok.encode("hé", bos=False, eos=False) == list("hé".encode())


@pytest.mark.parametrize(
    "content,message",
    [
        (b"", "is empty"),
        (b"\n\n", "not a valid sentencepiece model"),  # not recognisable as a rank file either
        (b"QQ== 0\nQg== 2\n", "ranks must be 0..1"),
        (b"QQ== 0\nnot base64! 1\n", ":2: not a tiktoken rank line"),
        (b"this is not a protobuf" * 10, "not a valid sentencepiece model"),
    ],
)
def test_bad_tokenizer_files_name_the_path(tmp_path, content, message):
    path = tmp_path / "bad.model"
    path.write_bytes(content)
    with pytest.raises(TokenizerError, match=message) as raised:
        _tokenizer(path)
    assert str(path) in str(raised.value)


def test_a_rank_file_of_blank_lines_holds_no_tokens(tmp_path):
    """The TikTokenizer class itself refuses it (build_tokenizer takes such a file for sentencepiece,
    since its first line is no rank line)."""
    path = tmp_path / "blank.model"
    path.write_bytes(b"\n  \n\n")
    with pytest.raises(TokenizerError) as raised:
        TikTokenizer(str(path))
    assert str(raised.value) == f"tokenizer file {path} holds no tokens"


def test_missing_file():
    with pytest.raises(TokenizerError, match="not found: no/such.model"):
        _tokenizer("no/such.model")
