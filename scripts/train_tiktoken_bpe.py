#!/usr/bin/env -S sh -c 'exec "${0%/*}/project_python.sh" "$0" "$@"'
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's torchtitan, also where it is not installed

from torchtitan.datasets.bpe_trainer import save_tiktoken_ranks, train_bpe  # noqa: E402 - after the path above
from torchtitan.errors import DatasetError, UserError


def read_texts(path: Path) -> Iterator[str]:
    """Yields the "text" field of every non-blank JSON line of path."""
    try:
        f = open(path, "rb")  # decoded line by line, so that a bad byte is placed on its line
    except OSError as e:
        raise DatasetError(f"cannot read --corpus {path}: {e.strerror or e}") from None
    with f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line.decode("utf-8"))
            except UnicodeDecodeError as e:
                raise DatasetError(f"{path}:{line_no}: not UTF-8 text ({e.reason} at byte {e.start})") from None
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path}:{line_no}: not a JSON line ({e.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise DatasetError(f'{path}:{line_no}: no string "text" field')
            yield record["text"]


def _vocab_size(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 256:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 256 (the single bytes), got {text!r}")
    return int(text)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, required=True, help='JSONL file with a "text" field per line')
    parser.add_argument("--vocab-size", type=_vocab_size, default=2000,
                        help="total tokens, the 256 single bytes included")
    parser.add_argument("--out", type=Path, required=True, help="where to write the tiktoken rank file")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Trains, saves, and prints a short summary; a mistake is one `error:` line and exit status 2."""
    args = parse_args(argv)
    start = time.perf_counter()
    try:
        tokens = train_bpe(read_texts(args.corpus), args.vocab_size)
        save_tiktoken_ranks(tokens, args.out)
    except UserError as e:  # the corpus
        print(e.line, file=sys.stderr)
        return 2
    except OSError as e:  # the corpus was read: --out could not be written
        print(f"error: cannot write --out {args.out}: {e.strerror or e}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - start
    print(f"wrote {len(tokens)} tokens ({len(tokens) - 256} merges) to {args.out}")
    if len(tokens) < args.vocab_size:
        print(f"stopped early: no pair occurs twice after {len(tokens)} tokens (asked for {args.vocab_size})")
    print("first merges:", tokens[256:266])
    print("last merges: ", tokens[-5:] if len(tokens) > 256 else [])
    print(f"wall time: {elapsed:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
