#!/usr/bin/env -S sh -c 'exec "${0%/*}/project_python.sh" "$0" "$@"'
"""Tokenizes a text source once into memory-mapped token shards the trainer reads at no cost.

    .venv/bin/python scripts/tokenize_dataset.py --input data/web --out data/web-tokens \\
        --tokenizer bundled:stdlib_docs/tokenizer.model
    ./run_llama_train.sh --training.dataset_path data/web-tokens

--input takes what training.dataset_path takes (a .jsonl, .txt or .parquet file, a folder, a
glob) or a registered name (stdlib_docs). The output folder holds part-NNNNN.bin / .idx and a
manifest naming the tokenizer; the trainer refuses the shards with any other tokenizer. Uses every
core by default (--workers), prints a progress bar on stderr and, at the end, the figures. A
mistake (an option, the input, the output folder, a full disk) is one `error:` line on stderr and
exit status 2, as in the trainer.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's torchtitan, also where it is not installed

from torchtitan.assets import resolve_path
from torchtitan.datasets.pretokenize import pretokenize  # noqa: E402 - after the path above
from torchtitan.datasets.sources import DATASETS, DatasetError, local_source, resolve_source
from torchtitan.datasets.tokenizer import tokenizer_from_file
from torchtitan.errors import UserError


class _Parser(argparse.ArgumentParser):
    """argparse with its usage mistakes as one `error:` line (exit 2), like every other mistake here."""

    def error(self, message: str) -> NoReturn:
        raise UserError(f"{message} (see {self.prog} --help)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = _Parser(prog="tokenize_dataset.py", description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, help="text source: file, folder, glob or registered name")
    parser.add_argument("--out", required=True, type=Path, help="folder for the shards and manifest.json")
    parser.add_argument("--tokenizer", default="bundled:stdlib_docs/tokenizer.model",
                        help="tokenizer file (tiktoken, sentencepiece or a Hugging Face tokenizer.json) or a "
                             "Hugging Face tokenizer's folder, as model.tokenizer_path takes it")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes (default: every core)")
    parser.add_argument("--parts", type=int, help="output parts (default: one per 512 MB of input, at least one per "
                                                  "worker)")
    parser.add_argument("--skip-bad-lines", action="store_true", help="skip and count malformed lines")
    parser.add_argument("--overwrite", action="store_true", help="replace shards already in --out")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.workers < 1:
        raise UserError(f"--workers must be at least 1, got {args.workers}")
    if args.parts is not None and args.parts < 1:
        raise UserError(f"--parts must be at least 1, got {args.parts} (leave it out for one part per 512 MB of "
                        "input)")
    return args


def input_source(given: str) -> Any:
    """The source --input names: a registered name, else what training.dataset_path would read."""
    if given in DATASETS:
        return resolve_source(given, "")
    return local_source(resolve_path(given, "--input", DatasetError))


def input_folder(given: str) -> Path | None:
    """The folder --input names: the folder itself, or a glob's folder (the part before its first
    wildcard); None for a file or a registered name."""
    parts = Path(given).parts
    wild = [i for i, part in enumerate(parts) if any(c in part for c in "*?[")]
    if wild:
        return Path(*parts[:wild[0]]) if wild[0] else Path(".")
    return Path(given) if Path(given).is_dir() else None


def check_out(out: Path, given: str, files: list[Path]) -> None:
    """Refuses an --out that would mix token shards and the text they come from. Symbolic links are
    followed: a link to the input folder is the input folder."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; name a folder for the shards (it is created if missing)")
    target = out.resolve()
    folder = input_folder(given)
    if folder is not None and (folder.resolve() == target or folder.resolve() in target.parents):
        # Inside the text folder, the shards would be a second copy of its data that every later
        # --input or training.dataset_path on the folder walks past (and a copy of it carries).
        named = folder if folder.name else folder.resolve()  # "." has no name to build on
        beside = named.with_name(f"{named.name}-tokens")
        where = (f"is inside the input folder {folder}" if folder.resolve() != target else "is the input folder: its "
                 "manifest would make a run given that folder read the token shards instead of the text")
        raise UserError(f"--out {out} {where}; write the shards beside it (e.g. --out {beside})")
    # A folder that holds the input at any depth (a file's own folder, or one above it): the
    # manifest written into it makes the trainer read that folder as token shards
    # (sources.local_source), so a run given the folder would silently read the tokens and no longer
    # any of the text below it.
    for f in files:
        if target in f.resolve().parents:
            raise UserError(f"--out {out} holds the input {f}: a run given that folder would then read the token "
                            "shards instead of its text; choose an --out outside the input")


def _os_error(e: OSError, out: Path) -> UserError:
    """A read or write that failed (a full disk, an unwritable or unreadable path) as one line."""
    target, path = out.resolve(), Path(e.filename or out).resolve()
    if e.filename and path != target and target not in path.parents:
        return UserError(f"cannot read {e.filename}: {e.strerror or e}")
    # A folder this run made is removed again on failure (pretokenize); one that was there stays.
    left = "; the folder holds no manifest, so no run reads it" if out.is_dir() else ""
    return UserError(f"cannot write --out {out}: {e.strerror or e} ({e.filename or 'a part file'}){left}")


def tokenize(args: argparse.Namespace) -> None:
    try:
        source = input_source(args.input)
        check_out(args.out, args.input, source if isinstance(source, list) else [])
        tokenizer = tokenizer_from_file(resolve_path(args.tokenizer, "--tokenizer", UserError), "--tokenizer")
        manifest, figures = pretokenize(source, tokenizer, args.out, args.workers, args.parts or 0,
                                        args.skip_bad_lines, args.overwrite, progress=not args.quiet,
                                        description=args.input)
    except OSError as e:
        raise _os_error(e, args.out) from None
    print(f"wrote {manifest}: {figures['documents']:,} documents, {figures['tokens']:,} tokens in {figures['parts']} "
          f"parts, {figures['seconds']:.1f} s ({figures['tokens_per_second'] / 1e6:.2f} M tokens/s with "
          f"{args.workers} workers)" + (f"; skipped {figures['skipped']} bad lines" if figures["skipped"] else ""))


def main(argv: list[str] | None = None) -> int:
    try:
        tokenize(parse_args(argv))
    except UserError as e:
        print(e.line, file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
