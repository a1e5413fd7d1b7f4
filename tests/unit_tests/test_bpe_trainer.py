"""Byte-level BPE training: hand-checked merges, tie-breaking, tiktoken compatibility, pre-token boundaries;
scripts/train_tiktoken_bpe.py's mistakes."""

import base64
import json
import random
import time
from pathlib import Path

import pytest
import regex
import tiktoken
from tiktoken.load import load_tiktoken_bpe

from scripts import train_tiktoken_bpe
from torchtitan.datasets.bpe_trainer import LLAMA3_PATTERN, pretokenize, save_tiktoken_ranks, train_bpe

PARAGRAPH = (
    "The river ran quietly past the old mill, and the miller watched the water turn the wheel. "
    "Every morning he walked along the bank, counting the herons that stood in the shallows. "
    "In the evening the light turned gold, and the children of the village came down to the water "
    "to throw stones and listen to the wheel turning slowly in the dark.\n"
)
CORPUS = Path(__file__).resolve().parents[2] / "torchtitan" / "assets" / "stdlib_docs" / "corpus.jsonl"
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>"]


@pytest.fixture(autouse=True)
def _no_tiktoken_cache(monkeypatch):
    """tiktoken caches even local files by path under /tmp; an empty cache dir makes it read the file."""
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")


def _encoding(path: Path) -> tiktoken.Encoding:
    """A Llama-3-style Encoding from a rank file, special tokens placed after the learned ranks."""
    ranks = load_tiktoken_bpe(str(path))
    specials = {s: len(ranks) + i for i, s in enumerate(SPECIALS)}
    return tiktoken.Encoding(name="test_bpe", pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens=specials)


def test_first_merges_match_hand_computation():
    # Pieces: "aaab" x1, " aaab" x2, " ab" x1.
    # Pair counts: (a,a) = 2 + 2*2 = 6, (a,b) = 1 + 2 + 1 = 4, (" ",a) = 3          -> merge "aa"
    # Then: (a,b) = 4, (aa,a) = 3, (" ",aa) = 2, (" ",a) = 1                          -> merge "ab"
    # Then words aa|ab, " "|aa|ab x2, " "|ab: (aa,ab) = 3, (" ",aa) = 2, (" ",ab) = 1  -> merge "aaab"
    # Then (" ",aaab) = 2, (" ",ab) = 1 -> merge " aaab"; only (" ",ab) = 1 is left, so training stops.
    text = "aaab aaab aaab ab"
    assert pretokenize(text) == ["aaab", " aaab", " aaab", " ab"]
    assert train_bpe([text], 258)[256:] == [b"aa", b"ab"]
    assert train_bpe([text], 1000)[256:] == [b"aa", b"ab", b"aaab", b" aaab"]


def test_ties_go_to_the_lexicographically_smallest_pair():
    # Each text is pre-tokenised on its own, so every "xy" / "ab" / "ac" below is a whole piece.
    # (x,y) and (a,b) tie at 3; the losing pair comes first in the input so input order cannot decide.
    assert train_bpe(["xy", "ab"] * 3, 258)[256:] == [b"ab", b"xy"]
    # Same left byte: the right byte decides.
    assert train_bpe(["ac", "ab"] * 2, 258)[256:] == [b"ab", b"ac"]
    # A higher count beats a smaller pair.
    assert train_bpe(["zz"] * 3 + ["ab"] * 2, 258)[256:] == [b"zz", b"ab"]


def test_training_is_deterministic_and_independent_of_document_order():
    docs = [PARAGRAPH[i : i + 37] for i in range(0, len(PARAGRAPH), 37)] * 5
    first = train_bpe(docs, 350)
    assert train_bpe(docs, 350) == first
    shuffled = docs[:]
    random.Random(0).shuffle(shuffled)
    assert train_bpe(shuffled, 350) == first
    assert len(first) == 350


def test_saved_file_loads_in_tiktoken_and_round_trips(tmp_path):
    path = tmp_path / "bpe.model"
    tokens = train_bpe([PARAGRAPH * 3, "naïve café 東京 🙂 " * 4], 500)
    save_tiktoken_ranks(tokens, path)
    raw = path.read_bytes()
    assert raw.endswith(b"\n")
    assert [int(line.split()[1]) for line in raw.splitlines()] == list(range(len(tokens)))
    ranks = load_tiktoken_bpe(str(path))
    assert sorted(ranks.values()) == list(range(len(tokens)))
    assert all(ranks[bytes([b])] == b for b in range(256))
    assert {tok: r for r, tok in enumerate(tokens)} == ranks
    enc = _encoding(path)
    samples = ["naïve café 東京 🙂", "line one\nline two\r\n\n\ttabbed   spaces  ", PARAGRAPH, ""]
    samples.append("\x00\xff€𝔘 'll 12345")  # control byte, Latin-1, euro sign, astral letter
    for text in samples:
        assert enc.decode(enc.encode(text)) == text
    # Bytes never seen in training still encode, one rank per byte.
    assert enc.decode_bytes(enc.encode("ǅ")) == "ǅ".encode()
    ids = enc.encode(SPECIALS[0] + "café", allowed_special="all")
    assert ids[0] == len(tokens) and enc.decode(ids) == SPECIALS[0] + "café"


def test_tiktoken_reproduces_the_learned_merges(tmp_path):
    path = tmp_path / "bpe.model"
    tokens = train_bpe(["aaab aaab aaab ab"], 1000)
    save_tiktoken_ranks(tokens, path)
    enc = _encoding(path)
    # Learned whole pieces encode as one token; " ab" stays two because " "+"ab" was never merged.
    assert enc.encode("aaab aaab ab") == [tokens.index(b"aaab"), tokens.index(b" aaab"), ord(" "), tokens.index(b"ab")]


def test_more_merges_compress_better(tmp_path):
    text = PARAGRAPH * 20
    counts = []
    # The paragraph has well under 200 distinct merges, so stay below that to keep every step growing.
    for vocab_size in (256, 280, 310, 350):
        path = tmp_path / f"bpe{vocab_size}.model"
        save_tiktoken_ranks(train_bpe([text], vocab_size), path)
        counts.append(len(_encoding(path).encode(text)))
    assert counts[0] == len(text.encode())  # bytes only: one token per byte
    assert counts[1] < counts[0]
    assert counts == sorted(counts, reverse=True) and len(set(counts)) == len(counts)
    assert counts[-1] < len(text.encode()) / 2


def test_llama3_pattern_splits_as_expected():
    assert regex.findall(LLAMA3_PATTERN, "x y x y") == ["x", " y", " x", " y"]
    assert regex.findall(LLAMA3_PATTERN, "I'm 1234567!") == ["I", "'m", " ", "123", "456", "7", "!"]
    assert regex.findall(LLAMA3_PATTERN, "a   b\n\nc") == ["a", "  ", " b", "\n\n", "c"]
    assert pretokenize("Don't STOP.") == regex.findall(LLAMA3_PATTERN, "Don't STOP.") == ["Don", "'t", " STOP", "."]


def test_merges_never_cross_pre_token_boundaries():
    text = "x y " * 300 + "1234567 " * 300
    tokens = train_bpe([text], 1000)
    learned = tokens[256:]
    assert b" y" in learned and b" x" in learned  # the space joins the following letter
    for forbidden in (b"x y", b"x ", b"y x", b"1234", b"4567"):
        assert forbidden not in learned
    pieces = {p.encode() for p in regex.findall(LLAMA3_PATTERN, text)}
    assert all(any(tok in piece for piece in pieces) for tok in learned)


def test_vocab_size_below_256_is_rejected():
    with pytest.raises(ValueError, match="256"):
        train_bpe(["hello"], 255)
    assert train_bpe(["hello hello"], 256) == [bytes([b]) for b in range(256)]


def test_save_rejects_duplicate_tokens(tmp_path):
    tokens = [bytes([b]) for b in range(256)] + [b"ab", b"ab"]
    with pytest.raises(ValueError, match="duplicate"):
        save_tiktoken_ranks(tokens, tmp_path / "dup.model")


def test_base64_lines_decode_to_tokens(tmp_path):
    path = tmp_path / "bpe.model"
    tokens = train_bpe(["hello world " * 10], 270)
    save_tiktoken_ranks(tokens, path)
    lines = path.read_text(encoding="ascii").splitlines()
    assert [base64.b64decode(line.split(" ")[0]) for line in lines] == tokens


def test_training_on_real_text_is_fast():
    # Guards the incremental bookkeeping: recounting all pairs per merge takes tens of seconds here.
    docs = [json.loads(line)["text"] for line in CORPUS.read_text(encoding="utf-8").splitlines()[:400]]
    start = time.perf_counter()
    tokens = train_bpe(docs, 1500)
    assert time.perf_counter() - start < 4.0
    assert len(tokens) == 1500


# ----------------------------------------------------------------------------- scripts/train_tiktoken_bpe.py


def _script_refuses(capsys, corpus, out, *more: str) -> str:
    """Runs the script; asserts exit 2, one `error:` line, and no rank file written. Returns the line."""
    code = train_tiktoken_bpe.main(["--corpus", str(corpus), "--out", str(out), "--vocab-size", "260", *more])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, captured.err)
    assert "Traceback" not in captured.err and captured.out == ""
    assert not Path(out).is_file()
    return lines[0]


def test_the_script_trains_and_writes_a_rank_file(tmp_path, capsys):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"text": "aaab aaab aaab ab"}) + "\n\n")  # a blank line is skipped
    assert train_tiktoken_bpe.main(["--corpus", str(corpus), "--out", str(tmp_path / "bpe.model"),
                                    "--vocab-size", "258"]) == 0
    assert "wrote 258 tokens (2 merges)" in capsys.readouterr().out
    assert len((tmp_path / "bpe.model").read_text().splitlines()) == 258


@pytest.mark.parametrize("content,expected", [
    (b'{"text": "fine"}\n{not json\n', ':2: not a JSON line (Expecting property name enclosed in double quotes)'),
    (b'{"text": "fine"}\n\n{"body": "no text"}\n', ':3: no string "text" field'),
    (b'["a list"]\n', ':1: no string "text" field'),
    (b'{"text": "fine"}\n{"text": "caf\xe9"}\n', ":2: not UTF-8 text (invalid continuation byte at byte 13)"),
])
def test_a_bad_corpus_line_is_named(tmp_path, capsys, content, expected):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_bytes(content)
    assert _script_refuses(capsys, corpus, tmp_path / "bpe.model") == f"error: {corpus}{expected}"


def test_a_missing_corpus_and_an_unwritable_out(tmp_path, capsys):
    assert _script_refuses(capsys, tmp_path / "none.jsonl", tmp_path / "bpe.model") == (
        f"error: cannot read --corpus {tmp_path / 'none.jsonl'}: No such file or directory")
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"text": "hello hello"}) + "\n")
    out = tmp_path / "no" / "such" / "bpe.model"
    assert _script_refuses(capsys, corpus, out) == f"error: cannot write --out {out}: No such file or directory"


def test_a_vocabulary_below_the_single_bytes_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        train_tiktoken_bpe.main(["--corpus", "c.jsonl", "--out", "o.model", "--vocab-size", "255"])
    assert e.value.code == 2
    assert "--vocab-size: must be a whole number >= 256 (the single bytes), got '255'" in capsys.readouterr().err

