#!/usr/bin/env -S sh -c 'exec "${0%/*}/project_python.sh" "$0" "$@"'
"""Measures the data path: read amplification across data shards, and loader throughput per rank.

    .venv/bin/python scripts/data_benchmark.py corpus DIR --gb 2      # JSON lines, Parquet, token shards
    .venv/bin/python scripts/data_benchmark.py amplification DIR      # bytes read by all shards / corpus bytes
    .venv/bin/python scripts/data_benchmark.py order DIR              # rank correlation of shuffled reading
    .venv/bin/python scripts/data_benchmark.py throughput DIR         # loader tokens/s of one rank's share

`corpus` writes about --gb GB of each format: 4 JSON-lines files of documents cut at random from
the bundled corpus (100 to 20,000 characters), the same documents as one Parquet file (row groups
of 2,048 rows), and token shards of random ids (4 parts, documents of 50 to 5,000 tokens) with a
manifest naming the bundled tokenizer. `amplification` reads every data shard of 1, 2, 4 and 8 as
the trainer's readers do (parsing, not tokenizing) and sums the bytes taken from the operating
system (cross-checked with /proc/self/io for file reads); `--shuffle` reads them shuffled (seed 0).
`order` reads one epoch of one rank's share (shard 0 of 8) in file order and shuffled, and prints
Spearman's rank correlation between each document's place in the files and its place in the
reading order (documents told apart by a checksum). `throughput` packs one rank's share
(shard 0 of 8) into batches of 8 x 2048 tokens with the bundled tokenizer, with 0 and 2 worker
processes, and prints tokens/s next to what a trainer consumes: the debug model on this machine
(--trainer-tps, from a run's metrics) and, by arithmetic, Llama 3 8B on one H100.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
import zlib
from collections import defaultdict, deque
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's torchtitan, also where it is not installed

from torchtitan.assets import resolve_path  # noqa: E402 - after the path above
from torchtitan.datasets.chunks import ShardItems  # noqa: E402
from torchtitan.datasets.shuffle import Shuffle, rank_correlation  # noqa: E402
from torchtitan.datasets.sources import resolve_source  # noqa: E402
from torchtitan.datasets.text_dataset import PackedTextDataset  # noqa: E402
from torchtitan.datasets.tokenized import TokenFile, write_manifest  # noqa: E402
from torchtitan.datasets.tokenizer import tokenizer_from_file  # noqa: E402

TOKENIZER = "bundled:stdlib_docs/tokenizer.model"


def make_corpus(folder: Path, gb: float, seed: int = 0) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(seed)
    text = " ".join(json.loads(line)["text"] for line in open(resolve_path("bundled:stdlib_docs/corpus.jsonl", "")))
    target = int(gb * 1e9)
    (folder / "jsonl").mkdir(parents=True, exist_ok=True)
    writer = pq.ParquetWriter(folder / "parquet.parquet", pa.schema([("text", pa.string())]))
    written, rows, part = 0, [], 0
    out = open(folder / "jsonl" / f"part-{part}.jsonl", "w")
    start = time.perf_counter()
    while written < target:
        length = int(math.exp(rng.uniform(math.log(100), math.log(20000))))
        at = rng.randrange(0, len(text) - length)
        doc = text[at:at + length]
        line = json.dumps({"text": doc}) + "\n"
        out.write(line)
        written += len(line)
        rows.append(doc)
        if len(rows) == 2048:
            writer.write_table(pa.table({"text": rows}))
            rows = []
        if written > (part + 1) * target / 4 and part < 3:
            out.close()
            part += 1
            out = open(folder / "jsonl" / f"part-{part}.jsonl", "w")
    out.close()
    if rows:
        writer.write_table(pa.table({"text": rows}))
    writer.close()
    print(f"text: {written / 1e9:.2f} GB of JSON lines in 4 files, {(folder / 'parquet.parquet').stat().st_size / 1e9:.2f} "
          f"GB of Parquet ({time.perf_counter() - start:.0f} s)")
    tokens_dir = folder / "tokens"
    tokens_dir.mkdir(exist_ok=True)
    gen = np.random.default_rng(seed)
    files = []
    per_part = int(target / 2 / 4)  # uint16: 2 bytes a token
    for p in range(4):
        lengths = gen.integers(50, 5000, size=per_part // 2000)
        lengths = lengths[: np.searchsorted(np.cumsum(lengths), per_part)]
        ids = gen.integers(0, 2000, size=int(lengths.sum()), dtype=np.uint16)
        ids.tofile(tokens_dir / f"part-{p:05d}.bin")
        np.concatenate([[0], np.cumsum(lengths)]).astype("<i8").tofile(tokens_dir / f"part-{p:05d}.idx")
        files.append(TokenFile(f"part-{p:05d}.bin", f"part-{p:05d}.idx", int(lengths.sum()), len(lengths)))
    write_manifest(tokens_dir, files, "uint16", tokenizer_from_file(resolve_path(TOKENIZER, "")), "random ids")
    print(f"token shards: {sum(f.num_tokens for f in files) * 2 / 1e9:.2f} GB")


class _NoTokenizer:
    """Reading without tokenizing: amplification is about bytes, and parsing is what every reader does."""

    def encode(self, text, bos, eos):
        return []


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar"))


def sources(folder: Path) -> dict:
    return {"JSON lines": resolve_source("", str(folder / "jsonl")),
            "Parquet": resolve_source("", str(folder / "parquet.parquet")),
            "token shards": resolve_source("", str(folder / "tokens"))}


def corpus_bytes(source) -> int:
    if isinstance(source, list):
        return sum(f.stat().st_size for f in source)
    return sum((source.folder / f.tokens).stat().st_size + (source.folder / f.index).stat().st_size for f in source.files)


class _ChecksumTokenizer:
    """A document is one token, its checksum: the stream says which documents came in which order."""

    def encode(self, text, bos, eos):
        return [zlib.crc32(text.encode()) >> 1]


def amplification(folder: Path, shuffle: bool) -> None:
    print(f"data shards read {'shuffled (seed 0)' if shuffle else 'in file order'}")
    print("| format | corpus | shards | bytes read (all shards) | amplification | largest shard's share | rchar check | s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, source in sources(folder).items():
        total = corpus_bytes(source)
        for count in (1, 2, 4, 8):
            start, rchar = time.perf_counter(), _rchar()
            read, largest = 0, 0
            for shard in range(count):
                items = ShardItems(source, shard, count, _NoTokenizer(), infinite=False,
                                   shuffle=Shuffle(0) if shuffle else None)
                shard_bytes = sum(item["bytes"] for item in items.items())
                read += shard_bytes
                largest = max(largest, shard_bytes)
            rchar = _rchar() - rchar
            check = f"{rchar / total:.4f}" if name != "token shards" else "(mmap)"
            print(f"| {name} | {total / 1e9:.2f} GB | {count} | {read / 1e9:.3f} GB | {read / total:.4f} | "
                  f"{largest * count / read:.3f} x 1/{count} | {check} | {time.perf_counter() - start:.0f} |", flush=True)


def _document_checksums(source, shuffle: Shuffle | None) -> list[int]:
    """Shard 0 of 8's documents over one epoch, in reading order, each as a checksum of its tokens."""
    items = ShardItems(source, 0, 8, _ChecksumTokenizer(), infinite=False, lengths=True, shuffle=shuffle)
    out = []
    for item in items.items():  # the generated corpus has no bad line (an item with "error")
        at = 0
        for length in item["lengths"]:
            out.append(zlib.crc32(item["tokens"][at:at + length].numpy().tobytes()))
            at += length
    return out


def order(folder: Path) -> None:
    print("one rank's share (data shard 0 of 8), one epoch; Spearman's rank correlation between the documents' "
          "places in the files and in the reading order")
    print("| format | chunks | documents | file order | shuffled (seed 0) | shuffled (seed 1) | s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, source in sources(folder).items():
        start = time.perf_counter()
        in_order = _document_checksums(source, None)
        places = defaultdict(deque)  # checksum -> its places in the files (a repeated document has several)
        for place, checksum in enumerate(in_order):
            places[checksum].append(place)
        row = []
        for shuffle in (None, Shuffle(0), Shuffle(1)):
            read = in_order if shuffle is None else _document_checksums(source, shuffle)
            assert sorted(read) == sorted(in_order), "a shuffled epoch must read every document once"
            left = {c: deque(p) for c, p in places.items()}
            row.append(rank_correlation([left[c].popleft() for c in read]))
        chunks = len(ShardItems(source, 0, 8, _NoTokenizer()).plan)
        print(f"| {name} | {chunks} | {len(in_order):,} | {row[0]:.4f} | {row[1]:.4f} | {row[2]:.4f} | "
              f"{time.perf_counter() - start:.0f} |", flush=True)


def throughput(folder: Path, seconds: float, trainer_tps: float) -> None:
    tokenizer = tokenizer_from_file(resolve_path(TOKENIZER, ""))
    seq, batch = 2048, 8
    print(f"one rank's share (data shard 0 of 8), batches of {batch} x {seq} tokens, bundled tokenizer "
          f"(vocabulary {tokenizer.n_words}); {torch.get_num_threads()} thread(s), {os.cpu_count()} cores")
    print("| format | workers | loader tokens/s per rank | batches |")
    print("| --- | ---: | ---: | ---: |")
    results = {}
    for name, source in sources(folder).items():
        for workers in (0, 2):
            ds = PackedTextDataset(source, tokenizer, seq, batch, [0], 8, num_workers=workers)
            it = iter(ds)
            next(it)  # start-up (workers, first chunk) is not throughput
            start, n = time.perf_counter(), 0
            while time.perf_counter() - start < seconds:
                next(it)
                n += 1
            tps = n * batch * seq / (time.perf_counter() - start)
            results[(name, workers)] = tps
            print(f"| {name} | {workers} | {tps:,.0f} | {n} |", flush=True)
            del it, ds
    from torchtitan.models.llama.flavors import llama3_configs
    from torchtitan.models.llama.model import Transformer

    with torch.device("meta"):
        model = Transformer(llama3_configs["8B"])
    flops = model.flops_per_token(8192)
    h100 = 0.40 * 989e12 / flops
    print(f"\nconsumption: debug model on this machine {trainer_tps:,.0f} tokens/s per rank (--trainer-tps); "
          f"Llama 3 8B at seq 8192 on one H100 at 40 % MFU (989 TFLOP/s bf16 dense): "
          f"{flops / 1e9:.1f} GFLOP/token -> {h100:,.0f} tokens/s per GPU")
    for (name, workers), tps in results.items():
        print(f"  {name}, {workers} workers: {tps / h100:.1f}x the 8B H100 rate, {tps / trainer_tps:.0f}x the debug model's")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["corpus", "amplification", "order", "throughput"])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--gb", type=float, default=2.0, help="corpus: size of each format")
    parser.add_argument("--shuffle", action="store_true", help="amplification: read the shards shuffled")
    parser.add_argument("--seconds", type=float, default=10.0, help="throughput: time per measurement")
    parser.add_argument("--trainer-tps", type=float, default=1.0,
                        help="throughput: the trainer's tokens/s per rank to compare with (from a run's metrics)")
    args = parser.parse_args(argv)
    if args.mode == "corpus":
        make_corpus(args.folder, args.gb)
    elif args.mode == "amplification":
        amplification(args.folder, args.shuffle)
    elif args.mode == "order":
        order(args.folder)
    else:
        throughput(args.folder, args.seconds, args.trainer_tps)


if __name__ == "__main__":
    main()
