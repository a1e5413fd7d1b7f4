"""Options a job sets that have no effect in it: each gets one notice line, or a refusal where
ignoring it would change what the job asked for.

Two tables, read by `config.manager` once the TOML file and the command line are merged:

- LEGACY: options of earlier versions (late-2024 torchtitan TOMLs) that this schema no longer has.
  A config that worked keeps working: each value is read by its entry, which returns the notice
  (the option is ignored, or read as the option that replaced it) or raises ConfigError when no
  option here can honour it.
- APPLIES_ONLY_WITH: options of a feature the job does not use (Muon's with AdamW, the semi-sync
  modes' with every-step averaging). The job runs as configured; the notice says they are unused.

Only options the TOML file or the command line set are looked at, never defaults. Torch-free.
"""

from __future__ import annotations

import fnmatch
import functools
from dataclasses import dataclass, field
from typing import Any, Callable

from torchtitan.config.job_config import JobConfig
from torchtitan.errors import ConfigError

COMMAND_LINE = "command line"  # the source of a value given as --section.key


@dataclass
class Given:
    """What the TOML file and the command line set, by source ("command line" or the file's path)."""

    options: dict[str, str] = field(default_factory=dict)  # "section.key" of the schema -> its source
    legacy: dict[str, tuple[Any, str]] = field(default_factory=dict)  # a LEGACY option -> (its value, its source)


# ---------------------------------------------------------------------------------------------
# LEGACY: each entry reads one old option's value: returns its notice, or refuses.


def _integration_test_marker(value: bool, config: JobConfig, given: Given) -> str:
    return ("job.use_for_integration_test is ignored: it marked torchtitan's own integration-test configs "
            "and has no effect on a run")


def _interval_type(value: str, config: JobConfig, given: Given) -> str:
    if value == "steps":
        return ("checkpoint.interval_type 'steps' is ignored: checkpoint.interval always counts steps in this "
                "version")
    raise ConfigError(f"checkpoint.interval_type {value!r} is not supported: checkpoint.interval counts steps in "
                      "this version, so its value would be read as steps; give the interval in steps and delete "
                      "checkpoint.interval_type")


# PyTorch's context parallelism of late 2024 named how ranks exchange keys and values: all-gather
# every shard at once, or pass them around the ring (all-to-all). This version's option of the
# same meaning is experimental.context_parallel_method; both of its methods give the same losses.
_ROTATE_TO_METHOD = {"allgather": "allgather", "alltoall": "ring"}


def _rotate_method(value: str, config: JobConfig, given: Given) -> str:
    old, new = "experimental.context_parallel_rotate_method", "experimental.context_parallel_method"
    if value not in _ROTATE_TO_METHOD:
        raise ConfigError(f"{old} must be allgather or alltoall, got {value!r} (it is read as {new}: allgather, or "
                          "ring for alltoall)")
    return _read_as(old, value, new, _ROTATE_TO_METHOD[value], config, given,
                    "the late-2024 name", "the same exchange of keys and values between context-parallel ranks")


# torchtitan's float8 options since 2025: converters named on the model (`model.converters`
# float8), the recipe as `float8.recipe_name`, and from mid-2025 the float8 options under
# `[quantize.linear.float8]`. This version's float8.recipe takes the same recipe names and
# tensorwise, which torchtitan removed.
_RECIPE_NAMES = ("rowwise", "rowwise_with_gw_hp", "tensorwise")
_FLOAT8_CONVERTERS = ("float8", "quantize.linear.float8")


def _recipe_name(old: str, value: str, config: JobConfig, given: Given) -> str:
    new = "float8.recipe"
    if value not in _RECIPE_NAMES:
        raise ConfigError(f"{old} must be one of {', '.join(_RECIPE_NAMES)}, got {value!r} (it is read as {new})")
    return _read_as(old, value, new, value, config, given, "torchtitan's name", "the same float8 scaling recipe")


def _float8_flag(old: str, value: bool, config: JobConfig, given: Given) -> str:
    new = f"float8.{old.rsplit('.', 1)[1]}"
    return _read_as(old, value, new, value, config, given, "torchtitan's name", "the same option")


def _converters(value: list[str], config: JobConfig, given: Given) -> str:
    old = "model.converters"
    others = [v for v in value if v not in _FLOAT8_CONVERTERS]
    if others:
        raise ConfigError(f"{old} {others[0]!r} is not supported: float8 is this version's only converter "
                          "(float8.enable_float8_linear); delete the others from model.converters")
    if not value:
        return f"{old} [] (torchtitan's name) is ignored: it converts nothing"
    return _read_as(old, value, "float8.enable_float8_linear", True, config, given, "torchtitan's name",
                    "float8 linear layers through torchao")


def _filter_fqns(value: list[str], config: JobConfig, given: Given) -> str:
    return ("quantize.linear.float8.filter_fqns is ignored: here the output projection and MoE routers stay in high "
            "precision and every other linear layer whose sizes divide by 16 is converted")


def _read_as(old: str, value: Any, new: str, new_value: Any, config: JobConfig, given: Given, name: str,
             meaning: str) -> str:
    """An old option read as the new one (`new` set to `new_value`): the notice. Given both, the
    command line overrides the file as for any option; one source setting them differently is refused."""
    section, key = new.split(".")
    source, new_source = given.legacy[old][1], given.options.get(new)
    current = getattr(getattr(config, section), key)
    notice = f"{old} {value!r} ({name}) is read as {new} {new_value}: {meaning}"
    if new_source is not None and current != new_value:
        if new_source == source:
            raise ConfigError(f"{old} {value!r} asks for {new} {new_value}, but the {_where(source)} also sets {new} "
                              f"{current}; keep one of the two")
        if new_source == COMMAND_LINE:
            return f"{old} {value!r} in {source} is overridden by --{new} {current}"
        notice += f" (over {new} {current} in {_where(new_source)})"  # the old name on the command line wins
    setattr(getattr(config, section), key, new_value)
    return notice

def _where(source: str) -> str:
    return source if source == COMMAND_LINE else f"file {source}"


@dataclass(frozen=True)
class Legacy:
    type: type  # what a value must be, as for a field of the schema
    read: Callable[[Any, JobConfig, Given], str]  # the notice; raises ConfigError to refuse


LEGACY: dict[str, Legacy] = {
    "job.use_for_integration_test": Legacy(bool, _integration_test_marker),
    "checkpoint.interval_type": Legacy(str, _interval_type),
    "experimental.context_parallel_rotate_method": Legacy(str, _rotate_method),
    "float8.recipe_name": Legacy(str, functools.partial(_recipe_name, "float8.recipe_name")),
    "model.converters": Legacy(list[str], _converters),
    "quantize.linear.float8.recipe_name": Legacy(str, functools.partial(_recipe_name,
                                                                        "quantize.linear.float8.recipe_name")),
    "quantize.linear.float8.filter_fqns": Legacy(list[str], _filter_fqns),
    **{f"quantize.linear.float8.{key}": Legacy(bool, functools.partial(_float8_flag, f"quantize.linear.float8.{key}"))
       for key in ("enable_fsdp_float8_all_gather", "precompute_float8_dynamic_scale_for_fsdp", "emulate")},
}


# ---------------------------------------------------------------------------------------------
# APPLIES_ONLY_WITH: options read only when another option turns their feature on.


def _semi_sync(config: JobConfig) -> str:
    ft = config.fault_tolerance
    if not ft.enable:
        return "this job has no replica groups (fault_tolerance.enable is off)"
    if ft.semi_sync_method == "none":
        return "this job's semi_sync_method is none (the groups average gradients every step)"
    return f"this job's semi_sync_method is {ft.semi_sync_method}"


@dataclass(frozen=True)
class AppliesOnlyWith:
    options: str  # an fnmatch pattern of "section.key"
    feature: str  # the setting that uses them
    used: Callable[[JobConfig], bool]  # whether this job has it
    instead: Callable[[JobConfig], str]  # what this job has instead


APPLIES_ONLY_WITH: tuple[AppliesOnlyWith, ...] = (
    AppliesOnlyWith("float8.recipe", "float8.enable_float8_linear", lambda c: c.float8.enable_float8_linear,
                    lambda c: "this job's linear layers are not float8 (float8.enable_float8_linear is off)"),
    AppliesOnlyWith("float8.emulate", "float8.enable_float8_linear", lambda c: c.float8.enable_float8_linear,
                    lambda c: "this job's linear layers are not float8 (float8.enable_float8_linear is off)"),
    AppliesOnlyWith("optimizer.muon_*", "optimizer.name Muon", lambda c: c.optimizer.name == "Muon",
                    lambda c: f"this job's optimizer is {c.optimizer.name}"),
    AppliesOnlyWith("fault_tolerance.sync_steps", "fault_tolerance.semi_sync_method local_sgd or diloco",
                    lambda c: c.fault_tolerance.semi_sync_method != "none", _semi_sync),
    AppliesOnlyWith("fault_tolerance.outer_*", "fault_tolerance.semi_sync_method diloco",
                    lambda c: c.fault_tolerance.semi_sync_method == "diloco", _semi_sync),
    # Every [lora] option but lora.rank, which turns LoRA on.
    AppliesOnlyWith("lora.[adst]*", "lora.rank > 0", lambda c: c.lora.rank > 0,
                    lambda c: "this job trains every parameter (lora.rank is 0)"),
)


def read_legacy(config: JobConfig, given: Given) -> list[str]:
    """Reads the LEGACY options the job set into `config`; returns their notices (ConfigError: a refusal)."""
    return [LEGACY[option].read(value, config, given) for option, (value, _) in given.legacy.items()]


def unused(config: JobConfig, given: Given) -> list[str]:
    """The notices of options set for a feature this job does not use."""
    notices = []
    for rule in APPLIES_ONLY_WITH:
        names = [o for o in given.options if fnmatch.fnmatchcase(o, rule.options)]
        if names and not rule.used(config):
            has = "has" if len(names) == 1 else "have"
            notices.append(f"{', '.join(names)} {has} no effect: {'it applies' if len(names) == 1 else 'they apply'} "
                           f"to {rule.feature}, and {rule.instead(config)}")
    return notices
