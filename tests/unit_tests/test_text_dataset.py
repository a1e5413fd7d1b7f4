"""Packing, data-shard assignment (byte ranges), workers, resumable position, held-out split."""

import json
import logging

import pytest
import torch

from torchtitan.datasets import chunks
from torchtitan.datasets.chunks import Split, document_key
from torchtitan.datasets.sources import DatasetError, read_documents
from torchtitan.datasets.text_dataset import PackedTextDataset


class CharTokenizer:
    """One token per character (ord), BOS 1 / EOS 2: makes packed windows easy to check."""

    bos_id, eos_id, pad_id, n_words = 1, 2, -1, 256

    def encode(self, text, bos, eos):
        return ([1] if bos else []) + [ord(c) for c in text] + ([2] if eos else [])

    def decode(self, ids):
        return "".join(chr(i) for i in ids if i > 2)


def _corpus(tmp_path, docs, name="docs.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


def _line_starts(path):
    data, starts, at = path.read_bytes(), [], 0
    for line in data.splitlines(True):
        starts.append(at)
        at += len(line)
    return starts, len(data)


def _stream(path, shards, num_shards):
    """Each shard's token stream as packing should see it: a document belongs to the shard whose
    byte range [s * size // S, (s + 1) * size // S) holds the first byte of its line."""
    tok = CharTokenizer()
    starts, size = _line_starts(path)
    docs = list(read_documents(path))
    owner = [next(s for s in range(num_shards) if s * size // num_shards <= b < (s + 1) * size // num_shards)
             for b in starts]
    return {s: [t for d, o in zip(docs, owner) if o == s for t in tok.encode(d, True, True)] for s in shards}


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 64 bytes, so that small files have many (lines cross chunk boundaries)."""
    monkeypatch.setattr(chunks, "CHUNK_BYTES", 64)


def test_windows_are_shifted_stream_slices_without_padding(tmp_path):
    docs = ["hello world", "a much longer document that spans several windows", "x", "tail text"]
    path = _corpus(tmp_path, docs)
    seq_len = 8
    ds = iter(PackedTextDataset(path, CharTokenizer(), seq_len, batch_size=2, shards=[0], num_shards=1))
    stream = _stream(path, [0], 1)[0]
    rows = []
    for _ in range(4):
        inputs, labels = next(ds)
        assert inputs.shape == labels.shape == (2, seq_len) and inputs.dtype == torch.long
        assert (inputs[:, 1:] == labels[:, :-1]).all()  # labels are inputs shifted by one
        rows += [row + [label[-1]] for row, label in zip(inputs.tolist(), labels.tolist())]
    # Windows of seq_len+1 tokens with stride seq_len: every token after the first is a label once.
    for k, row in enumerate(rows):
        assert row == stream[k * seq_len : k * seq_len + seq_len + 1]


@pytest.mark.parametrize("num_shards", [1, 2, 3, 4])
def test_shards_are_byte_ranges_that_cover_every_document_once(tmp_path, small_chunks, num_shards):
    docs = [f"document number {i} " * (1 + i % 5) for i in range(40)]
    path = _corpus(tmp_path, docs)
    expected = _stream(path, range(num_shards), num_shards)
    assert sum(len(v) for v in expected.values()) == sum(len(d) + 2 for d in docs)
    for shard in range(num_shards):
        stream = expected[shard]
        # finite, one row per batch, window = the whole stream minus one token at most
        ds = PackedTextDataset(path, CharTokenizer(), len(stream) - 1, 1, [shard], num_shards, infinite=False)
        (inputs, labels), = list(ds)
        assert inputs[0].tolist() + [labels[0, -1].item()] == stream


def test_each_shard_reads_about_its_share_of_the_bytes(tmp_path, small_chunks, monkeypatch):
    path = _corpus(tmp_path, [f"doc {i} " + "words " * (i % 13) for i in range(400)])
    size = path.stat().st_size
    for num_shards in (1, 2, 4, 8):
        read = 0
        for shard in range(num_shards):
            ds = PackedTextDataset(path, CharTokenizer(), 16, 1, [shard], num_shards, infinite=False)
            list(ds)
            read += ds.bytes_read()
        # 64-byte chunks: each reads the rest of its last line, which the next chunk reads again to
        # skip it (lines are about 40 bytes): bounded, whatever the shard count.
        assert size <= read < 3 * size, (num_shards, read / size)
    # With the real chunk size the overlap is a line per MiB.
    monkeypatch.setattr(chunks, "CHUNK_BYTES", 1 << 20)
    ds = PackedTextDataset(path, CharTokenizer(), 16, 1, [1], 4, infinite=False)
    list(ds)
    assert size / 4 * 0.9 < ds.bytes_read() < size / 4 * 1.2


def test_global_batch_independent_of_rank_count(tmp_path, small_chunks):
    """One reader of shards [0, 1] gives exactly the rows of two readers of one shard each."""
    path = _corpus(tmp_path, [f"doc {i} " + "words " * i for i in range(20)])
    one = iter(PackedTextDataset(path, CharTokenizer(), 16, batch_size=4, shards=[0, 1], num_shards=2))
    r0 = iter(PackedTextDataset(path, CharTokenizer(), 16, batch_size=2, shards=[0], num_shards=2))
    r1 = iter(PackedTextDataset(path, CharTokenizer(), 16, batch_size=2, shards=[1], num_shards=2))
    for _ in range(30):  # several epochs
        (a, _), (b, _), (c, _) = next(one), next(r0), next(r1)
        assert a.tolist() == b.tolist() + c.tolist()


@pytest.mark.parametrize("workers", [(0, 0), (2, 2), (2, 0), (0, 3)])
def test_state_dict_resumes_the_exact_stream(tmp_path, small_chunks, workers):
    """Also across worker counts: (saving run's workers, resumed run's workers)."""
    path = _corpus(tmp_path, [f"doc {i} " + "text " * (i % 7) for i in range(30)])

    def make(num_workers):
        return PackedTextDataset(path, CharTokenizer(), 12, batch_size=2, shards=[0, 1], num_shards=3,
                                 num_workers=num_workers)

    reference = iter(make(0))
    expected = [next(reference)[0].tolist() for _ in range(25)]  # wraps into further epochs
    first = make(workers[0])
    it = iter(first)
    got = [next(it)[0].tolist() for _ in range(9)]
    assert got == expected[:9]  # workers deliver the same stream
    state = json.loads(json.dumps(first.state_dict()))  # survives serialisation
    resumed = make(workers[1])
    resumed.load_state_dict(state)
    it = iter(resumed)
    got += [next(it)[0].tolist() for _ in range(16)]
    assert got == expected


def test_resume_does_not_read_the_consumed_chunks(tmp_path, small_chunks):
    """A resumed dataset starts at the chunk its buffer started with: garbling every byte before
    that chunk changes nothing."""
    path = _corpus(tmp_path, [f"doc {i} " + "text " * (i % 7) for i in range(60)])

    def make():
        return PackedTextDataset(path, CharTokenizer(), 12, batch_size=2, shards=[0], num_shards=1)

    first = make()
    it = iter(first)
    for _ in range(20):
        next(it)
    state = json.loads(json.dumps(first.state_dict()))
    expected = [next(it)[0].tolist() for _ in range(6)]
    item = state["shard_0"]["source_0"]["item"]
    assert item > 2
    begin = chunks.plan_shard([path], 0, 1)[item].begin
    data = path.read_bytes()
    cut = data.rindex(b"\n", 0, begin - 1) + 1  # the line holding byte begin - 1 is skipped, not parsed
    path.write_bytes(b"".join(b"#" * (len(line) - 1) + b"\n" for line in data[:cut].splitlines(True)) + data[cut:])
    resumed = make()
    resumed.load_state_dict(state)
    it = iter(resumed)
    assert [next(it)[0].tolist() for _ in range(6)] == expected
    with pytest.raises(DatasetError, match="docs.jsonl:1: not a JSON object"):
        next(iter(make()))


def test_an_error_in_a_worker_is_one_line_in_the_trainer(tmp_path, small_chunks):
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps({"text": f"fine {i} " * 5}) + "\n" for i in range(30)) + "{not json\n")
    ds = PackedTextDataset(path, CharTokenizer(), 8, batch_size=1, shards=[0], num_shards=1, num_workers=2,
                           infinite=False)
    with pytest.raises(DatasetError, match=r"^\S*bad.jsonl:31: not a JSON object with a 'text' field \(set "
                                           r"training.dataset_skip_bad_lines to skip such lines\)$"):
        list(ds)


def test_bad_inputs(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{not json\n')
    with pytest.raises(DatasetError, match="bad.jsonl:2"):
        list(read_documents(bad))
    path = _corpus(tmp_path, ["only one document"])
    with pytest.raises(DatasetError, match="divisible"):
        PackedTextDataset(path, CharTokenizer(), 8, batch_size=3, shards=[0, 1], num_shards=2)
    empty_shard = iter(PackedTextDataset(path, CharTokenizer(), 8, batch_size=1, shards=[1], num_shards=2))
    with pytest.raises(DatasetError, match="no documents for data shard 1 of 2"):
        next(empty_shard)


@pytest.mark.parametrize("infinite", [True, False])
def test_a_shard_smaller_than_its_share_of_one_batch_is_refused(tmp_path, infinite):
    """Instead of looping over epochs to fill one batch (thousands of "starting epoch" lines), or
    ending a finite run before its first step, the data is refused with the numbers."""
    path = _corpus(tmp_path, ["a short document", "another one"])
    tokens = len(_stream(path, [0], 1)[0])
    ds = PackedTextDataset(path, CharTokenizer(), tokens, batch_size=1, shards=[0], num_shards=1, infinite=infinite)
    with pytest.raises(DatasetError, match=rf"gives data shard 0 of 1 only {tokens} tokens, .*one batch \({tokens + 1}\)"):
        next(iter(ds))
    # One token fewer per window fits: the same data trains.
    fits = PackedTextDataset(path, CharTokenizer(), tokens - 1, batch_size=1, shards=[0], num_shards=1, infinite=infinite)
    assert next(iter(fits))[0].shape == (1, tokens - 1)


@pytest.mark.parametrize("rows", [1, 2, 3, 5])
def test_a_finite_source_ends_cleanly_whatever_the_batch(tmp_path, small_chunks, rows):
    """The data running out in the middle of a batch ends the stream: it is not taken for data too
    small to train on (the end is met once, not again for each row still missing)."""
    path = _corpus(tmp_path, [f"document {i} " * 5 for i in range(20)])
    stream = _stream(path, [0], 1)[0]
    ds = PackedTextDataset(path, CharTokenizer(), 16, batch_size=rows, shards=[0], num_shards=1, infinite=False)
    batches = list(ds)
    windows = (len(stream) - 1) // 16
    assert len(batches) == windows // rows > 0
    assert [t for inputs, _ in batches for row in inputs.tolist() for t in row] == stream[: 16 * rows * len(batches)]


# ----------------------------------------------------------------------------- validation's held-out split


def test_held_out_documents_are_disjoint_from_training_and_spread_over_the_source():
    train, held = Split(0.1, validation=False), Split(0.1, validation=True)
    keys = [document_key(f, 57 * i) for f in range(4) for i in range(5000)]  # lines of ~57 bytes in 4 files
    held_out = [k for k in keys if held.reads(k)]
    assert all(train.reads(k) != held.reads(k) for k in keys)
    assert abs(len(held_out) / len(keys) - 0.1) < 0.01
    for part in range(10):  # every tenth of the source holds a share near the fraction
        piece = keys[part * 2000:(part + 1) * 2000]
        assert abs(sum(held.reads(k) for k in piece) / 2000 - 0.1) < 0.03
    assert all(Split(1.0, validation=True).reads(k) for k in keys)


def test_validation_batches_are_the_held_out_documents_read_once(tmp_path, caplog):
    docs = [f"document number {i} " * 3 for i in range(200)]
    path = _corpus(tmp_path, docs)
    held = Split(0.2, validation=True)
    starts, _ = _line_starts(path)
    kept = [held.reads(document_key(0, s)) for s in starts]
    expected = [t for d, k in zip(docs, kept) if k for t in CharTokenizer().encode(d, True, True)]
    ds = PackedTextDataset(path, CharTokenizer(), 16, batch_size=1, shards=[0], num_shards=1, infinite=False,
                           split=held)
    with caplog.at_level(logging.INFO):
        batches = list(ds)  # finite: no second epoch
    # Reaching the end is how a validation of all the held-out data ends: said so, not as "data exhausted".
    assert [r.getMessage() for r in caplog.records] == [
        f"validation read all of the held-out split of {path} (validation.held_out_fraction 0.2): every full batch it "
        "holds (the tokens after the last one make no batch)"]
    assert 20 < sum(kept) < 60
    assert len(batches) == (len(expected) - 1) // 16
    assert [t for inputs, _ in batches for t in inputs[0].tolist()] == expected[: 16 * len(batches)]
    # Training reads the other documents (its inputs, joined, are its token stream), none of these.
    train_text = "".join(CharTokenizer().decode(inputs[0].tolist()) for inputs, _ in
                         PackedTextDataset(path, CharTokenizer(), 16, 1, [0], 1, False, split=Split(0.2, False)))
    assert not any(f"document number {i} document" in train_text for i in range(200) if kept[i])
    assert all(f"document number {i} document" in train_text for i in range(199) if not kept[i])


def test_an_empty_held_out_split_is_one_clear_line(tmp_path):
    path = _corpus(tmp_path, ["only one document"])
    held = Split(0.01, validation=True)
    assert not held.reads(document_key(0, 0))
    ds = PackedTextDataset(path, CharTokenizer(), 8, batch_size=1, shards=[0], num_shards=1, infinite=False, split=held)
    with pytest.raises(DatasetError, match=r"validation: the held-out split of .* \(validation.held_out_fraction "
                                           r"0.01\) has no documents for data shard 0 of 1 \(give more validation data"):
        list(ds)


def test_a_training_split_too_small_names_the_held_out_fraction(tmp_path):
    path = _corpus(tmp_path, [f"document {i} " * 5 for i in range(20)])
    ds = PackedTextDataset(path, CharTokenizer(), 16, batch_size=1, shards=[0], num_shards=1,
                           split=Split(0.999, validation=False))
    with pytest.raises(DatasetError, match=r"training skips the documents validation holds out "
                                           r"\(validation.held_out_fraction 0.999\)"):
        next(iter(ds))


def test_changed_files_are_named_when_resuming(tmp_path, caplog):
    path = _corpus(tmp_path, [f"doc {i} " + "text " * (i % 7) for i in range(30)])
    first = PackedTextDataset(path, CharTokenizer(), 12, batch_size=2, shards=[0], num_shards=1)
    it = iter(first)
    next(it)
    state = first.state_dict()
    with path.open("a") as f:  # a growing corpus: new documents appended
        f.write(json.dumps({"text": "appended later"}) + "\n")
    resumed = PackedTextDataset(path, CharTokenizer(), 12, batch_size=2, shards=[0], num_shards=1)
    with caplog.at_level("WARNING"):
        resumed.load_state_dict(state)
    assert "docs.jsonl changed since this data position was saved (data shard 0 of 1)" in caplog.text
    assert next(iter(resumed))[0].shape == (2, 12)


def test_a_changed_mixture_is_refused_when_resuming(tmp_path):
    from torchtitan.datasets.mixture import Mixture

    a, b = _corpus(tmp_path, ["a " * 50] * 20, "a.jsonl"), _corpus(tmp_path, ["b " * 50] * 20, "b.jsonl")
    saved = PackedTextDataset(Mixture(("a", "b"), ([a], [b]), (0.5, 0.5)), CharTokenizer(), 12, 2, [0], 1)
    other = PackedTextDataset(Mixture(("a", "b"), ([a], [b]), (0.9, 0.1)), CharTokenizer(), 12, 2, [0], 1)
    with pytest.raises(DatasetError, match=r"data position is for the sources 'a:0.5,b:0.5', but this run reads "
                                           r"'a:0.9,b:0.1' \(training.dataset_mix\)"):
        other.load_state_dict(saved.state_dict())


def test_workers_leave_stop_signals_to_the_training_process(tmp_path, small_chunks):
    """Ctrl-C reaches the whole process group (SLURM signals every process): the workers keep
    reading, so the training process can finish its agreed stop and save."""
    import os
    import signal
    import time

    path = _corpus(tmp_path, [f"doc {i} " + "text " * (i % 7) for i in range(60)])
    ds = PackedTextDataset(path, CharTokenizer(), 12, batch_size=2, shards=[0], num_shards=1, num_workers=2)
    it = iter(ds)
    got = [next(it)[0].tolist() for _ in range(5)]
    workers = ds.packers[0][0]._stream._workers
    assert len(workers) == 2
    for worker in workers:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
            os.kill(worker.pid, sig)
    time.sleep(0.5)
    assert all(w.is_alive() for w in workers)
    got += [next(it)[0].tolist() for _ in range(35)]
    reference = iter(PackedTextDataset(path, CharTokenizer(), 12, 2, [0], 1))
    assert got == [next(reference)[0].tolist() for _ in range(40)]


@pytest.mark.parametrize("workers", [0, 2])
def test_starting_a_loader_leaves_the_training_random_state_alone(tmp_path, small_chunks, workers):
    """The training and validation loaders' iterators draw their seed from a generator of their own,
    not torch's global one: a resumed run, which starts its loaders after the checkpoint restored
    the random state, then draws what the uninterrupted run draws (with dropout, say); validation
    starts its loader anew each time."""
    import types

    from torchdata.stateful_dataloader import StatefulDataLoader

    from torchtitan.config.manager import parse_args
    from torchtitan.datasets.text_dataset import build_text_dataloader, build_validation_dataloader

    path = _corpus(tmp_path, [f"document {i} " * 5 for i in range(200)])
    config = parse_args(["--training.dataset_path", str(path), "--training.seq_len", "16", "--training.batch_size", "2",
                         "--training.dataset_num_workers", str(workers), "--validation.enabled"])
    shards = types.SimpleNamespace(owned=[0], count=1)
    before = torch.random.get_rng_state()
    train = build_text_dataloader(config, CharTokenizer(), shards)
    validation = build_validation_dataloader(config, CharTokenizer(), shards)
    next(iter(train))
    for _ in range(2):  # validation reads its data from the start each time
        next(iter(validation))
    assert torch.equal(torch.random.get_rng_state(), before)
    # torch's default would have moved it: what the loaders avoid.
    next(iter(StatefulDataLoader(validation.dataset, batch_size=None, num_workers=0)))
    assert not torch.equal(torch.random.get_rng_state(), before)
