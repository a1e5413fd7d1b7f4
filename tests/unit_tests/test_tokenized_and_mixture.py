"""Pre-tokenized shards (format, checks, token-range sharding) and mixtures of sources."""

import json

import pytest
import torch

from tests.unit_tests.test_text_dataset import CharTokenizer, _corpus
from torchtitan.datasets.chunks import ShardItems, Split
from torchtitan.datasets.mixture import Mixture, build_mixture, parse_mix
from torchtitan.datasets.pretokenize import pretokenize
from torchtitan.datasets.sources import DatasetError, read_documents, resolve_source
from torchtitan.datasets.text_dataset import PackedTextDataset
from torchtitan.datasets.tokenized import MANIFEST


class FileCharTokenizer(CharTokenizer):
    """CharTokenizer with a file to fingerprint, and a vocabulary size of choice."""

    def __init__(self, tmp_path, n_words=256):
        self.path = str(tmp_path / f"chars-{n_words}.model")
        (tmp_path / f"chars-{n_words}.model").write_text(f"one token per character, {n_words}")
        self.n_words = n_words

    def fingerprint(self):
        import hashlib

        return hashlib.sha256(open(self.path, "rb").read()).hexdigest()


def _docs(n=60):
    return [f"document {i} " + "word " * (i % 9) for i in range(n)]


@pytest.fixture
def shards(tmp_path):
    path = _corpus(tmp_path, _docs())
    out = tmp_path / "tokens"
    pretokenize([path], FileCharTokenizer(tmp_path), out, workers=2, parts=3, progress=False)
    return path, out


def test_shards_hold_the_token_stream_of_the_text(tmp_path, shards):
    path, out = shards
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["dtype"] == "uint16" and manifest["num_documents"] == 60 and len(manifest["files"]) == 3
    tok = CharTokenizer()
    stream = [t for d in read_documents(path) for t in tok.encode(d, True, True)]
    raw = b"".join((out / f["tokens"]).read_bytes() for f in manifest["files"])
    assert list(torch.frombuffer(bytearray(raw), dtype=torch.uint16).tolist()) == stream
    # The trainer's batches over the shards are the batches over the text (one data shard).
    source = resolve_source("", str(out))
    a = iter(PackedTextDataset(path, tok, 16, 2, [0], 1))
    b = iter(PackedTextDataset(source, tok, 16, 2, [0], 1))
    for _ in range(40):
        assert torch.equal(next(a)[0], next(b)[0])


@pytest.mark.parametrize("num_shards", [1, 2, 3, 5])
def test_token_ranges_give_every_document_to_one_shard(shards, num_shards, monkeypatch):
    from torchtitan.datasets import chunks

    monkeypatch.setattr(chunks, "CHUNK_TOKENS", 50)  # several chunks per shard
    _, out = shards
    source = resolve_source("", str(out))
    docs = []
    for shard in range(num_shards):
        for item in ShardItems(source, shard, num_shards, CharTokenizer(), infinite=False).items():
            docs += CharTokenizer().decode(item["tokens"].tolist()).split("document ")[1:]
    assert sorted(docs) == sorted(d.removeprefix("document ") for d in _docs())


def test_held_out_split_of_token_shards_is_disjoint(shards):
    _, out = shards
    source = resolve_source("", str(out))
    texts = {}
    for validation in (False, True):
        items = ShardItems(source, 0, 1, CharTokenizer(), infinite=False, split=Split(0.3, validation))
        texts[validation] = "".join(CharTokenizer().decode(i["tokens"].tolist()) for i in items.items())
    held = set(texts[True].split("document ")[1:])
    kept = set(texts[False].split("document ")[1:])
    assert held and kept and not held & kept and len(held) + len(kept) == 60


def test_large_vocabularies_are_written_as_uint32(tmp_path):
    path = _corpus(tmp_path, _docs(5))
    pretokenize([path], FileCharTokenizer(tmp_path, 70000), tmp_path / "t", workers=1, progress=False)
    manifest = json.loads((tmp_path / "t" / MANIFEST).read_text())
    assert manifest["dtype"] == "uint32"
    assert (tmp_path / "t" / "part-00000.bin").stat().st_size == 4 * manifest["num_tokens"]


def test_damaged_or_foreign_shards_are_one_line(tmp_path, shards):
    _, out = shards
    manifest = json.loads((out / MANIFEST).read_text())
    other = FileCharTokenizer(tmp_path, 300)
    with pytest.raises(DatasetError, match=r"tokens was tokenized with chars-256.model \(vocabulary 256, sha256 .*\), "
                                           r"but model.tokenizer_path is .*chars-300.model \(vocabulary 300"):
        resolve_source("", str(out)).check_tokenizer(other)
    resolve_source("", str(out)).check_tokenizer(FileCharTokenizer(tmp_path))  # the same file: accepted
    part = out / manifest["files"][1]["tokens"]
    part.write_bytes(part.read_bytes()[:-2])
    with pytest.raises(DatasetError, match=r"part-00001.bin holds .* bytes, but .*manifest.json says .* \(truncated"):
        resolve_source("", str(out))
    part.unlink()
    with pytest.raises(DatasetError, match=r"part-00001.bin is missing \(named by"):
        resolve_source("", str(out / MANIFEST))
    (out / MANIFEST).write_text(json.dumps({**manifest, "version": 9}))
    with pytest.raises(DatasetError, match="format version 9; this torchtitan reads version 1"):
        resolve_source("", str(out))
    (out / MANIFEST).write_text("{not json")
    with pytest.raises(DatasetError, match="is not a readable manifest of pre-tokenized shards"):
        resolve_source("", str(out))


def test_pretokenize_keeps_existing_shards_unless_told(tmp_path, shards):
    path, out = shards
    with pytest.raises(DatasetError, match="already holds tokenized shards .*--overwrite"):
        pretokenize([path], FileCharTokenizer(tmp_path), out, workers=1, progress=False)
    pretokenize([path], FileCharTokenizer(tmp_path), out, workers=1, parts=1, overwrite=True, progress=False)
    assert len(json.loads((out / MANIFEST).read_text())["files"]) == 1
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST, "part-00000.bin", "part-00000.idx"]


# ----------------------------------------------------------------------------- mixtures


@pytest.mark.parametrize("text,why", [
    ("a", "entry 'a' is not 'source:weight'"),
    ("a:x", "weight 'x' is not a number"),
    ("a:0", "the weight must be a positive number"),
    ("a:-1,b:1", "the weight must be a positive number"),
    ("a:1,a:2", "names a source twice"),
    ("a:1,", "entry '' is not 'source:weight'"),
])
def test_mixture_mistakes_are_one_line(text, why):
    with pytest.raises(DatasetError, match=why):
        parse_mix(text)


def test_paths_with_colons_keep_them():
    assert parse_mix("C:/data/x.jsonl:2, stdlib_docs:1") == [("C:/data/x.jsonl", 2.0), ("stdlib_docs", 1.0)]


def _mixture(tmp_path, weights=(0.7, 0.3), seed=0):
    a = _corpus(tmp_path, ["alpha " * 40] * 50, "a.jsonl")
    b = _corpus(tmp_path, ["beta " * 40] * 50, "b.jsonl")
    return build_mixture(f"{a}:{weights[0]},{b}:{weights[1]}", seed)


def test_rows_follow_the_weights_and_the_seed(tmp_path):
    mix = _mixture(tmp_path)
    assert mix.weights == (0.7, 0.3)
    picks = [mix.pick(0, r) for r in range(4000)]
    assert abs(picks.count(0) / 4000 - 0.7) < 0.03
    assert picks == [mix.pick(0, r) for r in range(4000)]  # deterministic
    assert picks != [_mixture(tmp_path, seed=1).pick(0, r) for r in range(4000)]  # per seed
    assert picks != [mix.pick(1, r) for r in range(4000)]  # each shard draws its own rows
    ds = PackedTextDataset(mix, CharTokenizer(), 16, 4, [0, 1], 2)
    it = iter(ds)
    batches = [next(it)[0] for _ in range(200)]
    alpha = sum(int((row == ord("l")).any()) for b in batches for row in b)
    assert abs(alpha / 800 - 0.7) < 0.05
    counts = ds.tokens_by_source()
    assert sum(counts.values()) == 800 * 16 and abs(counts[mix.names[0]] / (800 * 16) - alpha / 800) < 1e-9


def test_a_mixture_resumes_exactly(tmp_path):
    mix = _mixture(tmp_path, (0.5, 0.5))

    def make(workers=0):
        return PackedTextDataset(mix, CharTokenizer(), 16, 2, [0], 1, num_workers=workers)

    reference = iter(make())
    expected = [next(reference)[0].tolist() for _ in range(30)]
    first = make()
    it = iter(first)
    got = [next(it)[0].tolist() for _ in range(11)]
    resumed = make(workers=1)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    it = iter(resumed)
    got += [next(it)[0].tolist() for _ in range(19)]
    assert got == expected
    assert resumed.tokens_by_source() == make_counts(expected, mix)


def make_counts(batches, mix):
    """Tokens per source from the rows themselves: alpha rows hold 'l', beta rows do not."""
    rows = [row for batch in batches for row in batch]
    alpha = sum(1 for row in rows if ord("l") in row)
    return {mix.names[0]: alpha * 16, mix.names[1]: (len(rows) - alpha) * 16}


def test_single_sources_are_a_mixture_of_one():
    mix = Mixture.single(["x"], "x")
    assert mix.pick(3, 12345) == 0 and mix.describe() == "x:1"


def test_a_full_disk_while_tokenizing_is_one_line_and_no_manifest(tmp_path, monkeypatch, capsys):
    from scripts.tokenize_dataset import main
    from torchtitan.datasets import tokenized

    def full(self, ids):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tokenized.TokenFileWriter, "add", full)  # the forked workers inherit it
    path = _corpus(tmp_path, _docs(5))
    assert main(["--input", str(path), "--out", str(tmp_path / "t"), "--workers", "2", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: cannot write --out {tmp_path / 't'}: No space left on device (a part file)"]
    assert not (tmp_path / "t").exists()  # the parts written before the disk filled are removed with the folder
