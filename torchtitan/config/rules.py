"""The one registry of the rules a job's configuration must pass before training starts.

Each rule is declared once below: its name, its phase, the options it reads, and the function
that checks it (raising a one-line user error). A phase says what a rule needs besides the
options, and so which step of start-up can run it:

- options: the option values alone. Run by `config.manager.parse_args`.
- shapes:  batch, microbatch and stage counts: the pipeline plan, returned to whoever runs the
           job. Run by the launcher's pre-check and by `preflight`.
- layout:  the parallel degrees against the number of ranks. Run by the launcher's pre-check
           (when it knows the number of ranks) and by `preflight`.
- model:   the model's TrainSpec, tokenizer, arguments or meta-device model. Run by `preflight`.
- device:  the device type and the file system the ranks run on. Run by `preflight`.

Every process runs each rule once: the launcher's pre-check (`python -m torchtitan.config.manager`,
torch-free) runs options, shapes and layout; each rank runs options (parse_args), then shapes,
layout, model and device (`preflight`, before any process group exists). A model family's own
rules live in its TrainSpec's `validate_fn`, which the `model_shapes` rule calls.

Refusals raised while something is being built (an unknown model name, split points naming no
block, a schedule the installed PyTorch lacks) stay with the builder; this table holds checks.

Functions are named as "module:function" and imported when their rule runs, so that the table
itself, and the launcher that reads it, import no torch; device and model rules live in modules
that do.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torchtitan.config.job_config import JobConfig

PHASES = ("options", "shapes", "layout", "model", "device")


@dataclass(frozen=True)
class Rule:
    name: str
    phase: str
    reads: tuple[str, ...]  # "section.option"; "section.*" for every option of a section; "*" for all
    check: str  # "module:function"

    def __call__(self, *args: Any) -> Any:
        module, _, function = self.check.partition(":")
        return getattr(importlib.import_module(module), function)(*args)


_PP = ("experimental.pipeline_parallel_degree",)
_DEGREES = ("training.data_parallel_replicate_degree", "training.data_parallel_shard_degree",
            "training.tensor_parallel_degree", "training.expert_parallel_degree", *_PP,
            "experimental.context_parallel_degree")

# In the order a run meets them; within a phase, the first rule that fails names the mistake.
RULES: tuple[Rule, ...] = (
    # options: (config)
    Rule("finite_numbers", "options", ("*",), "torchtitan.config.sections:check_finite"),
    Rule("degrees", "options", _DEGREES, "torchtitan.parallelisms.parallel_dims:check_degree_options"),
    Rule("comm", "options", ("comm.*",), "torchtitan.config.sections:check_comm"),
    Rule("training", "options", ("training.*",), "torchtitan.config.sections:check_training"),
    Rule("data", "options", ("training.dataset_shards", "training.dataset_num_workers", "training.dataset_mix",
                             "training.dataset_path"), "torchtitan.config.sections:check_data"),
    Rule("optimizer", "options", ("optimizer.lr", "optimizer.beta1", "optimizer.beta2", "optimizer.eps",
                                  "optimizer.weight_decay"), "torchtitan.config.sections:check_optimizer"),
    Rule("schedule", "options", ("training.warmup_steps", "training.steps", "training.lr_min"),
         "torchtitan.config.sections:check_lr_schedule"),
    Rule("moe", "options", ("moe.aux_loss_coef", "moe.bias_update_rate", "moe.capacity_factor"),
         "torchtitan.config.sections:check_moe"),
    Rule("moe_capacity_layout", "options", ("moe.capacity_factor", "training.tensor_parallel_degree",
                                            "experimental.context_parallel_degree"),
         "torchtitan.config.sections:check_moe_capacity_layout"),
    Rule("model", "options", ("model.vocab_size_divisible_by", "model.mtp_depth", "model.mtp_loss_weight"),
         "torchtitan.config.sections:check_model"),
    Rule("profiling", "options", ("profiling.enable_profiling", "profiling.profile_freq", "profiling.audit_host_reads",
                                  "training.compile"),
         "torchtitan.config.sections:check_profiling"),
    Rule("checkpoint", "options", ("checkpoint.*",), "torchtitan.config.sections:check_checkpoint"),
    Rule("activation_checkpoint", "options", ("activation_checkpoint.mode", "activation_checkpoint.selective_ac_option",
                                              "activation_checkpoint.offload"),
         "torchtitan.config.sections:check_activation_checkpoint"),
    Rule("float8", "options", ("float8.*",), "torchtitan.config.sections:check_float8"),
    Rule("metrics", "options", ("metrics.log_freq", "metrics.peak_tflops", "metrics.enable_wandb"),
         "torchtitan.config.sections:check_metrics"),
    Rule("sft", "options", ("sft.*", "training.dataset_mix", "training.mask_loss_after_eos"),
         "torchtitan.config.sections:check_sft"),
    Rule("validation", "options", ("validation.*", "training.batch_size", *_PP),
         "torchtitan.config.sections:check_validation"),
    Rule("dry_run", "options", ("job.dry_run", "job.dry_run_world_size", "job.dry_run_vocab_size", "job.dry_run_rank",
                                "memory_estimation.disable_fake_mode", "memory_estimation.device_memory_gib"),
         "torchtitan.config.sections:check_dry_run"),
    Rule("parallel_options", "options", ("experimental.enable_async_tensor_parallel", "training.tensor_parallel_degree",
                                         "training.compile", "experimental.context_parallel_degree",
                                         "experimental.context_parallel_backend"),
         "torchtitan.parallelisms.parallel_dims:check_options"),
    Rule("muon", "options", ("optimizer.name", "optimizer.muon_momentum", "optimizer.muon_ns_steps",
                             "training.enable_cpu_offload"),
         "torchtitan.trainer.optimizer_options:check_muon"),
    Rule("optimizer_state", "options", ("optimizer.state_dtype", "optimizer.state_rounding"),
         "torchtitan.trainer.optimizer_options:check_state"),
    Rule("fault_tolerance", "options", ("fault_tolerance.*", "optimizer.early_step_in_backward", "moe.bias_update_rate",
                                        "checkpoint.enable_checkpoint", "checkpoint.interval"),
         "torchtitan.config.sections:check_fault_tolerance"),
    Rule("lora", "options", ("lora.*", "float8.enable_float8_linear", "checkpoint.create_seed_checkpoint",
                             "checkpoint.initial_load_path", "checkpoint.enable_checkpoint",
                             "checkpoint.model_weights_only", "checkpoint.last_save_in_hf", "moe.bias_update_rate"),
         "torchtitan.config.sections:check_lora"),
    Rule("not_yet", "options", ("experimental.enable_compiled_autograd",), "torchtitan.config.sections:check_not_yet"),
    # shapes: (config) -> PipelinePlan | None
    Rule("pipeline_plan", "shapes", ("experimental.pipeline_parallel_*", "training.batch_size",
                                     "activation_checkpoint.mode", "activation_checkpoint.selective_ac_option"),
         "torchtitan.parallelisms.pipeline:plan_if_pipelined"),
    # layout: world_size (config, world_size) -> ParallelDims, then the others (config, dims)
    Rule("world_size", "layout", (*_DEGREES, "training.enable_loss_parallel", "training.disable_loss_parallel",
                                  "job.dry_run", "job.dry_run_world_size"),
         "torchtitan.parallelisms.parallel_dims:parallel_dims_from_config"),
    Rule("sequence_split", "layout", ("training.seq_len", "training.disable_sequence_parallel"),
         "torchtitan.parallelisms.parallel_dims:check_sequence_split"),
    Rule("fsdp_only", "layout", ("training.enable_cpu_offload", "training.fsdp_reshard_after_forward",
                                 "training.defer_sharded_gradient_reduction", "training.mixed_precision_reduce",
                                 "checkpoint.create_seed_checkpoint"),
         "torchtitan.parallelisms.parallel_dims:check_layout"),
    Rule("optimizer_layout", "layout", ("optimizer.zero1", "optimizer.early_step_in_backward", "optimizer.name",
                                        "training.max_norm", "training.gradient_accumulation_steps"),
         "torchtitan.trainer.optimizer_options:check_layout"),
    Rule("dataset_shards", "layout", ("training.dataset_shards",), "torchtitan.datasets.shards:check_layout"),
    # model and device: run one by one by preflight, each with what it needs
    Rule("output_locations", "device", ("job.dump_folder", "checkpoint.folder", "checkpoint.enable_checkpoint",
                                        "checkpoint.create_seed_checkpoint", "checkpoint.last_save_in_hf",
                                        "metrics.save_tb_folder", "metrics.enable_tensorboard", "profiling.save_*",
                                        "profiling.enable_profiling", "profiling.enable_memory_snapshot"),
         "torchtitan.config.output_locations:check_output_locations"),
    Rule("flavor", "model", ("model.name", "model.flavor"), "torchtitan.config.preflight:check_flavor"),
    Rule("document_mask", "model", ("training.document_mask", "training.mask_loss_after_eos", "model.tokenizer_path", "sft.format", "sft.packing"),
         "torchtitan.config.preflight:check_document_mask"),
    Rule("pipelining_fn", "model", (*_PP,), "torchtitan.config.preflight:check_pipelining_fn"),
    Rule("hf_export", "model", ("checkpoint.last_save_in_hf",), "torchtitan.config.preflight:check_hf_adapter"),
    Rule("export_target", "device", ("checkpoint.last_save_in_hf", "checkpoint.initial_load_path", "job.dump_folder",
                                     "checkpoint.folder", "training.steps"),
         "torchtitan.checkpoint.hf_training:check_export_target"),
    Rule("validation_loader", "model", ("validation.enabled",), "torchtitan.config.preflight:check_validation_loader"),
    Rule("experts", "model", ("training.expert_parallel_degree", "model.name", "model.flavor"),
         "torchtitan.config.preflight:check_experts"),
    Rule("muon_exclude", "model", ("optimizer.name", "optimizer.muon_exclude", "model.name", "model.flavor"),
         "torchtitan.optimizers.muon:check_exclude"),
    Rule("lora_targets", "model", ("lora.rank", "lora.target_modules", "model.name", "model.flavor"),
         "torchtitan.parallelisms.lora:check_targets"),
    Rule("mtp", "model", ("model.mtp_depth", "model.mtp_loss_weight", "model.name", "model.flavor",
                          "training.loss_chunk_size"),
         "torchtitan.config.preflight:check_mtp"),
    Rule("model_shapes", "model", ("*",), "torchtitan.config.preflight:check_model_shapes"),
    Rule("async_tp_device", "device", ("experimental.enable_async_tensor_parallel",),
         "torchtitan.runtime.device_setup:check_device_features"),
    Rule("float8_device", "device", ("float8.enable_float8_linear", "float8.emulate", "float8.recipe", "model.name",
                                     "training.disable_sequence_parallel"),
         "torchtitan.parallelisms.float8:check_float8_support"),
    Rule("memory_snapshot_device", "device", ("profiling.enable_memory_snapshot",),
         "torchtitan.observability.profiling:check_memory_snapshot_support"),
    Rule("memory_floor", "device", ("training.batch_size", "training.seq_len", "training.enable_cpu_offload",
                                    "training.mixed_precision_param", "training.disable_sequence_parallel",
                                    "optimizer.early_step_in_backward", "optimizer.zero1", "lora.rank", "model.name",
                                    "model.flavor",
                                    "experimental.pipeline_parallel_microbatches"),
         "torchtitan.estimation.memory_floor:check_step_fits"),
)

_BY_NAME = {rule.name: rule for rule in RULES}


def run(name: str, *args: Any) -> Any:
    """Runs one rule (what preflight does for the model and device rules, each where a run meets it)."""
    return _BY_NAME[name](*args)


def _phase(phase: str) -> list[Rule]:
    return [r for r in RULES if r.phase == phase]


def check_options(config: JobConfig) -> None:
    """The options phase: every rule that needs nothing but the option values."""
    for r in _phase("options"):
        r(config)


def check_shapes(config: JobConfig) -> Any:
    """The shapes phase; returns the job's PipelinePlan (None without pipeline parallelism), the
    one the ranks hand to the model's validate_fn and pipelining_fn."""
    (plan_rule,) = _phase("shapes")
    return plan_rule(config)


def check_layout(config: JobConfig, world_size: int) -> Any:
    """The layout phase: the degrees against `world_size`; returns the validated ParallelDims."""
    first, *others = _phase("layout")
    dims = first(config, world_size)
    for r in others:
        r(config, dims)
    return dims
