"""The files the package ships, and the one rule by which an option names them.

Shipped here: `stdlib_docs/` (the bundled corpus, its tiktoken and sentencepiece tokenizers and their
provenance), `chat_tokenizer/` (a tiny Hugging Face tokenizer.json with a chat template) and
`train_configs/` (the TOML configs; the repository's `train_configs/` links here).

An option that takes a file (job.config_file, model.tokenizer_path, training.dataset_path, the
converter's --tokenizer) names a shipped file as `bundled:<path under this folder>`, for example
`bundled:stdlib_docs/tokenizer.model` or `bundled:train_configs/debug_model.toml`. Such a name works
from any working directory, in the checkout and in an installed package alike. Every other value is
an ordinary path, relative to the working directory, and is used as given.
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path, PurePosixPath

from torchtitan.errors import UserError

BUNDLED_PREFIX = "bundled:"


def resolve_path(path: str, option: str, error: type[UserError] = UserError) -> str:
    """The file-system path an option's value stands for: a `bundled:` name becomes the shipped file's
    (or folder's) path, anything else is returned unchanged. A bundled name the package does not ship
    raises `error` (the caller's own kind of UserError), one line naming the option and what is shipped."""
    if not path.startswith(BUNDLED_PREFIX):
        return path
    name = PurePosixPath(path[len(BUNDLED_PREFIX):])
    root = _assets_root()
    # Only the data folders can be named: not this module, and nothing outside the package.
    shipped = name.parts and not name.is_absolute() and ".." not in name.parts and name.parts[0] in _data_folders(root)
    if not shipped or not root.joinpath(*name.parts).exists():
        raise error(f"{option} {path!r}: the torchtitan package ships no such file; "
                    f"bundled files: {', '.join(bundled_files())}")
    return str(root.joinpath(*name.parts))


def bundled_files() -> list[str]:
    """Every shipped file, as the name that follows `bundled:`."""
    root = _assets_root()
    return sorted(p.relative_to(root).as_posix() for folder in _data_folders(root)
                  for p in (root / folder).rglob("*") if p.is_file())


def _data_folders(root: Path) -> set[str]:
    return {p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("__")}


def _assets_root() -> Path:
    root = importlib.resources.files(__name__)
    if not isinstance(root, Path):  # e.g. imported from a zip archive: its files have no path to open
        raise UserError(f"bundled files need torchtitan installed as a folder (pip install); it is imported from {root}")
    return root
