"""Damaged token shards (issue 37): shards written by the project's own pretokenizer, then corrupted
the ways a disk, a copy or a hand edit does. Each is one DatasetError line naming the damaged file:
the index at open, a token id outside the vocabulary when its chunk is read (never an IndexError
from the embedding)."""

import json
import multiprocessing

import pytest
import torch

from tests.unit_tests.test_text_dataset import CharTokenizer, _corpus
from tests.unit_tests.test_tokenized_and_mixture import FileCharTokenizer, _docs
from torchtitan.datasets import pretokenize as pretokenize_module
from torchtitan.datasets.chunks import ShardItems, Split
from torchtitan.datasets.pretokenize import pretokenize
from torchtitan.datasets.sources import resolve_source
from torchtitan.datasets.text_dataset import PackedTextDataset
from torchtitan.datasets.tokenized import MANIFEST, TokenFileWriter
from torchtitan.errors import DatasetError


def _shards(tmp_path, n_words=256):
    out = tmp_path / f"tokens-{n_words}"
    pretokenize([_corpus(tmp_path, _docs())], FileCharTokenizer(tmp_path, n_words), out, workers=1, parts=2,
                progress=False)
    return out, json.loads((out / MANIFEST).read_text())["files"]


@pytest.fixture
def shards(tmp_path):
    return _shards(tmp_path)


def _one_line(error: pytest.ExceptionInfo, *parts: str) -> None:
    message = str(error.value)
    assert "\n" not in message
    for part in parts:
        assert part in message, message


def _poke(path, index: int, value: int, dtype: torch.dtype) -> None:
    """Writes `value` over element `index` of the file, as `dtype`."""
    data = bytearray(path.read_bytes())
    size = torch.empty(0, dtype=dtype).element_size()
    data[index * size:(index + 1) * size] = torch.tensor([value], dtype=dtype).view(torch.uint8).numpy().tobytes()
    path.write_bytes(bytes(data))


def _read_all(out, split=None):
    items = ShardItems(resolve_source("", str(out)), 0, 1, CharTokenizer(), infinite=False, split=split)
    for item in items.items():
        if "error" in item:
            raise DatasetError(item["error"])


def test_undamaged_shards_read_through(shards):
    out, _ = shards
    _read_all(out)
    _read_all(out, Split(0.3, validation=True))


def test_a_token_id_beyond_the_vocabulary_names_the_file_and_the_token(shards):
    out, files = shards
    part = out / files[0]["tokens"]
    _poke(part, 7, 300, torch.int16)  # vocabulary 256: ids 0..255
    resolve_source("", str(out))  # opening does not scan the tokens
    with pytest.raises(DatasetError) as e:
        _read_all(out)
    _one_line(e, f"{part}: token id 300 at token 7 is outside the vocabulary of 256 that manifest.json records")
    # What the trainer's dataset raises with its first batch, rather than an IndexError in the embedding.
    with pytest.raises(DatasetError, match="token id 300 at token 7"):
        next(iter(PackedTextDataset(resolve_source("", str(out)), CharTokenizer(), 16, 2, [0], 1)))


def test_the_damaged_token_is_placed_in_its_file_with_a_held_out_split(shards):
    out, files = shards
    starts = torch.frombuffer(bytearray((out / files[0]["index"]).read_bytes()), dtype=torch.int64).tolist()
    split = Split(0.5, validation=False)
    kept = next(d for d in range(1, len(starts) - 1) if split.reads((0 << 40) + d))  # a document training reads
    _poke(out / files[0]["tokens"], starts[kept] + 2, 256, torch.int16)
    with pytest.raises(DatasetError) as e:
        _read_all(out, split)
    _one_line(e, f"{out / files[0]['tokens']}: token id 256 at token {starts[kept] + 2} is outside")


def test_a_uint32_id_above_int32_is_named_as_written(tmp_path):
    out, files = _shards(tmp_path, n_words=70000)
    _poke(out / files[0]["tokens"], 3, -16, torch.int32)  # 0xFFFFFFF0
    with pytest.raises(DatasetError) as e:
        _read_all(out)
    _one_line(e, f"{out / files[0]['tokens']}: token id 4294967280 at token 3 is outside the vocabulary of 70000")


def test_shards_of_a_larger_vocabulary_than_the_models_are_refused_before_reading(tmp_path):
    # The model's vocabulary is the tokenizer's (preflight.build_model_args): ids up to 299 would
    # index past a 256-row embedding, so the tokenizer check refuses the shards at start-up.
    out, _ = _shards(tmp_path, n_words=300)
    with pytest.raises(DatasetError) as e:
        resolve_source("", str(out)).check_tokenizer(FileCharTokenizer(tmp_path, 256))
    _one_line(e, f"{out} was tokenized with chars-300.model (vocabulary 300", "(vocabulary 256")


def test_a_truncated_token_file_is_refused_at_open(shards):
    out, files = shards
    part = out / files[0]["tokens"]
    part.write_bytes(part.read_bytes()[:-3])
    with pytest.raises(DatasetError) as e:
        resolve_source("", str(out))
    _one_line(e, f"{part} holds {2 * files[0]['num_tokens'] - 3} bytes, but {out / MANIFEST} says "
                 f"{2 * files[0]['num_tokens']} (truncated or rewritten? tokenize the data again)")


def test_an_index_that_goes_back_is_refused_at_open(shards):
    out, files = shards
    index = out / files[1]["index"]
    starts = torch.frombuffer(bytearray(index.read_bytes()), dtype=torch.int64).tolist()
    _poke(index, 4, starts[2] - 1, torch.int64)
    with pytest.raises(DatasetError) as e:
        resolve_source("", str(out))
    _one_line(e, f"{index} is damaged: document 4 starts at token {starts[2] - 1}, before document 3 "
                 f"(token {starts[3]}); the starts must never decrease")


def test_an_index_past_the_end_is_refused_at_open(shards):
    out, files = shards
    index = out / files[0]["index"]
    n = files[0]["num_tokens"]
    _poke(index, files[0]["num_documents"], n + 5, torch.int64)  # the last entry: the part's token count
    with pytest.raises(DatasetError) as e:
        resolve_source("", str(out))
    _one_line(e, f"{index} is damaged: it ends at token {n + 5}, but {out / MANIFEST} says the part holds {n} tokens")
    # A document that starts past the end, inside the index, comes before a smaller last entry.
    _poke(index, files[0]["num_documents"], n, torch.int64)
    _poke(index, 2, n + 100, torch.int64)
    with pytest.raises(DatasetError) as e:
        resolve_source("", str(out))
    _one_line(e, f"{index} is damaged: document 3 starts at token", "before document 2")


def test_an_index_not_starting_at_zero_is_refused_at_open(shards):
    out, files = shards
    index = out / files[0]["index"]
    _poke(index, 0, 1, torch.int64)
    with pytest.raises(DatasetError) as e:
        resolve_source("", str(out))
    _one_line(e, f"{index} is damaged: the first document starts at token 1, not 0")


@pytest.mark.parametrize("change", [b"\0" * 8, b"\0" * 3])
def test_an_index_of_the_wrong_size_is_refused_at_open(shards, change):
    out, files = shards
    index = out / files[1]["index"]
    index.write_bytes(index.read_bytes() + change)
    expected = 8 * (files[1]["num_documents"] + 1)
    with pytest.raises(DatasetError) as e:
        resolve_source("", str(out))
    _one_line(e, f"{index} holds {expected + len(change)} bytes, but {out / MANIFEST} says {expected}")


def test_a_manifest_with_negative_counts_is_refused(shards):
    out, _ = shards
    manifest = json.loads((out / MANIFEST).read_text())
    manifest["files"][0]["num_documents"] = -1
    (out / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(DatasetError) as e:
        resolve_source("", str(out))
    _one_line(e, f"{out / MANIFEST}: part-00000.bin has", "-1 documents, which cannot be")


@pytest.mark.parametrize("change,message", [
    ({"dtype": "int8"}, "unknown token dtype 'int8' (uint16 or uint32)"),
    ({"vocab_size": 0}, "vocab_size 0 is not a vocabulary size (a damaged manifest? tokenize the data again)"),
])
def test_a_manifest_with_an_unknown_dtype_or_no_vocabulary_is_refused(shards, change, message):
    out, _ = shards
    manifest = json.loads((out / MANIFEST).read_text())
    (out / MANIFEST).write_text(json.dumps({**manifest, **change}))
    with pytest.raises(DatasetError) as e:
        resolve_source("", str(out))
    _one_line(e, f"{out / MANIFEST}: {message}")


# The two below run in this process what the pretokenizer's pool workers run: the pool ends its
# workers with SIGTERM, so what they execute is missing from the suite's coverage data.


def test_the_writer_refuses_an_id_outside_the_vocabulary(tmp_path):
    writer = TokenFileWriter(tmp_path, "part-00000", "uint16", 100)
    writer.add([0, 99])
    for ids, bad in (([5, 100, 7], 100), ([3, -1], -1)):
        with pytest.raises(DatasetError) as e:
            writer.add(ids)
        _one_line(e, f"the tokenizer gave token id {bad}, outside its vocabulary of 100")
    assert writer.close().num_documents == 1  # nothing of the refused documents was written


def test_a_bad_line_in_a_part_names_the_scripts_option(tmp_path, monkeypatch):
    corpus = _corpus(tmp_path, ["fine"])
    corpus.write_text(corpus.read_text() + "{not json\n")
    out = tmp_path / "tokens"
    out.mkdir()
    tokenizer = FileCharTokenizer(tmp_path)
    monkeypatch.setattr(pretokenize_module, "_job", {
        "source": [corpus], "parts": 1, "tokenizer": tokenizer, "skip_bad_lines": False, "out": out,
        "dtype": "uint16", "bytes": multiprocessing.Value("q", 0), "tokens": multiprocessing.Value("q", 0)})
    with pytest.raises(DatasetError) as e:
        pretokenize_module._tokenize_part(0)
    _one_line(e, f"{corpus}:2: not a JSON object with a 'text' field (set --skip-bad-lines to skip such lines)")


def test_a_tokenizer_that_gives_ids_beyond_its_vocabulary_writes_no_shards(tmp_path):
    out = tmp_path / "tokens"
    with pytest.raises(DatasetError) as e:  # CharTokenizer gives ord(c): 'd' is 100
        pretokenize([_corpus(tmp_path, _docs(3))], FileCharTokenizer(tmp_path, 100), out, workers=1, progress=False)
    _one_line(e, "the tokenizer gave token id 100, outside its vocabulary of 100")
    assert not (out / MANIFEST).exists()
