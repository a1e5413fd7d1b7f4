"""The options phase's checks of each config section's own values (ranges, and options of one
section that must agree). Each is a rule of torchtitan/config/rules.py; torch-free."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import sys

from torchtitan.config.job_config import JobConfig
from torchtitan.errors import ConfigError

# Sizes beyond which a tensor's element count overflows before a memory check can say it does not
# fit: 2**31 tokens (8,000 times the longest context trained so far) and a padding multiple of 2**20.
MAX_SEQ_LEN = 2**31
MAX_VOCAB_MULTIPLE = 2**20


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
    comm = config.comm
    _at_least_one({"comm.init_timeout_seconds": comm.init_timeout_seconds,
                   "comm.train_timeout_seconds": comm.train_timeout_seconds})
    if comm.trace_buf_size < 0:
        raise ConfigError(f"comm.trace_buf_size must be >= 0 (0 turns NCCL's flight recorder off), got {comm.trace_buf_size}")


def check_training(config: JobConfig) -> None:
    training = config.training
    _at_least_one({"training.batch_size": training.batch_size, "training.seq_len": training.seq_len, "training.steps": training.steps,
                   "training.gradient_accumulation_steps": training.gradient_accumulation_steps,
                   "training.gc_freq": training.gc_freq, "training.ddp_bucket_cap_mb": training.ddp_bucket_cap_mb})
    if training.seq_len > MAX_SEQ_LEN:  # beyond it, the model's position tables overflow before any size check
        raise ConfigError(f"training.seq_len {training.seq_len} is beyond the longest sequence this version takes "
                          f"({MAX_SEQ_LEN:,} tokens)")
    if training.loss_chunk_size < 0:
        raise ConfigError(f"training.loss_chunk_size must be >= 0 (0 computes the loss over the whole logits), got "
                          f"{training.loss_chunk_size}")


def check_data(config: JobConfig) -> None:
    training = config.training
    if training.dataset_shards == 0 or training.dataset_shards < -1:
        raise ConfigError(f"training.dataset_shards must be >= 1 or -1, got {training.dataset_shards}")
    if training.dataset_num_workers < 0:
        raise ConfigError(f"training.dataset_num_workers must be >= 0 (0 reads in the training process), got "
                          f"{training.dataset_num_workers}")
    if training.dataset_mix:
        from torchtitan.datasets.mixture import parse_mix

        try:
            parse_mix(training.dataset_mix)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if training.dataset_path:
            raise ConfigError("training.dataset_mix and training.dataset_path both name the training data; set one "
                              "(a mixture entry can be a path)")


def check_optimizer(config: JobConfig) -> None:
    optimizer = config.optimizer
    if not optimizer.lr > 0:
        raise ConfigError(f"optimizer.lr must be > 0, got {optimizer.lr}")
    if not 0 <= optimizer.beta1 < 1 or not 0 <= optimizer.beta2 < 1:
        raise ConfigError(f"optimizer.beta1 and beta2 must lie in [0, 1), got {optimizer.beta1}, {optimizer.beta2}")
    if optimizer.eps <= 0 or optimizer.weight_decay < 0:
        raise ConfigError(f"optimizer.eps must be > 0 and optimizer.weight_decay >= 0, got {optimizer.eps} and {optimizer.weight_decay}")


def check_lr_schedule(config: JobConfig) -> None:
    training = config.training
    if training.warmup_steps < 0:
        raise ConfigError(f"training.warmup_steps must be >= 0, got {training.warmup_steps}")
    if training.warmup_steps > training.steps:
        raise ConfigError(f"training.warmup_steps {training.warmup_steps} is longer than the run (training.steps {training.steps}): "
                          "the learning rate would never reach optimizer.lr; lower training.warmup_steps")
    if not 0 <= training.lr_min <= 1:
        raise ConfigError(f"training.lr_min is a fraction of optimizer.lr and must lie in [0, 1], got {training.lr_min}")


def check_moe(config: JobConfig) -> None:
    moe = config.moe
    if moe.aux_loss_coef < 0 or moe.bias_update_rate < 0:
        raise ConfigError(f"moe.aux_loss_coef and moe.bias_update_rate must be >= 0 (0 turns each off), got "
                          f"{moe.aux_loss_coef} and {moe.bias_update_rate}")
    if moe.capacity_factor < 0:
        raise ConfigError(f"moe.capacity_factor must be > 0 to drop tokens, or 0 for dropless routing; got "
                          f"{moe.capacity_factor}")


def check_moe_capacity_layout(config: JobConfig) -> None:
    """The dropping mode's capacity is per sequence, so that every layout drops the same (token,
    choice) pairs; under TP and CP a rank routes only a slice of each sequence, and would drop
    per slice instead."""
    tp, cp = config.training.tensor_parallel_degree, config.experimental.context_parallel_degree
    if config.moe.capacity_factor > 0 and (tp > 1 or cp > 1):
        raise ConfigError(f"moe.capacity_factor {config.moe.capacity_factor} drops tokens per whole sequence, but "
                          f"training.tensor_parallel_degree {tp} / experimental.context_parallel_degree {cp} route a "
                          "slice of each sequence per rank; set both to 1 or moe.capacity_factor to 0 (dropless)")


def check_model(config: JobConfig) -> None:
    _at_least_one({"model.vocab_size_divisible_by": config.model.vocab_size_divisible_by})
    model = config.model
    if model.vocab_size_divisible_by > MAX_VOCAB_MULTIPLE:
        raise ConfigError(f"model.vocab_size_divisible_by {model.vocab_size_divisible_by} would pad the vocabulary by "
                          f"up to as many rows; at most {MAX_VOCAB_MULTIPLE:,} (a multiple of the TP degree is enough)")
    if model.mtp_depth < -1:
        raise ConfigError(f"model.mtp_depth must be -1 (the flavor's), 0 (off) or a depth, got {model.mtp_depth}")
    if model.mtp_loss_weight < 0:
        raise ConfigError(f"model.mtp_loss_weight must be >= 0 (the multi-token prediction loss's weight; 0 leaves it "
                          f"out of the training loss), got {model.mtp_loss_weight}")


def check_profiling(config: JobConfig) -> None:
    profiling = config.profiling
    _at_least_one({"profiling.profile_freq": profiling.profile_freq})
    if profiling.enable_profiling and profiling.profile_freq < 2:
        raise ConfigError("profiling.profile_freq must be >= 2 (one warm-up step, one recorded step)")
    if profiling.audit_host_reads and config.training.compile:
        raise ConfigError("profiling.audit_host_reads records the steps' ops eagerly, which torch.compile cannot trace; "
                          "audit without training.compile (a compiled block's host reads are graph breaks, "
                          "refused by its fullgraph compile)")


def check_checkpoint(config: JobConfig) -> None:
    checkpoint = config.checkpoint
    _at_least_one({"checkpoint.interval": checkpoint.interval})
    if checkpoint.keep_latest_k < 0:
        raise ConfigError(f"checkpoint.keep_latest_k must be >= 0 (0 keeps every checkpoint), got {checkpoint.keep_latest_k}")
    if checkpoint.load_step < -1:
        raise ConfigError(f"checkpoint.load_step must be a step number or -1 (the newest), got {checkpoint.load_step}")
    if checkpoint.load_step >= 0 and not checkpoint.enable_checkpoint:
        raise ConfigError("checkpoint.load_step needs checkpoint.enable_checkpoint (it picks among this job's "
                          "checkpoints); to start from another folder's weights use checkpoint.initial_load_path")
    if checkpoint.export_dtype != "float32" and not (checkpoint.model_weights_only or checkpoint.last_save_in_hf):
        raise ConfigError(f"checkpoint.export_dtype {checkpoint.export_dtype} applies to the weights-only final checkpoint and "
                          "the Hugging Face export; set checkpoint.model_weights_only or checkpoint.last_save_in_hf too "
                          "(full checkpoints keep the training dtype)")
    if checkpoint.create_seed_checkpoint and (checkpoint.initial_load_path or checkpoint.last_save_in_hf):
        option = "initial_load_path" if checkpoint.initial_load_path else "last_save_in_hf"
        raise ConfigError(f"checkpoint.create_seed_checkpoint writes freshly initialised weights and trains nothing; "
                          f"leave checkpoint.{option} unset (a Hugging Face folder becomes a DCP checkpoint with "
                          "scripts/convert_checkpoint.py hf-to-dcp)")
    if (checkpoint.exclude_from_loading or checkpoint.allow_partial_load) and not (checkpoint.enable_checkpoint or checkpoint.initial_load_path):
        option = "exclude_from_loading" if checkpoint.exclude_from_loading else "allow_partial_load"
        raise ConfigError(f"checkpoint.{option} applies to a checkpoint being loaded; set checkpoint.enable_checkpoint "
                          "(resume) or checkpoint.initial_load_path")


def check_activation_checkpoint(config: JobConfig) -> None:
    ac = config.activation_checkpoint
    if ac.mode == "selective":
        value = ac.selective_ac_option
        if value != "op" and (not value.isdigit() or int(value) < 1):
            raise ConfigError(f"activation_checkpoint.selective_ac_option must be a positive integer or 'op', got {value!r}")
    if ac.offload not in ("none", "all") and (not ac.offload.isdigit() or int(ac.offload) < 1):
        raise ConfigError(f"activation_checkpoint.offload must be 'none', 'all' or a positive integer k (every k-th "
                          f"block), got {ac.offload!r}")


def check_float8(config: JobConfig) -> None:
    f8 = config.float8
    if (f8.enable_fsdp_float8_all_gather or f8.precompute_float8_dynamic_scale_for_fsdp) and not f8.enable_float8_linear:
        raise ConfigError("float8.enable_fsdp_float8_all_gather and precompute_float8_dynamic_scale_for_fsdp need "
                          "float8.enable_float8_linear")
    if f8.enable_fsdp_float8_all_gather and f8.recipe != "tensorwise":
        raise ConfigError(f"float8.enable_fsdp_float8_all_gather needs float8.recipe tensorwise (torchao all-gathers "
                          f"weights in float8 with one scale a tensor only); float8.recipe {f8.recipe} all-gathers "
                          "them in high precision: drop one of the two")
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
    metrics = config.metrics
    _at_least_one({"metrics.log_freq": metrics.log_freq})
    if metrics.peak_tflops < 0:
        raise ConfigError(f"metrics.peak_tflops must be >= 0 (0 = auto), got {metrics.peak_tflops}")
    # Checked here, before torchrun starts any rank, rather than at the first log line.
    if metrics.enable_wandb and not _module_available("wandb"):
        raise ConfigError("metrics.enable_wandb needs the wandb package (pip install wandb)")


def check_validation(config: JobConfig) -> None:
    validation = config.validation
    if validation.freq < 1:
        raise ConfigError(f"validation.freq must be >= 1, got {validation.freq}")
    if validation.steps == 0 or validation.steps < -1:
        raise ConfigError(f"validation.steps must be >= 1 or -1 (the whole validation data), got {validation.steps}")
    if validation.batch_size == 0 or validation.batch_size < -1:
        raise ConfigError(f"validation.batch_size must be >= 1 or -1 (the rows of one optimizer step: training.batch_size "
                          f"x training.gradient_accumulation_steps), got {validation.batch_size}")
    if not 0 < validation.held_out_fraction < 1:
        raise ConfigError(f"validation.held_out_fraction must lie strictly between 0 and 1, got {validation.held_out_fraction}")
    if not validation.enabled:
        return
    if config.experimental.pipeline_parallel_degree > 1 and validation.batch_size > 0 and validation.batch_size % config.training.batch_size:
        # The schedule's stages exchange microbatches of the shape the training step set up.
        raise ConfigError(f"validation.batch_size {validation.batch_size} must be a multiple of training.batch_size "
                          f"{config.training.batch_size} under pipeline parallelism (or -1)")


def check_sft(config: JobConfig) -> None:
    """Supervised fine-tuning reads conversations from JSON lines (datasets/sft.py)."""
    sft, training = config.sft, config.training
    if not sft.format:
        set_anyway = [name for name, value in (("sft.chat_template", sft.chat_template),) if value]
        if set_anyway:
            raise ConfigError(f"{set_anyway[0]} is set but sft.format is empty: set sft.format chat to fine-tune on "
                              "conversations")
        return
    if training.dataset_mix:
        raise ConfigError("sft.format reads one source of conversations; training.dataset_mix mixes text sources "
                          "(leave it empty and name the conversations in training.dataset_path)")
    if training.mask_loss_after_eos:
        raise ConfigError("training.mask_loss_after_eos does not combine with sft.format: the loss is on the assistant "
                          "turns only already")
    if sft.chat_template and sft.format != "chat":
        raise ConfigError(f"sft.chat_template renders chat lines; sft.format is {sft.format}")
    if sft.chat_template and not sft.chat_template.startswith("bundled:") and not os.path.isfile(sft.chat_template):
        raise ConfigError(f"sft.chat_template {sft.chat_template} is not a file")


def check_dry_run(config: JobConfig) -> None:
    job, memory_estimation = config.job, config.memory_estimation
    if job.dry_run_world_size < 0:
        raise ConfigError(f"job.dry_run_world_size must be a number of ranks (0: the launcher's), got {job.dry_run_world_size}")
    if job.dry_run_vocab_size < 0:
        raise ConfigError(f"job.dry_run_vocab_size must be a number of tokens (0: the tokenizer's), got {job.dry_run_vocab_size}")
    if job.dry_run_rank < -1:
        raise ConfigError(f"job.dry_run_rank must be a rank, or -1 (the first and the last pipeline rank), got {job.dry_run_rank}")
    if not job.dry_run:
        given = [name for name, value in (("job.dry_run_world_size", job.dry_run_world_size),
                                          ("job.dry_run_vocab_size", job.dry_run_vocab_size),
                                          ("job.dry_run_rank", job.dry_run_rank + 1),
                                          ("memory_estimation.disable_fake_mode", memory_estimation.disable_fake_mode)) if value]
        if given:
            raise ConfigError(f"{given[0]} needs job.dry_run (without it the job trains for real)")
    if not math.isfinite(memory_estimation.device_memory_gib) or memory_estimation.device_memory_gib < 0:
        raise ConfigError(f"memory_estimation.device_memory_gib must be a finite number >= 0 (0: this machine's GPU), got "
                          f"{memory_estimation.device_memory_gib}")


# Options declared for schema compatibility whose features arrive in later work: each refuses
# clearly instead of being silently ignored.
_NOT_YET = ("experimental.enable_compiled_autograd",)


def check_lora(config: JobConfig) -> None:
    """LoRA's own values, and what it does not combine with (docs/lora.md)."""
    lora, checkpoint = config.lora, config.checkpoint
    if lora.rank < 0:
        raise ConfigError(f"lora.rank must be >= 0 (0 turns LoRA off), got {lora.rank}")
    if lora.rank == 0:
        return
    if lora.alpha <= 0 or not 0 <= lora.dropout < 1:
        raise ConfigError(f"lora.alpha must be > 0 and lora.dropout in [0, 1), got {lora.alpha} and {lora.dropout}")
    if not lora.target_modules:
        raise ConfigError("lora.target_modules is empty: name the linear layers to adapt (all-linear: every one of "
                          "the transformer blocks)")
    if config.float8.enable_float8_linear:
        raise ConfigError("lora does not combine with float8.enable_float8_linear: float8 replaces the linear layers "
                          "the adapters attach to (and would quantize the frozen base anew every step); set lora.rank 0 "
                          "or leave float8 off")
    if checkpoint.create_seed_checkpoint:
        raise ConfigError("checkpoint.create_seed_checkpoint writes a freshly initialised base model; write it "
                          "without lora (lora.rank 0), then fine-tune from it with checkpoint.initial_load_path")
    if not checkpoint.initial_load_path and (lora.save_adapters_only or not checkpoint.enable_checkpoint):
        needs = ("lora.save_adapters_only reads the frozen base from it again on every resume" if lora.save_adapters_only
                 else "LoRA fine-tunes a trained model")
        raise ConfigError(f"lora.rank {lora.rank} needs base weights: set checkpoint.initial_load_path to a checkpoint "
                          f"or Hugging Face folder of the base model ({needs}; a base trained from scratch would stay "
                          "random)")
    if checkpoint.model_weights_only or checkpoint.last_save_in_hf:
        option = "model_weights_only" if checkpoint.model_weights_only else "last_save_in_hf"
        raise ConfigError(f"checkpoint.{option} does not combine with lora yet; export the final checkpoint with "
                          "scripts/convert_checkpoint.py dcp-to-hf --lora-merge (merged weights) or lora-to-peft "
                          "(a PEFT adapter folder)")
    if config.moe.bias_update_rate > 0:
        raise ConfigError(f"moe.bias_update_rate {config.moe.bias_update_rate} trains the routing biases, which "
                          "belong to the frozen base under lora; set moe.bias_update_rate 0")


def check_not_yet(config: JobConfig) -> None:
    for dotted in _NOT_YET:
        section, key = dotted.split(".")
        if getattr(getattr(config, section), key):
            raise ConfigError(f"{dotted} is not implemented yet in this version; leave it at its default")


def check_fault_tolerance(config: JobConfig) -> None:
    ft = config.fault_tolerance
    if not ft.enable:
        if ft.semi_sync_method != "none":
            raise ConfigError(f"fault_tolerance.semi_sync_method {ft.semi_sync_method} syncs replica groups: it needs "
                              "fault_tolerance.enable (and a lighthouse), or semi_sync_method none")
        return
    # What replica groups never compose with comes first: the settings below would only be changed in vain.
    if config.optimizer.early_step_in_backward:
        raise ConfigError("fault_tolerance does not combine with optimizer.early_step_in_backward: a step is applied "
                          "only once the groups have averaged its gradients and agreed to commit it; use one or the other")
    if config.moe.bias_update_rate > 0:
        raise ConfigError("fault_tolerance does not combine with moe.bias_update_rate > 0 yet: each group would steer "
                          "its routing biases by its own tokens, and the groups' models would drift apart")
    if (missing := torchft_missing()) is not None:
        raise ConfigError(missing)
    _at_least_one({"fault_tolerance.group_size": ft.group_size, "fault_tolerance.min_replica_size": ft.min_replica_size,
                   "fault_tolerance.sync_steps": ft.sync_steps, "fault_tolerance.timeout_seconds": ft.timeout_seconds,
                   "fault_tolerance.quorum_timeout_seconds": ft.quorum_timeout_seconds})
    if not 0 <= ft.replica_id < ft.group_size:
        raise ConfigError(f"fault_tolerance.replica_id must be a group index 0..{ft.group_size - 1} "
                          f"(fault_tolerance.group_size {ft.group_size}), got {ft.replica_id}")
    if ft.min_replica_size > ft.group_size:
        raise ConfigError(f"fault_tolerance.min_replica_size {ft.min_replica_size} is more than the "
                          f"{ft.group_size} replica groups (fault_tolerance.group_size): no step could be committed")
    address = lighthouse_address(config)
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError("fault_tolerance needs the lighthouse's host:port in fault_tolerance.lighthouse or "
                          f"$TORCHFT_LIGHTHOUSE, got {address!r} (run_llama_train.sh with FT_LIGHTHOUSE=start starts one)")
    if not 0 < ft.outer_lr or not 0 <= ft.outer_momentum < 1:
        raise ConfigError(f"fault_tolerance.outer_lr must be > 0 and outer_momentum in [0, 1), got {ft.outer_lr} and "
                          f"{ft.outer_momentum}")
    if ft.semi_sync_method != "none" and config.checkpoint.enable_checkpoint and config.checkpoint.interval % ft.sync_steps:
        raise ConfigError(f"fault_tolerance.semi_sync_method {ft.semi_sync_method}: checkpoint.interval "
                          f"{config.checkpoint.interval} must be a multiple of fault_tolerance.sync_steps {ft.sync_steps}, "
                          "so that checkpoints fall on syncs, where the groups' parameters agree")


def torchft_missing() -> str | None:
    """Why fault tolerance cannot run here (torchft not installed), or None."""
    if importlib.util.find_spec("torchft") is None:
        return ("fault_tolerance.enable needs torchft, an optional extra: pip install 'torchtitan[ft]' "
                "(or pip install torchft)")
    return None


def lighthouse_address(config: JobConfig) -> str:
    """host:port of the lighthouse: fault_tolerance.lighthouse, else $TORCHFT_LIGHTHOUSE."""
    import os

    address = config.fault_tolerance.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE", "")
    return address.removeprefix("http://")
