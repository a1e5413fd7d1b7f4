"""Trains a byte-level BPE vocabulary on a JSONL corpus and writes it as a tiktoken rank file.

The output has Llama 3's `tokenizer.model` format (`<base64 token bytes> <rank>` per line) and loads
with `tiktoken.load.load_tiktoken_bpe`; pair it with `LLAMA3_PATTERN` and your special tokens.

    .venv/bin/python scripts/train_tiktoken_bpe.py --corpus torchtitan/assets/stdlib_docs/corpus.jsonl \\
        --vocab-size 2000 --out /tmp/bpe.model
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

try:
    from torchtitan.datasets.bpe_trainer import save_tiktoken_ranks, train_bpe
except ImportError:  # torchtitan not installed in this interpreter: fall back to the checkout it lives in
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from torchtitan.datasets.bpe_trainer import save_tiktoken_ranks, train_bpe


def read_texts(path: Path) -> Iterator[str]:
    """Yields the "text" field of every non-blank JSON line of path."""
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            if not isinstance(record.get("text"), str):
                raise SystemExit(f'{path}:{line_no}: no string "text" field')
            yield record["text"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, required=True, help='JSONL file with a "text" field per line')
    parser.add_argument("--vocab-size", type=int, default=2000, help="total tokens, the 256 single bytes included")
    parser.add_argument("--out", type=Path, required=True, help="where to write the tiktoken rank file")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Trains, saves, and prints a short summary."""
    args = parse_args(argv)
    start = time.perf_counter()
    tokens = train_bpe(read_texts(args.corpus), args.vocab_size)
    save_tiktoken_ranks(tokens, args.out)
    elapsed = time.perf_counter() - start
    print(f"wrote {len(tokens)} tokens ({len(tokens) - 256} merges) to {args.out}")
    if len(tokens) < args.vocab_size:
        print(f"stopped early: no pair occurs twice after {len(tokens)} tokens (asked for {args.vocab_size})")
    print("first merges:", tokens[256:266])
    print("last merges: ", tokens[-5:] if len(tokens) > 256 else [])
    print(f"wall time: {elapsed:.2f} s")


if __name__ == "__main__":
    main()
