"""The installed package trains the debug job from a folder outside the checkout.

What ships (the config, corpus and tokenizers) must be package data that the wheel carries and
that `bundled:` names find wherever the package lands: a path into the repository would work here
in the checkout and fail for everyone who ran `pip install`. The package is built from a copy of
the sources (so the build writes nothing into the checkout) with this venv's setuptools, offline,
and installed into a private folder that the run imports instead of the checkout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO_ROOT, read_metrics, read_setup

SHIPPED = ("stdlib_docs/corpus.jsonl", "stdlib_docs/tokenizer.model", "stdlib_docs/sentencepiece.model",
           "stdlib_docs/README.md", "chat_tokenizer/tokenizer.json", "chat_tokenizer/tokenizer_config.json",
           "train_configs/debug_model.toml")
# An outer launcher's variables (the suite may itself run under one) and any path to the checkout.
DROPPED_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_RUN_ID", "TORCHTITAN_REPORT_DIR", "PYTHONPATH", "PYTHONHOME")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """torchtitan built from a copy of the checkout and installed (no dependencies) into a folder."""
    root = tmp_path_factory.mktemp("installed")
    src = root / "src"
    shutil.copytree(REPO_ROOT / "torchtitan", src / "torchtitan", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):  # the README is the package's long description
        shutil.copy(REPO_ROOT / name, src / name)
    target = root / "site"
    result = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                             "--no-index", "--disable-pip-version-check", "--target", str(target), str(src)],
                            cwd=root, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return target


def _env(site: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in DROPPED_VARS}
    return {**env, "PYTHONPATH": str(site), "PYTHONNOUSERSITE": "1", "OMP_NUM_THREADS": "1"}


def test_the_wheel_carries_the_shipped_files(site):
    record = next(site.glob("torchtitan-*.dist-info")) / "RECORD"
    listed = {line.split(",")[0] for line in record.read_text().splitlines()}
    for name in SHIPPED:
        assert f"torchtitan/assets/{name}" in listed, name
        assert (site / "torchtitan" / "assets" / name).stat().st_size > 0, name


def test_the_debug_job_trains_from_the_installed_package(site, tmp_path):
    work = tmp_path / "elsewhere"  # outside the checkout: no train_configs/ or tests/ to lean on
    work.mkdir()
    env = _env(site)
    where = subprocess.run([sys.executable, "-c", "import torchtitan; print(torchtitan.__file__)"], cwd=work, env=env,
                           capture_output=True, text=True, timeout=60)
    assert Path(where.stdout.strip()).is_relative_to(site), where.stdout + where.stderr

    result = subprocess.run([sys.executable, "-m", "torchtitan.train",
                             "--job.config_file", "bundled:train_configs/debug_model.toml",
                             "--training.steps", "2", "--training.seq_len", "64", "--metrics.log_freq", "1",
                             "--metrics.peak_tflops", "1", "--job.dump_folder", str(work / "out")],
                            cwd=work, env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert [r["step"] for r in read_metrics(work / "out")] == [1, 2]
    assert read_setup(work / "out")["model"]["vocab_size"] == 2256  # the bundled tokenizer's
