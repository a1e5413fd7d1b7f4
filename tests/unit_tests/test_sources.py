"""Text sources: files, folders and globs; registry; optional Parquet / HF; bad lines; finite data."""

import json
import sys
import types

import pytest

from tests.unit_tests.test_text_dataset import CharTokenizer
from torchtitan.datasets.chunks import ShardItems, plan_shard
from torchtitan.datasets.sources import BadLineCounter, ByteCount, DatasetError, read_documents, read_jsonl, resolve_source
from torchtitan.datasets.text_dataset import PackedTextDataset


def _jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def test_folder_and_glob_read_supported_files_in_sorted_order(tmp_path):
    _jsonl(tmp_path / "b.jsonl", ["b1", "b2"])
    (tmp_path / "a.txt").write_text("whole file is one document\nwith two lines")
    (tmp_path / "sub").mkdir()
    _jsonl(tmp_path / "sub" / "c.jsonl", ["c1"])
    (tmp_path / "notes.md").write_text("ignored")
    docs = list(read_documents(resolve_source("ignored", str(tmp_path))))
    assert docs == ["whole file is one document\nwith two lines", "b1", "b2", "c1"]
    assert list(read_documents(resolve_source("", str(tmp_path / "*.jsonl")))) == ["b1", "b2"]


def test_missing_and_unmatched_locations(tmp_path):
    with pytest.raises(DatasetError, match="dataset file not found: .*nope"):
        resolve_source("", str(tmp_path / "nope"))
    (tmp_path / "readme.md").write_text("x")
    with pytest.raises(DatasetError, match=r"no \.jsonl, \.txt, \.parquet, \.jsonl\.gz, \.json\.gz files in"):
        resolve_source("", str(tmp_path))
    with pytest.raises(DatasetError, match="no .* files in .*\\*.jsonl"):
        resolve_source("", str(tmp_path / "*.jsonl"))


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(DatasetError, match="unknown training.dataset 'c5'; known: c4, reverse_words, stdlib_docs"):
        resolve_source("c5", "")


def test_optional_backends_missing_give_install_hints(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    with pytest.raises(DatasetError, match="needs the optional `datasets` package"):
        list(read_documents(resolve_source("c4", "")))
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    (tmp_path / "data.parquet").write_bytes(b"PAR1")
    with pytest.raises(DatasetError, match="needs pyarrow.*pip install pyarrow"):
        list(read_documents(resolve_source("", str(tmp_path / "data.parquet"))))


def test_a_hub_stream_that_breaks_off_is_one_line(monkeypatch):
    """The network gone mid-stream (a stand-in for `datasets`, which CI does not install): the line
    names the dataset (the trainer's stream reader: test_streams.py)."""

    def load_dataset(path, name, split, streaming):
        assert (path, name, split, streaming) == ("allenai/c4", "en", "train", True)
        yield {"text": "first document"}
        raise ConnectionError("Couldn't reach 'allenai/c4' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    expected = ("cannot stream allenai/c4 from the Hugging Face hub (offline?): Couldn't reach 'allenai/c4' on the Hub "
                "(LocalEntryNotFoundError)")
    documents = read_documents(resolve_source("c4", ""))
    assert next(documents) == "first document"
    with pytest.raises(DatasetError) as e:
        next(documents)
    assert str(e.value) == expected


@pytest.mark.parametrize(
    "content,why",
    [
        (b'{"text": "ok"}\n{"text": "broken\n', "not a JSON object"),
        (b'{"text": "ok"}\n{"txt": "wrong key"}\n', "not a JSON object with a 'text' field"),
        (b'{"text": "ok"}\n{"text": 7}\n', "'text' holds int '7'"),
        (b'{"text": "ok"}\n{"text": "caf\xe9"}\n', "invalid UTF-8"),
    ],
)
def test_bad_jsonl_line_is_named_or_skipped(tmp_path, content, why):
    path = tmp_path / "d.jsonl"
    path.write_bytes(content + b'{"text": "after"}\n')
    with pytest.raises(DatasetError, match=f"d.jsonl:2: {why}"):
        list(read_documents(path))
    counter = BadLineCounter(skip_bad_lines=True)
    assert list(read_documents(path, counter)) == ["ok", "after"]
    assert counter.skipped == 1


def test_non_utf8_text_file(tmp_path):
    path = tmp_path / "d.txt"
    path.write_bytes(b"good start \xff\xfe end")
    with pytest.raises(DatasetError, match="d.txt: invalid UTF-8 at byte 11"):
        list(read_documents(path))
    counter = BadLineCounter(skip_bad_lines=True)
    assert list(read_documents(path, counter)) == ["good start \ufffd\ufffd end"]


def test_empty_source_is_reported(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    dataset = iter(PackedTextDataset(path, CharTokenizer(), 8, 2, [0], 1))
    with pytest.raises(DatasetError, match="empty.jsonl has no documents for data shard 0 of 1"):
        next(dataset)


def test_finite_mode_stops_after_the_last_full_batch(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", ["abcdefghij" * 3, "klmnop" * 4])  # 30+2 and 24+2 tokens
    batches = list(PackedTextDataset(path, CharTokenizer(), 8, 2, [0], 1, infinite=False))
    # 58 tokens give 7 windows of 9 tokens at stride 8 (the 7th ends at token 57), i.e. 3 full batches of 2.
    assert len(batches) == 3
    infinite = iter(PackedTextDataset(path, CharTokenizer(), 8, 2, [0], 1))
    assert len([next(infinite) for _ in range(10)]) == 10  # loops into further epochs


def _mixed_folder(tmp_path):
    """Sorted: a.txt (1 doc), b.jsonl (blank and bad lines among 6 docs), c.jsonl (3 docs)."""
    (tmp_path / "a.txt").write_text("the whole file")
    (tmp_path / "b.jsonl").write_bytes(b'{"text": "b0"}\n\n{"text": "b1"}\n{bad\n{"text": "b2"}\n{"text": "b3"}\n'
                                       b'{"text": "b4"}\n{"text": "b5"}\n')
    _jsonl(tmp_path / "c.jsonl", ["c0", "c1", "c2"])
    return resolve_source("", str(tmp_path))


def test_byte_ranges_that_tile_a_file_give_each_line_once(tmp_path):
    """Whatever the cut points (inside a line, on a newline, on a line's first byte), the lines
    starting in each range are read by that range alone."""
    path = _jsonl(tmp_path / "d.jsonl", [f"line {i} " + "x" * (i * 7 % 23) for i in range(40)])
    size = path.stat().st_size
    full = list(read_jsonl(path, 0, size, BadLineCounter()))
    assert [t for t, _ in full] == [f"line {i} " + "x" * (i * 7 % 23) for i in range(40)]
    for step in (1, 7, 31, 64, 1000):
        cuts = list(range(0, size, step)) + [size]
        got, read = [], ByteCount()
        for a, b in zip(cuts, cuts[1:]):
            got += list(read_jsonl(path, a, b, BadLineCounter(), read))
        assert got == full
        assert read.bytes >= size


def test_folders_mix_formats_in_shard_plans(tmp_path):
    files = _mixed_folder(tmp_path)
    counter = BadLineCounter(skip_bad_lines=True)
    every = [d for d in read_documents(files, counter)]
    assert every == ["the whole file", "b0", "b1", "b2", "b3", "b4", "b5", "c0", "c1", "c2"]
    for num_shards in (1, 2, 3, 5):
        docs = []
        for shard in range(num_shards):
            items = ShardItems(files, shard, num_shards, CharTokenizer(), infinite=False, skip_bad_lines=True)
            for item in items.items():
                docs.append(CharTokenizer().decode(item["tokens"].tolist()))
        assert "".join(docs) == "".join(every), num_shards


def test_parquet_is_split_by_row_group(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    texts = [f"row {i} " + "y" * (i % 11) for i in range(100)]
    pq.write_table(pa.table({"text": texts, "id": list(range(100))}), tmp_path / "d.parquet", row_group_size=10)
    files = resolve_source("", str(tmp_path / "d.parquet"))
    assert list(read_documents(files)) == texts
    seen = []
    for shard in range(4):
        plan = plan_shard(files, shard, 4)
        assert all(c.end == c.begin + 1 for c in plan if c.file >= 0)  # whole row groups
        items = ShardItems(files, shard, 4, CharTokenizer(), infinite=False)
        seen += [CharTokenizer().decode(i["tokens"].tolist()) for i in items.items()]
    assert "".join(seen) == "".join(texts)
    pq.write_table(pa.table({"text": list(range(5))}), tmp_path / "ints.parquet")
    with pytest.raises(DatasetError, match="the 'text' column holds int64, not strings"):
        list(read_documents(resolve_source("", str(tmp_path / "ints.parquet"))))
    pq.write_table(pa.table({"body": ["a"], "id": [1]}), tmp_path / "body.parquet")
    with pytest.raises(DatasetError) as e:
        list(read_documents(resolve_source("", str(tmp_path / "body.parquet"))))
    assert str(e.value) == f"{tmp_path / 'body.parquet'} has no 'text' column (columns: body, id)"
    (tmp_path / "text.parquet").write_text("a text file named .parquet\n")
    with pytest.raises(DatasetError) as e:
        list(read_documents(resolve_source("", str(tmp_path / "text.parquet"))))
    assert str(e.value).startswith(f"{tmp_path / 'text.parquet'} is not a readable Parquet file: ")
    assert "\n" not in str(e.value)
