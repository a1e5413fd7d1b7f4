"""Every command README.md and docs/*.md show (tests/documented_commands.py), checked without
running it (tests/documented_command_checks.py): the script's own argument parsing and the
launcher's config pre-check with the same arguments, in this process (milliseconds each); a
command that cannot run here must be marked so in its doc. One command of each kind runs for real
in tests/integration/test_documented_commands.py."""

from __future__ import annotations

import functools
from collections import Counter

import pytest

from tests.documented_command_checks import (
    has_project_shebang,
    in_repo_root,
    precheck_calls,
    problem,
    run_precheck,
    runner_problem,
    written_by_runnable,
)
from tests.documented_commands import REPO_ROOT, Marker, extract, extract_all
from torchtitan.config import rules
from torchtitan.config.manager import parse_args
from torchtitan.errors import ConfigError

MARKERS: list[Marker] = []
COMMANDS = extract_all(markers=MARKERS)
CHECKED = [cmd for cmd in COMMANDS if not cmd.usage]
# What the docs showed when this test was written (96 commands, 6 of them usage lines): an extractor
# that finds fewer has broken, or commands left the docs (then lower these, on purpose).
AT_LEAST_CHECKED = 85
KINDS = {"train", "dry run", "generate", "convert", "tokenize", "plan", "loss_compare"}


def test_the_docs_show_commands_of_every_kind():
    kinds = Counter(cmd.kind for cmd in CHECKED)
    docs = Counter(cmd.doc for cmd in CHECKED)
    syntax_only = Counter(cmd.syntax_only for cmd in CHECKED if cmd.syntax_only)
    print(f"{len(COMMANDS)} documented commands: {len(CHECKED)} checked, {len(COMMANDS) - len(CHECKED)} usage lines; "
          f"{sum(syntax_only.values())} syntax-only\nby kind: {dict(kinds)}\nby doc: {dict(docs)}\n"
          f"syntax-only: {dict(syntax_only)}")
    assert len(CHECKED) >= AT_LEAST_CHECKED, f"found {len(CHECKED)} documented commands, expected {AT_LEAST_CHECKED}+"
    assert KINDS <= set(kinds), f"no documented command of kind {KINDS - set(kinds)}"
    assert {"README.md", "docs/operations.md", "docs/parity.md"} <= set(docs)


@functools.cache
def written_before() -> list[tuple[str, ...]]:
    return written_by_runnable(CHECKED)


@pytest.mark.parametrize("index", range(len(CHECKED)), ids=[cmd.where for cmd in CHECKED])
def test_documented_command(index):
    """The script's parser accepts the command, the config pre-check passes every trainer job it
    starts (as run_llama_train.sh runs it: WORLD_SIZE = NGPU x NNODES), and an unmarked command
    needs nothing this machine lacks (tests/documented_commands.problem)."""
    assert problem(CHECKED[index], written_before()[index]) == ""


def test_documented_scripts_run_with_the_projects_python():
    """Every documented script command, usage lines included, runs its script with the project's
    interpreter as written: directly (the script's first line finds it) or with .venv/bin/python;
    never with whatever `python` or `torchrun` the reader's PATH finds."""
    wrong = [runner_problem(cmd) for cmd in COMMANDS if runner_problem(cmd)]
    assert not wrong, "\n\n".join(wrong)


def test_every_script_runs_directly():
    """Each script with a main is executable and starts with the line that hands it to
    scripts/project_python.sh, so `scripts/<name>.py ...` works wherever a doc shows it."""
    scripts = [p for p in sorted((REPO_ROOT / "scripts").glob("*.py")) if '__name__ == "__main__"' in p.read_text()]
    assert len(scripts) > 20
    assert [p.name for p in scripts if not has_project_shebang(p)] == []


def test_a_bare_python_or_torchrun_is_refused(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("```bash\npython scripts/plan_layout.py --flavor 8B --ngpu 8\n"
                   "torchrun --nproc_per_node 2 scripts/generate.py --checkpoint c --prompt x\n"
                   ".venv/bin/python -m torch.distributed.run --nproc_per_node 2 scripts/generate.py --checkpoint c "
                   "--prompt x\nscripts/plan_layout.py --flavor 8B --ngpu 8\n```\n")
    found = [runner_problem(cmd) for cmd in extract(doc)]
    assert "`python` is whatever the reader's PATH finds" in found[0]
    assert "`torchrun` is whatever the reader's PATH finds" in found[1]
    assert found[2:] == ["", ""]


def test_every_marker_marks_a_command():
    stale = [m for m in MARKERS if not m.marked]
    assert not stale, "syntax-only markers that mark no command (remove them, or fix their `for` text): " + \
        ", ".join(f"{m.doc}:{m.line}" for m in stale)


def test_the_batch_that_does_not_split_into_microbatches_is_refused_by_the_precheck():
    """The README's dry run as it was (405B's batch 2 per rank into 8 pipeline microbatches): the
    pre-check refuses it in milliseconds, before torch, with the same line that the shapes phase
    gives every start-up (preflight: the trainer, the dry run)."""
    old = ["--job.config_file", "train_configs/llama3_405b.toml", "--job.dry_run", "--job.dry_run_world_size", "512",
           "--training.data_parallel_shard_degree", "8", "--experimental.pipeline_parallel_degree", "8",
           "--memory_estimation.device_memory_gib", "80"]
    line = "training.batch_size 2 must split into experimental.pipeline_parallel_microbatches = 8 equal microbatches"
    assert run_precheck(["--launch-mode", *old], 2) == (2, f"error: {line}")
    with pytest.raises(ConfigError, match=line), in_repo_root():
        rules.check_shapes(parse_args(old))
    assert run_precheck(["--launch-mode", *old, "--training.batch_size", "32"], 2) == (0, "")


SAMPLE = '''\
# A doc

Start with `./run_llama_train.sh --training.steps 3`; `scripts/generate.py` is a name, not a command,
and `scripts/plan_layout.py --flavor 8B --ngpu 8` is one.

```bash
export OMP_NUM_THREADS=1
PY=".venv/bin/python scripts/convert_checkpoint.py"
NGPU=4 CONFIG_FILE=train_configs/qwen3_moe_debug.toml ./run_llama_train.sh \\
    --training.tensor_parallel_degree 2   # TP 2
$PY dcp-to-torch outputs/checkpoint/step-2 model.pt
./run_llama_train.sh [--section.key value ...]
python - <<'EOF'
./run_llama_train.sh --inside-a-heredoc
EOF
torchrun --standalone --nproc_per_node=2 -m torchtitan.train --training.steps 1
```

<!-- doc-command: syntax-only (SLURM) -->
<!-- doc-command: syntax-only (a GPU) for "cuda" -->
```
$ sbatch --nodes=3 scripts/multinode_trainer.slurm --training.steps 2
the job's output
$ python scripts/generate.py --checkpoint c --prompt "x # y" --device cuda
```

```toml
[job]
```
'''


def test_the_extractor_reads_blocks_spans_variables_and_markers(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text(SAMPLE)
    markers: list[Marker] = []
    found = [(c.line, c.program, c.kind, c.args, c.world_size, c.env, c.syntax_only, c.usage, c.inline)
             for c in extract(doc, markers)]
    assert found == [
        (3, "launcher", "train", ["--training.steps", "3"], 2, {}, "", False, True),
        (4, "script", "plan", ["--flavor", "8B", "--ngpu", "8"], 1, {}, "", False, True),
        (9, "launcher", "train", ["--training.tensor_parallel_degree", "2"], 4,
         {"OMP_NUM_THREADS": "1", "NGPU": "4", "CONFIG_FILE": "train_configs/qwen3_moe_debug.toml"}, "", False, False),
        (11, "script", "convert", ["dcp-to-torch", "outputs/checkpoint/step-2", "model.pt"], 1,
         {"OMP_NUM_THREADS": "1"}, "", False, False),
        (12, "launcher", "train", ["[--section.key", "value", "...]"], 2, {"OMP_NUM_THREADS": "1"}, "", True, False),
        (16, "trainer", "train", ["--training.steps", "1"], 2, {"OMP_NUM_THREADS": "1"}, "", False, False),
        (22, "sbatch", "train", ["--training.steps", "2"], 24, {}, "SLURM", False, False),
        (24, "script", "generate", ["--checkpoint", "c", "--prompt", "x # y", "--device", "cuda"], 1, {}, "a GPU",
         False, False),
    ]
    assert [(m.line, m.marked) for m in markers] == [(19, 2), (20, 1)]
    assert precheck_calls(extract(doc)[2]) == [(["--launch-mode", "--job.config_file", "train_configs/qwen3_moe_debug.toml",
                                                 "--training.tensor_parallel_degree", "2"], 4)]


BROKEN = """\
```bash
./run_llama_train.sh --training.stepz 3
NGPU=3 ./run_llama_train.sh --training.tensor_parallel_degree 2
.venv/bin/python scripts/plan_layout.py --flavor 8B
.venv/bin/python scripts/generate.py --checkpoint path/to/Llama-3.2-1B --prompt hi
.venv/bin/python scripts/tokenize_dataset.py --input bundled:stdlib_docs/corpus.jsonl --out data/tokens
.venv/bin/python scripts/generate.py --checkpoint data/tokens --prompt hi
./run_llama_train.sh --training.dataset_path data/elsewhere
sbatch scripts/multinode_trainer.slurm
```
"""


def test_the_checks_name_what_breaks_a_command(tmp_path):
    """A misspelt option, degrees that do not fit the world, a script's missing argument, an
    unmarked command that needs files nobody made or SLURM; an earlier command's output is there."""
    doc = tmp_path / "doc.md"
    doc.write_text(BROKEN)
    commands = extract(doc)
    found = [problem(cmd, before).partition("\n")[2] for cmd, before in zip(commands, written_by_runnable(commands))]
    assert "refuses it: error: unknown option --training.stepz; did you mean 'steps'?" in found[0]
    assert "refuses it: error: training.tensor_parallel_degree 2 does not divide the world size 3 (NGPU)" in found[1]
    assert "plan_layout.py refuses it: exit 2: error: the following arguments are required: --ngpu" in found[2]
    assert found[3].startswith("needs files that are not here: path/to/Llama-3.2-1B: if it cannot run on a CPU machine")
    assert "<!-- doc-command: syntax-only (reason) -->" in found[3]
    assert found[4:6] == ["", ""]  # data/tokens: written by the line above
    assert found[6].startswith("needs files that are not here: data/elsewhere: ")
    assert found[7].startswith("needs SLURM: ")
