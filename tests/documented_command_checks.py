"""The checks every documented command gets without running (tests/documented_commands.py finds
them; tests/unit_tests/test_documented_commands.py applies these): its script's own argument
parsing, the launcher's config pre-check of every trainer job it starts, and whether it needs
what this machine lacks (then its doc must mark it syntax-only). docs/testing.md ("Documented
commands") states the convention."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import os
import sys
from pathlib import Path
from typing import Iterator, Sequence
from unittest import mock

from tests.documented_commands import DEFAULT_CONFIG, REPO_ROOT, DocCommand
from torchtitan.config import manager as config_manager
from torchtitan.config.job_config import JobConfig
from torchtitan.datasets.sources import DATASETS
from torchtitan.errors import ConfigError, UserError


@contextlib.contextmanager
def in_repo_root() -> Iterator[None]:
    """The docs' commands run in the repository root, where their relative paths resolve."""
    before = os.getcwd()
    os.chdir(REPO_ROOT)
    try:
        yield
    finally:
        os.chdir(before)


class ScriptUsageError(Exception):
    """A script's own parser refused a documented command; the message is what it printed."""


class _Parsed(Exception):
    def __init__(self, namespace: argparse.Namespace):
        self.namespace = namespace


@contextlib.contextmanager
def _stop_after_parsing() -> Iterator[None]:
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_then_stop):
        yield


def parse_script_args(cmd: DocCommand) -> argparse.Namespace:
    """The script's own argument parsing of `cmd.args`, in this process: its `main()` runs up to its
    parser's answer and stops there (nothing is read, trained or written). A usage mistake raises
    ScriptUsageError with what the script printed."""
    module = importlib.import_module(f"scripts.{Path(cmd.script).stem}")
    printed = io.StringIO()
    with _stop_after_parsing(), mock.patch.object(sys, "argv", [cmd.script, *cmd.args]), \
            contextlib.redirect_stderr(printed), contextlib.redirect_stdout(printed), in_repo_root():
        try:
            module.main()
        except _Parsed as parsed:
            return parsed.namespace
        except SystemExit as e:
            raise ScriptUsageError(f"exit {e.code}: {printed.getvalue().strip()}") from None
        except UserError as e:  # a parser that raises the project's one-line error
            raise ScriptUsageError(str(e)) from None
    raise AssertionError(f"{cmd.script}: main() returned without parsing its arguments")


def config_file(cmd: DocCommand) -> str:
    """--job.config_file, else CONFIG_FILE, else the launcher's default (the trainer alone: none)."""
    for i, a in enumerate(cmd.args):
        if a.startswith("--job.config_file="):
            return a.split("=", 1)[1]
        if a == "--job.config_file" and i + 1 < len(cmd.args):
            return cmd.args[i + 1]
    return cmd.env.get("CONFIG_FILE", DEFAULT_CONFIG) if cmd.program in ("launcher", "sbatch") else ""


def precheck_calls(cmd: DocCommand, script_args: argparse.Namespace | None = None) -> list[tuple[list[str], int]]:
    """(arguments of `python -m torchtitan.config.manager`, WORLD_SIZE) for each trainer job the
    command starts: as run_llama_train.sh runs it (`--launch-mode --job.config_file $CONFIG_FILE "$@"`,
    WORLD_SIZE=NGPU*NNODES), the trainer's own arguments, or the trainer options a script passes on."""
    if cmd.program in ("launcher", "sbatch"):
        return [(["--launch-mode", "--job.config_file", config_file(cmd), *cmd.args], cmd.world_size)]
    if cmd.program == "trainer":
        return [(list(cmd.args), cmd.world_size)]
    ns, name = script_args, Path(cmd.script).stem
    if ns is None:
        return []
    if name in ("benchmark", "step_breakdown") and not getattr(ns, "from_dump", None):
        config = ns.config if ns.config.endswith(".toml") else f"train_configs/{ns.config}.toml"
        return [(["--job.config_file", config, *ns.overrides], ns.nproc)]
    if name == "pipeline_bubble":
        return [(["--job.config_file", DEFAULT_CONFIG, "--experimental.pipeline_parallel_degree", str(ns.pp),
                  *ns.overrides], ns.pp)]
    if name == "loss_compare":  # --custom NAME NPROC "OVERRIDES"
        return [(["--job.config_file", DEFAULT_CONFIG, *overrides.split()], int(nproc)) for _, nproc, overrides in ns.custom]
    return []


def launcher_exports(cmd: DocCommand) -> dict[str, str]:
    """What run_llama_train.sh exports from its own variables before its pre-check: FT_LIGHTHOUSE
    (start, or host:port) becomes the lighthouse address the config check reads."""
    lighthouse = cmd.env.get("FT_LIGHTHOUSE", "") if cmd.program == "launcher" else ""
    if lighthouse == "start":
        return {"TORCHFT_LIGHTHOUSE": f"localhost:{cmd.env.get('FT_LIGHTHOUSE_PORT', '29510')}"}
    return {"TORCHFT_LIGHTHOUSE": lighthouse} if lighthouse else {}


def run_precheck(argv: Sequence[str], world_size: int, env: dict[str, str] | None = None) -> tuple[int, str]:
    """`WORLD_SIZE=<world_size> python -m torchtitan.config.manager <argv>` in this process (it
    imports no torch), with `env` added: the exit code and what it printed on stderr."""
    printed = io.StringIO()
    with mock.patch.dict(os.environ, {"WORLD_SIZE": str(world_size), **(env or {})}), contextlib.redirect_stderr(printed), \
            contextlib.redirect_stdout(io.StringIO()), in_repo_root():
        code = config_manager.main(list(argv))
    return code, printed.getvalue().strip()


# What a command reads, what it leaves for the doc's later commands, and what it needs.
# argparse dests of the files a script reads, and of those it writes.
SCRIPT_INPUTS = {"generate": ("checkpoint", "prompts_file", "tokenizer"),
                 "convert_checkpoint": ("hf_dir", "ckpt_dir", "in_file", "tokenizer"),
                 "tokenize_dataset": ("input", "tokenizer"), "train_tiktoken_bpe": ("corpus",),
                 "step_breakdown": ("from_dump",)}
SCRIPT_OUTPUTS = ("out", "out_dir", "out_file", "workdir", "dump", "plot")
# Every run writes here by default (job.dump_folder), so a later command may read from it.
DEFAULT_OUTPUTS = "outputs"


def job_config(cmd: DocCommand) -> JobConfig | None:
    """The merged JobConfig of a launcher, trainer or SLURM command (None if it does not parse)."""
    argv = [a for a in precheck_calls(cmd)[0][0] if a != "--launch-mode"]
    if "--help" in argv or "-h" in argv:
        return None
    try:
        with in_repo_root(), mock.patch.dict(os.environ, launcher_exports(cmd)):
            return config_manager.parse_args(argv)
    except ConfigError:
        return None


def reads_and_writes(cmd: DocCommand, script_args: argparse.Namespace | None) -> tuple[list[str], list[str]]:
    """The paths `cmd` reads and those it writes, as the doc names them."""
    reads, writes = [], []
    if cmd.program != "script":
        config = job_config(cmd)
        if config is not None:
            writes.append(config.job.dump_folder)
            if not config.job.dry_run:  # a dry run reads no data, tokenizer or weights
                reads += [config.model.tokenizer_path, config.training.dataset_path, config.validation.dataset_path,
                          config.checkpoint.initial_load_path]
        reads += [p for p in cmd.env.get("PYTHONPATH", "").split(":") if p]
    elif script_args is not None:
        ns, name = script_args, Path(cmd.script).stem
        reads += [str(getattr(ns, dest)) for dest in SCRIPT_INPUTS.get(name, ()) if getattr(ns, dest, None)]
        writes += [str(getattr(ns, dest)) for dest in SCRIPT_OUTPUTS if getattr(ns, dest, None)]
        if name == "data_benchmark":  # `corpus DIR` writes the folder the other modes read
            (writes if ns.mode == "corpus" else reads).append(str(ns.folder))
        if name == "tokenize_dataset":
            reads = [p for p in reads if p not in DATASETS]  # a registered source's name
    return [p for p in reads if p], [p for p in writes if p]


def missing_inputs(reads: Sequence[str], written_before: Sequence[str]) -> list[str]:
    """The paths read that do not exist here (relative to the repository root), are not shipped
    (`bundled:`) and are not written by an earlier runnable command of the doc or a default run."""
    before = [os.path.normpath(p) for p in [DEFAULT_OUTPUTS, *written_before]]
    missing = []
    for path in reads:
        p = os.path.normpath(path)
        if not (path.startswith("bundled:") or (REPO_ROOT / path).exists()
                or any(p == q or p.startswith(q + os.sep) for q in before)):
            missing.append(path)
    return missing


def cannot_run_here(cmd: DocCommand, reads: Sequence[str], written_before: Sequence[str]) -> str:
    """Why `cmd` cannot run on this machine as written ("": it can); an unmarked command must not
    need any of it."""
    if cmd.program == "sbatch":
        return "SLURM"
    if cmd.nnodes > 1:
        return f"{cmd.nnodes} nodes"
    if "cuda" in [value for option, value in zip(cmd.args, cmd.args[1:]) if option == "--device"] \
            or "--device=cuda" in cmd.args:
        return "a GPU"
    if cmd.program != "script":
        config = job_config(cmd)
        if config is not None and not config.job.dry_run and not config.training.dataset_path \
                and not isinstance(DATASETS.get(config.training.dataset), str):
            return f"a download (training.dataset {config.training.dataset})"
    missing = missing_inputs(reads, written_before)
    return f"files that are not here: {', '.join(missing)}" if missing else ""


# A script of this checkout runs with the project's interpreter as the docs show it: directly (its
# first line hands it to scripts/project_python.sh, which sets up .venv on first use and runs it
# there), or with the interpreter that set-up makes. A bare `python` or `torchrun` is whatever the
# reader's PATH finds: on a fresh machine, a Python without torch.
PROJECT_SHEBANG = "#!/usr/bin/env -S sh -c 'exec \"${0%/*}/project_python.sh\" \"$0\" \"$@\"'"
PROJECT_PYTHON = ".venv/bin/python"


def has_project_shebang(script: Path) -> bool:
    """The script runs directly: executable, and its first line is PROJECT_SHEBANG."""
    with script.open() as f:
        return os.access(script, os.X_OK) and f.readline().rstrip("\n") == PROJECT_SHEBANG


def runner_problem(cmd: DocCommand) -> str:
    """Why a documented script command would not run with the project's interpreter as written ("":
    it would)."""
    if cmd.program != "script" or not (REPO_ROOT / cmd.script).is_file():
        return ""
    first = cmd.runner[0] if cmd.runner else ""
    if first.removeprefix("./") == cmd.script:
        if has_project_shebang(REPO_ROOT / cmd.script):
            return ""
        return (f"{cmd}\n{cmd.script} is run directly, so it must be executable (chmod +x) and start with the "
                f"line {PROJECT_SHEBANG}")
    if first == PROJECT_PYTHON:
        return ""
    return (f"{cmd}\n`{first}` is whatever the reader's PATH finds (on a fresh machine, a Python without torch): "
            f"write `{cmd.script} ...` or `{PROJECT_PYTHON} {cmd.script} ...` (under torchrun: `{PROJECT_PYTHON} -m "
            f"torch.distributed.run ... {cmd.script} ...`) in {cmd.doc}")


def problem(cmd: DocCommand, written_before: Sequence[str]) -> str:
    """What is wrong with a documented command ("": nothing): its script is missing or refuses the
    arguments, the config pre-check refuses a trainer job it starts, or it is not marked syntax-only
    but needs what this machine lacks."""
    ns = None
    if cmd.script and not (REPO_ROOT / cmd.script).is_file():
        return f"{cmd}\n{cmd.script} does not exist"
    if cmd.program == "script":
        try:
            ns = parse_script_args(cmd)
        except ScriptUsageError as e:
            return f"{cmd}\n{cmd.script} refuses it: {e}\nfix the command in {cmd.doc}"
    for argv, world_size in precheck_calls(cmd, ns):
        code, error = run_precheck(argv, world_size, launcher_exports(cmd))
        if code:
            return (f"{cmd}\nthe config pre-check (WORLD_SIZE={world_size} python -m torchtitan.config.manager "
                    f"{' '.join(argv)}) refuses it: {error}\nfix the command in {cmd.doc}")
    if not cmd.syntax_only:
        why = cannot_run_here(cmd, reads_and_writes(cmd, ns)[0], written_before)
        if why:
            return (f"{cmd}\nneeds {why}: if it cannot run on a CPU machine with this checkout, mark it on the line "
                    f"above its block or paragraph in {cmd.doc}: <!-- doc-command: syntax-only (reason) --> "
                    '(with for "text" after the parenthesis, only the commands containing the text)')
    return ""


def written_by_runnable(commands: Sequence[DocCommand]) -> list[tuple[str, ...]]:
    """For each command, what the runnable commands of its doc before it write (a later command of
    the doc may read it)."""
    written: dict[str, list[str]] = {}
    before = []
    for cmd in commands:
        so_far = written.setdefault(cmd.doc, [])
        before.append(tuple(so_far))
        if cmd.syntax_only or cmd.usage:
            continue
        try:
            ns = parse_script_args(cmd) if cmd.program == "script" else None
        except ScriptUsageError:
            continue
        reads, writes = reads_and_writes(cmd, ns)
        if not cannot_run_here(cmd, reads, so_far):
            so_far += writes
    return before
