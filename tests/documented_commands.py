"""The shell commands README.md and docs/*.md show, extracted so that tests can check them: every
one through the script's own argument parsing and the launcher's config pre-check
(tests/documented_command_checks.py, applied by tests/unit_tests/test_documented_commands.py), one
of each kind run for real (tests/integration/test_documented_commands.py). docs/testing.md
("Documented commands") states the convention.

A documented command is a line of a fenced shell block (```bash, sh, shell, console or no language;
under `$ ` prompts only the prompted lines) or an inline code span of prose that starts the
launcher (`./run_llama_train.sh`, with environment prefixes such as `NGPU=4`), a script
(`scripts/*.py`, directly or through python or torchrun), the SLURM script
(`sbatch scripts/multinode_trainer.slurm`) or the trainer (`python -m torchtitan.train`, also under
torchrun). Continuations are joined, `# comments` dropped, `NAME=value` lines of a block expanded
in the lines after them. Usage lines with placeholders (`[--section.key value ...]`, `<run>`,
`FILE`, `N`) are recognised and not checked. A command that cannot run here (SLURM, several nodes,
a GPU, a download, files the user supplies) is marked on a line of its own above its block or
paragraph, for every command there, or with `for "text"` for the commands containing the text:

    <!-- doc-command: syntax-only (SLURM) -->
    <!-- doc-command: syntax-only (a GPU) for "--device cuda" -->
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

REPO_ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^\s*(```|~~~)\s*([\w+-]*)\s*$")
SHELL_LANGUAGES = {"", "bash", "sh", "shell", "console"}
MARKER = re.compile(r"<!--\s*doc-command:\s*syntax-only\s*\((?P<reason>[^)]+)\)\s*(?:for\s+\"(?P<only>[^\"]+)\"\s*)?-->")
INLINE_CODE = re.compile(r"(?<!`)`([^`]+)`(?!`)")
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
VARIABLE = re.compile(r"\$(?:\{(\w+)\}|(\w+))")
# A line that may start a command or set a variable: only such lines continue across an open quote.
SHELL_START = re.compile(r"^(export\s+|[A-Za-z_]\w*=|\./|\.venv/|python|torchrun|sbatch|scripts/|\$)")
HEREDOC = re.compile(r"<<-?\s*['\"]?(\w+)['\"]?")
# Placeholders a reader replaces: [optional ...], <run>, FILE, N (a usage line, not a command).
PLACEHOLDER = re.compile(r"^\[|\]$|\.\.\.|<[^>]+>|^[A-Z]+(\.[a-z0-9]+)?$")
PYTHON = re.compile(r"^(\S*/)?python(3(\.\d+)?)?$")
SCRIPT = re.compile(r"^(\./)?(scripts/\w+\.py)$")
LAUNCHER = "./run_llama_train.sh"
SLURM_SCRIPT = "scripts/multinode_trainer.slurm"
DEFAULT_CONFIG = "train_configs/debug_model.toml"
# The launcher's NGPU on a machine without GPUs: a command that sets no NGPU is checked as started here.
DEFAULT_NGPU = 2
# torchrun's and sbatch's options that take a value as the next word.
VALUED_OPTIONS = {"--nproc_per_node", "--nproc-per-node", "--nnodes", "--rdzv-endpoint", "--rdzv_endpoint",
                  "--rdzv-backend", "--rdzv_backend", "--rdzv-id", "--rdzv_id", "--node-rank", "--node_rank",
                  "--max-restarts", "--max_restarts", "--local-ranks-filter", "--role", "--tee", "--nodes", "-N"}
# Script -> the kind of command; a script not named here is its own kind.
SCRIPT_KINDS = {"generate": "generate", "convert_checkpoint": "convert", "tokenize_dataset": "tokenize",
                "plan_layout": "plan", "loss_compare": "loss_compare"}


@dataclass
class DocCommand:
    """One command as a doc shows it, and what it starts."""

    doc: str  # path relative to the repository root
    line: int  # 1-based line where the command starts
    text: str  # as written: continuations joined, comment dropped
    env: dict[str, str]  # VAR=value prefixes and the block's exported variables
    program: str = ""  # "launcher", "trainer", "script" or "sbatch"
    args: list[str] = field(default_factory=list)  # after the launcher, the trainer module or the script
    script: str = ""  # scripts/<name>.py ("script"), SLURM_SCRIPT ("sbatch")
    nproc: int = 1  # processes per node (NGPU, torchrun's --nproc_per_node, the SLURM script's GPUs)
    nnodes: int = 1
    inline: bool = False  # an inline code span of prose
    syntax_only: str = ""  # the doc's reason why it cannot run here ("": it can)
    usage: bool = False  # a usage line with placeholders: recognised, not checked
    runner: list[str] = field(default_factory=list)  # the words before `args`, as written (variables expanded)

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def kind(self) -> str:
        if self.program != "script":
            return "dry run" if any(a.split("=")[0] == "--job.dry_run" for a in self.args) else "train"
        return SCRIPT_KINDS.get(Path(self.script).stem, Path(self.script).stem)

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes

    def __str__(self) -> str:
        return f"{self.where}: {self.text}"


@dataclass
class Marker:
    """A `<!-- doc-command: syntax-only (reason) [for "text"] -->` line, and how many commands it marked."""

    doc: str
    line: int
    reason: str
    only: str  # "": every command of the block or paragraph below
    marked: int = 0


def documented_files() -> list[Path]:
    return [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]


def extract_all(files: Sequence[Path] | None = None, markers: list[Marker] | None = None) -> list[DocCommand]:
    return [cmd for path in (files or documented_files()) for cmd in extract(path, markers)]


def extract(path: Path, markers: list[Marker] | None = None) -> list[DocCommand]:
    """Every documented command of one markdown file, in order; its markers are added to `markers`."""
    doc = path.relative_to(REPO_ROOT).as_posix() if path.is_relative_to(REPO_ROOT) else str(path)
    lines = path.read_text().splitlines()
    commands: list[DocCommand] = []
    pending: list[Marker] = []  # the markers above the next block or paragraph
    i = 0
    while i < len(lines):
        fence, found = FENCE.match(lines[i]), MARKER.search(lines[i])
        if fence:
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip().startswith(fence.group(1))), len(lines))
            if fence.group(2).lower() in SHELL_LANGUAGES:
                commands += _marked(_block_commands(doc, lines[i + 1:end], i + 1, fence.group(2).lower()), pending)
            pending, i = [], end + 1
        elif found:
            pending.append(Marker(doc, i + 1, found.group("reason"), found.group("only") or ""))
            if markers is not None:
                markers.append(pending[-1])
            i += 1
        elif not lines[i].strip():
            i += 1  # a blank line between a marker and what it marks
        else:
            start = i
            while i < len(lines) and lines[i].strip() and not FENCE.match(lines[i]) and not MARKER.search(lines[i]):
                i += 1
            commands += _marked(_inline_commands(doc, lines[start:i], start), pending)
            pending = []
    return commands


def _marked(commands: list[DocCommand], markers: list[Marker]) -> list[DocCommand]:
    for cmd in commands:
        for marker in markers:
            if not marker.only or marker.only in cmd.text:
                cmd.syntax_only, marker.marked = marker.reason, marker.marked + 1
    return commands


def _block_commands(doc: str, body: list[str], first_line: int, language: str) -> list[DocCommand]:
    prompted = language == "console" or any(line.lstrip().startswith("$ ") for line in body)
    variables: dict[str, str] = {}
    exported: dict[str, str] = {}
    commands = []
    i = 0
    while i < len(body):
        start, text = i, body[i].strip()
        i += 1
        if prompted and not text.startswith("$ "):
            continue  # a program's output under a prompt line
        text = text.removeprefix("$ ")
        # Continuation lines, and the lines of a quoted value that spans several.
        while i < len(body) and (text.endswith("\\") or (SHELL_START.match(text) and not _balanced(text))):
            text = text.removesuffix("\\").rstrip() + " " + body[i].strip()
            i += 1
        heredoc = HEREDOC.search(text)
        while heredoc and i < len(body) and body[i].strip() != heredoc.group(1):
            i += 1  # a here-document's body is no command
        i += bool(heredoc)
        words = _split(text)
        export = words[:1] == ["export"]
        words = words[export:]
        if words and all(ENV_ASSIGNMENT.match(w) for w in words):  # NAME=value: a variable of the block
            for name, value in (w.split("=", 1) for w in words):
                variables[name] = _expand(value, variables)
                if export:
                    exported[name] = variables[name]
            continue
        cmd = parse_command(doc, first_line + start + 1, _strip_comment(text), variables, exported)
        if cmd is not None:
            commands.append(cmd)
    return commands


def _inline_commands(doc: str, paragraph: list[str], first_line: int) -> list[DocCommand]:
    """A paragraph's inline code spans that start a command; a Python script's bare name is a mention."""
    commands = []
    text = "\n".join(paragraph)
    for span in INLINE_CODE.finditer(text):
        line = first_line + 1 + text[: span.start()].count("\n")
        cmd = parse_command(doc, line, " ".join(span.group(1).split()), {}, {})
        if cmd is not None and (cmd.args or cmd.program in ("launcher", "sbatch")):
            cmd.inline = True
            commands.append(cmd)
    return commands


def _balanced(text: str) -> bool:
    try:
        shlex.split(text, comments=True)
    except ValueError:
        return False
    return True


def _split(text: str) -> list[str]:
    try:
        return shlex.split(text, comments=True)
    except ValueError:
        return []


def _strip_comment(text: str) -> str:
    """The command without its trailing `# comment` (a # inside quotes or inside a word stays)."""
    quote = ""
    for pos, ch in enumerate(text):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (pos == 0 or text[pos - 1].isspace()):
            return text[:pos].rstrip()
    return text.rstrip()


def _expand(text: str, variables: dict[str, str]) -> str:
    return VARIABLE.sub(lambda m: variables.get(m.group(1) or m.group(2), m.group(0)), text)


def parse_command(doc: str, line: int, text: str, variables: dict[str, str], exported: dict[str, str]) -> DocCommand | None:
    """A DocCommand if `text` starts one of the documented command forms, else None."""
    words = _split(_expand(text, variables))
    env = dict(exported)
    while words and ENV_ASSIGNMENT.match(words[0]):
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    if not words:
        return None
    cmd = DocCommand(doc, line, text, env, usage=any(PLACEHOLDER.search(w) for w in words))
    found = _parse_program(cmd, words)
    if found is not None:
        found.runner = words[: len(words) - len(found.args)]
    return found


def _parse_program(cmd: DocCommand, words: list[str]) -> DocCommand | None:
    """`cmd` with what its words start (program, args, script, world), or None."""
    program, rest = words[0], words[1:]
    if program == LAUNCHER:
        cmd.program, cmd.args = "launcher", rest
        cmd.nproc = _number(cmd.env.get("NGPU"), DEFAULT_NGPU)
        cmd.nnodes = _number(cmd.env.get("NNODES"), 1)
        return cmd
    if program == "sbatch":
        options, rest = _leading_options(rest)
        if rest[:1] != [SLURM_SCRIPT]:
            return None
        script_defaults = dict(re.findall(r"^#SBATCH\s+(--[\w-]+)=(\S+)", (REPO_ROOT / SLURM_SCRIPT).read_text(), re.M))
        cmd.program, cmd.script, cmd.args = "sbatch", SLURM_SCRIPT, rest[1:]
        cmd.nnodes = _number(options.get("--nodes", options.get("-N", script_defaults.get("--nodes"))), 1)
        cmd.nproc = _number(cmd.env.get("NGPU", script_defaults.get("--gpus-per-node")), 1)
        return cmd
    if PYTHON.match(program) and rest[:2] in (["-m", "torch.distributed.run"], ["-m", "torchtitan.runtime.launch"]):
        program, rest = "torchrun", rest[2:]
    if program == "torchrun":
        options, rest = _leading_options(rest)
        cmd.nproc = _number(options.get("--nproc_per_node", options.get("--nproc-per-node")), 1)
        cmd.nnodes = _number(options.get("--nnodes", "1").split(":")[-1], 1)
        program = "python"
    if PYTHON.match(program) and rest[:2] == ["-m", "torchtitan.train"]:
        cmd.program, cmd.args = "trainer", rest[2:]
        return cmd
    if PYTHON.match(program) and rest:
        program, rest = rest[0], rest[1:]
    script = SCRIPT.match(program)
    if script:
        cmd.program, cmd.script, cmd.args = "script", script.group(2), rest
        return cmd
    return None


def _number(text: str | None, default: int) -> int:
    return int(text) if text and text.isdigit() else default


def _leading_options(words: list[str]) -> tuple[dict[str, str], list[str]]:
    """`--a=1 --nnodes 2 --standalone rest...` -> ({"--a": "1", "--nnodes": "2", "--standalone": ""}, rest)."""
    options: dict[str, str] = {}
    i = 0
    while i < len(words) and words[i].startswith("-") and words[i] != "-m":
        name, eq, value = words[i].partition("=")
        if not eq and name in VALUED_OPTIONS and i + 1 < len(words):
            value, i = words[i + 1], i + 1
        options[name] = value
        i += 1
    return options, words[i:]
