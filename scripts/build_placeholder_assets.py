"""Builds the placeholder training text and tokenizer under tests/assets/placeholder/.

PLACEHOLDER: until the project's bundled corpus arrives, the default job trains on real English
prose taken from the docstrings of Python's own standard library (present on every machine with
Python; Python Software Foundation License). Re-running this script with the same Python version
gives the same files.

    python scripts/build_placeholder_assets.py [--out tests/assets/placeholder]
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

# Modules with long, prose-heavy docstrings; a fixed list keeps the output reproducible.
MODULES = [
    "argparse", "asyncio", "collections", "concurrent.futures", "contextlib", "csv", "dataclasses",
    "datetime", "decimal", "difflib", "email", "enum", "fractions", "functools", "http.client",
    "http.server", "inspect", "ipaddress", "itertools", "json", "logging", "multiprocessing", "os",
    "pathlib", "pickle", "pydoc", "random", "re", "shutil", "socket", "sqlite3", "statistics",
    "string", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "tkinter", "turtle",
    "typing", "unittest", "urllib", "uuid", "xml.dom", "zipfile",
]
VOCAB_SIZE = 2256  # 256 byte-fallback pieces + specials + merges; the debug model's usual vocab


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
            if doc and len(doc) > 200:
                yield f"{mod.__name__}.{qualname}" if obj is not mod else qualname, doc
            if inspect.isclass(obj):
                for name, member in sorted(vars(obj).items()):
                    doc = inspect.getdoc(member) if not name.startswith("_") else None
                    if doc and len(doc) > 200 and id(member) not in seen:
                        seen.add(id(member))
                        yield f"{mod.__name__}.{qualname}.{name}", doc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="tests/assets/placeholder")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    warnings.simplefilter("ignore")

    corpus = out / "corpus.jsonl"
    n_docs = 0
    with corpus.open("w", encoding="utf-8") as f:
        for module_name in MODULES:
            for name, doc in iter_docstrings(module_name):
                f.write(json.dumps({"text": doc, "source": name}, ensure_ascii=False) + "\n")
                n_docs += 1
    print(f"wrote {corpus}: {n_docs} documents, {corpus.stat().st_size / 1e6:.2f} MB (Python {sys.version.split()[0]})")

    import sentencepiece as spm

    texts = (json.loads(line)["text"] for line in corpus.open(encoding="utf-8"))
    spm.SentencePieceTrainer.train(
        sentence_iterator=texts,
        model_prefix=str(out / "tokenizer"),
        model_type="bpe",
        vocab_size=VOCAB_SIZE,
        byte_fallback=True,  # every byte is representable: no unknown tokens
        character_coverage=1.0,
        num_threads=1,  # single thread: identical output on every run
        bos_id=1, eos_id=2, unk_id=0, pad_id=-1,
        max_sentence_length=1 << 16,
        minloglevel=2,
    )
    (out / "tokenizer.vocab").unlink(missing_ok=True)  # human-readable copy, not needed
    print(f"wrote {out / 'tokenizer.model'}: vocab {VOCAB_SIZE}")


if __name__ == "__main__":
    main()
