"""Streams split by data shard (streams.py): gzip-compressed JSON lines and hub datasets (through a
stand-in for `datasets`, which CI does not install), workers, the saved position, epochs, splits."""

import gzip
import json
import logging
import random
import sys
import types

import pytest

from tests.unit_tests.test_text_dataset import CharTokenizer
from torchtitan.datasets import sources, streams
from torchtitan.datasets.chunks import ShardItems, Split
from torchtitan.datasets.pretokenize import source_bytes
from torchtitan.datasets.sources import DatasetError, GzipFiles, HFSource, resolve_source
from torchtitan.datasets.text_dataset import PackedTextDataset

pytestmark = pytest.mark.fast


def _gz(path, lines):
    with gzip.open(path, "wt") as f:
        f.write("".join(line if isinstance(line, str) else json.dumps(line) + "\n" for line in lines))
    return path


def _corpus(tmp_path, files=5):
    """`files` gzip files of 6 + 2f documents each (uneven); returns the source and every document."""
    folder = tmp_path / "c4"
    folder.mkdir()
    docs = []
    for f in range(files):
        texts = [f"file {f} doc {i} " + "w" * ((f * 7 + i) % 11) for i in range(6 + 2 * f)]
        _gz(folder / f"part-{f:02d}.json.gz", [{"text": t, "url": "u"} for t in texts])
        docs += texts
    return resolve_source("", str(folder)), docs


def _documents(tokens):
    """CharTokenizer's documents back from a token stream (each BOS ... EOS)."""
    text = "".join(chr(t) if t > 2 else "\0" for t in tokens)
    return [d for d in text.split("\0") if d]


@pytest.fixture
def small_items(monkeypatch):
    monkeypatch.setattr(streams, "ITEM_DOCUMENTS", 3)  # many items per file
    monkeypatch.setattr(streams, "_warned", set())  # each test sees its own warnings


@pytest.fixture
def opened(monkeypatch):
    """The (file name, first line) of every gzip file the readers open."""
    log, read = [], sources.read_gzip_lines

    def recording(path, skip, counted=None):
        log.append((path.name, skip))
        return read(path, skip, counted)

    monkeypatch.setattr(sources, "read_gzip_lines", recording)
    return log


def _epoch(source, shard, num_shards, split=None):
    """One epoch of a data shard: its documents and the bytes its items say they read."""
    items = list(ShardItems(source, shard, num_shards, CharTokenizer(), infinite=False, split=split).items())
    if "error" in items[-1]:
        raise DatasetError(items[-1]["error"])  # as the packer does
    assert items[-1]["last"]
    return _documents(t for i in items for t in i["tokens"].tolist()), sum(i["bytes"] for i in items)


def test_gzip_files_are_a_stream(tmp_path):
    source, docs = _corpus(tmp_path, files=2)
    assert isinstance(source, GzipFiles) and [p.name for p in source.files] == ["part-00.json.gz", "part-01.json.gz"]
    assert list(sources.read_documents(source)) == docs
    # bytes: the compressed bytes of the files, counted as the items read them (here in many reads)
    rng = random.Random(0)
    big = _gz(tmp_path / "big.jsonl.gz", [{"text": "".join(rng.choices("abcdefgh ", k=400))} for _ in range(1200)])
    items = list(ShardItems(resolve_source("", str(big)), 0, 1, CharTokenizer(), infinite=False).items())
    assert len(items) > 10 and sum(i["bytes"] for i in items) == big.stat().st_size > 150_000


@pytest.mark.parametrize("num_shards", [2, 3])
def test_each_data_shard_reads_only_its_files(tmp_path, small_items, opened, num_shards):
    source, _ = _corpus(tmp_path)
    for shard in range(num_shards):
        opened.clear()
        _, read = _epoch(source, shard, num_shards)
        mine = source.files[shard::num_shards]  # 5 files: uneven (3 + 2, or 2 + 2 + 1), each read once
        assert sorted(opened) == sorted((p.name, 0) for p in mine)
        assert read == sum(p.stat().st_size for p in mine)


@pytest.mark.parametrize("num_shards", [1, 2, 3, 5, 7])
def test_every_document_is_read_once_per_epoch(tmp_path, small_items, opened, caplog, num_shards):
    """7 data shards > 5 files: every shard reads the whole stream and keeps 1 document in 7, with
    one warning (for all shards)."""
    source, docs = _corpus(tmp_path)
    with caplog.at_level(logging.WARNING):
        got = [d for s in range(num_shards) for d in _epoch(source, s, num_shards)[0]]
    assert sorted(got) == sorted(docs)
    warnings = [r.message for r in caplog.records if "stream shard" in r.message]
    if num_shards > 5:
        assert len(warnings) == 1 and "each data shard reads the whole stream" in warnings[0]
        assert len(opened) == 5 * num_shards
    else:
        assert not warnings and len(opened) == 5


def _dataset(source, workers, shards=(0, 1), num_shards=2):
    return PackedTextDataset(source, CharTokenizer(), 10, batch_size=2 * len(shards), shards=list(shards),
                             num_shards=num_shards, num_workers=workers)


def _batches(dataset, n):
    it = iter(dataset)
    return [next(it)[0].tolist() for _ in range(n)]


def test_the_stream_is_the_same_for_any_worker_count(tmp_path, small_items):
    source, docs = _corpus(tmp_path)
    expected = _batches(_dataset(source, 0), 60)
    assert sum(len(d) + 2 for d in docs) < 60 * 2 * 10  # each shard's rows hold more than the whole corpus: epochs wrap
    assert _batches(_dataset(source, 2), 60) == expected


@pytest.mark.parametrize("workers", [(0, 0), (2, 2)])
def test_resume_mid_stream_is_bitwise_and_reads_no_earlier_file(tmp_path, small_items, opened, workers):
    """(saving run's workers, resumed run's workers). Files before the saved position are garbled
    (same size, not gzip): the resumed run never opens them."""
    source, _ = _corpus(tmp_path)
    expected = _batches(_dataset(source, 0, shards=[0]), 30)
    first = _dataset(source, workers[0], shards=[0])
    it = iter(first)
    got = [next(it)[0].tolist() for _ in range(12)]
    state = json.loads(json.dumps(first.state_dict()))
    epoch, file, line = state["shard_0"]["source_0"]["at"]
    assert (epoch, file) == (0, 2) and line > 0  # in the middle of the data shard's second file
    source.files[0].write_bytes(b"\0" * source.files[0].stat().st_size)
    opened.clear()
    resumed = _dataset(source, workers[1], shards=[0])
    resumed.load_state_dict(state)
    it = iter(resumed)
    got += [next(it)[0].tolist() for _ in range(4)]
    assert got == expected[:16]
    if workers[1] == 0:  # (workers open files in their own processes)
        assert opened[0] == ("part-02.json.gz", line)
    with pytest.raises(DatasetError, match="part-00.json.gz is not a readable gzip file"):
        next(it) and [next(it) for _ in range(30)]  # the next epoch starts at the garbled file


def test_epochs_repeat_and_the_held_out_split_divides_a_stream(tmp_path, small_items):
    source, docs = _corpus(tmp_path)
    training = [d for s in range(2) for d in _epoch(source, s, 2, Split(0.3, validation=False))[0]]
    held_out = [d for s in range(2) for d in _epoch(source, s, 2, Split(0.3, validation=True))[0]]
    assert sorted(training + held_out) == sorted(docs) and not set(training) & set(held_out)
    assert 0.1 < len(held_out) / len(docs) < 0.5
    items = ShardItems(source, 1, 2, CharTokenizer(), infinite=True).items()
    epochs: dict[int, list[int]] = {}
    for item in items:
        if item["epoch"] == 2:
            break
        epochs.setdefault(item["epoch"], []).extend(item["tokens"].tolist())
    assert epochs[0] == epochs[1] and len(epochs[0]) > 0


def test_bad_gzip_streams_are_one_line(tmp_path):
    (tmp_path / "a").mkdir()
    bad = tmp_path / "a" / "x.jsonl.gz"
    bad.write_bytes(b"not gzip\n")
    with pytest.raises(DatasetError, match=r"^\S*x.jsonl.gz is not a readable gzip file \(Not a gzipped file"):
        _epoch(resolve_source("", str(bad)), 0, 1)
    truncated = _gz(tmp_path / "a" / "y.jsonl.gz", [{"text": f"document {i} " * 50} for i in range(200)])
    truncated.write_bytes(truncated.read_bytes()[:300])
    items = list(ShardItems(resolve_source("", str(truncated)), 0, 1, CharTokenizer(), infinite=False).items())
    assert "error" in items[-1] and "y.jsonl.gz is not a readable gzip file (Compressed file ended" in items[-1]["error"]
    no_text = _gz(tmp_path / "b.jsonl.gz", [{"text": "fine"}, {"txt": "misnamed"}, {"text": "fine too"}])
    with pytest.raises(DatasetError, match=r"b.jsonl.gz:2: not a JSON object with a 'text' field \(set "
                                           r"training.dataset_skip_bad_lines to skip such lines\)$"):
        _epoch(resolve_source("", str(no_text)), 0, 1)
    items = ShardItems(resolve_source("", str(no_text)), 0, 1, CharTokenizer(), infinite=False, skip_bad_lines=True)
    assert _documents(t for i in items.items() for t in i["tokens"].tolist()) == ["fine", "fine too"]
    odd = tmp_path / "d.jsonl.gz"
    odd.write_bytes(gzip.compress(b'{"text": "ok"}\n\xff\xfe\n{"text": 5}\n\n'))
    items = ShardItems(resolve_source("", str(odd)), 0, 1, CharTokenizer(), infinite=False, skip_bad_lines=True)
    assert _documents(t for i in items.items() for t in i["tokens"].tolist()) == ["ok"]
    assert items.counter.skipped == 2  # invalid UTF-8, a number for text; the blank line is no document
    (tmp_path / "c.jsonl").write_text('{"text": "plain"}\n')
    with pytest.raises(DatasetError, match="holds both gzip-compressed streams .* give them as two sources"):
        resolve_source("", str(tmp_path / "*.jsonl*"))
    with pytest.raises(DatasetError, match="gunzip the files first"):
        source_bytes(resolve_source("", str(no_text)))


def test_a_position_without_a_stream_position_is_refused(tmp_path):
    source, _ = _corpus(tmp_path, files=2)
    dataset = _dataset(source, 0)
    state = dataset.state_dict()
    del state["shard_0"]["source_0"]["at"]
    with pytest.raises(DatasetError, match="has no stream position .* --checkpoint.exclude_from_loading dataloader"):
        _dataset(source, 0).load_state_dict(state)


class StandInHub:
    """Just the `datasets` API the hub stream calls: an iterable dataset of files (lists of rows)
    with n_shards, shard(num_shards, index) and skip(n); `log` records what is opened and read."""

    def __init__(self, files, log, skipped=0):
        self.files, self.log, self.skipped = files, log, skipped

    @property
    def n_shards(self):
        return len(self.files)

    def shard(self, num_shards, index):
        assert num_shards == len(self.files)
        return StandInHub([self.files[index]], self.log)

    def skip(self, n):
        return StandInHub(self.files, self.log, self.skipped + n)

    def __iter__(self):
        for rows in self.files:
            self.log.append((rows[0]["text"].split(" doc")[0], self.skipped))
            for row in rows[self.skipped:]:
                if row is None:
                    raise ConnectionError("Couldn't reach 'allenai/c4' on the Hub (LocalEntryNotFoundError)")
                yield row


def _hub(monkeypatch, files):
    log = []

    def load_dataset(path, name, split, streaming):
        assert (path, name, split, streaming) == ("allenai/c4", "en", "train", True)
        return StandInHub(files, log)

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    return resolve_source("c4", ""), log


def _hub_files(count):
    return [[{"text": f"file {f} doc {i} " + "h" * (i % 5)} for i in range(5 + f)] for f in range(count)]


def test_a_hub_dataset_is_split_by_its_files_like_local_streams(tmp_path, monkeypatch, small_items):
    files = _hub_files(5)
    source, log = _hub(monkeypatch, files)
    for shard in range(2):
        log.clear()
        docs, _ = _epoch(source, shard, 2)
        assert docs == [r["text"] for rows in files[shard::2] for r in rows]
        assert log == [(f"file {f}", 0) for f in range(shard, 5, 2)]
    # the same files as local gzip files give the same items
    folder = tmp_path / "local"
    folder.mkdir()
    for f, rows in enumerate(files):
        _gz(folder / f"{f}.jsonl.gz", rows)
    local = resolve_source("", str(folder))
    expected = _batches(_dataset(local, 0), 12)
    assert _batches(_dataset(source, 0), 12) == expected
    first = _dataset(source, 0)
    got = _batches(first, 5)
    state = first.state_dict()
    log.clear()
    resumed = _dataset(source, 0)
    resumed.load_state_dict(state)
    got += _batches(resumed, 7)
    assert got == expected
    at = state["shard_0"]["source_0"]["at"]
    assert log[0] == (f"file {at[1]}", at[2]) and at[1] > 0  # skip() into the saved file; none before it


def test_a_hub_dataset_with_fewer_files_than_shards_reads_one_document_in_s(monkeypatch, caplog, small_items):
    files = _hub_files(1)
    source, _ = _hub(monkeypatch, files)
    with caplog.at_level(logging.WARNING):
        got = [_epoch(source, s, 3)[0] for s in range(3)]
    assert got == [[r["text"] for r in files[0][s::3]] for s in range(3)]
    assert sum("each data shard reads the whole stream" in r.message for r in caplog.records) == 1


def test_hub_mistakes_are_one_line(monkeypatch):
    files = _hub_files(2)
    files[1][1] = {"content": "no text field"}
    source, _ = _hub(monkeypatch, files)
    with pytest.raises(DatasetError, match=r"^hub dataset allenai/c4, file 1, row 1: no string 'text' field \(set "):
        _epoch(source, 1, 2)
    files[1][1] = None  # the network gone mid-stream
    items = list(ShardItems(source, 1, 2, CharTokenizer(), infinite=False).items())
    assert items[-1] == {"k": 0, "error": "cannot stream allenai/c4 from the Hugging Face hub (offline?): Couldn't "
                                          "reach 'allenai/c4' on the Hub (LocalEntryNotFoundError)"}


def test_the_real_datasets_package_reads_local_files_like_the_gzip_stream(tmp_path, monkeypatch):
    """Only where `datasets` is installed (not in CI): a folder of .jsonl.gz files loaded by
    `datasets` as a hub dataset gives the items the gzip stream gives."""
    pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    source, _ = _corpus(tmp_path)
    hub = HFSource(str(source.files[0].parent))
    for shard in range(2):
        assert _epoch(hub, shard, 2)[0] == _epoch(source, shard, 2)[0]
    expected = _batches(_dataset(source, 0), 12)
    first = _dataset(hub, 2)
    got = _batches(first, 5)
    resumed = _dataset(hub, 0)
    resumed.load_state_dict(first.state_dict())
    assert got + _batches(resumed, 7) == expected
