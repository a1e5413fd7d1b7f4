"""Config fuzzing: seeded random option sets, valid and invalid, through every torch-free way a job's
configuration is read, and a share of them through preflight.

- Option sets (types right and wrong, negatives, zero, huge numbers, unknown choices, empty strings,
  odd paths, old and unknown options, parallel degrees and features together), each written once as
  a TOML file and once as command-line options, through the launcher's pre-check
  (`torchtitan.config.manager.main`, in-process) with a WORLD_SIZE (the launcher's, a random one,
  none, or not a number).
- The accepted ones, every few, through `preflight` in-process (builds the tokenizer and the model
  on the meta device).
- The launcher's variables (NGPU, NNODES, LOG_RANK, ...) through run_llama_train.sh's own checks,
  sourced into one bash process: no torch, no process per draw beyond a subshell.

Every draw must end with exit code 0 (stderr: notices only) or 2 (stderr: exactly one `error:` line);
a traceback (an exception that is not a UserError), another code, a second line or a hang (each
draw is bounded by an alarm) fails the test, which lists the draws to reproduce them.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import math
import os
import random
import shlex
import signal
import subprocess
import typing
from dataclasses import dataclass, fields

import pytest

from tests.helpers import REPO_ROOT
from torchtitan.config import manager
from torchtitan.config.job_config import JobConfig
from torchtitan.config.preflight import preflight
from torchtitan.config.unused_options import LEGACY
from torchtitan.errors import UserError

SEED = 52
OPTION_SETS = 1500  # each through the TOML file and the command line
PREFLIGHT_EVERY = 3  # of the option sets the pre-check accepts
LAUNCHER_DRAWS = 300
DRAW_SECONDS = 30  # a hang, not a slow draw: one draw takes milliseconds

# What every draw starts from: the debug model, small enough for preflight to build quickly.
BASE = {"model": {"flavor": "tiny"}, "training": {"seq_len": 64, "steps": 10, "warmup_steps": 2}}
# Options whose value could do something outside the test if drawn freely (import any module).
SAFE_VALUES = {"experimental.custom_import": ["", "no_such_module_xyz", "torchtitan.nope", "1bad", "a..b", "os.path"]}
NOT_DRAWN = {"job.config_file"}  # the TOML path sets it; the command-line draws add odd ones themselves

INTS = [1, 1, 2, 2, 3, 4, 8, 0, -1, -2, 7, 64, 1000, 2**31, 2**63, 10**30]
FLOATS = [0.0, 0.5, 1.0, 1e-3, 2.0, -1.0, -0.0, 1e308, 1e-320, math.inf, -math.inf, math.nan]
TEXTS = ["", " ", "x", "llama3", "tiny", "debugmodel", "a b", "a\nb", "é", "💥", "-1", "true", "none", "a" * 300]
PATHS = ["", ".", "/", "out", "a/b/c", "/proc/nope/x", "/dev/null", "/dev/null/x", "bundled:stdlib_docs/corpus.jsonl",
         "bundled:../errors.py", "bundled:", "~/x", "a\nb", "x" * 300, "/".join(["d"] * 100), "nul\x00byte",
         "adir", "afile", "garbage.bin", "empty", "dangling", "dangling/x", "afile/x", "*.jsonl", "adir/*"]
# Options naming files and folders; the scratch folder holds the odd ones PATHS names (in_scratch).
PATH_OPTIONS = ["job.dump_folder", "profiling.save_traces_folder", "profiling.save_memory_snapshot_folder",
                "metrics.save_tb_folder", "model.tokenizer_path", "training.dataset_path", "checkpoint.folder",
                "experimental.pipeline_parallel_schedule_csv", "checkpoint.initial_load_path",
                "validation.dataset_path", "training.dataset_mix"]
ODD_TEXT = {"training.dataset_mix": ["stdlib_docs:1", "a:1,b", "stdlib_docs:0", "stdlib_docs:-1", "stdlib_docs:nan",
                                     ":1", "stdlib_docs:1e400", "stdlib_docs:1,stdlib_docs:1", "adir:1"],
            "fault_tolerance.lighthouse": ["host:1", "host:99999999", "host:", ":1", "http://h:2", "a b:3"],
            "experimental.pipeline_parallel_schedule": ["GPipe", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV",
                                                        "gpipe", "", "Nope"],
            "experimental.pipeline_parallel_split_points": [["layers.1"], ["layers.0"], ["layers.9"], ["nope"], [""]],
            "activation_checkpoint.selective_ac_option": ["op", "1", "2", "0", "-1", "x", ""],
            "activation_checkpoint.offload": ["none", "all", "1", "2", "0", "x"]}
BAD_TEXT = ["", "abc", "1.5", "1e3", "0x10", " 3", "true", "nan", "inf", "1e400", "--", "٣", "1_000", "+5", "-0"]
DEGREES = ["training.data_parallel_replicate_degree", "training.data_parallel_shard_degree",
           "training.tensor_parallel_degree", "experimental.context_parallel_degree",
           "experimental.pipeline_parallel_degree", "training.expert_parallel_degree"]
FEATURES = {"training.compile": [True, False], "training.document_mask": [True], "optimizer.name": ["Muon", "Adam"],
            "optimizer.zero1": [True], "optimizer.early_step_in_backward": [True], "training.enable_cpu_offload": [True],
            "experimental.context_parallel_method": ["allgather"], "activation_checkpoint.mode": ["full", "none"],
            "float8.enable_float8_linear": [True], "float8.recipe": ["rowwise", "rowwise_with_gw_hp"], "model.name": ["qwen3", "deepseek_v3", "llama2"],
            "model.flavor": ["debugmodel", "debugmodel_moe", "tiny_tied", "8B"], "training.loss_chunk_size": [16],
            "validation.enabled": [True], "checkpoint.enable_checkpoint": [True], "moe.capacity_factor": [1.25],
            "training.gradient_accumulation_steps": [2], "training.max_norm": [0.0], "job.dry_run": [True],
            "training.dataset_shards": [2, 3, -1], "sft.format": ["chat", "prompt_completion"],
            "sft.packing": [False], "lora.rank": [4], "lora.target_modules": [["wq"]]}


def schema() -> dict[str, tuple[typing.Any, typing.Any]]:
    """'section.option' -> (its type, its field) for every option."""
    hints = typing.get_type_hints(JobConfig)
    out = {}
    for section in fields(JobConfig):
        section_hints = typing.get_type_hints(hints[section.name])
        for option in fields(hints[section.name]):
            out[f"{section.name}.{option.name}"] = (section_hints[option.name], option)
    return out


def draw_value(rng: random.Random, name: str, typ, field, plausible: bool):
    """A value for option `name`: of its type and a likely one (`plausible`), or anything."""
    default = getattr(getattr(JobConfig(), name.split(".")[0]), name.split(".")[1])
    if name in SAFE_VALUES:
        return rng.choice(SAFE_VALUES[name])
    if plausible and typ in (int, float) and not isinstance(default, bool):
        return rng.choice([default, default, 1, 2, 4] if typ is int else [default, 0.5, 1e-3])
    if name in ODD_TEXT and rng.random() < 0.7:
        return rng.choice(ODD_TEXT[name])
    if not plausible and rng.random() < 0.15:  # a value of another type: text for anything, a number for text
        return rng.choice(BAD_TEXT + [1, 2.5, True, [1, 2], {"a": 1}, datetime.date(2024, 12, 26)])
    choices = field.metadata.get("choices")
    if choices:
        return rng.choice([*choices, *choices, "", "bogus", str(choices[0]).upper()])
    if typing.get_origin(typ) is list:
        return rng.choice([[], ["layers.1"], ["a", "b"], ["*"], [""], ["layers.99"], ["tok_embeddings", "output"], "a,b"])
    if typ is bool:
        return rng.choice([True, False, True, "yes", "maybe", ""])
    if typ is int:
        return rng.choice(INTS + [default])
    if typ is float:
        return rng.choice(FLOATS)
    return rng.choice(PATHS if name in PATH_OPTIONS else TEXTS)


@dataclass
class OptionSet:
    values: dict[str, typing.Any]  # "section.option" -> value (a LEGACY or unknown name included)
    world_size: str | None  # WORLD_SIZE as the launcher would export it; None: not exported


def draw_option_set(rng: random.Random, options: dict) -> OptionSet:
    """Half the sets are plausible (values of the right type, degrees >= 1 fitting the world size),
    so that many reach preflight; the others draw anything."""
    values = {f"{s}.{k}": v for s, section in BASE.items() for k, v in section.items()}
    plausible = rng.random() < 0.5
    if rng.random() < 0.6:  # a layout
        for name in rng.sample(DEGREES, rng.randint(1, 4)):
            values[name] = rng.choice([1, 2, 2, 4] if plausible else [1, 2, 2, 4, -1, 3, 0, 8])
    for name in rng.sample(sorted(FEATURES), rng.randint(0, 3)):
        values[name] = rng.choice(FEATURES[name])
    for name in rng.sample(sorted(set(options) - NOT_DRAWN), rng.randint(0, 4)):
        values[name] = draw_value(rng, name, *options[name], plausible)
    if rng.random() < (0.1 if plausible else 0.3):
        values[rng.choice(PATH_OPTIONS)] = rng.choice(PATHS)
    for name in rng.sample(sorted(ODD_TEXT), rng.randint(0, 1)):
        values[name] = rng.choice(ODD_TEXT[name])
    roll = rng.random() * (3 if plausible else 1)
    if roll < 0.05:
        values[rng.choice(sorted(LEGACY))] = rng.choice([True, "steps", "seconds", "allgather", "alltoall", "x", 3])
    elif roll < 0.08:
        values[rng.choice(["training.stepz", "trainig.steps", "job.x", "metrics.log_frq"])] = 1
    product = 1
    for name in DEGREES[:5]:
        degree = values.get(name, 1)
        product *= degree if isinstance(degree, int) and degree > 0 else 1
    world = str(product) if plausible else rng.choice(
        [str(product)] * 4 + ["1", "2", "3", "4", "8", "16", None, None, "0", "-2", "abc", "", " 4", "1e3", str(2**64)])
    return OptionSet(values, world)


def toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # a TOML basic string: control characters escaped
    return str(value)


# Lines only a file can hold: a sub-table, an array of tables, a key twice, a value outside any
# section, a byte-order mark, a broken line, a multi-line string.
TOML_ODDITIES = ["[training.sub]\nx = 1\n", "[[job]]\nx = 1\n", "[training]\nsteps = 3\nsteps = 4\n", "steps = 3\n",
                 "[metrics]\nlog_freq = \n", "\ufeff[job]\n", '[job]\ndescription = """two\nlines"""\n']


def as_toml(values: dict, oddity: str = "") -> str:
    sections: dict[str, list[str]] = {}
    for name, value in values.items():
        section, key = name.split(".", 1)
        sections.setdefault(section, []).append(f"{key} = {toml_value(value)}")
    text = "".join(f"[{s}]\n" + "\n".join(lines) + "\n" for s, lines in sections.items())
    return oddity + text if oddity.startswith("\ufeff") else text + oddity  # a mark opens the file


def as_argv(rng: random.Random, values: dict) -> list[str]:
    argv = []
    for name, value in values.items():
        if isinstance(value, bool) and value and rng.random() < 0.5:
            argv.append(f"--{name}")  # a bare flag
            continue
        if isinstance(value, list):
            text = ",".join(map(str, value))
        elif isinstance(value, float):
            text = repr(value)
        else:
            text = str(value).lower() if isinstance(value, bool) else str(value)
        if "\x00" in text:  # no process can be given it
            continue
        argv += [f"--{name}={text}"] if rng.random() < 0.3 else [f"--{name}", text]
    if rng.random() < 0.05:  # something that is not an option
        argv.insert(rng.randrange(len(argv) + 1), rng.choice(["stray", "-x", "--", "--training", "--a.b.c", "--=1"]))
    if rng.random() < 0.03:
        argv += ["--job.config_file", rng.choice(["nope.toml", "/", "/dev/null", "bundled:nope.toml", ""])]
    return argv


class Hang(Exception):
    pass


@contextlib.contextmanager
def bounded(seconds: int):
    def alarm(signum, frame):
        raise Hang(f"no answer within {seconds} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def precheck(argv: list[str], world_size: str | None) -> tuple[int | str, str, str]:
    """The launcher's pre-check in-process: (exit code, or the exception a bug raised; stdout; stderr)."""
    out, err = io.StringIO(), io.StringIO()
    saved = os.environ.pop("WORLD_SIZE", None)
    if world_size is not None:
        os.environ["WORLD_SIZE"] = world_size
    try:
        with bounded(DRAW_SECONDS), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code: int | str = manager.main(argv)
    except Exception as e:  # noqa: BLE001 - a bug: recorded with its draw
        code = f"{type(e).__name__}: {e}"
    finally:
        os.environ.pop("WORLD_SIZE", None)
        if saved is not None:
            os.environ["WORLD_SIZE"] = saved
    return code, out.getvalue(), err.getvalue()


def judge(code, stdout: str, stderr: str) -> str | None:
    """What is wrong with one ending of the pre-check, or None."""
    lines = stderr.splitlines()
    if code == 0:
        bad = [line for line in lines if not line.startswith("notice: ")]
        return f"exit 0 with {bad!r} on stderr" if bad else None
    if code == 2:
        return None if len(lines) == 1 and lines[0].startswith("error: ") and not stdout else f"exit 2 with {lines!r}"
    return f"exit {code!r}, stderr {stderr[-300:]!r}"


def run_preflight(argv: list[str], world_size: int) -> str | None:
    try:
        with bounded(DRAW_SECONDS), contextlib.redirect_stdout(io.StringIO()):
            config, _ = manager.read_config(argv)
            preflight(config, world_size, device_type="cpu")
    except UserError as e:
        return None if "\n" not in e.line else f"a refusal of several lines: {e.line!r}"
    except Exception as e:  # noqa: BLE001 - a bug
        return f"{type(e).__name__}: {e}"
    return None


@pytest.fixture
def in_scratch(tmp_path, monkeypatch):
    """Relative paths the draws name land in a scratch folder; nothing is written but probe files."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "adir").mkdir()
    (tmp_path / "adir" / "x.jsonl").write_text('{"text": "a"}\n')
    (tmp_path / "afile").write_text("not a folder\n")
    (tmp_path / "garbage.bin").write_bytes(bytes(range(256)) * 4)
    (tmp_path / "empty").write_text("")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    return tmp_path


def test_random_option_sets_end_in_notices_or_one_line(in_scratch):
    rng, options = random.Random(SEED), schema()
    failures, endings, preflights = [], {0: 0, 2: 0}, 0
    for index in range(OPTION_SETS):
        drawn = draw_option_set(rng, options)
        toml_file = in_scratch / f"draw{index}.toml"  # a new file: rewriting one can wait for the disk
        toml_text = as_toml(drawn.values, rng.choice(TOML_ODDITIES) if rng.random() < 0.05 else "")
        toml_file.write_text(toml_text)
        for path, argv in (("toml", ["--job.config_file", str(toml_file)]), ("cli", as_argv(rng, drawn.values))):
            code, stdout, stderr = precheck(argv, drawn.world_size)
            if code in endings:
                endings[code] += 1
            if (problem := judge(code, stdout, stderr)) is not None:
                failures.append(f"{path} draw {index} (WORLD_SIZE={drawn.world_size!r}): {problem}\n  argv {argv!r}\n"
                                f"  toml {toml_text!r}")
            elif code == 0 and path == "cli" and drawn.world_size and drawn.world_size.isdigit() \
                    and 0 < int(drawn.world_size) <= 64 and endings[0] % PREFLIGHT_EVERY == 0:
                preflights += 1
                if (problem := run_preflight([*argv, "--job.dump_folder", "out"], int(drawn.world_size))) is not None:
                    failures.append(f"preflight of draw {index} (world {drawn.world_size}): {problem}\n  argv {argv!r}")
    print(f"{2 * OPTION_SETS} pre-check draws: {endings[0]} accepted, {endings[2]} refused; {preflights} preflights")
    assert endings[0] > OPTION_SETS // 10 and endings[2] > OPTION_SETS // 10 and preflights >= 20  # both ways, often
    assert not failures, f"{len(failures)} draws failed:\n" + "\n".join(failures[:15])



# The launcher's variables: each drawn from values a user might set, right or wrong.
NUMBERS = ["", "0", "1", "2", "8", "08", "-1", "abc", "1.5", " 2", "2 ", "1e3", "٣", "+2", "2\n3", str(2**63),
           "99999999999999999999", "18446744073709551617", "x[$(touch CANARY)]", "1/0"]
LAUNCHER_VARIABLES = {
    "NGPU": [None, "1", "2", "4", *NUMBERS], "NNODES": [None, None, "1", "2", *NUMBERS],
    "NODE_RANK": [None, "0", "1", "2", "01", *NUMBERS, "18446744073709551615"],
    "LOG_RANK": [None, "0", "0,1", "1", "3", "0,", ",0", "0,0", "x", "18446744073709551615", "1,x[$(touch CANARY)]"],
    "MAX_RESTARTS": [None, "0", "3", *NUMBERS], "RDZV_TIMEOUT": [None, "600", "1", *NUMBERS],
    "RDZV_PROGRESS_INTERVAL": [None, "30", *NUMBERS], "OMP_NUM_THREADS": [None, "1", "4", *NUMBERS],
    "RDZV_ENDPOINT": [None, "node0:29500", "node0", ":1", "a b:1", "node0:99999999", "node0:0", "[::1]:29500"],
    "FT_LIGHTHOUSE": [None, None, None, "start", "host:29510", "host", "http://host:1", "host:99999999"],
    "FT_LIGHTHOUSE_PORT": [None, "29510", "0", "65535", "65536", "http", *NUMBERS],
    "FT_MIN_REPLICAS": [None, "1", "2", *NUMBERS],
}
# One bash process runs every draw, each in a subshell: the variables, the launcher's check, and on
# success the values it settled on (the world size as bash computes it, to catch an overflow).
LAUNCHER_DRAW = """{{ err=$( {{ ( set -euo pipefail; unset {names}; {assign}
  check_launcher_variables
  port=${{FT_LIGHTHOUSE_PORT:-}} replicas=${{FT_MIN_REPLICAS:-}}
  printf 'OK\\t%s\\t%s\\t%s\\t%s\\t%s\\t%s\\t%s\\t%s\\t%s\\n' {index} "$NGPU" "$NNODES" "$NODE_RANK" "$LOG_RANK" \\
    "$OMP_NUM_THREADS" "$(( NGPU * NNODES ))" "${{port//[^0-9]/?}}" "${{replicas//[^0-9]/?}}" ) 1>&3; }} 2>&1 )
  code=$?; }} 3>&1
printf 'RC\\t%s\\t%s\\t%s\\n' {index} "$code" "${{err//$'\\n'/<LF>}}"
"""


def launcher_script(draws: list[dict]) -> str:
    names = " ".join(LAUNCHER_VARIABLES)
    lines = ["source ./run_llama_train.sh"]  # defines check_launcher_variables, starts nothing
    for index, draw in enumerate(draws):
        assign = " ".join(f"export {k}={shlex.quote(v)};" for k, v in draw.items())
        lines.append(LAUNCHER_DRAW.format(names=names, assign=assign, index=index))
    return "\n".join(lines) + "\n"


def settled_wrong(draw: dict, values: list[str]) -> str | None:
    """What is wrong with the values the launcher settled on for `draw`, or None."""
    ngpu, nnodes, node_rank, log_rank, omp, world, port, replicas = values
    numbers = [ngpu, nnodes, node_rank, omp, world, *log_rank.split(",")]
    if not all(n.isascii() and n.isdigit() for n in numbers):
        return f"not numbers: {values}"
    if int(world) != int(ngpu) * int(nnodes) or int(world) < 1:
        return f"world size {world} for NGPU {ngpu} x NNODES {nnodes}"
    if int(node_rank) >= int(nnodes) or any(int(r) >= int(ngpu) for r in log_rank.split(",")) or int(omp) < 1:
        return f"a rank out of range: {values}"
    if draw.get("FT_LIGHTHOUSE") == "start" and not (port.isdigit() and 0 < int(port) < 65536 and replicas.isdigit()
                                                      and int(replicas) >= 1):
        return f"lighthouse port {port!r}, min replicas {replicas!r}"
    for name in ("MAX_RESTARTS", "RDZV_TIMEOUT", "RDZV_PROGRESS_INTERVAL"):
        value = draw.get(name)
        if value and not (value.isascii() and value.isdigit() and int(value) < 2**31):
            return f"{name}={value!r} accepted"
    endpoint = draw.get("RDZV_ENDPOINT") or ""
    if int(nnodes) > 1 and not (endpoint.rpartition(":")[2].isdigit() and 0 < int(endpoint.rpartition(":")[2]) < 65536):
        return f"RDZV_ENDPOINT={endpoint!r} accepted"
    return None


def test_random_launcher_variables_end_in_one_line_or_sane_values(tmp_path):
    rng = random.Random(SEED)
    draws = []
    for _ in range(LAUNCHER_DRAWS):  # a few variables set at a time, as a user sets them
        names = rng.sample(sorted(LAUNCHER_VARIABLES), rng.randint(1, 4))
        draws.append({name: value for name in names if (value := rng.choice(LAUNCHER_VARIABLES[name])) is not None})
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    result = subprocess.run(["bash", "-s"], input=launcher_script(draws), cwd=REPO_ROOT, env=env, capture_output=True,
                            text=True, timeout=DRAW_SECONDS * 4)
    assert result.returncode == 0 and not result.stderr, result.stderr[-2000:]
    settled, failures, refused = {}, [], 0
    for line in result.stdout.splitlines():
        kind, index, *rest = line.split("\t")
        if kind == "OK":
            settled[int(index)] = rest
            continue
        draw, (code, err) = draws[int(index)], rest
        if code == "2" and err.startswith("error: ") and "<LF>" not in err:
            refused += 1
        elif code != "0" or err:
            failures.append(f"draw {index} {draw!r}: exit {code}, stderr {err!r}")
        elif (problem := settled_wrong(draw, settled[int(index)])) is not None:
            failures.append(f"draw {index} {draw!r}: {problem}")
    assert not (REPO_ROOT / "CANARY").exists() and not (tmp_path / "CANARY").exists(), "a variable was run as code"
    print(f"{LAUNCHER_DRAWS} launcher draws: {len(settled)} accepted, {refused} refused")
    assert not failures, f"{len(failures)} draws failed:\n" + "\n".join(failures[:15])
    assert len(settled) > LAUNCHER_DRAWS // 5 and refused > LAUNCHER_DRAWS // 5  # both ways, often
