"""The config pass: JobConfig (schema in job_config.py) merged as defaults < TOML file < command
line, then checked.

Unknown sections or keys, wrong types and impossible values raise `ConfigError`, which the entry
points turn into one line on stderr and exit code 2. Checks of one option (ranges, a section's
own options) live here; a rule that ties options of several features together lives in the
module of the feature it protects and is collected below (OPTION_RULES, LAYOUT_RULES). Those
modules are torch-free like this one, so `run_llama_train.sh` validates a config in
milliseconds, before torchrun starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import importlib.util
import math
import os
import sys
import typing
from typing import Any, Sequence

from torchtitan import optimizer_options
from torchtitan.assets import resolve_path
from torchtitan.datasets import shards
from torchtitan.errors import ConfigError, UserError
from torchtitan.job_config import JobConfig, Metrics
from torchtitan.parallelisms import parallel_dims, pipeline
from torchtitan.parallelisms.parallel_dims import ParallelDims, parallel_dims_from_config

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib


# ---------------------------------------------------------------------------------------------
# Reading values


@functools.cache  # the classes are fixed; resolving their type hints is the slow part of parsing
def _sections() -> dict[str, type]:
    hints = typing.get_type_hints(JobConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(JobConfig)}


@functools.cache
def _fields(section_cls: type) -> dict[str, tuple[Any, dataclasses.Field]]:
    hints = typing.get_type_hints(section_cls)
    return {f.name: (hints[f.name], f) for f in dataclasses.fields(section_cls)}


def _suggest(name: str, known: Sequence[str]) -> str:
    match = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f"; did you mean '{match[0]}'?" if match else f"; known: {', '.join(sorted(known))}"


_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _coerce(value: Any, typ: Any, where: str, from_text: bool) -> Any:
    """Checks a value against the field type. TOML values are typed and must match exactly;
    command-line values arrive as text (from_text) and are parsed."""
    if typing.get_origin(typ) is list:
        if from_text and isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        (item_typ,) = typing.get_args(typ)
        return [_coerce(v, item_typ, where, from_text) for v in value]
    if isinstance(value, str) and not from_text and typ is not str:
        kind = {"bool": "true or false", "int": "an integer", "float": "a number"}.get(typ.__name__, typ.__name__)
        raise ConfigError(f"{where} must be {kind}, not the string {value!r}")
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise ConfigError(f"{where} must be true or false, got {value!r}")
    if typ is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where} must be an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise ConfigError(f"{where} must be an integer, got {value!r}")
    if typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where} must be a number, got {value!r}")
    if typ is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where} must be a string, got {value!r}")
    raise AssertionError(f"unsupported config type {typ} for {where}")


def _set(config: JobConfig, section: str, key: str, raw: Any, source: str, from_text: bool) -> None:
    sections = _sections()
    if section not in sections:
        raise ConfigError(f"unknown config section [{section}] in {source}{_suggest(section, sections)}")
    fields = _fields(sections[section])
    if key not in fields:
        raise ConfigError(f"unknown option {section}.{key} in {source}{_suggest(key, fields)}")
    typ, f = fields[key]
    value = _coerce(raw, typ, f"{section}.{key} ({source})", from_text)
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        raise ConfigError(
            f"{section}.{key} ({source}) must be one of {', '.join(map(str, choices))}, got {value!r}"
        )
    setattr(getattr(config, section), key, value)


def _load_toml(path: str) -> dict[str, Any]:
    try:
        with open(resolve_path(path, "job.config_file", ConfigError), "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path} (set --job.config_file)") from None
    except IsADirectoryError:
        raise ConfigError(f"config file is a directory: {path}") from None
    except tomllib.TOMLDecodeError as e:  # the message carries "(at line N, column M)"
        raise ConfigError(f"malformed TOML in {path}: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not valid UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None


# ---------------------------------------------------------------------------------------------
# Command line


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:
        raise ConfigError(message)


def _build_parser() -> _Parser:
    parser = _Parser(
        prog="torchtitan.train",
        description="Train a model. Precedence: defaults < TOML (--job.config_file) < these options. "
        "Lists are comma-separated; booleans may be given as a bare flag or with true/false.",
        usage="python -m torchtitan.train [--section.key VALUE ...]",
        allow_abbrev=False,
        argument_default=argparse.SUPPRESS,  # only options actually given appear in the namespace
    )
    defaults = JobConfig()
    for section, section_cls in _sections().items():
        group = parser.add_argument_group(f"[{section}]")
        for key, (typ, f) in _fields(section_cls).items():
            default = getattr(getattr(defaults, section), key)
            shown = ",".join(default) if isinstance(default, list) else default
            text = f"{f.metadata['help']} (default: {shown!r})"
            if f.metadata.get("choices"):
                text += f" [choices: {', '.join(map(str, f.metadata['choices']))}]"
            kwargs: dict[str, Any] = {"dest": f"{section}.{key}", "help": text.replace("%", "%%")}
            if typ is bool:
                kwargs.update(nargs="?", const="true", metavar="BOOL")
            else:
                kwargs.update(metavar=typing.get_origin(typ).__name__.upper() if typing.get_origin(typ) else typ.__name__.upper())
            group.add_argument(f"--{section}.{key}", **kwargs)
    return parser


def _attach_negative_numbers(argv: Sequence[str]) -> list[str]:
    """`--optimizer.lr -1e-3` -> `--optimizer.lr=-1e-3`: argparse would read -1e-3 as an option."""
    out: list[str] = []
    for token in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and token.startswith("-"):
            try:
                float(token)
            except ValueError:
                pass
            else:
                out[-1] = f"{out[-1]}={token}"
                continue
        out.append(token)
    return out


def _cli_overrides(argv: Sequence[str]) -> dict[str, Any]:
    parser = _build_parser()
    known, unknown = parser.parse_known_args(_attach_negative_numbers(argv))
    if unknown:
        bad = unknown[0]
        name = bad.split("=", 1)[0]
        if name.startswith("--") and "." in name:
            section, key = name[2:].split(".", 1)
            sections = _sections()
            if section not in sections:
                raise ConfigError(f"unknown config section in {name}{_suggest(section, sections)}")
            raise ConfigError(f"unknown option {name}{_suggest(key, _fields(sections[section]))}")
        raise ConfigError(f"unexpected argument {bad!r}; options look like --section.key value")
    return vars(known)


def help_text() -> str:
    return _build_parser().format_help()


# ---------------------------------------------------------------------------------------------
# Cross-option validation: every check that needs no process group lives here.

# Options declared for schema compatibility whose features arrive in later work. Each refuses
# clearly instead of being silently ignored.
__all__ = ["ConfigError", "JobConfig", "help_text", "main", "parse_args", "validate", "validate_world_size"]

# Cross-option rules, each written in the module of the feature it protects (all torch-free, so
# the launcher's pre-check stays fast), collected here in the order a run meets them.
OPTION_RULES = (parallel_dims.check_options, optimizer_options.check_options, pipeline.check_options)
LAYOUT_RULES = (parallel_dims.check_layout, optimizer_options.check_layout, shards.check_layout)

_NOT_YET = {
    ("experimental", "enable_compiled_autograd"): bool,
}


def validate(config: JobConfig) -> None:
    """Rejects impossible values and combinations, naming the option to change."""
    for section in _sections():
        for name, (typ, _) in _fields(_sections()[section]).items():
            value = getattr(getattr(config, section), name)
            if typ is float and not math.isfinite(value):  # nan slips through every comparison below
                raise ConfigError(f"{section}.{name} must be a finite number, got {value}")
    t, m, o = config.training, config.metrics, config.optimizer
    positive = {
        "training.batch_size": t.batch_size,
        "training.seq_len": t.seq_len,
        "training.steps": t.steps,
        "training.gradient_accumulation_steps": t.gradient_accumulation_steps,
        "training.data_parallel_replicate_degree": t.data_parallel_replicate_degree,
        "training.tensor_parallel_degree": t.tensor_parallel_degree,
        "training.expert_parallel_degree": t.expert_parallel_degree,
        "training.gc_freq": t.gc_freq,
        "training.ddp_bucket_cap_mb": t.ddp_bucket_cap_mb,
        "metrics.log_freq": m.log_freq,
        "profiling.profile_freq": config.profiling.profile_freq,
        "model.vocab_size_divisible_by": config.model.vocab_size_divisible_by,
        "experimental.pipeline_parallel_degree": config.experimental.pipeline_parallel_degree,
        "experimental.context_parallel_degree": config.experimental.context_parallel_degree,
        "comm.init_timeout_seconds": config.comm.init_timeout_seconds,
        "comm.train_timeout_seconds": config.comm.train_timeout_seconds,
    }
    for name, value in positive.items():
        if value < 1:
            raise ConfigError(f"{name} must be >= 1, got {value}")
    if config.comm.trace_buf_size < 0:
        raise ConfigError(f"comm.trace_buf_size must be >= 0 (0 turns NCCL's flight recorder off), got "
                          f"{config.comm.trace_buf_size}")
    if t.data_parallel_shard_degree == 0 or t.data_parallel_shard_degree < -1:
        raise ConfigError(f"training.data_parallel_shard_degree must be >= 1 or -1, got {t.data_parallel_shard_degree}")
    if t.dataset_shards == 0 or t.dataset_shards < -1:
        raise ConfigError(f"training.dataset_shards must be >= 1 or -1, got {t.dataset_shards}")
    if t.dataset_num_workers < 0:
        raise ConfigError(f"training.dataset_num_workers must be >= 0 (0 reads in the training process), got "
                          f"{t.dataset_num_workers}")
    if t.dataset_mix:
        from torchtitan.datasets.mixture import parse_mix

        try:
            parse_mix(t.dataset_mix)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if t.dataset_path:
            raise ConfigError("training.dataset_mix and training.dataset_path both name the training data; set one "
                              "(a mixture entry can be a path)")
    if not o.lr > 0:
        raise ConfigError(f"optimizer.lr must be > 0, got {o.lr}")
    if not 0 <= o.beta1 < 1 or not 0 <= o.beta2 < 1:
        raise ConfigError(f"optimizer.beta1 and beta2 must lie in [0, 1), got {o.beta1}, {o.beta2}")
    if o.eps <= 0 or o.weight_decay < 0:
        raise ConfigError(f"optimizer.eps must be > 0 and optimizer.weight_decay >= 0, got {o.eps} and {o.weight_decay}")
    if t.warmup_steps < 0:
        raise ConfigError(f"training.warmup_steps must be >= 0, got {t.warmup_steps}")
    if t.warmup_steps > t.steps:
        raise ConfigError(f"training.warmup_steps {t.warmup_steps} is longer than the run (training.steps {t.steps}): "
                          "the learning rate would never reach optimizer.lr; lower training.warmup_steps")
    if config.moe.aux_loss_coef < 0 or config.moe.bias_update_rate < 0:
        raise ConfigError(f"moe.aux_loss_coef and moe.bias_update_rate must be >= 0 (0 turns each off), got "
                          f"{config.moe.aux_loss_coef} and {config.moe.bias_update_rate}")
    if not 0 <= t.lr_min <= 1:
        raise ConfigError(f"training.lr_min is a fraction of optimizer.lr and must lie in [0, 1], got {t.lr_min}")
    if config.profiling.enable_profiling and config.profiling.profile_freq < 2:
        raise ConfigError("profiling.profile_freq must be >= 2 (one warm-up step, one recorded step)")
    c = config.checkpoint
    if c.interval < 1:
        raise ConfigError(f"checkpoint.interval must be >= 1, got {c.interval}")
    if c.keep_latest_k < 0:
        raise ConfigError(f"checkpoint.keep_latest_k must be >= 0 (0 keeps every checkpoint), got {c.keep_latest_k}")
    if c.load_step < -1:
        raise ConfigError(f"checkpoint.load_step must be a step number or -1 (the newest), got {c.load_step}")
    if c.load_step >= 0 and not c.enable_checkpoint:
        raise ConfigError("checkpoint.load_step needs checkpoint.enable_checkpoint (it picks among this job's "
                          "checkpoints); to start from another folder's weights use checkpoint.initial_load_path")
    if c.export_dtype != "float32" and not (c.model_weights_only or c.last_save_in_hf):
        raise ConfigError(f"checkpoint.export_dtype {c.export_dtype} applies to the weights-only final checkpoint and "
                          "the Hugging Face export; set checkpoint.model_weights_only or checkpoint.last_save_in_hf too "
                          "(full checkpoints keep the training dtype)")
    if c.create_seed_checkpoint and (c.initial_load_path or c.last_save_in_hf):
        option = "initial_load_path" if c.initial_load_path else "last_save_in_hf"
        raise ConfigError(f"checkpoint.create_seed_checkpoint writes freshly initialised weights and trains nothing; "
                          f"leave checkpoint.{option} unset (a Hugging Face folder becomes a DCP checkpoint with "
                          "scripts/convert_checkpoint.py hf-to-dcp)")
    if (c.exclude_from_loading or c.allow_partial_load) and not (c.enable_checkpoint or c.initial_load_path):
        option = "exclude_from_loading" if c.exclude_from_loading else "allow_partial_load"
        raise ConfigError(f"checkpoint.{option} applies to a checkpoint being loaded; set checkpoint.enable_checkpoint "
                          "(resume) or checkpoint.initial_load_path")
    ac = config.activation_checkpoint
    if ac.mode == "selective":
        opt_value = ac.selective_ac_option
        if opt_value != "op" and (not opt_value.isdigit() or int(opt_value) < 1):
            raise ConfigError(
                f"activation_checkpoint.selective_ac_option must be a positive integer or 'op', got {opt_value!r}"
            )
    f8 = config.float8
    if (f8.enable_fsdp_float8_all_gather or f8.precompute_float8_dynamic_scale_for_fsdp) and not f8.enable_float8_linear:
        raise ConfigError("float8.enable_fsdp_float8_all_gather and precompute_float8_dynamic_scale_for_fsdp need "
                          "float8.enable_float8_linear")
    if f8.precompute_float8_dynamic_scale_for_fsdp and not f8.enable_fsdp_float8_all_gather:
        raise ConfigError("float8.precompute_float8_dynamic_scale_for_fsdp needs float8.enable_fsdp_float8_all_gather")
    for key in ("scaling_type_input", "scaling_type_weight", "scaling_type_grad_output"):
        if getattr(f8, key) == "delayed":
            raise ConfigError(f"float8.{key} 'delayed' is not supported: torchao (0.18) removed delayed scaling; use 'dynamic'")
    _validate_metrics(m)
    _validate_validation(config)
    _validate_dry_run(config)
    for rule in OPTION_RULES:
        rule(config)
    for (section, key), active in _NOT_YET.items():
        if active(getattr(getattr(config, section), key)):
            raise ConfigError(f"{section}.{key} is not implemented yet in this version; leave it at its default")


def _module_available(name: str) -> bool:
    if name in sys.modules:  # also what tests inject (a fake module, or None for "not installed")
        return sys.modules[name] is not None
    return importlib.util.find_spec(name) is not None


def _validate_metrics(m: Metrics) -> None:
    if m.peak_tflops < 0:
        raise ConfigError(f"metrics.peak_tflops must be >= 0 (0 = auto), got {m.peak_tflops}")
    # Checked here, before torchrun starts any rank, rather than at the first log line.
    if m.enable_wandb and not _module_available("wandb"):
        raise ConfigError("metrics.enable_wandb needs the wandb package (pip install wandb)")


def _validate_dry_run(config: JobConfig) -> None:
    j, e = config.job, config.memory_estimation
    if j.dry_run_world_size < 0:
        raise ConfigError(f"job.dry_run_world_size must be a number of ranks (0: the launcher's), got {j.dry_run_world_size}")
    if j.dry_run_vocab_size < 0:
        raise ConfigError(f"job.dry_run_vocab_size must be a number of tokens (0: the tokenizer's), got {j.dry_run_vocab_size}")
    if j.dry_run_rank < -1:
        raise ConfigError(f"job.dry_run_rank must be a rank, or -1 (the first and the last pipeline rank), got {j.dry_run_rank}")
    if not j.dry_run:
        given = [name for name, value in (("job.dry_run_world_size", j.dry_run_world_size),
                                          ("job.dry_run_vocab_size", j.dry_run_vocab_size),
                                          ("job.dry_run_rank", j.dry_run_rank + 1),
                                          ("memory_estimation.disable_fake_mode", e.disable_fake_mode)) if value]
        if given:
            raise ConfigError(f"{given[0]} needs job.dry_run (without it the job trains for real)")
    if not math.isfinite(e.device_memory_gib) or e.device_memory_gib < 0:
        raise ConfigError(f"memory_estimation.device_memory_gib must be a finite number >= 0 (0: this machine's GPU), got "
                          f"{e.device_memory_gib}")


def _validate_validation(config: JobConfig) -> None:
    v = config.validation
    if v.freq < 1:
        raise ConfigError(f"validation.freq must be >= 1, got {v.freq}")
    if v.steps == 0 or v.steps < -1:
        raise ConfigError(f"validation.steps must be >= 1 or -1 (the whole validation data), got {v.steps}")
    if v.batch_size == 0 or v.batch_size < -1:
        raise ConfigError(f"validation.batch_size must be >= 1 or -1 (the rows of one optimizer step: training.batch_size "
                          f"x training.gradient_accumulation_steps), got {v.batch_size}")
    if not 0 < v.held_out_fraction < 1:
        raise ConfigError(f"validation.held_out_fraction must lie strictly between 0 and 1, got {v.held_out_fraction}")
    if not v.enabled:
        return
    if config.experimental.pipeline_parallel_degree > 1 and v.batch_size > 0 and v.batch_size % config.training.batch_size:
        # The schedule's stages exchange microbatches of the shape the training step set up.
        raise ConfigError(f"validation.batch_size {v.batch_size} must be a multiple of training.batch_size "
                          f"{config.training.batch_size} under pipeline parallelism (or -1)")


def validate_world_size(config: JobConfig, world_size: int) -> ParallelDims:
    """Checks that need the number of ranks (the parallel degrees, what each layout can honour)
    and returns the validated ParallelDims."""
    dims = parallel_dims_from_config(config, world_size)
    for rule in LAYOUT_RULES:
        rule(config, dims)
    return dims


def parse_args(argv: Sequence[str] | None = None) -> JobConfig:
    """Builds the JobConfig from defaults, the TOML file named by --job.config_file, and argv."""
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides = _cli_overrides(argv)
    config = JobConfig()
    config_file = overrides.get("job.config_file", "")
    if config_file:
        for section, values in _load_toml(config_file).items():
            if not isinstance(values, dict):
                raise ConfigError(f"'{section}' in {config_file} must be a [section] table, got a value")
            for key, value in values.items():
                _set(config, section, key, value, config_file, from_text=False)
    for dotted, value in overrides.items():
        section, key = dotted.split(".", 1)
        _set(config, section, key, value, "command line", from_text=True)
    validate(config)
    return config


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m torchtitan.config_manager [options]`: validates without importing torch.

    The launcher runs this before torchrun so that --help and bad options answer at once,
    with one line and exit code 2, instead of once per rank behind torchrun's error report.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(help_text())
        return 0
    # --launch-mode (the launcher's): print how to start the job, `torchrun` or `dry_run` (one
    # process standing for the whole world, job.dry_run).
    launch_mode = "--launch-mode" in argv
    argv = [a for a in argv if a != "--launch-mode"]
    try:
        config = parse_args(argv)
        dry_run = config.job.dry_run and not config.memory_estimation.disable_fake_mode
        world_size = int(os.environ.get("WORLD_SIZE", "0"))  # the launcher passes the number of ranks it will start
        if dry_run and config.job.dry_run_world_size:
            world_size = config.job.dry_run_world_size
        if world_size:
            validate_world_size(config, world_size)
    except UserError as e:  # ConfigError, and a feature rule's own kind (all one line, exit 2)
        print(e.line, file=sys.stderr)
        return 2
    if launch_mode:
        print("dry_run" if dry_run else "torchrun")
    return 0


if __name__ == "__main__":
    # Run the imported module's main, so ConfigError raised by other torchtitan modules is the
    # same class as the one caught here (not a twin defined in __main__).
    from torchtitan.config_manager import main as _main

    sys.exit(_main())
