"""Tokenizes a text source once into memory-mapped token shards the trainer reads at no cost.

    .venv/bin/python scripts/tokenize_dataset.py --input data/web --out data/web-tokens \\
        --tokenizer bundled:stdlib_docs/tokenizer.model
    ./run_llama_train.sh --training.dataset_path data/web-tokens

--input takes what training.dataset_path takes (a .jsonl, .txt or .parquet file, a folder, a
glob) or a registered name (stdlib_docs). The output folder holds part-NNNNN.bin / .idx and a
manifest naming the tokenizer; the trainer refuses the shards with any other tokenizer. Uses every
core by default (--workers), prints a progress bar on stderr and, at the end, the figures.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

try:
    from torchtitan.datasets.pretokenize import pretokenize
except ImportError:  # torchtitan not installed in this interpreter: fall back to the checkout it lives in
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from torchtitan.datasets.pretokenize import pretokenize

from torchtitan.assets import resolve_path
from torchtitan.datasets.sources import DATASETS, DatasetError, resolve_source
from torchtitan.datasets.tokenizer import TokenizerError, tokenizer_from_file


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, help="text source: file, folder, glob or registered name")
    parser.add_argument("--out", required=True, type=Path, help="folder for the shards and manifest.json")
    parser.add_argument("--tokenizer", default="bundled:stdlib_docs/tokenizer.model",
                        help="tokenizer file (tiktoken or sentencepiece), as model.tokenizer_path takes it")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes (default: every core)")
    parser.add_argument("--parts", type=int, default=0,
                        help="output parts (default: one per 512 MB of input, at least one per worker)")
    parser.add_argument("--skip-bad-lines", action="store_true", help="skip and count malformed lines")
    parser.add_argument("--overwrite", action="store_true", help="replace shards already in --out")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.workers < 1 or args.parts < 0:
        parser.error("--workers must be >= 1 and --parts >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        source = resolve_source(args.input, "") if args.input in DATASETS else resolve_source("", args.input, "--input")
        tokenizer = tokenizer_from_file(resolve_path(args.tokenizer, "--tokenizer", TokenizerError), "--tokenizer")
        manifest, figures = pretokenize(source, tokenizer, args.out, args.workers, args.parts, args.skip_bad_lines,
                                        args.overwrite, progress=not args.quiet, description=args.input)
    except (DatasetError, TokenizerError) as e:
        print(f"tokenize_dataset: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the output folder not writable, the disk full: no manifest was written
        print(f"tokenize_dataset: cannot write {args.out}: {e.strerror or e} ({e.filename or 'a part file'}); "
              "the folder holds no manifest, so no run reads it", file=sys.stderr)
        return 1
    print(f"wrote {manifest}: {figures['documents']:,} documents, {figures['tokens']:,} tokens in {figures['parts']} "
          f"parts, {figures['seconds']:.1f} s ({figures['tokens_per_second'] / 1e6:.2f} M tokens/s with "
          f"{args.workers} workers)" + (f"; skipped {figures['skipped']} bad lines" if figures["skipped"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
