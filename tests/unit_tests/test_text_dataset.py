"""Packing, data-shard assignment and resumable position of the packed text dataset."""

import json

import pytest

from torchtitan.datasets.sources import DatasetError, read_documents
from torchtitan.datasets.text_dataset import PackedTextDataset


class CharTokenizer:
    """One token per character (ord), BOS 1 / EOS 2: makes packed windows easy to check."""

    bos_id, eos_id, pad_id, n_words = 1, 2, -1, 256

    def encode(self, text, bos, eos):
        return ([1] if bos else []) + [ord(c) for c in text] + ([2] if eos else [])

    def decode(self, ids):
        return "".join(chr(i) for i in ids if i > 2)


def _corpus(tmp_path, docs):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


def _stream(path, docs_shards, num_shards):
    """The concatenated token stream of the given shards' documents, as packing should see it."""
    tok = CharTokenizer()
    docs = list(read_documents(path))
    return {s: [t for i, d in enumerate(docs) if i % num_shards == s for t in tok.encode(d, True, True)] for s in docs_shards}


def test_windows_are_shifted_stream_slices_without_padding(tmp_path):
    docs = ["hello world", "a much longer document that spans several windows", "x", "tail text"]
    path = _corpus(tmp_path, docs)
    seq_len = 8
    ds = iter(PackedTextDataset(path, CharTokenizer(), seq_len, batch_size=2, shards=[0], num_shards=1))
    stream = _stream(path, [0], 1)[0]
    rows = []
    for _ in range(4):
        inputs, labels = next(ds)
        assert inputs.shape == labels.shape == (2, seq_len)
        assert (inputs[:, 1:] == labels[:, :-1]).all()  # labels are inputs shifted by one
        rows += [row + [label[-1]] for row, label in zip(inputs.tolist(), labels.tolist())]
    # Windows of seq_len+1 tokens with stride seq_len: every token after the first is a label once.
    for k, row in enumerate(rows):
        assert row == stream[k * seq_len : k * seq_len + seq_len + 1]


@pytest.mark.parametrize("num_ranks", [1, 2, 4])
def test_shards_are_disjoint_and_cover_all_documents(tmp_path, num_ranks):
    docs = [f"document number {i} " * 3 for i in range(12)]
    path = _corpus(tmp_path, docs)
    seen = []
    for shard in range(num_ranks):
        # One window holds the shard's whole epoch (a shard smaller than one window is refused).
        seq_len = len(_stream(path, [shard], num_ranks)[shard]) - 1
        packer_ds = PackedTextDataset(path, CharTokenizer(), seq_len, batch_size=1, shards=[shard], num_shards=num_ranks)
        inputs, labels = next(iter(packer_ds))
        text = CharTokenizer().decode(inputs[0].tolist() + [labels[0, -1].item()])
        seen.append({i for i in range(12) if f"document number {i} " in text})
    assert set().union(*seen) == set(range(12))  # complete
    assert sum(len(s) for s in seen) == 12  # disjoint


def test_global_batch_independent_of_rank_count(tmp_path):
    """One reader of shards [0, 1] gives exactly the rows of two readers of one shard each."""
    path = _corpus(tmp_path, [f"doc {i} " + "words " * i for i in range(20)])
    one = iter(PackedTextDataset(path, CharTokenizer(), 16, batch_size=4, shards=[0, 1], num_shards=2))
    r0 = iter(PackedTextDataset(path, CharTokenizer(), 16, batch_size=2, shards=[0], num_shards=2))
    r1 = iter(PackedTextDataset(path, CharTokenizer(), 16, batch_size=2, shards=[1], num_shards=2))
    for _ in range(5):
        (a, _), (b, _), (c, _) = next(one), next(r0), next(r1)
        assert a.tolist() == b.tolist() + c.tolist()


def test_state_dict_resumes_the_exact_stream(tmp_path):
    path = _corpus(tmp_path, [f"doc {i} " + "text " * (i % 7) for i in range(30)])

    def make():
        return PackedTextDataset(path, CharTokenizer(), 12, batch_size=2, shards=[0, 1], num_shards=3)

    reference = iter(make())
    expected = [next(reference)[0].tolist() for _ in range(25)]  # wraps into a second epoch
    first = make()
    it = iter(first)
    got = [next(it)[0].tolist() for _ in range(9)]
    state = json.loads(json.dumps(first.state_dict()))  # survives serialisation
    resumed = make()
    resumed.load_state_dict(state)
    it = iter(resumed)
    got += [next(it)[0].tolist() for _ in range(16)]
    assert got == expected


def test_resume_seeks_past_the_consumed_documents(tmp_path):
    """A resumed dataset does not read what its shards consumed before: garbling it changes nothing."""
    path = _corpus(tmp_path, [f"doc {i} " + "text " * (i % 7) for i in range(60)])

    def make():
        return PackedTextDataset(path, CharTokenizer(), 12, batch_size=2, shards=[0, 1], num_shards=3)

    first = make()
    it = iter(first)
    for _ in range(9):
        next(it)
    state = json.loads(json.dumps(first.state_dict()))
    expected = [next(it)[0].tolist() for _ in range(6)]
    consumed = min(s["position"]["offset"] for s in state.values())
    assert consumed > 0
    data = path.read_bytes()
    path.write_bytes(b"".join(b"#" * (len(line) - 1) + b"\n" for line in data[:consumed].splitlines(True))
                     + data[consumed:])
    resumed = make()
    resumed.load_state_dict(state)
    it = iter(resumed)
    assert [next(it)[0].tolist() for _ in range(6)] == expected


def test_bad_inputs(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{not json\n')
    with pytest.raises(DatasetError, match="bad.jsonl:2"):
        list(read_documents(bad))
    path = _corpus(tmp_path, ["only one document"])
    with pytest.raises(DatasetError, match="divisible"):
        PackedTextDataset(path, CharTokenizer(), 8, batch_size=3, shards=[0, 1], num_shards=2)
    empty_shard = iter(PackedTextDataset(path, CharTokenizer(), 8, batch_size=1, shards=[1], num_shards=2))
    with pytest.raises(DatasetError, match="no documents for data shard 1"):
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


# ----------------------------------------------------------------------------- validation's held-out split


def test_held_out_documents_are_disjoint_from_training_and_cover_the_source():
    from torchtitan.datasets.text_dataset import Split

    train, held = Split(0.1, validation=False), Split(0.1, validation=True)
    indices = range(1, 20001)
    held_out = [i for i in indices if held.reads(i)]
    assert all(train.reads(i) != held.reads(i) for i in indices)
    assert abs(len(held_out) / 20000 - 0.1) < 0.01
    # Spread over the source: every tenth of it holds a share near the fraction, and so does each of
    # 4 document shards (document i is in shard (i - 1) % 4).
    for part in range(10):
        share = sum(1 for i in held_out if part * 2000 < i <= (part + 1) * 2000) / 2000
        assert abs(share - 0.1) < 0.03
    for shard in range(4):
        assert abs(sum(1 for i in held_out if (i - 1) % 4 == shard) / 5000 - 0.1) < 0.02


def test_validation_batches_are_the_held_out_documents_read_once(tmp_path):
    from torchtitan.datasets.text_dataset import Split

    docs = [f"document number {i} " * 3 for i in range(200)]
    path = _corpus(tmp_path, docs)
    held = Split(0.2, validation=True)
    expected = [t for i, d in enumerate(docs, start=1) if held.reads(i) for t in CharTokenizer().encode(d, True, True)]
    ds = PackedTextDataset(path, CharTokenizer(), 16, batch_size=1, shards=[0], num_shards=1, infinite=False,
                           split=held)
    batches = list(ds)  # finite: no second epoch
    assert len(batches) == (len(expected) - 1) // 16
    assert [t for inputs, _ in batches for t in inputs[0].tolist()] == expected[: 16 * len(batches)]
    # Training reads the other documents (its inputs, joined, are its token stream), none of these.
    train_text = "".join(CharTokenizer().decode(inputs[0].tolist()) for inputs, _ in
                         PackedTextDataset(path, CharTokenizer(), 16, 1, [0], 1, False, split=Split(0.2, False)))
    assert "document number 0 " in train_text or held.reads(1)
    assert not any(f"document number {i - 1} " in train_text for i in range(1, 201) if held.reads(i))


def test_an_empty_held_out_split_is_one_clear_line(tmp_path):
    from torchtitan.datasets.text_dataset import Split

    path = _corpus(tmp_path, ["only one document"])
    held = Split(0.01, validation=True)
    assert not held.reads(1)
    ds = PackedTextDataset(path, CharTokenizer(), 8, batch_size=1, shards=[0], num_shards=1, infinite=False, split=held)
    with pytest.raises(DatasetError, match=r"validation: the held-out split of .* \(validation.held_out_fraction "
                                           r"0.01\) has no documents for data shard 0 of 1 \(give more validation data"):
        list(ds)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5])
def test_a_finite_source_ends_cleanly_whatever_the_batch(tmp_path, rows):
    """The data running out in the middle of a batch ends the stream: it is not taken for data too
    small to train on (the end is met once, not again for each row still missing)."""
    path = _corpus(tmp_path, [f"document {i} " * 5 for i in range(20)])
    stream = _stream(path, [0], 1)[0]
    ds = PackedTextDataset(path, CharTokenizer(), 16, batch_size=rows, shards=[0], num_shards=1, infinite=False)
    batches = list(ds)
    windows = (len(stream) - 1) // 16
    assert len(batches) == windows // rows > 0
    assert [t for inputs, _ in batches for row in inputs.tolist() for t in row] == stream[: 16 * rows * len(batches)]


def test_a_training_split_too_small_names_the_held_out_fraction(tmp_path):
    from torchtitan.datasets.text_dataset import Split

    path = _corpus(tmp_path, [f"document {i} " * 5 for i in range(20)])
    ds = PackedTextDataset(path, CharTokenizer(), 16, batch_size=1, shards=[0], num_shards=1,
                           split=Split(0.999, validation=False))
    with pytest.raises(DatasetError, match=r"training skips the documents validation holds out "
                                           r"\(validation.held_out_fraction 0.999\)"):
        next(iter(ds))
