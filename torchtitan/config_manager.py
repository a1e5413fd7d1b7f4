"""JobConfig: typed configuration sections, merged as defaults < TOML file < command line.

Each TOML section is one dataclass; each field's `help` metadata is the `--help` text.
Unknown sections or keys, wrong types and impossible values raise `ConfigError`, which the
entry points turn into one line on stderr and exit code 2. This module imports no torch so
that `run_llama_train.sh` can validate a config in milliseconds, before torchrun starts.

Field names follow the late-2024 torchtitan TOML schema so existing configs run unchanged.
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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from torchtitan.errors import UserError

if TYPE_CHECKING:  # imported lazily at run time: this module must load without torch
    from torchtitan.parallelisms.parallel_dims import ParallelDims

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib


class ConfigError(UserError, ValueError):
    """A configuration problem the user can fix; its message is one line naming the option."""


def opt(default: Any, help: str, choices: Sequence[Any] | None = None) -> Any:
    """Declares a config field with its help text (and optional allowed values)."""
    meta = {"help": help, "choices": tuple(choices) if choices else None}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class Job:
    config_file: str = opt("", "TOML file with the job's settings (command-line options override it).")
    dump_folder: str = opt("./outputs", "Folder for everything a run writes: logs, TensorBoard, checkpoints, traces.")
    description: str = opt("default job", "Free-text description of the job, printed at start-up.")
    use_for_integration_test: bool = opt(False, "Marks a config as part of the integration-test set.")
    print_args: bool = opt(False, "Print the fully merged configuration at start-up.")


@dataclass
class Profiling:
    enable_profiling: bool = opt(False, "Record torch.profiler traces every profile_freq steps.")
    save_traces_folder: str = opt("profile_traces", "Trace folder, relative to job.dump_folder.")
    profile_freq: int = opt(10, "Steps between profiler traces.")
    enable_memory_snapshot: bool = opt(False, "Dump CUDA memory snapshots (CUDA only).")
    save_memory_snapshot_folder: str = opt("memory_snapshot", "Snapshot folder, relative to job.dump_folder.")


@dataclass
class Metrics:
    log_freq: int = opt(10, "Print one metrics line every log_freq steps (the first step is always logged).")
    enable_tensorboard: bool = opt(False, "Write TensorBoard scalars under job.dump_folder/save_tb_folder.")
    disable_color_printing: bool = opt(False, "Print metrics without ANSI colours.")
    save_tb_folder: str = opt("tb", "TensorBoard folder, relative to job.dump_folder.")
    rank_0_only: bool = opt(True, "Write TensorBoard from the logging rank only (else one sub-folder per rank).")
    save_jsonl: bool = opt(
        True, "Write each logged step's metrics to job.dump_folder/metrics.jsonl (rank 0), for plots and parity checks. "
        "A resumed run appends to it (dropping rows after its checkpoint's step, which it trains again); a fresh "
        "run starts a new file and renames an existing one to metrics.<n>.jsonl (the first free n, so a larger n "
        "is a later run), so two runs' steps never mix and none is lost.")
    enable_color_printing: bool = opt(True, "Late-2024 spelling kept for old configs: false prints without ANSI "
                                            "colours, like disable_color_printing true.")
    enable_wandb: bool = opt(
        False, "Also log the scalars to Weights & Biases (rank 0; needs the wandb package; run files under "
        "job.dump_folder/wandb). The project is $WANDB_PROJECT or 'torchtitan'; WANDB_MODE=offline logs without a network.")
    peak_tflops: float = opt(
        0.0, "Peak TFLOP/s of one device that MFU is relative to; 0 = auto: a datasheet table of dense peaks for "
        "known GPUs in the compute dtype, or on CPU a matmul peak measured once per CPU model, thread count and "
        "dtype and cached in $TORCHTITAN_CACHE_DIR (default ~/.cache/torchtitan).")


@dataclass
class Model:
    name: str = opt("llama3", "Registered model name (see torchtitan.models).")
    flavor: str = opt("debugmodel", "Model size/shape, one of the registered model's flavors.")
    norm_type: str = opt("rmsnorm", "Normalization layer; fused_rmsnorm (the late-2024 name of a Triton kernel) computes "
                         "the same RMSNorm, which torch.compile fuses.",
                         choices=["rmsnorm", "layernorm", "np_layernorm", "fused_rmsnorm"])
    tokenizer_path: str = opt(
        "tests/assets/stdlib_docs/tokenizer.model",
        "Tokenizer file: a tiktoken rank file (Llama 3 format) or a sentencepiece .model (Llama 2 format).",
    )
    vocab_size_divisible_by: int = opt(1, "Pad the vocabulary (embedding and output rows) up to a multiple of this.")


@dataclass
class Optimizer:
    name: str = opt("AdamW", "Optimizer.", choices=["AdamW", "Adam"])
    lr: float = opt(8e-4, "Peak learning rate.")
    beta1: float = opt(0.9, "Adam beta1.")
    beta2: float = opt(0.95, "Adam beta2.")
    eps: float = opt(1e-8, "Adam epsilon.")
    weight_decay: float = opt(0.1, "Decoupled (AdamW) or L2 (Adam) weight decay.")
    fused: bool = opt(False, "Use the fused kernel (CUDA); otherwise the multi-tensor foreach path.")
    zero1: bool = opt(
        False, "ZeRO-1: shard the optimizer state over the data-parallel replicas (training."
        "data_parallel_replicate_degree > 1): each replica keeps and updates the state of its share of the "
        "parameters, then broadcasts them. Composes with FSDP (HSDP), TP, CP and PP; losses are unchanged.")
    early_step_in_backward: bool = opt(
        False, "Step each parameter's optimizer in backward, as soon as its gradient is complete (after FSDP's "
        "reduce-scatter), and free that gradient at once: the gradients of the whole model never exist together. "
        "Same updates as the usual step. Needs training.max_norm 0 (clipping needs every gradient first) and no "
        "gradient accumulation, pipeline parallelism, ZeRO-1 or plain DDP.")


@dataclass
class Training:
    dataset: str = opt("stdlib_docs", "Registered text source name.")
    dataset_path: str = opt(
        "", "Local data overriding training.dataset: a .jsonl ('text' field), .txt or .parquet file, a folder or a glob."
    )
    dataset_infinite: bool = opt(True, "Loop over the data in epochs; false ends training cleanly when the data runs out.")
    dataset_skip_bad_lines: bool = opt(False, "Skip and count malformed lines (bad JSON, invalid UTF-8) instead of stopping.")
    dataset_shards: int = opt(
        -1,
        "Document shards the dataset is split into; -1 = one per data-parallel rank. Each rank reads "
        "dataset_shards / dp shards and takes an equal slice of its batch from each, so two runs with the "
        "same dataset_shards and global batch see identical data whatever their data-parallel degree.",
    )
    batch_size: int = opt(8, "Batch size per data-parallel rank and micro-step.")
    seq_len: int = opt(2048, "Tokens per sequence.")
    warmup_steps: int = opt(200, "Linear learning-rate warm-up steps.")
    decay_type: str = opt("linear", "Learning-rate decay after warm-up.", choices=["linear", "cosine", "constant"])
    lr_min: float = opt(0.0, "Learning rate at the end of decay, as a fraction of optimizer.lr.")
    max_norm: float = opt(1.0, "Clip the global gradient norm to this value (<= 0 disables clipping).")
    steps: int = opt(10000, "Optimizer steps to train.")
    gradient_accumulation_steps: int = opt(1, "Micro-batches per optimizer step; gradients sync on the last only.")
    data_parallel_replicate_degree: int = opt(1, "Replicas (DDP, or HSDP's outer dim when sharding too).")
    data_parallel_shard_degree: int = opt(-1, "FSDP shard degree; -1 = every rank not used by another degree.")
    enable_cpu_offload: bool = opt(False, "Offload FSDP parameters, gradients and optimizer state to CPU.")
    tensor_parallel_degree: int = opt(1, "Tensor-parallel degree.")
    disable_loss_parallel: bool = opt(False, "Gather full logits instead of computing the loss vocab-sharded (TP).")
    enable_loss_parallel: bool = opt(True, "Late-2024 spelling of the same switch: false means disable_loss_parallel.")
    disable_sequence_parallel: bool = opt(False, "TP without sequence parallelism for norms (all-reduce mode).")
    fsdp_reshard_after_forward: str = opt(
        "default",
        "When FSDP frees gathered parameters: default (after forward, except the root), always, never (ZeRO-2-like).",
        choices=["default", "always", "never"],
    )
    mixed_precision_param: str = opt(
        "auto", "FSDP parameter/compute dtype; auto = bfloat16 on CUDA, float32 on CPU.",
        choices=["auto", "bfloat16", "float32"],
    )
    mixed_precision_reduce: str = opt("float32", "FSDP gradient reduce dtype.", choices=["float32", "bfloat16"])
    ddp_bucket_cap_mb: int = opt(100, "DDP gradient bucket size in MB.")
    compile: bool = opt(False, "torch.compile each transformer block.")
    gc_freq: int = opt(50, "Run Python's garbage collector every gc_freq steps (automatic GC is disabled).")
    seed: int = opt(-1, "Random seed; -1 = a fixed default (0) so runs repeat.")
    deterministic: bool = opt(False, "Use deterministic algorithms (slower; for parity and debugging).")
    on_nonfinite_loss: str = opt(
        "stop", "At a non-finite loss or gradient norm: 'stop' before applying the step (exit code 3; the newest "
        "checkpoint stays good; costs one host-device sync per step), or 'continue' (no check).",
        choices=["stop", "continue"])


@dataclass
class Experimental:
    pipeline_parallel_degree: int = opt(1, "Pipeline-parallel degree.")
    pipeline_parallel_split_points: list[str] = opt(
        [], "Modules where stages 2, 3, ... start, e.g. layers.4,layers.8; empty = split by estimated cost.")
    pipeline_parallel_schedule: str = opt(
        "1F1B", "GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble or DualPipeV.")
    pipeline_parallel_schedule_csv: str = opt(
        "", "CSV file with a custom schedule (one row of actions like 0F0,0B0 per rank); overrides the schedule.")
    pipeline_parallel_stages_per_rank: int = opt(
        -1, "Stages each pp rank runs; -1 = 1 for single-stage schedules, 2 for multi-stage and V schedules.")
    pipeline_parallel_microbatches: int = opt(
        -1, "Microbatches per step and data-parallel rank; -1 = one per stage (pp x stages per rank).")
    pipeline_parallel_microbatch_size: int = opt(
        -1, "Sequences per microbatch (alternative to pipeline_parallel_microbatches); -1 = unset.")
    context_parallel_degree: int = opt(1, "Context-parallel degree (sequence split across ranks).")
    context_parallel_backend: str = opt(
        "ring", "CP attention: ring (this project's ring attention, CPU and CUDA) or torch (PyTorch's; not yet offered).",
        choices=["ring", "torch"])
    context_parallel_rotate_method: str = opt(
        "allgather", "How PyTorch's CP backend exchanges keys/values (the ring backend always passes them around "
        "the ring).", choices=["allgather", "alltoall"])
    enable_async_tensor_parallel: bool = opt(False, "Async TP via symmetric-memory micro-pipelining (CUDA + compile).")
    enable_compiled_autograd: bool = opt(False, "Compile the backward pass with compiled autograd.")
    custom_import: str = opt("", "Python module imported at start-up, e.g. one that registers a new model.")


@dataclass
class Checkpoint:
    enable_checkpoint: bool = opt(False, "Save checkpoints, and resume from the newest complete one at start-up.")
    folder: str = opt("checkpoint", "Checkpoint folder, relative to job.dump_folder; holds one step-N folder per save.")
    interval_type: str = opt("steps", "Unit of checkpoint.interval.", choices=["steps"])
    interval: int = opt(500, "Steps between checkpoints (the last step is always saved).")
    model_weights_only: bool = opt(
        False, "The last step's checkpoint holds model weights only (for inference, fine-tuning or conversion), "
        "cast to checkpoint.export_dtype.")
    export_dtype: str = opt("float32", "Dtype of the weights-only final checkpoint (needs model_weights_only).",
                            choices=["float32", "bfloat16", "float16"])
    create_seed_checkpoint: bool = opt(False, "Write the freshly initialised model as step 0 and exit (one process).")
    async_mode: str = opt(
        "disabled", "disabled: the loop waits for each save; async: it waits only while the state is copied to host "
        "memory, a background thread writes it; async_with_pinned_mem: copies into reused (pinned on CUDA) buffers, "
        "a checkpoint process writes them. At most one save is in flight; the last one is awaited before exit.",
        choices=["disabled", "async", "async_with_pinned_mem"])
    keep_latest_k: int = opt(
        0, "Keep only the newest k complete checkpoints (0 = keep all); the newest resumable one always stays.")
    load_step: int = opt(-1, "Step to resume from (-1 = the newest complete checkpoint).")
    initial_load_path: str = opt(
        "", "Checkpoint (e.g. a seed checkpoint's step-0 folder) whose model weights initialise a run that "
        "has no checkpoint of its own yet; any parallel layout can load it."
    )
    exclude_from_loading: list[str] = opt(
        [], "What not to load from the checkpoint (comma-separated): state names (optimizer, lr_scheduler, "
        "dataloader, train_state, rng) or parameter-name prefixes (output, layers.7), which leave out those "
        "parameters and their optimizer state. Excluded entries keep their initial values; each is logged.")
    allow_partial_load: bool = opt(
        False, "Load a checkpoint that does not fully fit the model (another model, flavor or optimizer): entries "
        "on one side only or of another shape are left out, with a warning, instead of refused.")


@dataclass
class ActivationCheckpoint:
    mode: str = opt("selective", "Activation checkpointing.", choices=["none", "full", "selective"])
    selective_ac_option: str = opt("2", "Selective AC: an integer k checkpoints every k-th block; 'op' is op-level.")


@dataclass
class Float8:
    enable_float8_linear: bool = opt(False, "Float8 linear layers through torchao (GPUs of compute capability 8.9+).")
    enable_fsdp_float8_all_gather: bool = opt(False, "All-gather FSDP parameters in float8.")
    precompute_float8_dynamic_scale_for_fsdp: bool = opt(False, "Compute float8 scales for all parameters at once.")
    emulate: bool = opt(False, "Emulate the float8 matmuls in high precision, so float8 runs where the hardware has "
                               "no float8 units (CPU, older GPUs): for tests and debugging, never faster.")
    scaling_type_input: str = opt(
        "dynamic", "Float8 scaling of the linear inputs: dynamic (scale from each tensor's current amax). 'delayed' "
        "(scales from an amax history) is accepted from late-2024 configs but refused: torchao removed it.",
        choices=["dynamic", "delayed"])
    scaling_type_weight: str = opt("dynamic", "Float8 scaling of the weights; dynamic only, as scaling_type_input.",
                                   choices=["dynamic", "delayed"])
    scaling_type_grad_output: str = opt(
        "dynamic", "Float8 scaling of the output gradients; dynamic only, as scaling_type_input.",
        choices=["dynamic", "delayed"])


@dataclass
class Comm:
    init_timeout_seconds: int = opt(300, "Timeout for process-group initialisation and the first step.")
    train_timeout_seconds: int = opt(100, "Collective timeout after the first step.")
    trace_buf_size: int = opt(20000, "NCCL flight-recorder entries (0 disables).")


@dataclass
class MemoryEstimation:
    enabled: bool = opt(False, "Estimate peak memory with fake tensors before training.")
    disable_fake_mode: bool = opt(False, "Estimate with real tensors.")


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    profiling: Profiling = field(default_factory=Profiling)
    metrics: Metrics = field(default_factory=Metrics)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    training: Training = field(default_factory=Training)
    experimental: Experimental = field(default_factory=Experimental)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    float8: Float8 = field(default_factory=Float8)
    comm: Comm = field(default_factory=Comm)
    memory_estimation: MemoryEstimation = field(default_factory=MemoryEstimation)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)


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
        with open(path, "rb") as f:
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
_NOT_YET = {
    ("experimental", "enable_compiled_autograd"): bool,
    ("memory_estimation", "enabled"): bool,
    ("profiling", "enable_memory_snapshot"): bool,
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
    if t.data_parallel_shard_degree == 0 or t.data_parallel_shard_degree < -1:
        raise ConfigError(f"training.data_parallel_shard_degree must be >= 1 or -1, got {t.data_parallel_shard_degree}")
    if t.dataset_shards == 0 or t.dataset_shards < -1:
        raise ConfigError(f"training.dataset_shards must be >= 1 or -1, got {t.dataset_shards}")
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
    if c.export_dtype != "float32" and not c.model_weights_only:
        raise ConfigError(f"checkpoint.export_dtype {c.export_dtype} applies to the weights-only final checkpoint; "
                          "set checkpoint.model_weights_only too (full checkpoints keep the training dtype)")
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
    if config.experimental.enable_async_tensor_parallel:
        if t.tensor_parallel_degree == 1:
            raise ConfigError("experimental.enable_async_tensor_parallel needs training.tensor_parallel_degree > 1")
        if not t.compile:
            raise ConfigError("experimental.enable_async_tensor_parallel works through torch.compile's micro-pipelining; "
                              "set training.compile true")
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
    _validate_early_step(config)
    cp = config.experimental.context_parallel_degree
    if cp > 1:
        if t.seq_len % (2 * cp):
            raise ConfigError(f"training.seq_len {t.seq_len} must divide by 2 x experimental.context_parallel_degree "
                              f"= {2 * cp}: each cp rank holds two equal chunks of every sequence")
        if config.experimental.context_parallel_backend == "torch":
            raise ConfigError("experimental.context_parallel_backend 'torch' (PyTorch's context parallel) is not offered "
                              "yet: it has no CPU path, and this version runs only the ring backend; use 'ring'")
        if t.compile:
            raise ConfigError("training.compile with context parallelism is not supported yet: ring attention's "
                              "point-to-point exchange cannot sit inside a fullgraph-compiled block")
    if config.experimental.pipeline_parallel_degree > 1:
        from torchtitan.parallelisms.pipeline import plan_pipeline

        plan_pipeline(config)
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


def _validate_early_step(config: JobConfig) -> None:
    """optimizer.early_step_in_backward steps each parameter as soon as its gradient is final and
    frees it. Whatever needs all gradients at once, or a parameter's gradient more than once per
    step, cannot compose with it."""
    if not config.optimizer.early_step_in_backward:
        return
    t, name = config.training, "optimizer.early_step_in_backward"
    if t.max_norm > 0:
        raise ConfigError(f"{name} applies and frees each gradient during backward, so no global norm can clip "
                          f"them; set training.max_norm 0 (got {t.max_norm})")
    if t.gradient_accumulation_steps > 1:
        raise ConfigError(f"{name} would step after the first micro-batch's gradient; set "
                          "training.gradient_accumulation_steps 1")
    if config.experimental.pipeline_parallel_degree > 1:
        raise ConfigError(f"{name} does not compose with pipeline parallelism (each microbatch's backward adds to the "
                          "gradients); set experimental.pipeline_parallel_degree 1")
    if config.optimizer.zero1:
        raise ConfigError(f"{name} does not compose with optimizer.zero1 (its owners broadcast updates after the "
                          "whole step); use one or the other")


def _check_fsdp_only_options(t: Training, dims: ParallelDims) -> None:
    """Options that only FSDP/HSDP can honour are refused, not ignored, on layouts without it."""
    if dims.fsdp_enabled:
        return
    if dims.ddp_enabled:
        layout = (f"training.data_parallel_replicate_degree {dims.dp_replicate} with shard degree 1 is DDP, "
                  "which has no sharding")
    else:
        layout = "this layout has no FSDP (data_parallel_shard_degree 1)"
    if t.enable_cpu_offload:
        raise ConfigError(
            f"training.enable_cpu_offload offloads FSDP-sharded state and needs data_parallel_shard_degree > 1; {layout}"
        )
    if t.fsdp_reshard_after_forward != "default":
        raise ConfigError(f"training.fsdp_reshard_after_forward {t.fsdp_reshard_after_forward!r} applies to FSDP only; "
                          f"{layout}; leave it at 'default'")
    if t.mixed_precision_param == "bfloat16":
        raise ConfigError(f"training.mixed_precision_param bfloat16 is FSDP's mixed-precision policy; {layout} and "
                          "computes in float32; use 'auto' or 'float32', or shard (data_parallel_shard_degree > 1)")
    if t.mixed_precision_reduce == "bfloat16" and not dims.ddp_enabled:
        raise ConfigError(f"training.mixed_precision_reduce bfloat16 has no effect on one rank: {layout}; leave it at float32")


def validate_world_size(config: JobConfig, world_size: int) -> ParallelDims:
    """Checks that need the number of ranks (the parallel degrees, one-process-only modes) and
    returns the validated ParallelDims."""
    from torchtitan.parallelisms.parallel_dims import parallel_dims_from_config  # torch-free import

    dims = parallel_dims_from_config(config, world_size)
    _check_fsdp_only_options(config.training, dims)
    if config.optimizer.zero1 and not dims.dp_replicate_enabled:
        raise ConfigError("optimizer.zero1 shards the optimizer state over data-parallel replicas, and this layout has "
                          "none (training.data_parallel_replicate_degree is 1); raise it, or rely on FSDP, which already "
                          "shards the optimizer state over data_parallel_shard_degree")
    if config.optimizer.early_step_in_backward and dims.ddp_enabled and not (dims.tp_enabled or dims.pp_enabled):
        # Composable DDP all-reduces gradient buckets after the per-parameter hooks have run, so
        # each optimizer would see its rank's own gradient. FSDP (and the FSDP-based replicate
        # used with TP) calls the hooks after the reduction.
        raise ConfigError("optimizer.early_step_in_backward does not compose with DDP (data_parallel_replicate_degree "
                          f"{dims.dp_replicate} with shard degree 1): DDP reduces gradients after the hooks step on "
                          "them; shard instead (data_parallel_shard_degree > 1, HSDP with replicas)")
    if config.checkpoint.create_seed_checkpoint and world_size > 1:
        raise ConfigError(f"checkpoint.create_seed_checkpoint runs on one process; got {world_size} (set NGPU=1)")
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
    try:
        config = parse_args(argv)
        if "WORLD_SIZE" in os.environ:  # the launcher passes the number of ranks it will start
            validate_world_size(config, int(os.environ["WORLD_SIZE"]))
    except ConfigError as e:
        print(e.line, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    # Run the imported module's main, so ConfigError raised by other torchtitan modules is the
    # same class as the one caught here (not a twin defined in __main__).
    from torchtitan.config_manager import main as _main

    sys.exit(_main())
