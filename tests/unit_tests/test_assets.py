"""Shipped files: the `bundled:` rule, and every option that names a file going through it."""

import importlib.resources
import sys
import zipfile
from pathlib import Path

import pytest

import torchtitan
from scripts.build_test_assets import iter_docstrings
from torchtitan import assets
from torchtitan.assets import bundled_files, resolve_path
from torchtitan.config.manager import JobConfig, parse_args
from torchtitan.datasets.sources import DatasetError, resolve_source
from torchtitan.datasets.tokenizer import TokenizerError, build_tokenizer
from torchtitan.errors import ConfigError, UserError

ASSETS = Path(torchtitan.__file__).parent / "assets"


def test_plain_paths_are_returned_unchanged():
    for path in ("tokenizer.model", "./a/b.toml", "/abs/x.jsonl", "data/*.jsonl", "bundled", "Bundled:x"):
        assert resolve_path(path, "model.tokenizer_path") == path


def test_bundled_names_are_the_package_files():
    assert resolve_path("bundled:stdlib_docs/tokenizer.model", "x") == str(ASSETS / "stdlib_docs" / "tokenizer.model")
    assert resolve_path("bundled:train_configs/debug_model.toml", "x") == str(ASSETS / "train_configs" / "debug_model.toml")
    assert resolve_path("bundled:stdlib_docs", "x") == str(ASSETS / "stdlib_docs")  # a folder, e.g. for dataset_path
    assert {"stdlib_docs/corpus.jsonl", "stdlib_docs/tokenizer.model", "stdlib_docs/sentencepiece.model",
            "stdlib_docs/README.md", "train_configs/debug_model.toml"} <= set(bundled_files())


@pytest.mark.parametrize("name", ["bundled:nope.model", "bundled:", "bundled:stdlib_docs/nope", "bundled:../errors.py",
                                  "bundled:stdlib_docs/../../errors.py", "bundled:__init__.py", "bundled:/etc/passwd"])
def test_a_name_the_package_does_not_ship_is_one_line_of_the_callers_kind(name):
    with pytest.raises(TokenizerError) as e:
        resolve_path(name, "model.tokenizer_path", TokenizerError)
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"model.tokenizer_path {name!r}: the torchtitan package ships no such file")
    assert "stdlib_docs/tokenizer.model" in line  # what is shipped, to choose from
    with pytest.raises(UserError):  # the default kind
        resolve_path(name, "x")


def test_a_package_imported_from_a_zip_archive_says_so(tmp_path, monkeypatch):
    """Imported from a zip (zipimport), the shipped files have no path to open: one line saying how
    to install, and plain paths still work."""
    archive = tmp_path / "site.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("torchtitan/assets/stdlib_docs/tokenizer.model", "")
    zipped = zipfile.Path(archive, "torchtitan/assets/")
    monkeypatch.setattr(importlib.resources, "files", lambda package: zipped)
    with pytest.raises(UserError) as e:
        resolve_path("bundled:stdlib_docs/tokenizer.model", "model.tokenizer_path")
    assert str(e.value) == f"bundled files need torchtitan installed as a folder (pip install); it is imported from {zipped}"
    with pytest.raises(UserError, match="installed as a folder"):
        assets.bundled_files()
    assert resolve_path("tokenizer.model", "model.tokenizer_path") == "tokenizer.model"


def test_every_file_option_resolves_bundled_names():
    config = parse_args(["--job.config_file", "bundled:train_configs/debug_model.toml"])
    assert config.model.tokenizer_path == "bundled:stdlib_docs/tokenizer.model" == JobConfig().model.tokenizer_path
    assert build_tokenizer(config).n_words == 2256
    config.model.tokenizer_path = "bundled:stdlib_docs/sentencepiece.model"
    assert build_tokenizer(config).n_words == 2256
    assert resolve_source("stdlib_docs", "") == [ASSETS / "stdlib_docs" / "corpus.jsonl"]
    assert resolve_source("", "bundled:stdlib_docs") == [ASSETS / "stdlib_docs" / "corpus.jsonl"]
    with pytest.raises(ConfigError, match="job.config_file 'bundled:nope.toml': the torchtitan package ships no such file"):
        parse_args(["--job.config_file", "bundled:nope.toml"])
    with pytest.raises(DatasetError, match="training.dataset_path 'bundled:x.jsonl': the torchtitan"):
        resolve_source("", "bundled:x.jsonl")


def test_the_checkouts_train_configs_is_the_packaged_folder():
    """run_llama_train.sh's default CONFIG_FILE and every documented train_configs/ path keep working."""
    repo_configs = Path(__file__).resolve().parents[2] / "train_configs"
    assert repo_configs.resolve() == (ASSETS / "train_configs").resolve()


@pytest.mark.parametrize("config", ["debug_model.toml", "qwen3_moe_debug.toml", "gpt_oss_debug.toml"])
def test_the_shipped_debug_configs_validate_on_two_ranks(config):
    """`--validation.enabled` on a shipped debug config (the README's quick start) finds a full
    validation batch for each of the launcher's 2 ranks in the held-out split of the bundled corpus."""
    from torchtitan.datasets.shards import decide_data_shards
    from torchtitan.datasets.text_dataset import build_validation_dataloader

    job = parse_args(["--job.config_file", f"bundled:train_configs/{config}", "--validation.enabled"])
    tokenizer = build_tokenizer(job)
    for rank in range(2):
        shards = decide_data_shards(job.training.dataset_shards, rank, 2, None)
        inputs, _ = next(iter(build_validation_dataloader(job, tokenizer, shards)))
        assert inputs.shape == (job.training.batch_size, job.training.seq_len)


def test_the_corpus_builder_skips_modules_this_python_lacks(tmp_path, monkeypatch):
    """scripts/build_test_assets.py takes docstrings from a fixed list of standard modules: one this
    build of Python lacks, or a submodule that fails to import, is skipped, not the whole corpus."""
    doc = "A docstring long enough for the corpus, " * 3
    package = tmp_path / "stdlib_like"
    package.mkdir()
    (package / "__init__.py").write_text(f'"""{doc}"""\n')
    (package / "good.py").write_text(f'"""{doc}(good)"""\n')
    (package / "broken.py").write_text("raise ImportError('needs a C library this build lacks')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert [name for name, _ in iter_docstrings("stdlib_like")] == ["stdlib_like", "stdlib_like.good"]
    finally:
        for name in ("stdlib_like", "stdlib_like.good", "stdlib_like.broken"):
            sys.modules.pop(name, None)
    assert list(iter_docstrings("no_module_of_this_name")) == []
