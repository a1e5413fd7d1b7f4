"""The config pass: JobConfig (schema in job_config.py) merged as defaults < TOML file < command
line, then checked.

Unknown sections or keys and wrong types raise `ConfigError` here; options of earlier versions and
options of a feature the job does not use get a notice, or a refusal (config/unused_options.py).
The checks of the values are the rules of torchtitan/config/rules.py: `parse_args` runs their
options phase, and `main` (the launcher's pre-check) the shapes and layout phases too. The entry points turn a refusal into one
line on stderr and exit code 2. All of it is torch-free, so `run_llama_train.sh` validates a config
in milliseconds, before torchrun starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import logging
import os
import sys
import typing
from typing import Any, Sequence

from torchtitan.assets import resolve_path
from torchtitan.config import rules
from torchtitan.config.job_config import JobConfig
from torchtitan.config.unused_options import COMMAND_LINE, LEGACY, Given, read_legacy, unused
from torchtitan.errors import ConfigError, UserError

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
_INT64 = 2**63
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
        if isinstance(value, str):
            try:
                value = int(value)
            except ValueError:
                pass
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"{where} must be an integer, got {value!r}")
        if not -_INT64 <= value < _INT64:  # torch (and every count it takes) holds 64-bit integers
            raise ConfigError(f"{where} must fit in 64 bits (at most {_INT64 - 1}), got {value}")
        return value
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


def _set(config: JobConfig, given: Given, section: str, key: str, raw: Any, source: str, from_text: bool) -> None:
    sections = _sections()
    dotted = f"{section}.{key}"
    if dotted in LEGACY:  # an earlier version's option: read once every value is in (unused_options.py)
        # Earlier TOMLs wrote some lists as comma-separated text (torchtitan's `converters = "float8"`).
        as_text = from_text or (typing.get_origin(LEGACY[dotted].type) is list and isinstance(raw, str))
        given.legacy[dotted] = (_coerce(raw, LEGACY[dotted].type, f"{dotted} ({source})", as_text), source)
        return
    if section not in sections:
        read = [name for name in LEGACY if name.startswith(f"{section}.")]
        if read:  # a section of an earlier version, of which only some options are read
            raise ConfigError(f"unknown option {dotted} in {source}: of [{section}] (an earlier version's section), "
                              f"only {', '.join(read)} are read")
        raise ConfigError(f"unknown config section [{section}] in {source}{_suggest(section, sections)}")
    fields = _fields(sections[section])
    if key not in fields:
        raise ConfigError(f"unknown option {dotted} in {source}{_suggest(key, fields)}")
    typ, f = fields[key]
    value = _coerce(raw, typ, f"{dotted} ({source})", from_text)
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        raise ConfigError(
            f"{dotted} ({source}) must be one of {', '.join(map(str, choices))}, got {value!r}"
        )
    setattr(getattr(config, section), key, value)
    given.options[dotted] = source


# A config is a few KiB; reading stops beyond this, so that a device or a huge file named by mistake
# (/dev/zero, a dataset) is refused instead of filling the memory.
_MAX_CONFIG_BYTES = 16 * 2**20


def _load_toml(path: str) -> dict[str, Any]:
    try:
        with open(resolve_path(path, "job.config_file", ConfigError), "rb") as f:
            data = f.read(_MAX_CONFIG_BYTES + 1)
        if len(data) > _MAX_CONFIG_BYTES:
            raise ConfigError(f"config file {path} holds more than {_MAX_CONFIG_BYTES // 2**20} MiB: not a TOML config "
                              "(set --job.config_file)")
        return tomllib.loads(data.decode("utf-8"))
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


@functools.cache  # the options are fixed; building ~200 arguments costs more than parsing with them
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
            group.add_argument(f"--{section}.{key}", help=text.replace("%", "%%"), **_value_kwargs(f"{section}.{key}", typ))
    for dotted, legacy in LEGACY.items():  # accepted, not offered: --help lists only what has an effect
        parser.add_argument(f"--{dotted}", help=argparse.SUPPRESS, **_value_kwargs(dotted, legacy.type))
    return parser


def _value_kwargs(dotted: str, typ: Any) -> dict[str, Any]:
    if typ is bool:
        return {"dest": dotted, "nargs": "?", "const": "true", "metavar": "BOOL"}
    return {"dest": dotted, "metavar": typing.get_origin(typ).__name__.upper() if typing.get_origin(typ) else typ.__name__.upper()}


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
            read = [dotted for dotted in LEGACY if dotted.startswith(f"{section}.")]
            if section not in sections and read:
                raise ConfigError(f"unknown option {name}: of [{section}] (an earlier version's section), only "
                                  f"{', '.join(read)} are read")
            if section not in sections:
                raise ConfigError(f"unknown config section in {name}{_suggest(section, sections)}")
            raise ConfigError(f"unknown option {name}{_suggest(key, _fields(sections[section]))}")
        raise ConfigError(f"unexpected argument {bad!r}; options look like --section.key value")
    return vars(known)


def help_text() -> str:
    return _build_parser().format_help()


# ---------------------------------------------------------------------------------------------
# Checks: the rules of torchtitan/config/rules.py, by phase.

__all__ = ["ConfigError", "JobConfig", "help_text", "main", "parse_args", "read_config", "validate", "validate_world_size"]


def validate(config: JobConfig) -> None:
    """The options phase: rejects impossible values and combinations, naming the option to change."""
    rules.check_options(config)


def validate_world_size(config: JobConfig, world_size: int) -> Any:
    """The layout phase: the parallel degrees against the number of ranks, and what each layout
    can honour; returns the validated ParallelDims (config/ names no feature's type: rules.py)."""
    return rules.check_layout(config, world_size)


def _nested(section: str, values: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """A section's (key, value) pairs; in a section this schema does not have, nested tables give
    dotted keys (torchtitan's `[quantize.linear.float8]`: section quantize, key linear.float8.x),
    which LEGACY may know and _set refuses otherwise."""
    if section in _sections():
        return list(values.items())
    pairs = []
    for key, value in values.items():
        if isinstance(value, dict):
            pairs += _nested(section, value, f"{prefix}{key}.")
        else:
            pairs.append((prefix + key, value))
    return pairs


def read_config(argv: Sequence[str] | None = None) -> tuple[JobConfig, list[str]]:
    """Builds the JobConfig from defaults, the TOML file named by --job.config_file, and argv, and
    runs the options rules. Returns it with its notices (options it sets that have no effect:
    config/unused_options.py), for the caller to show once."""
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides = _cli_overrides(argv)
    config, given = JobConfig(), Given()
    config_file = overrides.get("job.config_file", "")
    if config_file:
        for section, values in _load_toml(config_file).items():
            if not isinstance(values, dict):
                raise ConfigError(f"'{section}' in {config_file} must be a [section] table, got a value")
            for key, value in _nested(section, values):
                _set(config, given, section, key, value, config_file, from_text=False)
    for dotted, value in overrides.items():
        section, key = dotted.split(".", 1)
        _set(config, given, section, key, value, COMMAND_LINE, from_text=True)
    notices = read_legacy(config, given)
    validate(config)
    return config, notices + unused(config, given)


def parse_args(argv: Sequence[str] | None = None) -> JobConfig:
    """Builds and checks the JobConfig (read_config); its notices go to the log of rank 0 only, so
    that a job of N ranks (on any number of nodes) says each once, in the run's log."""
    config, notices = read_config(argv)
    if os.environ.get("RANK", "0") == "0":
        for notice in notices:
            logging.getLogger("torchtitan").warning(f"notice: {notice}")
    return config


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m torchtitan.config.manager [options]`: the launcher's pre-check, without torch.

    run_llama_train.sh runs this before torchrun so that --help and bad options answer at once,
    with one line and exit code 2, instead of once per rank behind torchrun's error report. It
    runs the rule phases that need no torch: options (read_config), shapes, and layout when the
    launcher exports the number of ranks (WORLD_SIZE). A config that passes gets its notices here,
    on stderr, one line each, unless the launcher asks (--launch-mode): then rank 0 says them, once
    per job rather than once per node and again from the rank.
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
        config, notices = read_config(argv)
        rules.check_shapes(config)
        dry_run = config.job.dry_run and not config.memory_estimation.disable_fake_mode
        world_size = _launcher_world_size()
        if dry_run and config.job.dry_run_world_size:
            world_size = config.job.dry_run_world_size
        if world_size:
            validate_world_size(config, world_size)
    except UserError as e:  # ConfigError, and a feature rule's own kind (all one line, exit 2)
        print(e.line, file=sys.stderr)
        return 2
    for notice in [] if launch_mode else notices:
        print(f"notice: {notice}", file=sys.stderr)
    if launch_mode:
        print("dry_run" if dry_run else "torchrun")
    return 0


def _launcher_world_size() -> int:
    """The number of ranks the launcher will start (it exports WORLD_SIZE); 0 when not given."""
    text = os.environ.get("WORLD_SIZE", "")
    if not text:
        return 0
    if not (text.isascii() and text.isdigit() and int(text) > 0):
        raise ConfigError(f"WORLD_SIZE must be the number of ranks the job starts (1 or more), got {text!r}")
    return int(text)


if __name__ == "__main__":
    # Run the imported module's main, so ConfigError raised by other torchtitan modules is the
    # same class as the one caught here (not a twin defined in __main__).
    from torchtitan.config.manager import main as _main

    sys.exit(_main())
