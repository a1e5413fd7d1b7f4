"""The job's configuration schema: one dataclass per TOML section, each field with its `--help` text.

Only the schema: parsing, type coercion and the checks live in `config.manager` and `config.rules`, which every
feature's rules are collected into. This module imports nothing from torchtitan, so any feature can
name `JobConfig` without an import circle. Field names follow the late-2024 torchtitan TOML schema
so existing configs run unchanged.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence


def opt(default: Any, help: str, choices: Sequence[Any] | None = None) -> Any:
    """Declares a config field with its help text (and optional allowed values)."""
    meta = {"help": help, "choices": tuple(choices) if choices else None}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class Job:
    config_file: str = opt("", "TOML file with the job's settings (command-line options override it); "
                           "bundled:train_configs/<name>.toml names a config the package ships.")
    dump_folder: str = opt("./outputs", "Folder for everything a run writes: logs, TensorBoard, checkpoints, traces.")
    description: str = opt("default job", "Free-text description of the job, printed at start-up.")
    print_args: bool = opt(False, "Print the fully merged configuration at start-up.")
    dry_run: bool = opt(
        False, "Start the job in ONE process, on fake tensors over PyTorch's fake process group, as one rank of "
        "job.dry_run_world_size would: the config checks, the mesh, the model, the real parallelize and pipeline "
        "functions, the optimizer and two training steps of that rank's share, tracked for memory. Prints the mesh, "
        "the applied parallelisms and the per-rank memory by category, and exits 0, or 2 with the line the real job "
        "would fail with (docs/memory.md). Needs no GPU and no other machine.")
    dry_run_world_size: int = opt(0, "The number of ranks the dry run stands for; 0: the launcher's (NGPU x NNODES), "
                                     "or 1 outside it.")
    dry_run_device: str = opt("auto", "The device the dry run stands for: cuda, cpu, or auto (this machine's GPU; "
                                      "else cuda for a world given by job.dry_run_world_size, a cluster's, and "
                                      "this CPU for the launcher's own job).",
                              choices=["auto", "cuda", "cpu"])
    dry_run_vocab_size: int = opt(0, "The dry run's vocabulary size: 0, that of model.tokenizer_path (or the flavor's "
                                     "where the file is not on this machine); else this many tokens, without a "
                                     "tokenizer file (planning a model whose tokenizer lives on the cluster).")
    dry_run_rank: int = opt(-1, "The rank the dry run simulates; -1: a rank of the first and one of the last "
                                "pipeline rank (ranks differ in memory by the stages they hold; those two hold the "
                                "most), reporting the most loaded.")


@dataclass
class Profiling:
    enable_profiling: bool = opt(False, "Record torch.profiler traces every profile_freq steps.")
    save_traces_folder: str = opt("profile_traces", "Trace folder, relative to job.dump_folder.")
    profile_freq: int = opt(10, "Steps between profiler traces and between memory snapshots.")
    enable_memory_snapshot: bool = opt(
        False, "Record the CUDA caching allocator's history (the last 100,000 allocations and frees, with stack "
        "traces) and write it after every step that is a multiple of profile_freq, to <job.dump_folder>/"
        "<save_memory_snapshot_folder>/iteration_<step>/rank<r>_memory_snapshot.pickle, and once more when CUDA "
        "runs out of memory, to iteration_<last step trained>_exit/. View a file at pytorch.org/memory_viz. "
        "CUDA only: refused on other devices.")
    save_memory_snapshot_folder: str = opt("memory_snapshot", "Memory snapshot folder, relative to job.dump_folder.")
    audit_host_reads: bool = opt(
        False, "Record every data-dependent host read of the training loop (.item(), .tolist(), nonzero, shapes "
        "that depend on the data), with its source line, step and phase, into <job.dump_folder>/host_reads/"
        "rank<r>.json, and log the steady-state count (docs/performance.md, \"Host reads\"). Slows eager steps "
        "a little; not with training.compile.")


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
        "is a later run), so two runs' steps never mix and none is lost. Each run also writes one setup record "
        "({\"record\": \"setup\", ...}: mesh, applied parallelisms, initial load, per-rank state bytes; "
        "docs/architecture.md) before its first step's row.")
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
        "bundled:stdlib_docs/tokenizer.model",
        "Tokenizer: a tiktoken rank file (Llama 3 format), a sentencepiece .model (Llama 2 format), or a Hugging "
        "Face tokenizer.json or the folder holding it (with its tokenizer_config.json: special tokens, chat template; "
        "needs pip install 'torchtitan[tokenizers]'). bundled:<name> names a file the package ships "
        "(torchtitan/assets), e.g. bundled:stdlib_docs/sentencepiece.model or bundled:chat_tokenizer; any other path "
        "is relative to the working directory. Left at this default while checkpoint.initial_load_path names a "
        "Hugging Face folder or a checkpoint converted from one (hf-to-dcp) that carries a tokenizer.json, that "
        "tokenizer is used.",
    )
    vocab_size_divisible_by: int = opt(1, "Pad the vocabulary (embedding and output rows) up to a multiple of this.")
    mtp_depth: int = opt(-1, "Multi-token prediction depth (DeepSeek-V3: extra modules predicting tokens further "
                             "ahead, trained beside the model): -1 = the flavor's, 0 = off.")
    mtp_loss_weight: float = opt(0.3, "Weight of the multi-token prediction loss (the mean over depths; DeepSeek-V3 "
                                      "used 0.3, then 0.1 late in training). Logged as mtp_loss, unweighted.")


@dataclass
class Optimizer:
    name: str = opt("AdamW", "Optimizer. Muon: orthogonalised momentum for the matrix parameters, AdamW (lr, betas, "
                    "eps, weight_decay above) for the rest (docs/optimizers.md).", choices=["AdamW", "Adam", "Muon"])
    lr: float = opt(8e-4, "Peak learning rate.")
    beta1: float = opt(0.9, "Adam beta1.")
    beta2: float = opt(0.95, "Adam beta2.")
    eps: float = opt(1e-8, "Adam epsilon.")
    weight_decay: float = opt(0.1, "Decoupled (AdamW) or L2 (Adam) weight decay.")
    fused: bool = opt(True, "PyTorch's fused Adam/AdamW kernel (CPU and CUDA; one pass per tensor, 5.7x faster than "
                            "foreach on a CPU core); false: the multi-tensor foreach path.")
    zero1: bool = opt(
        False, "ZeRO-1: shard the optimizer state over the data-parallel replicas (training."
        "data_parallel_replicate_degree > 1): each replica keeps and updates the state of its share of the "
        "parameters, then broadcasts them. Composes with FSDP (HSDP), TP, CP and PP; losses are unchanged.")
    early_step_in_backward: bool = opt(
        False, "Step each parameter's optimizer in backward, as soon as its gradient is complete (after FSDP's "
        "reduce-scatter), and free that gradient at once: the gradients of the whole model never exist together. "
        "Same updates as the usual step. Needs training.max_norm 0 (clipping needs every gradient first) and no "
        "gradient accumulation, pipeline parallelism, ZeRO-1, Muon, replica groups (fault_tolerance) or plain DDP.")
    muon_momentum: float = opt(0.95, "Muon: momentum (an exponential average of the gradients).")
    muon_nesterov: bool = opt(True, "Muon: orthogonalise the Nesterov blend of gradient and momentum; false: the "
                              "momentum itself.")
    muon_ns_steps: int = opt(5, "Muon: Newton-Schulz iterations that orthogonalise each update.")
    muon_update_scale: str = opt(
        "match_adamw_rms", "Muon: learning-rate multiplier by matrix shape (rows, cols): match_adamw_rms = 0.2 * "
        "sqrt(max(rows, cols)), so AdamW's lr and weight_decay carry over (Moonlight); original = "
        "sqrt(max(1, rows / cols)) (Keller Jordan's, with a Muon lr near 0.02).", choices=["match_adamw_rms", "original"])
    muon_ns_dtype: str = opt("auto", "Muon: dtype of the Newton-Schulz iterations; auto = bfloat16 on CUDA, float32 "
                             "on CPU.", choices=["auto", "bfloat16", "float32"])
    muon_exclude: list[str] = opt(
        ["tok_embeddings", "output"], "Muon: parameters AdamW updates although they are matrices (comma-separated "
        "name patterns: a name prefix like 'output' or 'layers.0', or an fnmatch pattern like '*.router.*'), "
        "matched against the model's own parameter names; a pattern matching none is refused. The list replaces "
        "the default: name tok_embeddings,output too to keep them with AdamW. Parameters with fewer than 2 dims "
        "(norms, biases) always go to AdamW.")
    state_dtype: str = opt(
        "float32", "Dtype of Adam/AdamW's two moments and Muon's momentum. bfloat16 halves the optimizer state "
        "(8 -> 4 bytes per parameter); the update is still computed in fp32 and the parameters stay fp32 "
        "(docs/memory.md).",
        choices=["float32", "bfloat16"])
    state_rounding: str = opt(
        "nearest", "How bfloat16 moments are rounded when stored: to nearest, or stochastic (unbiased; seeded by "
        "training.seed). Only with state_dtype bfloat16.", choices=["nearest", "stochastic"])


@dataclass
class Training:
    dataset: str = opt("stdlib_docs", "Registered text source name.")
    dataset_path: str = opt(
        "", "Local data overriding training.dataset: a .jsonl ('text' field), .txt or .parquet file, gzip-compressed "
        "JSON lines (.jsonl.gz / .json.gz, read as a stream), a folder or a glob."
    )
    dataset_infinite: bool = opt(True, "Loop over the data in epochs; false ends training cleanly when the data runs out.")
    dataset_skip_bad_lines: bool = opt(False, "Skip and count malformed lines (bad JSON, invalid UTF-8) instead of stopping.")
    dataset_shards: int = opt(
        -1,
        "Data shards the dataset is split into (contiguous byte ranges of the files; row groups of Parquet; token "
        "ranges of pre-tokenized shards); -1 = one per data-parallel rank. Each rank reads only its "
        "dataset_shards / dp shards and takes an equal slice of its batch from each, so two runs with the same "
        "dataset_shards and global batch see identical data whatever their data-parallel degree.",
    )
    dataset_mix: str = opt(
        "", "A mixture of sources with weights, 'source:weight,...' (a source is a registered name, a file, folder "
        "or glob, or a folder of pre-tokenized shards), e.g. 'stdlib_docs:0.7,data/code:0.3'. Each batch row comes "
        "from one source, drawn per seed; replaces training.dataset / dataset_path.")
    dataset_num_workers: int = opt(
        0, "Worker processes that read and tokenize each of the rank's data shards (0: in the training process). "
        "The data and its resume position do not depend on it.")
    dataset_shuffle: bool = opt(
        False, "Read each data shard's chunks (~1 MiB of JSON lines, a Parquet row group, ~256 Ki pre-tokenized "
        "tokens) in a new seeded order every epoch, and each chunk's documents in a seeded order (seed: "
        "training.seed). Off: file order. Layout, workers and resume are unaffected; validation is not shuffled.")
    document_mask: bool = opt(
        False, "Keep attention inside each packed document: a token attends only to earlier tokens after the last "
        "end-of-text token (block-causal). FlexAttention on CUDA, a masked SDPA on CPU, per-document blocks under "
        "context parallelism.")
    mask_loss_after_eos: bool = opt(
        False, "No loss where the input is the end-of-text token: the next document's first token is not a target "
        "(Megatron's eod_mask_loss). The loss is then the mean over the tokens that carry one, counted over the "
        "whole step (every micro-batch and data-parallel rank), so layouts and accumulation do not change it.")
    batch_size: int = opt(8, "Batch size per data-parallel rank and micro-step.")
    seq_len: int = opt(2048, "Tokens per sequence.")
    warmup_steps: int = opt(200, "Linear learning-rate warm-up steps.")
    decay_type: str = opt("linear", "Learning-rate decay after warm-up.", choices=["linear", "cosine", "constant"])
    lr_min: float = opt(0.0, "Learning rate at the end of decay, as a fraction of optimizer.lr.")
    max_norm: float = opt(1.0, "Clip the global gradient norm to this value (<= 0 disables clipping).")
    steps: int = opt(10000, "Optimizer steps to train.")
    gradient_accumulation_steps: int = opt(
        1, "Micro-batches per optimizer step. FSDP reduce-scatters each micro-step's gradients into the shards "
        "(HSDP all-reduces across replicas on the last only); DDP reduces on the last only.")
    defer_sharded_gradient_reduction: bool = opt(
        False, "With FSDP/HSDP and gradient accumulation: keep the unsharded gradients of the micro-steps and "
        "reduce-scatter once per step (less communication, a whole unsharded gradient copy more memory).")
    data_parallel_replicate_degree: int = opt(1, "Replicas (DDP, or HSDP's outer dim when sharding too).")
    data_parallel_shard_degree: int = opt(-1, "FSDP shard degree; -1 = every rank not used by another degree.")
    enable_cpu_offload: bool = opt(False, "Offload FSDP parameters, gradients and optimizer state to CPU.")
    tensor_parallel_degree: int = opt(1, "Tensor-parallel degree.")
    expert_parallel_degree: int = opt(
        1, "Expert-parallel degree (MoE models): experts are split over this many ranks, taken from the "
        "data-parallel shard x context-parallel ranks (it adds no ranks; docs/moe.md).")
    disable_loss_parallel: bool = opt(False, "Gather full logits instead of computing the loss vocab-sharded (TP).")
    enable_loss_parallel: bool = opt(True, "Late-2024 spelling of the same switch: false means disable_loss_parallel.")
    disable_sequence_parallel: bool = opt(False, "TP without sequence parallelism for norms (all-reduce mode).")
    fsdp_reshard_after_forward: str = opt(
        "default",
        "When FSDP frees gathered parameters: default (after forward, except the root), always, never (ZeRO-2-like).",
        choices=["default", "always", "never"],
    )
    mixed_precision_param: str = opt(
        "auto", "Compute dtype of every layout (FSDP's mixed-precision policy where FSDP shards, torch.autocast "
        "elsewhere; parameters, gradients and optimizer state stay float32); auto = bfloat16 on CUDA, float32 on CPU.",
        choices=["auto", "bfloat16", "float32"],
    )
    mixed_precision_reduce: str = opt("float32", "FSDP gradient reduce dtype.", choices=["float32", "bfloat16"])
    ddp_bucket_cap_mb: int = opt(100, "DDP gradient bucket size in MB.")
    compile: bool = opt(False, "torch.compile each transformer block.")
    loss_chunk_size: int = opt(
        0, "Compute the cross-entropy this many sequence positions at a time inside the output projection, "
        "recomputing each chunk's logits in backward: the whole fp32 logits are never held (docs/memory.md); "
        "0 = off (the whole logits, as before).")
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
    context_parallel_method: str = opt(
        "ring", "How CP attention gets the keys and values of other ranks: ring (passed rank to rank, overlapped with "
        "compute) or allgather (gathered at once per block; cheaper for grouped-query attention's small K/V). See "
        "docs/context_parallel.md.", choices=["ring", "allgather"])
    enable_async_tensor_parallel: bool = opt(False, "Async TP via symmetric-memory micro-pipelining (CUDA + compile).")
    enable_compiled_autograd: bool = opt(False, "Compile the backward pass with compiled autograd.")
    custom_import: str = opt("", "Python module imported at start-up, e.g. one that registers a new model.")


@dataclass
class MoE:
    aux_loss_coef: float = opt(
        0.001, "Weight of the sequence-wise load-balancing loss per MoE layer (0 = none; Qwen3-MoE trains with 0.001).")
    bias_update_rate: float = opt(
        0.0, "DeepSeek-V3 auxiliary-loss-free balancing: per step, each expert's routing bias moves by this much "
        "towards an even load (0 = off; DeepSeek-V3 uses 0.001).")
    grouped_mm: bool = opt(True, "Compute experts with torch._grouped_mm where the device supports it (else a loop).")
    capacity_factor: float = opt(
        0.0, "Token dropping: each expert takes at most ceil(factor x seq_len x top_k / experts) token choices from each "
        "sequence, the earliest first; the rest pass through the residual only. Static shapes, no host sync of "
        "split sizes (0 = off: dropless; docs/moe.md).")


@dataclass
class Checkpoint:
    enable_checkpoint: bool = opt(False, "Save checkpoints, and resume from the newest complete one at start-up.")
    folder: str = opt("checkpoint", "Checkpoint folder, relative to job.dump_folder; holds one step-N folder per save.")
    interval: int = opt(500, "Steps between checkpoints (the last step is always saved).")
    model_weights_only: bool = opt(
        False, "The last step's checkpoint holds model weights only (for inference, fine-tuning or conversion), "
        "cast to checkpoint.export_dtype.")
    export_dtype: str = opt("float32", "Dtype of the weights-only final checkpoint (model_weights_only) and of the "
                                       "Hugging Face export (last_save_in_hf).",
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
        "", "Checkpoint (e.g. a seed checkpoint's step-0 folder) or Hugging Face folder (config.json + safetensors, "
        "read directly, each rank its own shards) whose model weights initialise a run that has no checkpoint of "
        "its own yet; any parallel layout can load it."
    )
    last_save_in_hf: bool = opt(
        False, "Also write the final step's weights as a Hugging Face folder, <dump_folder>/<checkpoint.folder>/"
        "step-N-hf (config.json, safetensors in checkpoint.export_dtype, the tokenizer as tokenizer.model), "
        "whether or not checkpoint.enable_checkpoint is on. A run stopped before its last step writes none.")
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
    offload: str = opt("none", "Activation offload: what the chosen blocks save for backward is kept in host memory "
                               "(pinned, copied on a side stream on CUDA) and brought back in backward; exact. 'none', "
                               "'all', or an integer k: every k-th block. A checkpointed block offloads its saved input.")


@dataclass
class Float8:
    enable_float8_linear: bool = opt(False, "Float8 linear layers through torchao (GPUs of compute capability 8.9+).")
    enable_fsdp_float8_all_gather: bool = opt(False, "All-gather FSDP parameters in float8.")
    precompute_float8_dynamic_scale_for_fsdp: bool = opt(False, "Compute float8 scales for all parameters at once.")
    recipe: str = opt(
        "tensorwise", "Float8 scaling: tensorwise (one scale a tensor; FSDP float8 all-gather and float8 TP "
        "collectives possible), rowwise (one scale a row: more accurate; torchao's recommended recipe, TP moves "
        "high-precision activations) or rowwise_with_gw_hp (rowwise, the weight gradient's matmul in high precision).",
        choices=["tensorwise", "rowwise", "rowwise_with_gw_hp"])
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
    init_timeout_seconds: int = opt(300, "Until the first step is done, a rank making no progress this long ends "
                                         "the job, naming the stuck rank (start-up, first compile, checkpoint load).")
    train_timeout_seconds: int = opt(100, "After the first step, a rank making no progress this long ends the job "
                                          "with exit code 5, naming the stuck rank; raise it above the longest "
                                          "step or checkpoint save. Collectives time out a margin later.")
    trace_buf_size: int = opt(20000, "NCCL flight-recorder entries, dumped into job.dump_folder/hang_dumps on a "
                                     "hang (CUDA; 0 disables).")


@dataclass
class FaultTolerance:
    enable: bool = opt(False, "Train as one of fault_tolerance.group_size replica groups joined by torchft (an optional "
                              "extra): each group is its own launch with its own layout inside; gradients are averaged "
                              "across the live groups, a failed group leaves the others stepping and a group that comes "
                              "back recovers live from a peer (docs/fault_tolerance.md).")
    replica_id: int = opt(0, "This replica group's index, 0 .. fault_tolerance.group_size - 1; it reads the data shards "
                             "of that index and writes its outputs to <job.dump_folder>/replica_<id>.")
    group_size: int = opt(0, "The number of replica groups of the job (each launched with the same options but "
                             "fault_tolerance.replica_id).")
    min_replica_size: int = opt(1, "The fewest groups a step is committed with; with fewer the survivors wait.")
    lighthouse: str = opt("", "host:port of the torchft lighthouse the groups meet at; empty: $TORCHFT_LIGHTHOUSE "
                              "(run_llama_train.sh with FT_LIGHTHOUSE=start starts one).")
    semi_sync_method: str = opt("none", "none: average gradients every step (fault-tolerant HSDP); local_sgd: groups "
                                        "step alone and average parameters every sync_steps; diloco: the same with "
                                        "an outer Nesterov optimizer on the averaged drift (for slow links).",
                                choices=["none", "local_sgd", "diloco"])
    sync_steps: int = opt(20, "Steps between the groups' syncs in the semi-synchronous modes.")
    outer_lr: float = opt(0.7, "DiLoCo's outer learning rate.")
    outer_momentum: float = opt(0.9, "DiLoCo's outer Nesterov momentum.")
    timeout_seconds: int = opt(60, "How long a cross-group collective, a commit or a recovery may take before the "
                                   "step is given up (and retried with the groups still alive).")
    quorum_timeout_seconds: int = opt(60, "How long a group waits for a quorum of at least min_replica_size groups.")


@dataclass
class Validation:
    enabled: bool = opt(False, "Measure the loss on held-out data every validation.freq steps and at the last step "
                               "(loss and perplexity on the console, TensorBoard and metrics.jsonl; docs/validation.md).")
    dataset: str = opt("", "Registered text source to validate on; empty (with dataset_path empty too) = a held-out "
                           "split of the training data, which training then never reads.")
    dataset_path: str = opt("", "Local validation data (.jsonl, .txt, .parquet; a file, folder or glob), overriding "
                                "validation.dataset.")
    held_out_fraction: float = opt(
        0.01, "Share of the training source's documents held out for validation when no validation dataset is "
        "given (chosen by a hash of each document's position, so the split is the same in every run and layout).")
    freq: int = opt(100, "Steps between validation runs (the last step is always validated).")
    steps: int = opt(20, "Batches per validation run (each run reads the same batches from the start of the "
                         "validation data); -1 = the whole validation data. Fewer when the data runs out first.")
    batch_size: int = opt(-1, "Sequences per data-parallel rank and validation batch, of training.seq_len tokens; "
                              "-1 = those of one optimizer step (training.batch_size x gradient_accumulation_steps).")


@dataclass
class SFT:
    format: str = opt(
        "", "Supervised fine-tuning data in the training source (JSON lines): 'chat', a `messages` list per line "
        "(role system, user or assistant; content), rendered with the chat template; 'prompt_completion', `prompt` "
        "and `completion` strings per line, joined as plain text. Loss only on the assistant turns (completions), "
        "whole conversations per sequence. Empty: plain text for pre-training (docs/fine_tuning.md).",
        choices=["", "chat", "prompt_completion"])
    chat_template: str = opt(
        "", "A Jinja chat template file that renders the conversations; empty: the tokenizer's own (the "
        "chat_template of its tokenizer_config.json, as transformers' apply_chat_template renders it).")
    packing: bool = opt(
        True, "Pack several whole conversations into each sequence (with training.document_mask none attends to "
        "another); false: one conversation per sequence, padded.")
    overlong: str = opt(
        "truncate", "A conversation of more than training.seq_len + 1 tokens: truncate (keep its first tokens) or "
        "drop; either is counted and logged.", choices=["truncate", "drop"])


@dataclass
class MemoryEstimation:
    enabled: bool = opt(False, "Before training, each rank estimates its own peak memory with the dry run "
                               "(job.dry_run, in-process, before the process group exists), logs it by category and "
                               "warns when it exceeds the device's memory.")
    disable_fake_mode: bool = opt(False, "Dry run on real tensors: under torchrun with the real process group, each "
                                         "rank measures its own step with the same tracker (how docs/memory.md "
                                         "checks the estimates).")
    device_memory_gib: float = opt(0.0, "The memory of one device the estimate is compared with, in GiB; 0: this "
                                        "machine's GPU; for a job on this CPU (no GPU, no job.dry_run_world_size), the "
                                        "host's available memory shared by its ranks; no verdict for a GPU job on a "
                                        "machine without one.")


@dataclass
class LoRA:
    rank: int = opt(0, "LoRA: train low-rank adapters beside frozen base weights (docs/lora.md); the adapters' rank "
                       "(0 = off: every parameter trains). Needs base weights: checkpoint.initial_load_path.")
    alpha: float = opt(16.0, "LoRA: the adapters' output is scaled by alpha / rank.")
    dropout: float = opt(0.0, "LoRA: dropout on each adapter's input (training only); 0 = none.")
    target_modules: list[str] = opt(
        ["all-linear"], "LoRA: the linear layers that get adapters (comma-separated): fnmatch patterns matched against "
        "a module's name or its trailing part ('wq', 'attention.wo', 'layers.0.*'); all-linear = every linear layer "
        "of the transformer blocks (attention projections, dense and shared-expert MLPs), not routers, embeddings or "
        "the output projection (name those to adapt them). Routed experts (grouped 3-D weights) are refused.")
    save_adapters_only: bool = opt(
        True, "LoRA: checkpoints hold the adapters (with their optimizer state) but not the frozen base weights, "
        "which a resumed run reads from checkpoint.initial_load_path again; false: the whole model.")


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    profiling: Profiling = field(default_factory=Profiling)
    metrics: Metrics = field(default_factory=Metrics)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    training: Training = field(default_factory=Training)
    experimental: Experimental = field(default_factory=Experimental)
    moe: MoE = field(default_factory=MoE)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    float8: Float8 = field(default_factory=Float8)
    comm: Comm = field(default_factory=Comm)
    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)
    validation: Validation = field(default_factory=Validation)
    sft: SFT = field(default_factory=SFT)
    memory_estimation: MemoryEstimation = field(default_factory=MemoryEstimation)
    lora: LoRA = field(default_factory=LoRA)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)
