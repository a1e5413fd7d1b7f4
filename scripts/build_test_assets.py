#!/usr/bin/env -S sh -c 'exec "${0%/*}/project_python.sh" "$0" "$@"'
"""Builds the bundled corpus and its two tokenizers under torchtitan/assets/stdlib_docs/.

The corpus is real English prose (with some code) taken from the docstrings of Python's own
standard library: present on every machine with Python, under the Python Software Foundation
License. From it the script trains
- tokenizer.model: a Llama-3 format tiktoken rank file (2,000 byte-level BPE ranks; with Llama 3's
  256 special tokens the vocabulary is 2,256), and
- sentencepiece.model: a Llama-2 format sentencepiece BPE model of 2,256 pieces (byte fallback).
Re-running it under the same Python version gives byte-identical files.

    .venv/bin/python scripts/build_test_assets.py [--out torchtitan/assets/stdlib_docs]
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import pkgutil
import sys
import warnings
from pathlib import Path

from torchtitan.datasets.bpe_trainer import save_tiktoken_ranks, train_bpe

# Modules with long, prose-heavy docstrings; a fixed list keeps the output reproducible.
MODULES = [
    "argparse", "asyncio", "collections", "concurrent.futures", "contextlib", "csv", "dataclasses",
    "datetime", "decimal", "difflib", "email", "enum", "fractions", "functools", "http.client",
    "http.server", "inspect", "ipaddress", "itertools", "json", "logging", "multiprocessing", "os",
    "pathlib", "pickle", "pydoc", "random", "re", "shutil", "socket", "sqlite3", "statistics",
    "string", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "tkinter", "turtle",
    "typing", "unittest", "urllib", "uuid", "xml.dom", "zipfile",
    "collections.abc", "configparser", "ctypes", "doctest", "ftplib", "gettext", "hashlib", "heapq",
    "imaplib", "importlib", "io", "mailbox", "optparse", "pdb", "platform", "plistlib", "queue",
    "sched", "selectors", "smtplib", "ssl", "struct", "sysconfig", "timeit", "tokenize", "traceback",
    "types", "unittest.mock", "warnings", "wave", "weakref", "xml.etree.ElementTree", "zoneinfo",
    "bdb", "calendar", "cmd", "codecs", "copy", "dis", "filecmp", "fnmatch", "glob", "gzip",
    "html.parser", "locale", "mimetypes", "numbers", "operator", "pprint", "pstats", "shlex",
    "socketserver", "trace", "bz2", "lzma", "secrets", "graphlib", "contextvars", "abc",
    "xml.sax", "xmlrpc", "wsgiref", "http.cookiejar", "http.cookies", "curses", "venv", "compileall",
    "pickletools", "base64", "quopri", "symtable", "modulefinder", "netrc", "pkgutil", "runpy",
    "ast", "array", "cgi", "code", "codeop", "colorsys", "dbm", "getpass", "hmac", "linecache",
    "reprlib", "stat", "tabnanny", "tomllib", "zlib", "zipapp", "math", "cmath", "sys", "time",
]
VOCAB_SIZE = 2256  # the debug model's usual vocabulary: 2,000 BPE ranks + 256 Llama-3 specials
TIKTOKEN_RANKS = VOCAB_SIZE - 256
MIN_CHARS = 80  # shorter docstrings are mostly one-line signatures


def iter_docstrings(module_name: str):
    """Yields (qualified name, docstring) for a module, its public classes, functions and methods."""
    try:
        module = importlib.import_module(module_name)
    except Exception:  # a module missing on this build of Python is simply skipped
        return
    seen = set()
    submodules = [module]
    if hasattr(module, "__path__"):
        for info in sorted(pkgutil.iter_modules(module.__path__), key=lambda i: i.name):
            if not info.name.startswith("_") and "test" not in info.name:
                try:
                    submodules.append(importlib.import_module(f"{module_name}.{info.name}"))
                except Exception:
                    pass
    for mod in submodules:
        for qualname, obj in [(mod.__name__, mod)] + sorted(vars(mod).items()):
            if qualname.startswith("_") or id(obj) in seen:
                continue
            if obj is not mod and getattr(obj, "__module__", None) != mod.__name__:
                continue
            seen.add(id(obj))
            doc = inspect.getdoc(obj)
            if doc and len(doc) >= MIN_CHARS:
                yield f"{mod.__name__}.{qualname}" if obj is not mod else qualname, doc
            if inspect.isclass(obj):
                for name, member in sorted(vars(obj).items()):
                    doc = inspect.getdoc(member) if not name.startswith("_") else None
                    if doc and len(doc) >= MIN_CHARS and id(member) not in seen:
                        seen.add(id(member))
                        yield f"{mod.__name__}.{qualname}.{name}", doc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="torchtitan/assets/stdlib_docs")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    warnings.simplefilter("ignore")

    corpus = out / "corpus.jsonl"
    n_docs, seen_texts = 0, set()
    with corpus.open("w", encoding="utf-8") as f:
        for module_name in MODULES:
            for name, doc in iter_docstrings(module_name):
                if doc in seen_texts:  # inherited or aliased docstrings appear under several names
                    continue
                seen_texts.add(doc)
                f.write(json.dumps({"text": doc, "source": name}, ensure_ascii=False) + "\n")
                n_docs += 1
    print(f"wrote {corpus}: {n_docs} documents, {corpus.stat().st_size / 1e6:.2f} MB (Python {sys.version.split()[0]})")

    texts = [json.loads(line)["text"] for line in corpus.open(encoding="utf-8")]
    ranks = train_bpe(texts, TIKTOKEN_RANKS)
    save_tiktoken_ranks(ranks, out / "tokenizer.model")
    print(f"wrote {out / 'tokenizer.model'}: {len(ranks)} tiktoken ranks (+256 special tokens)")

    import sentencepiece as spm

    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts),
        model_prefix=str(out / "sentencepiece"),
        model_type="bpe",
        vocab_size=VOCAB_SIZE,
        byte_fallback=True,  # every byte is representable: no unknown tokens
        character_coverage=1.0,
        num_threads=1,  # single thread: identical output on every run
        bos_id=1, eos_id=2, unk_id=0, pad_id=-1,
        max_sentence_length=1 << 16,
        minloglevel=2,
    )
    (out / "sentencepiece.vocab").unlink(missing_ok=True)  # human-readable copy, not needed
    print(f"wrote {out / 'sentencepiece.model'}: vocab {VOCAB_SIZE}")


if __name__ == "__main__":
    main()
