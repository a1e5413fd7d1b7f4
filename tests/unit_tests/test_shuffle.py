"""training.dataset_shuffle: seeded chunk and document order that keeps sharding, layout and
worker independence, and exact resume (torchtitan/datasets/shuffle.py)."""

import json

import pytest

from tests.unit_tests.test_text_dataset import CharTokenizer, _corpus
from torchtitan.datasets import chunks
from torchtitan.datasets.chunks import ShardItems, Split
from torchtitan.datasets.mixture import Mixture
from torchtitan.datasets.pretokenize import pretokenize
from torchtitan.datasets.shuffle import Shuffle, rank_correlation
from torchtitan.datasets.sources import DatasetError, resolve_source
from torchtitan.datasets.text_dataset import PackedTextDataset

pytestmark = pytest.mark.fast

N = 2000  # documents


class NumberTokenizer(CharTokenizer):
    """A document "doc <i> ..." is the one token i: the token stream is the reading order."""

    def encode(self, text, bos, eos):
        return [int(text.split()[1])]


def _docs(n=N):
    return [f"doc {i} " + "words " * (i % 11) for i in range(n)]


def _jsonl(tmp_path):
    return [_corpus(tmp_path, _docs())]


def _parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "docs.parquet"
    docs = _docs()
    with pq.ParquetWriter(path, pa.schema([("text", pa.string())])) as writer:
        for at in range(0, N, 5):  # row groups of 5 documents: the chunks
            writer.write_table(pa.table({"text": docs[at:at + 5]}))
    return [path]


def _tokens(tmp_path):
    """Pre-tokenized shards whose documents are the single tokens 0..N-1 (a vocabulary of N)."""
    from tests.unit_tests.test_tokenized_and_mixture import FileCharTokenizer

    class Numbers(FileCharTokenizer, NumberTokenizer):
        pass

    out = tmp_path / "tokens"
    pretokenize(_jsonl(tmp_path), Numbers(tmp_path, n_words=N), out, workers=1, parts=3, progress=False)
    return resolve_source("", str(out))


FORMATS = {"jsonl": _jsonl, "parquet": _parquet, "tokens": _tokens}


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 128 bytes of JSON lines (about 2 documents) and 4 pre-tokenized tokens (4 documents)."""
    monkeypatch.setattr(chunks, "CHUNK_BYTES", 128)
    monkeypatch.setattr(chunks, "CHUNK_TOKENS", 4)


def _epochs(source, shard, num_shards, shuffle, epochs=1):
    """The documents shard `shard` reads, per epoch."""
    items = ShardItems(source, shard, num_shards, NumberTokenizer(), infinite=True, shuffle=shuffle)
    out = [[] for _ in range(epochs)]
    for item in items.items():
        if item["epoch"] == epochs:
            return out
        out[item["epoch"]] += item["tokens"].tolist()


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_epoch_reads_every_document_once_in_an_order_unrelated_to_the_files(tmp_path, small_chunks, fmt):
    source = FORMATS[fmt](tmp_path)
    for num_shards in (1, 2):
        for shard in range(num_shards):
            in_order, = _epochs(source, shard, num_shards, None)
            shuffled, = _epochs(source, shard, num_shards, Shuffle(0))
            assert in_order == sorted(in_order) and rank_correlation(in_order) == 1.0  # off: the files' order
            assert sorted(shuffled) == in_order  # the same documents, each once: the shard reads only its share
            assert abs(rank_correlation(shuffled)) < 0.15, (num_shards, shard, rank_correlation(shuffled))


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_held_out_split_holds_under_the_shuffle(tmp_path, small_chunks, fmt):
    """Training reads the same documents shuffled as in file order, and none that validation holds out."""
    source = FORMATS[fmt](tmp_path)

    def read(split, shuffle):
        items = ShardItems(source, 0, 1, NumberTokenizer(), infinite=False, split=split, shuffle=shuffle)
        return [t for item in items.items() for t in item["tokens"].tolist()]

    train = read(Split(0.3, False), Shuffle(0))
    held_out = read(Split(0.3, True), None)
    assert sorted(train) == read(Split(0.3, False), None) and train != sorted(train)
    assert sorted(train + held_out) == list(range(N)) and 0.2 < len(held_out) / N < 0.4


def test_documents_are_shuffled_inside_a_chunk(tmp_path):
    """One chunk (the whole file): only the document order can move."""
    source = _jsonl(tmp_path)
    assert len(chunks.plan_shard(source, 0, 1)) == 1
    shuffled, = _epochs(source, 0, 1, Shuffle(0))
    assert sorted(shuffled) == list(range(N)) and abs(rank_correlation(shuffled)) < 0.15


def test_a_new_epoch_and_a_new_seed_give_a_new_order(tmp_path, small_chunks):
    source = _jsonl(tmp_path)
    first, second = _epochs(source, 0, 1, Shuffle(0), epochs=2)
    assert sorted(first) == sorted(second) == list(range(N)) and first != second
    assert abs(rank_correlation([first.index(d) for d in second])) < 0.15  # unrelated, not a small change
    assert _epochs(source, 0, 1, Shuffle(0)) == [first]  # the same seed repeats
    assert _epochs(source, 0, 1, Shuffle(1))[0] not in (first, second)
    # Chunk order too, not only documents inside chunks.
    assert Shuffle(0).chunk_order(0, 0, 50) != Shuffle(0).chunk_order(0, 1, 50) != Shuffle(1).chunk_order(0, 1, 50)


def test_the_global_batch_does_not_depend_on_the_data_parallel_degree(tmp_path, small_chunks):
    """dataset_shards 4 read by 1, 2 or 4 ranks: the same rows, over several epochs, from a mixture."""
    a = _corpus(tmp_path, _docs(200), "a.jsonl")
    b = _corpus(tmp_path, [f"doc {i} " + "other " * (i % 5) for i in range(200)], "b.jsonl")
    mix = Mixture(("a", "b"), ([a], [b]), (0.6, 0.4), seed=3)

    def ranks(dp):
        per = 4 // dp
        return [iter(PackedTextDataset(mix, CharTokenizer(), 16, 8 // dp, list(range(r * per, (r + 1) * per)), 4,
                                       shuffle=Shuffle(5))) for r in range(dp)]

    readers = {dp: ranks(dp) for dp in (1, 2, 4)}
    for _ in range(60):  # 4 shards of about 1.3 KB each: several epochs
        batches = {dp: [row for r in rs for row in next(r)[0].tolist()] for dp, rs in readers.items()}
        assert batches[1] == batches[2] == batches[4]


@pytest.mark.parametrize("workers", [(0, 2), (2, 0)])
def test_resume_mid_epoch_is_exact_and_reads_nothing_twice(tmp_path, small_chunks, workers):
    """(saving run's workers, resumed run's workers). One finite epoch: the resumed run gives the
    uninterrupted run's batches, and the two runs together read the uninterrupted run's bytes
    plus only the chunks the saved buffer still held."""
    path = _corpus(tmp_path, [f"doc {i} " + "text " * (i % 7) for i in range(300)])

    def make(num_workers):
        return PackedTextDataset(path, CharTokenizer(), 12, batch_size=2, shards=[0, 1], num_shards=2,
                                 infinite=False, num_workers=num_workers, shuffle=Shuffle(7))

    reference = make(0)
    expected = [inputs.tolist() for inputs, _ in reference]
    assert len(expected) > 40
    first = make(workers[0])
    it = iter(first)
    got = [next(it)[0].tolist() for _ in range(20)]
    state = json.loads(json.dumps(first.state_dict()))  # survives serialisation
    resumed = make(workers[1])
    resumed.load_state_dict(state)
    got += [inputs.tolist() for inputs, _ in resumed]
    assert got == expected
    again = 0  # bytes of the items from the saved position to the first run's last fetched one
    for shard in (0, 1):
        start, stop = state[f"shard_{shard}"]["source_0"]["item"], first.packers[shard][0].next_item
        assert 0 < start < stop
        items = ShardItems(path, shard, 2, CharTokenizer(), infinite=False, shuffle=Shuffle(7)).items(start)
        again += sum(next(items)["bytes"] for _ in range(stop - start))
    assert first.bytes_read() + resumed.bytes_read() == reference.bytes_read() + again
    assert again < reference.bytes_read() / 10


def test_resume_does_not_read_the_consumed_chunks(tmp_path, small_chunks):
    """Garbling every line of the chunks read before the saved item (scattered over the file by the
    shuffle) changes nothing for the resumed run: it never parses them."""
    path = _corpus(tmp_path, [f"doc {i} " + "text " * (i % 7) for i in range(200)])

    def make():
        return PackedTextDataset(path, CharTokenizer(), 12, batch_size=1, shards=[0], num_shards=1, infinite=False,
                                 shuffle=Shuffle(2))

    first = make()
    it = iter(first)
    for _ in range(30):
        next(it)
    state = json.loads(json.dumps(first.state_dict()))
    expected = [inputs.tolist() for inputs, _ in it]
    item = state["shard_0"]["source_0"]["item"]
    plan = chunks.plan_shard([path], 0, 1)
    consumed = [plan[i] for i in Shuffle(2).chunk_order(0, 0, len(plan))[:item]]
    assert item > 3 and sorted(c.begin for c in consumed) != [c.begin for c in plan[:item]]  # not a prefix
    data, at, out = path.read_bytes(), 0, []
    for line in data.splitlines(True):
        out.append(b"#" * (len(line) - 1) + b"\n" if any(c.begin <= at < c.end for c in consumed) else line)
        at += len(line)
    path.write_bytes(b"".join(out))
    resumed = make()
    resumed.load_state_dict(state)
    assert [inputs.tolist() for inputs, _ in resumed] == expected
    with pytest.raises(DatasetError, match="not a JSON object"):
        list(make())


def _keys(state, prefix=""):
    return {k for key, v in state.items() for k in (_keys(v, f"{prefix}{key}.") if isinstance(v, dict) else [prefix + key])}


def test_resuming_with_another_order_is_refused(tmp_path):
    """A checkpoint loads into this run's keys (DCP): the shuffle changes a value, never the keys,
    so older checkpoints still fit, and a position saved shuffled cannot be read as file order."""
    path = _corpus(tmp_path, _docs(100))

    def saved(shuffle):
        ds = PackedTextDataset(path, CharTokenizer(), 12, 2, [0], 1, shuffle=shuffle)
        next(iter(ds))
        return ds.state_dict()

    assert _keys(saved(None)) == _keys(saved(Shuffle(0)))
    assert saved(None)["shard_0"]["mix"] == ":1"  # file order: the position of before the option

    for save, load, words in [(None, Shuffle(0), "file order, but .* in the shuffled order of seed 0"),
                              (Shuffle(0), Shuffle(1), "the shuffled order of seed 0, but .* of seed 1"),
                              (Shuffle(0), None, "the shuffled order of seed 0, but .* in file order")]:
        with pytest.raises(DatasetError, match=rf"data position is for {words} \(training.dataset_shuffle, "
                                               r"training.seed\).*exclude_from_loading dataloader$"):
            PackedTextDataset(path, CharTokenizer(), 12, 2, [0], 1, shuffle=load).load_state_dict(saved(save))


def test_training_shuffles_and_validation_reads_in_file_order(tmp_path):
    from torchtitan.config.job_config import JobConfig
    from torchtitan.datasets.shards import DataShards
    from torchtitan.datasets.text_dataset import build_text_dataloader, build_validation_dataloader

    path = _corpus(tmp_path, _docs(300))
    config = JobConfig()
    config.training.dataset_path, config.training.seq_len, config.training.batch_size = str(path), 16, 2
    config.validation.enabled = True
    shards = DataShards(0, 1, 1)

    def orders():
        train = build_text_dataloader(config, CharTokenizer(), shards).dataset
        val = build_validation_dataloader(config, CharTokenizer(), shards).dataset
        return train.packers[0][0].items.shuffle, val.packers[0][0].items.shuffle

    assert config.training.dataset_shuffle is False and orders() == (None, None)  # off by default
    config.training.dataset_shuffle, config.training.seed = True, 9
    assert orders() == (Shuffle(9), None)
