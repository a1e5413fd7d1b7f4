"""The options phase's checks of each config section's own values (ranges, and options of one
section that must agree). Each is a rule of torchtitan/config/rules.py; torch-free."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import sys

from torchtitan.errors import ConfigError
from torchtitan.job_config import JobConfig


def _at_least_one(values: dict[str, int]) -> None:
    for name, value in values.items():
        if value < 1:
            raise ConfigError(f"{name} must be >= 1, got {value}")


def check_finite(config: JobConfig) -> None:
    # nan slips through every comparison of the other rules
    for section in dataclasses.fields(config):
        values = getattr(config, section.name)
        for option in dataclasses.fields(values):
            value = getattr(values, option.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{section.name}.{option.name} must be a finite number, got {value}")


def check_comm(config: JobConfig) -> None:
    c = config.comm
    _at_least_one({"comm.init_timeout_seconds": c.init_timeout_seconds,
                   "comm.train_timeout_seconds": c.train_timeout_seconds})
    if c.trace_buf_size < 0:
        raise ConfigError(f"comm.trace_buf_size must be >= 0 (0 turns NCCL's flight recorder off), got {c.trace_buf_size}")


def check_training(config: JobConfig) -> None:
    t = config.training
    _at_least_one({"training.batch_size": t.batch_size, "training.seq_len": t.seq_len, "training.steps": t.steps,
                   "training.gradient_accumulation_steps": t.gradient_accumulation_steps,
                   "training.gc_freq": t.gc_freq, "training.ddp_bucket_cap_mb": t.ddp_bucket_cap_mb})


def check_data(config: JobConfig) -> None:
    t = config.training
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


def check_optimizer(config: JobConfig) -> None:
    o = config.optimizer
    if not o.lr > 0:
        raise ConfigError(f"optimizer.lr must be > 0, got {o.lr}")
    if not 0 <= o.beta1 < 1 or not 0 <= o.beta2 < 1:
        raise ConfigError(f"optimizer.beta1 and beta2 must lie in [0, 1), got {o.beta1}, {o.beta2}")
    if o.eps <= 0 or o.weight_decay < 0:
        raise ConfigError(f"optimizer.eps must be > 0 and optimizer.weight_decay >= 0, got {o.eps} and {o.weight_decay}")


def check_lr_schedule(config: JobConfig) -> None:
    t = config.training
    if t.warmup_steps < 0:
        raise ConfigError(f"training.warmup_steps must be >= 0, got {t.warmup_steps}")
    if t.warmup_steps > t.steps:
        raise ConfigError(f"training.warmup_steps {t.warmup_steps} is longer than the run (training.steps {t.steps}): "
                          "the learning rate would never reach optimizer.lr; lower training.warmup_steps")
    if not 0 <= t.lr_min <= 1:
        raise ConfigError(f"training.lr_min is a fraction of optimizer.lr and must lie in [0, 1], got {t.lr_min}")


def check_moe(config: JobConfig) -> None:
    m = config.moe
    if m.aux_loss_coef < 0 or m.bias_update_rate < 0:
        raise ConfigError(f"moe.aux_loss_coef and moe.bias_update_rate must be >= 0 (0 turns each off), got "
                          f"{m.aux_loss_coef} and {m.bias_update_rate}")


def check_model(config: JobConfig) -> None:
    _at_least_one({"model.vocab_size_divisible_by": config.model.vocab_size_divisible_by})


def check_profiling(config: JobConfig) -> None:
    p = config.profiling
    _at_least_one({"profiling.profile_freq": p.profile_freq})
    if p.enable_profiling and p.profile_freq < 2:
        raise ConfigError("profiling.profile_freq must be >= 2 (one warm-up step, one recorded step)")


def check_checkpoint(config: JobConfig) -> None:
    c = config.checkpoint
    _at_least_one({"checkpoint.interval": c.interval})
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


def check_activation_checkpoint(config: JobConfig) -> None:
    ac = config.activation_checkpoint
    if ac.mode == "selective":
        value = ac.selective_ac_option
        if value != "op" and (not value.isdigit() or int(value) < 1):
            raise ConfigError(f"activation_checkpoint.selective_ac_option must be a positive integer or 'op', got {value!r}")


def check_float8(config: JobConfig) -> None:
    f8 = config.float8
    if (f8.enable_fsdp_float8_all_gather or f8.precompute_float8_dynamic_scale_for_fsdp) and not f8.enable_float8_linear:
        raise ConfigError("float8.enable_fsdp_float8_all_gather and precompute_float8_dynamic_scale_for_fsdp need "
                          "float8.enable_float8_linear")
    if f8.precompute_float8_dynamic_scale_for_fsdp and not f8.enable_fsdp_float8_all_gather:
        raise ConfigError("float8.precompute_float8_dynamic_scale_for_fsdp needs float8.enable_fsdp_float8_all_gather")
    for key in ("scaling_type_input", "scaling_type_weight", "scaling_type_grad_output"):
        if getattr(f8, key) == "delayed":
            raise ConfigError(f"float8.{key} 'delayed' is not supported: torchao (0.18) removed delayed scaling; use 'dynamic'")


def _module_available(name: str) -> bool:
    if name in sys.modules:  # also what tests inject (a fake module, or None for "not installed")
        return sys.modules[name] is not None
    return importlib.util.find_spec(name) is not None


def check_metrics(config: JobConfig) -> None:
    m = config.metrics
    _at_least_one({"metrics.log_freq": m.log_freq})
    if m.peak_tflops < 0:
        raise ConfigError(f"metrics.peak_tflops must be >= 0 (0 = auto), got {m.peak_tflops}")
    # Checked here, before torchrun starts any rank, rather than at the first log line.
    if m.enable_wandb and not _module_available("wandb"):
        raise ConfigError("metrics.enable_wandb needs the wandb package (pip install wandb)")


def check_validation(config: JobConfig) -> None:
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


def check_dry_run(config: JobConfig) -> None:
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


# Options declared for schema compatibility whose features arrive in later work: each refuses
# clearly instead of being silently ignored.
_NOT_YET = ("experimental.enable_compiled_autograd",)


def check_not_yet(config: JobConfig) -> None:
    for dotted in _NOT_YET:
        section, key = dotted.split(".")
        if getattr(getattr(config, section), key):
            raise ConfigError(f"{dotted} is not implemented yet in this version; leave it at its default")
