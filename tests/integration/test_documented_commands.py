"""One documented command of each kind run for real: the dry run, training, generation, the
converter, tokenizing, the layout planner and the loss comparison. Each test takes its command from
the doc (tests/documented_commands.py), so a doc whose command breaks fails here, and changes only
what the name `cheaper` or `swap` says: a smaller model or fewer steps, and folders under tmp_path
instead of the doc's outputs/ and data/. What every documented command must pass without running
is tests/unit_tests/test_documented_commands.py."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from scripts import convert_checkpoint, loss_compare
from tests.documented_commands import LAUNCHER, REPO_ROOT, DocCommand, extract_all
from tests.helpers import read_metrics
from tests.machinery.warm_launcher import run_warm


def documented(doc: str, kind: str, contains: str = "") -> list[DocCommand]:
    """The commands of `doc` of this kind whose text contains `contains`, in the doc's order (at least one)."""
    found = [c for c in extract_all([REPO_ROOT / doc]) if c.kind == kind and contains in c.text and not c.usage]
    assert found, f"{doc} shows no {kind} command containing {contains!r} any more: pick another one here"
    return found


def swap(args: list[str], replacements: dict[str, str]) -> list[str]:
    """`args` with each value, or path prefix ending in '/', of `replacements` replaced."""
    out = []
    for a in args:
        for old, new in replacements.items():
            if a == old:
                a = new
            elif old.endswith("/") and a.startswith(old):
                a = new + a[len(old):]
        out.append(a)
    return out


def environment(cmd: DocCommand, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    return {**env, "OMP_NUM_THREADS": "1", **cmd.env, **extra}


def as_written(cmd: DocCommand, args: list[str], tmp_path: Path) -> tuple[list[str], dict[str, str]]:
    """The doc's shell line with `args` for its arguments (its interpreter or direct call as written),
    and the environment of a reader who ran the README's set-up: the project's .venv is not on PATH,
    and the `python` and `python3` PATH finds first fail, as a fresh machine's Python without torch would."""
    stubs = tmp_path / "fresh_machine_bin"
    stubs.mkdir(exist_ok=True)
    for name in ("python", "python3"):
        stub = stubs / name
        stub.write_text(f"#!/bin/sh\necho '{name} from PATH: a fresh machine has no torch there' >&2\nexit 1\n")
        stub.chmod(0o755)
    project_bins = {str(Path(sys.prefix) / "bin"), str(REPO_ROOT / ".venv" / "bin"),
                    os.path.join(os.environ.get("VIRTUAL_ENV", "-"), "bin")}
    path = [str(stubs), *(d for d in os.environ.get("PATH", "").split(os.pathsep) if d and d not in project_bins)]
    env = {k: v for k, v in environment(cmd).items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    runner = cmd.runner
    venv = os.environ.get("TORCHTITAN_VENV")
    if venv and runner[:1] == [".venv/bin/python"] and not (REPO_ROOT / ".venv").exists():
        runner = [f"{venv}/bin/python", *runner[1:]]  # the README's .venv lives where TORCHTITAN_VENV says
    return ["bash", "-c", shlex.join([*runner, *args])], {**env, "PATH": os.pathsep.join(path)}


def run(argv: list[str], env: dict[str, str], timeout: int = 300) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{' '.join(argv)}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


# The launcher's NGPU on a machine without GPUs; said outright, so that a GPU host runs the same job.
CPU_NGPU = "2"
# Training made cheap: the tiny model, 64-token sequences, 2 steps.
CHEAPER_TRAINING = ["--model.flavor", "tiny", "--training.seq_len", "64", "--training.steps", "2"]


def test_the_quick_start_dry_run_starts_all_512_ranks(tmp_path):
    """README's (and docs/memory.md's) 405B dry run at world size 512, FSDP 8 x TP 8 x PP 8, through
    the launcher. Cheaper: the debug model's 8 blocks for the 126 of 405B (the whole command takes
    about 95 s on 2 cores, the debug model 6 s); the layout, the world, the schedule and the batch
    are the doc's."""
    cmd = documented("README.md", "dry run")[0]
    assert cmd.args in [c.args for c in documented("docs/memory.md", "dry run")]  # the same command there
    result = run([LAUNCHER, *cmd.args, "--model.flavor", "debugmodel", "--job.dump_folder", str(tmp_path)],
                 environment(cmd))
    log = result.stdout + result.stderr
    assert "dry run: 512 ranks of llama3 debugmodel (pp 8 x dp_shard 8 x tp 8)" in log
    assert "schedule 1F1B, 8 microbatches" in log and "fits" in log
    # One process (the launcher starts no torchrun for it), a row for the first rank of the first
    # and of the last pipeline stage, and no checkpoint written.
    rows = re.findall(r"INFO -\s+(\d+)\s+(\d+)\s+[\d.]+", log)  # rank, its stage, the figures
    assert rows == [("0", "0"), ("448", "7")], log[-3000:]
    assert "largest: rank" in log and "torchrun" not in log
    assert not list(tmp_path.rglob("step-*")), "a dry run writes no checkpoint"


@pytest.fixture(scope="module")
def readme_run(tmp_path_factory) -> Path:
    """README's `./run_llama_train.sh --checkpoint.enable_checkpoint --validation.enabled`, through
    the launcher on 2 CPU ranks, cheaper (CHEAPER_TRAINING) and into a temporary dump folder."""
    cmd = documented("README.md", "train", "--checkpoint.enable_checkpoint --validation.enabled")[0]
    dump = tmp_path_factory.mktemp("readme_run")
    run([LAUNCHER, *cmd.args, *CHEAPER_TRAINING, "--job.dump_folder", str(dump)],
        environment(cmd, NGPU=cmd.env.get("NGPU", CPU_NGPU)))
    return dump


@pytest.mark.budget("the launcher's own 2 ranks (torchrun, 3 s of imports each) train the README's job")
def test_the_readme_training_command_saves_and_validates(readme_run):
    assert [r["step"] for r in read_metrics(readme_run)] == [1, 2]
    rows = [json.loads(line) for line in (readme_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r.get("record") == "validation"] == [2]
    assert (readme_run / "checkpoint" / "step-2").is_dir()


def test_the_readme_generation_command_continues_the_prompt(readme_run, tmp_path):
    """README's generate.py command on the run above (its outputs/ is the run's dump folder),
    4 new tokens instead of 64, run as written (as_written)."""
    cmd = documented("README.md", "generate")[0]
    args = swap(cmd.args, {"outputs/": f"{readme_run}/"})
    result = run(*as_written(cmd, [*args, "--max-new-tokens", "4"], tmp_path))
    assert result.stdout.startswith("The os module"), result.stdout
    assert "generated" in result.stderr


def test_the_checkpoint_docs_conversions_round_trip(readme_run, tmp_path):
    """docs/checkpoint.md's converter block, in order, on the run above, except its Hugging Face
    download (syntax-only): DCP -> HF, DCP -> torch.save, torch.save -> DCP. The doc's step-1000 is
    the run's step-2 and its flavor `tiny`; the outputs go to tmp_path."""
    commands = [c for c in documented("docs/checkpoint.md", "convert") if not c.syntax_only]
    assert [c.args[0] for c in commands] == ["dcp-to-hf", "dcp-to-torch", "torch-to-dcp"]
    replacements = {"outputs/checkpoint/step-1000": str(readme_run / "checkpoint" / "step-2"), "debugmodel": "tiny",
                    "hf_out": str(tmp_path / "hf_out"), "model.pt": str(tmp_path / "model.pt"),
                    "ckpt/": f"{tmp_path}/ckpt/"}
    assert "\nmkdir -p ckpt " in (REPO_ROOT / "docs/checkpoint.md").read_text()  # the block makes ckpt/ first
    (tmp_path / "ckpt").mkdir()
    for cmd in commands:
        assert convert_checkpoint.main(swap(cmd.args, replacements)) == 0, cmd
    assert (tmp_path / "hf_out" / "config.json").is_file() and (tmp_path / "model.pt").is_file()
    assert (tmp_path / "ckpt" / "from_torch").is_dir()


@pytest.mark.fast
def test_the_data_docs_tokenize_command_writes_shards(tmp_path):
    """docs/data.md's tokenize_dataset.py command (syntax-only there: it reads your corpus in
    data/web) on 40 documents written to tmp_path/web, its shards to tmp_path/web-tokens."""
    cmd = documented("docs/data.md", "tokenize")[0]
    (tmp_path / "web").mkdir()
    (tmp_path / "web" / "docs.jsonl").write_text("".join(
        json.dumps({"text": f"Document {i}: the os module offers a portable way to use the system."}) + "\n"
        for i in range(40)))
    args = swap(cmd.args, {"data/web": str(tmp_path / "web"), "data/web-tokens": str(tmp_path / "web-tokens")})
    run(*as_written(cmd, args, tmp_path))
    assert (tmp_path / "web-tokens" / "manifest.json").is_file()


@pytest.mark.fast
def test_the_readme_planner_command_prints_layouts(tmp_path):
    """README's plan_layout.py command (also docs/memory.md's), run as written (as_written: the
    script's own first line must find the project's interpreter). Cheaper: the tiny flavor for
    70B, and one layout confirmed by a dry run instead of three."""
    cmd = documented("README.md", "plan")[0]
    assert cmd.args in [c.args for c in documented("docs/memory.md", "plan")]  # the same command there
    out = run(*as_written(cmd, swap(cmd.args, {"70B": "tiny"}) + ["--top", "1"], tmp_path)).stdout
    assert "on 256 devices of 80 GiB" in out and "1. " in out and "--training.data_parallel_shard_degree" in out


@pytest.mark.budget("a seed checkpoint, a one-process baseline and a 4-rank run of the debug model")
def test_the_parity_docs_custom_layout_compares_losses(tmp_path, capsys):
    """docs/parity.md's `loss_compare.py --custom mine 4 "--training.data_parallel_shard_degree 4"`,
    in this process through the suite's warm runner, 2 steps instead of 10, in tmp_path."""
    cmd = documented("docs/parity.md", "loss_compare", "--custom")[0]
    assert loss_compare.main([*cmd.args, "--steps", "2", "--workdir", str(tmp_path)], runner=run_warm) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| mine "))
    assert row.rstrip().endswith("| ok |")
