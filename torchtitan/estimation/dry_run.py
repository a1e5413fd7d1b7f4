"""The dry run: a job's start-up and training step, for one rank of N, in one process.

`--job.dry_run --job.dry_run_world_size N` starts no other process and needs no GPU. It joins
PyTorch's fake process group as rank r of N (collectives return at once and move nothing), and
builds everything under FakeTensorMode (tensors with shapes, dtypes and devices but no storage):
the config checks of a real start-up (preflight), the named mesh, the model on the meta device,
the model family's real parallelize and pipelining functions, the materialised parameters and the
optimizer and its state (what a first step leaves), with shape-only stand-ins in the model's seams
where shapes depend on values (MoE routing: shapes_only.py). Then it runs one training step of rank r's
share, as every later step runs, under PyTorch's memory tracker (tracker.py), and reports the peak.

Pipeline ranks are replayed in their schedule's order (pipeline_replay.py); ranks of one pipeline
rank hold the same shapes, so by default the first and the last pipeline rank are simulated
(ranks_to_simulate) and the most loaded is reported.

What it cannot see: the device's caching allocator (fragmentation, reserved but unused blocks),
the CUDA context and the communication library's own buffers (NCCL: several hundred MiB), and
torch.compile (the dry run runs eager; compiled code keeps fewer temporaries). The estimate is the
memory the tensors of one step need: docs/memory.md measures it against real runs.

With `--memory_estimation.disable_fake_mode` under torchrun, every rank does the same on real
tensors with the real process group, and reports what it measured with the same tracker.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import logging
import os
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from torchtitan.config.job_config import JobConfig
from torchtitan.config.preflight import preflight
from torchtitan.datasets.text_dataset import training_source
from torchtitan.datasets.tokenizer import TokenizerError
from torchtitan.errors import ConfigError, UserError
from torchtitan.estimation.device_memory import device_memory
from torchtitan.estimation.pipeline_replay import PipelineReplay, replayable
from torchtitan.estimation.shapes_only import on_fake_tensors
from torchtitan.estimation.tracker import CATEGORIES, StepMemory, StepTracker
from torchtitan.models import get_train_spec
from torchtitan.models.common import causal_attention, document_causal_mask
from torchtitan.observability.setup_record import describe_parallelisms
from torchtitan.parallelisms import grad_clip, mixed_precision
from torchtitan.parallelisms.activation_offload import count_as_host
from torchtitan.parallelisms.context_parallel import shard_batch
from torchtitan.parallelisms.parallel_dims import MESH_DIM_ORDER, ParallelDims
from torchtitan.runtime import device_setup, process_group
from torchtitan.runtime.torch_compat import fake as torch_compat_fake
from torchtitan.trainer.step import (
    document_mask_eos,
    forward_backward,
    materialize,
    parallelize_model,
    with_chunked_loss,
    with_token_weights,
)

logger = logging.getLogger("torchtitan")
GiB = 2**30
WORLD_SIZE_ENV = "TORCHTITAN_DRY_RUN_WORLD_SIZE"  # the launcher's NGPU x NNODES, when job.dry_run_world_size is 0
# The dry run's own notes: what it changed to run on this machine, said once per run.
warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support on cpu")
warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
# FSDP2 warns of in-place ops on a view output (MoE blocks return one); a dry run changes no values.
warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")


@dataclass
class RankEstimate:
    rank: int
    coordinates: dict[str, int]  # the rank's place on each mesh dim
    stages: tuple[int, ...]  # pipeline stages it holds
    memory: StepMemory
    parallelisms: dict[str, Any]
    seconds: float

    def as_record(self) -> dict[str, Any]:
        return {"rank": self.rank, "coordinates": self.coordinates, "stages": list(self.stages),
                "memory": self.memory.as_record(), "seconds": self.seconds}


@dataclass
class DryRunResult:
    world_size: int
    device_type: str
    compute_dtype: str
    notes: list[str]
    ranks: list[RankEstimate]
    device_memory: int | None  # bytes of one device, when known
    memory_source: str = ""  # where device_memory comes from (device_memory.py), or why there is none

    @property
    def largest(self) -> RankEstimate:
        return max(self.ranks, key=lambda r: r.memory.peak)

    @property
    def fits(self) -> bool | None:
        return None if self.device_memory is None else self.largest.memory.peak <= self.device_memory


def target_device_type(job_config: JobConfig) -> str:
    """The device the real job runs on: job.dry_run_device; else this machine's GPU if it has one;
    else CUDA for a world named by job.dry_run_world_size (a cluster's), and this machine's CPU for
    the job the launcher would start here."""
    if job_config.job.dry_run_device != "auto":
        return job_config.job.dry_run_device
    if torch.cuda.is_available() or job_config.job.dry_run_world_size > 0:
        return "cuda"
    return "cpu"


def _as_on_cuda(model_parts: list[torch.nn.Module]) -> None:
    """On CUDA the attention kernel runs in the compute dtype; on the CPU the models' kernel
    computes bf16 in fp32 (models/common.py), which would count fp32 copies a GPU never makes. A
    dry run standing for a GPU swaps that kernel (the attention modules' `kernel` seam) for the
    CUDA path; kernels others installed (ring attention for context parallelism) stay.

    Document masking likewise: on the CPU it builds a (batch, 1, seq, seq) mask, while a GPU runs
    FlexAttention, which keeps what causal flash attention keeps plus a block mask of a few hundred
    KiB. The models' mask seam (`attention_mask`) then gives no mask: causal attention stands for it."""
    for part in model_parts:
        for module in part.modules():
            if getattr(module, "kernel", None) is causal_attention:
                module.kernel = _sdpa_in_input_dtype
            if getattr(module, "attention_mask", None) is document_causal_mask:
                module.attention_mask = _no_mask


def _no_mask(document_ids: torch.Tensor) -> None:
    return None


def _sdpa_in_input_dtype(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


def for_this_machine(job_config: JobConfig, target: str, world_size: int) -> tuple[JobConfig, list[str]]:
    """The config the simulation runs, and what it changed: the job's dtypes resolved for the target
    device (auto is bf16 on CUDA), float8 emulated, and what needs a GPU or cannot run on fake
    tensors turned off with a note."""
    config = copy.deepcopy(job_config)
    training, notes = config.training, []
    if training.mixed_precision_param == "auto":
        # What `auto` picks on the target device (the simulation's device is the CPU).
        training.mixed_precision_param = str(mixed_precision.resolve_param_dtype("auto", target)).removeprefix("torch.")
    if training.compile:
        training.compile = False
        notes.append("torch.compile is not simulated: the estimate is of eager execution (compiled blocks usually "
                     "keep fewer temporaries)")
    # Standing for a GPU job on a machine without one; a CPU job keeps the options, and their
    # checks refuse them as the real job would.
    if config.experimental.enable_async_tensor_parallel and target == "cuda":
        config.experimental.enable_async_tensor_parallel = False
        notes.append("async tensor parallelism is simulated as plain tensor parallelism (the same tensors)")
    if (config.float8.enable_float8_linear and not config.float8.emulate and target == "cuda"
            and not torch.cuda.is_available()):
        config.float8.emulate = True
        notes.append("float8 matmuls are emulated (the same float8 tensors are kept)")
    if training.document_mask and config.experimental.context_parallel_degree > 1:
        notes.append("document masking under context parallelism is simulated as causal attention (every block a "
                     "document could skip is computed: an upper bound; its masks are one block's size)")
    elif training.document_mask and target == "cuda":
        notes.append("document masking is simulated as causal attention (FlexAttention keeps what flash attention "
                     "keeps, plus a block mask of under a MiB)")
    accumulation = training.gradient_accumulation_steps
    if simulated_micro_steps(accumulation) < accumulation:
        notes.append(f"{simulated_micro_steps(accumulation)} of the step's {accumulation} micro-steps are simulated "
                     "(the first and the last; those between repeat a part of the last's work)")
    return config, notes


def _plain_ddp(parallel_dims: ParallelDims) -> bool:
    """DDP alone over the replicas (no FSDP, TP or PP): its C++ reducer needs real tensors and
    collectives, so the dry run simulates one replica, which computes exactly what a DDP rank
    does, and adds DDP's gradient buckets (a second copy of every gradient, kept across steps)."""
    return parallel_dims.ddp_enabled and not parallel_dims.tp_enabled and not parallel_dims.pp_enabled


def _coordinates(parallel_dims: ParallelDims, rank: int) -> dict[str, int]:
    sizes = [(name, getattr(parallel_dims, name)) for name in MESH_DIM_ORDER]
    coords, rest = {}, rank
    for name, size in reversed(sizes):
        coords[name] = rest % size
        rest //= size
    return {name: coords[name] for name, size in sizes if size > 1}


def ranks_to_simulate(parallel_dims: ParallelDims, requested: int) -> list[int]:
    """The requested rank; else the first rank of the first and of the last pipeline rank (pp is
    the outermost mesh dim). Ranks of one pipeline rank hold the same shapes; the first pipeline
    rank keeps the embedding and the most microbatches in flight, the last the output and the
    loss (V-shaped schedules give the first both ends), so the ranks between need no more."""
    if requested >= 0:
        if requested >= parallel_dims.world_size:
            raise ConfigError(f"job.dry_run_rank {requested} is no rank of a world of {parallel_dims.world_size}")
        return [requested]
    per_stage = parallel_dims.world_size // parallel_dims.pp
    return sorted({0, (parallel_dims.pp - 1) * per_stage})


def simulate_rank(job_config: JobConfig, world_size: int, rank: int, target: str, fake: bool = True,
                  tokenizer: Any = None, expert_load: float = 1.0) -> RankEstimate:
    """Builds rank `rank` of a world of `world_size` and runs a step under the memory tracker
    after the optimizer state exists (fake: made directly; real: by a whole first step).
    With `fake`, alone in this process (fake process group, fake tensors); without, as a rank of a
    real job (the process group must already exist). `expert_load`: dry_run's."""
    start = time.perf_counter()
    parallel_dims, plan, spec, tokenizer, model_args, model = preflight(job_config, world_size, target,
                                                                        check_memory=False, tokenizer=tokenizer)
    # training.loss_chunk_size and the token-weighted loss, as the trainer runs them
    spec = with_token_weights(with_chunked_loss(spec, job_config), parallel_dims)
    hook = sys.excepthook  # init_process_group wraps it with a "[rank<r>]" prefix, once per simulated rank
    own_share = contextlib.ExitStack()
    if fake:
        dist.init_process_group("fake", store=torch_compat_fake.fake_store(), rank=rank, world_size=world_size)
        # The rank's own parameter shards and process groups only: the others' are alike and unused.
        own_share.enter_context(torch_compat_fake.own_share_only())
    try:
        device = torch.device("cpu") if fake else torch.device(device_setup.device_type(), 0 if target == "cpu" else
                                                                  int(os.environ.get("LOCAL_RANK", "0")))
        parallel_dims.build_mesh("cpu" if fake else device_setup.device_type())
        device_setup.set_determinism(0, False)
        # Parallelized on the meta device first (fake tensors cannot be copied as meta ones are).
        model_parts, pipeline = parallelize_model(job_config, spec, parallel_dims, plan, model, model_args, device)
        replayed = fake and pipeline is not None
        if replayed and not replayable(pipeline):
            raise ConfigError(f"model {job_config.model.name}'s pipelining_fn gives no stage description the dry run "
                              "can replay (Pipeline.stage_ids, microbatch_loss, first_stage); dry-run it without "
                              "experimental.pipeline_parallel_degree")
        first_stage = pipeline.first_stage() if replayed else None
        if fake:  # offloaded activations: on the meta device, reported as host memory
            count_as_host([*model_parts, *([first_stage] if first_stage is not None else [])])
        with _fake_mode() if fake else contextlib.nullcontext():
            materialize(job_config, model_parts, device)
            if replayed and first_stage not in model_parts:
                materialize(job_config, [first_stage], device)
            if pipeline is not None and pipeline.tied is not None:
                pipeline.tied.sync_values()
            if fake:
                # Where the model's shapes depend on values (MoE routing), the fake tensors' stand-ins.
                on_fake_tensors([*model_parts, *([first_stage] if replayed else [])], expert_load)
            if fake and target == "cuda":
                _as_on_cuda(model_parts)
            optimizers = spec.build_optimizers_fn(model_parts, job_config, parallel_dims)
            lr_schedulers = spec.build_lr_schedulers_fn(optimizers, job_config)
            training = job_config.training
            vocab = model_args.vocab_size
            batches = [(torch.randint(0, vocab, (training.batch_size, training.seq_len), device=device),
                        torch.randint(0, vocab, (training.batch_size, training.seq_len), device=device))
                       for _ in range(simulated_micro_steps(training.gradient_accumulation_steps) if fake
                                      else training.gradient_accumulation_steps)]
            if replayed:
                tokens = shard_batch(batches[0], parallel_dims.cp_mesh)[0].tensor_split(pipeline.microbatches)[0]
                replay = PipelineReplay(pipeline, parallel_dims.pp_mesh.get_local_rank(), first_stage, tokens)
                del first_stage
                # Positional-only, as the Pipeline's: a model's own `labels` (MTP) travel in kwargs.
                pipeline.forward_backward = lambda inputs, labels, device, /, **kwargs: replay.step(inputs, labels,
                                                                                                    **kwargs)
            params = [p for part in model_parts for p in part.parameters()]

            def step() -> None:
                optimizers.zero_grad()
                forward_backward(spec, parallel_dims, model_parts, pipeline, batches, device,
                                 defer_sharded_reduction=training.defer_sharded_gradient_reduction,
                                 eos_id=document_mask_eos(job_config, tokenizer))
                if not job_config.optimizer.early_step_in_backward:
                    grad_clip.clip_grad_norm_(params, training.max_norm, parallel_dims.pp_mesh,
                                            uncounted=pipeline.tied.uncounted if pipeline and pipeline.tied else ())
                optimizers.step()
                lr_schedulers.step()

            # The tracked step stands for every later step: the optimizer state must exist before
            # it. A real run (the accuracy measurement) takes a whole first step; on fake tensors
            # only the state is made, by an update with zero gradients (a forward and backward fewer;
            # at 70B and 405B the build, not the step, takes most of a dry run's time).
            if fake:
                _create_optimizer_state(optimizers)
            else:
                step()
            optimizers.zero_grad()
            tracker = StepTracker(model_parts, optimizers.optimizers, offload=training.enable_cpu_offload)
            tracker.track_inputs(*[x for batch in batches for x in batch])
            with tracker.tracking():
                step()
        memory = tracker.result()
        parallelisms = describe_parallelisms(model_parts, parallel_dims, optimizers, pipeline, [])
        stages = pipeline.stage_ids if pipeline is not None else ()
        return RankEstimate(rank, _coordinates(parallel_dims, rank), tuple(stages), memory, parallelisms,
                            time.perf_counter() - start)
    finally:
        own_share.close()
        if fake:
            dist.destroy_process_group()
            torch_compat_fake.forget_sharding_caches()
            sys.excepthook = hook


def simulated_micro_steps(accumulation_steps: int) -> int:
    """How many of a step's micro-steps the dry run runs. The first makes the gradients that
    accumulation keeps; the last adds to them and runs every reduction; those between add to them
    and run a subset of the last's reductions, so two show the peak of any number."""
    return min(accumulation_steps, 2)


def _create_optimizer_state(optimizers: Any) -> None:
    """The optimizer state a first step would create (Adam's moments are made lazily by the first
    update of a parameter with a gradient), made by one update with zero gradients."""
    for optimizer in optimizers.optimizers:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
        optimizer.step()
    optimizers.zero_grad()


@contextlib.contextmanager
def _fake_mode():
    # nn.init.trunc_normal_ asks its tensor whether any value fell outside the bounds, which a
    # fake tensor cannot answer; values do not matter here, so it draws from the plain normal.
    truncated = torch.nn.init.trunc_normal_
    torch.nn.init.trunc_normal_ = lambda tensor, mean=0.0, std=1.0, a=-2.0, b=2.0, generator=None: tensor.normal_(mean,
                                                                                                                  std)
    try:
        # Tensors made before the mode (the meta model's, the tokenizer's) may meet fake ones.
        with torch_compat_fake.values_not_needed(), torch_compat_fake.FakeTensorMode(allow_non_fake_inputs=True):
            yield
    finally:
        torch.nn.init.trunc_normal_ = truncated


def dry_run(job_config: JobConfig, expert_load: float = 1.0) -> DryRunResult:
    """Every rank the dry run stands for, simulated in this process (see the module docstring).
    `expert_load`: for dropless MoE routing under expert parallelism, the simulated rank receives
    this many times its even share of tokens (1: perfectly balanced routing; the planner budgets
    for imbalance with more; shapes_only.py)."""
    job = job_config.job
    world_size = job.dry_run_world_size or int(os.environ.get(WORLD_SIZE_ENV, "0")) or process_group.world_size()
    target = target_device_type(job_config)
    config, notes = for_this_machine(job_config, target, world_size)
    training_source(config)  # the data must exist too
    tokenizer = _tokenizer(config, notes)
    pre = preflight(config, world_size, target, check_memory=False, tokenizer=tokenizer)
    parallel_dims, simulated, world, buckets = pre.parallel_dims, config, world_size, 0
    zero1_replicas = 1
    if _plain_ddp(parallel_dims):
        # One replica computes what a DDP rank does; the options that only mean something across
        # replicas (checked against them) are taken out of the simulation and accounted for here.
        simulated = copy.deepcopy(config)
        simulated.training.data_parallel_replicate_degree = 1
        simulated.training.mixed_precision_reduce = "float32"  # the buckets hold fp32 gradients either way
        if simulated.optimizer.zero1:
            simulated.optimizer.zero1 = False
            zero1_replicas = parallel_dims.dp_replicate
        world = world_size // parallel_dims.dp_replicate
        buckets = sum(p.numel() for p in pre.model.parameters()) * 4  # fp32 gradients
        notes.append(f"DDP is simulated as one replica plus its gradient buckets ({buckets / GiB:.3f} GiB)"
                     + (f"; ZeRO-1 as 1/{zero1_replicas} of its optimizer state" if zero1_replicas > 1 else ""))
    ranks = []
    log = logging.getLogger("torchtitan")
    level = log.level
    try:
        for rank in ranks_to_simulate(parallel_dims, job.dry_run_rank):
            estimate = simulate_rank(simulated, world, rank % world, target, tokenizer=tokenizer,
                                     expert_load=expert_load)
            estimate.rank = rank
            if buckets:
                estimate.memory.add("gradients", buckets)
            if zero1_replicas > 1:  # each replica keeps the state of the parameters it owns
                state = estimate.memory.at_peak["optimizer"]
                estimate.memory.add("optimizer", -(state - state // zero1_replicas))
            ranks.append(estimate)
            log.setLevel(max(level, logging.WARNING))  # the build's lines once, for the first rank
    finally:
        log.setLevel(level)
    memory = device_memory(job_config, target, world_size)
    return DryRunResult(world_size, target, compute_dtype(config, target), notes, ranks, memory.bytes, memory.source)


def compute_dtype(config: JobConfig, target: str) -> str:
    """The dtype the blocks compute in, on every layout (FSDP's policy or autocast: the trainer's rule)."""
    return str(mixed_precision.resolve_param_dtype(config.training.mixed_precision_param, target)).removeprefix("torch.")


@dataclass(frozen=True)
class _Vocabulary:
    """Stands for a tokenizer the dry run cannot read: only its size matters to memory."""

    n_words: int
    bos_id: int = 0
    eos_id: int = 1
    pad_id: int = -1


def _tokenizer(job_config: JobConfig, notes: list[str]) -> Any:
    """The job's tokenizer. For another world (job.dry_run_world_size: a cluster's job) whose file
    is not on this machine, a stand-in of the flavor's vocabulary size, with a note: the real job
    still needs the file. The job of this machine (the launcher's world) needs it here."""
    spec = get_train_spec(job_config.model.name)
    if job_config.job.dry_run_vocab_size:
        return _Vocabulary(job_config.job.dry_run_vocab_size)
    try:
        return spec.build_tokenizer_fn(job_config)
    except TokenizerError as e:
        flavor = spec.config.get(job_config.model.flavor)
        vocab = getattr(flavor, "vocab_size", None)
        if not vocab or "not found" not in str(e) or not job_config.job.dry_run_world_size:
            raise
        notes.append(f"{e}: estimated with the flavor's vocabulary ({vocab:,} tokens); the real job needs the file")
        return _Vocabulary(vocab)


def estimate_before_training(job_config: JobConfig) -> None:
    """memory_estimation.enabled: every rank, before joining the process group, dry-runs its own
    rank of the job (on this machine's device) and logs the estimate, with a warning when it
    exceeds the device's memory. The estimate is of tensors alone: the device also holds the CUDA
    context and the communication library's buffers."""
    config = copy.deepcopy(job_config)
    config.job.dry_run_world_size, config.job.dry_run_rank = process_group.world_size(), process_group.rank()
    config.job.dry_run_device = device_setup.device_type()
    log = logging.getLogger("torchtitan")
    level = log.level
    log.setLevel(logging.WARNING)  # the simulation's own start-up lines are the real run's, next
    try:
        result = dry_run(config)
    finally:
        log.setLevel(level)
    rank = result.ranks[0]
    m = rank.memory
    parts = ", ".join(f"{c} {m.at_peak[c] / GiB:.2f}" for c in CATEGORIES)
    limit = "" if result.device_memory is None else f" of {result.device_memory / GiB:.1f} GiB"
    logger.info(f"memory estimate for rank {rank.rank}: {m.peak / GiB:.2f} GiB{limit} at the step's peak ({parts} GiB; "
                f"dry run in {rank.seconds:.1f}s)")
    if result.fits is False:
        logger.warning(f"rank {rank.rank} is estimated to need {m.peak / GiB:.2f} GiB, more than the device's "
                       f"{result.device_memory / GiB:.1f} GiB: it will likely run out of memory; lower "
                       "training.batch_size or training.seq_len, use activation_checkpoint.mode full, or shard over more "
                       "ranks (docs/memory.md)")


def report_lines(result: DryRunResult, parallel_dims_text: str) -> list[str]:
    """The table the dry run prints: one row per simulated rank, GiB by category at the peak."""
    lines = [f"dry run: {result.world_size} ranks of {parallel_dims_text}, simulated in one process on fake tensors "
             f"(target {result.device_type}, compute {result.compute_dtype})"]
    lines += [f"note: {note}" for note in result.notes]
    head = f"{'rank':>6} {'stages':>7} " + " ".join(f"{c:>12}" for c in CATEGORIES) + f" {'peak GiB':>10}"
    offload = any(r.memory.host for r in result.ranks)
    lines.append(head + (f" {'host GiB':>9}" if offload else "") + f" {'seconds':>8}")
    for r in result.ranks:
        m = r.memory
        row = (f"{r.rank:>6} {','.join(map(str, r.stages)) or '-':>7} "
               + " ".join(f"{m.at_peak[c] / GiB:>12.3f}" for c in CATEGORIES) + f" {m.peak / GiB:>10.3f}")
        lines.append(row + (f" {m.host / GiB:>9.3f}" if offload else "") + f" {r.seconds:>8.1f}")
    for r in result.ranks:
        if r.memory.experts:
            e = {k: v / GiB for k, v in r.memory.experts.items()}
            lines.append(f"{r.rank:>6} experts: parameters {e['expert parameters']:.3f} and optimizer state "
                         f"{e['expert optimizer']:.3f} GiB of the columns above; one MoE layer's forward adds up to "
                         f"{e['dispatch buffers']:.3f} GiB of dispatch buffers (tokens sorted for their experts, "
                         "all-to-all buffers, expert intermediates)")
    big = result.largest
    verdict = (f"; no verdict ({result.memory_source})" if result.device_memory is None else
               f" of {result.device_memory / GiB:.1f} GiB per device ({result.memory_source}): "
               + ("fits" if result.fits else "does NOT fit"))
    lines.append(f"largest: rank {big.rank} needs {big.memory.peak / GiB:.2f} GiB at its peak{verdict}")
    return lines


def layout_text(job_config: JobConfig, world_size: int, target: str) -> str:
    from torchtitan.parallelisms.parallel_dims import parallel_dims_from_config

    dims = parallel_dims_from_config(job_config, world_size)
    mesh = " x ".join(f"{name} {getattr(dims, name)}" for name in MESH_DIM_ORDER if getattr(dims, name) > 1) or "1 rank"
    model = job_config.model
    capacity = getattr(job_config.moe, "capacity_factor", 0)  # the dropping mode, where this build has it
    return (f"{model.name} {model.flavor} ({mesh}{f', ep {dims.ep}' if dims.ep > 1 else ''}"
            f"{f', capacity factor {capacity:g}' if capacity else ''})")


class DoesNotFit(UserError):
    """A rank's estimated peak exceeds the device's memory: the real job would run out of it."""


def main(job_config: JobConfig) -> None:
    """`--job.dry_run`: prints the estimate, or raises the UserError (one line, exit code 2) the
    real job would fail with: a mistake in the config, or a rank that would run out of memory."""
    if job_config.memory_estimation.disable_fake_mode:
        return _measure_real(job_config)
    result = dry_run(job_config)
    text = layout_text(for_this_machine(job_config, result.device_type, result.world_size)[0], result.world_size,
                       result.device_type)
    for line in report_lines(result, text):
        logger.info(line)
    if result.fits is False:
        big = result.largest
        raise DoesNotFit(f"rank {big.rank} would need {big.memory.peak / GiB:.3g} GiB at its peak, more than the "
                         f"device's {result.device_memory / GiB:.3g} GiB "
                         f"({result.memory_source}); lower "
                         "training.batch_size or training.seq_len, use activation_checkpoint.mode full, or shard over "
                         "more ranks (FSDP, tensor, pipeline or context parallel)")


def _measure_real(job_config: JobConfig) -> None:
    """Every rank of a real job (torchrun) measures its own step with the same tracker; rank 0
    prints every rank's row, and a `MEASURED <json>` line for tools (scripts/memory_accuracy.py)."""
    target = device_setup.device_type()
    world_size = process_group.world_size()
    if job_config.job.dry_run_world_size not in (0, world_size):
        raise ConfigError(f"job.dry_run_world_size {job_config.job.dry_run_world_size} is not this job's "
                          f"{world_size} ranks: memory_estimation.disable_fake_mode measures the ranks the launcher "
                          "started (set NGPU)")
    config, notes = for_this_machine(job_config, target, world_size)
    process_group.init_distributed(target, 600)
    clean = False
    try:
        estimate = simulate_rank(config, world_size, process_group.rank(), target, fake=False)
        mine = {"memory": dataclasses.asdict(estimate.memory), "stages": list(estimate.stages),
                "seconds": estimate.seconds}
        records = [None] * world_size
        if dist.is_initialized():
            dist.all_gather_object(records, mine)
        else:
            records = [mine]
        if process_group.rank() == 0:
            ranks = [RankEstimate(r, {}, tuple(rec["stages"]), StepMemory(**rec["memory"]), {}, rec["seconds"])
                     for r, rec in enumerate(records)]
            dtype = compute_dtype(config, target)
            memory = device_memory(job_config, target, world_size)
            result = DryRunResult(world_size, target, dtype, notes, ranks, memory.bytes, memory.source)
            for line in report_lines(result, layout_text(config, world_size, target)):
                logger.info(line.replace("dry run:", "measured:").replace("simulated in one process on fake tensors",
                                                                         "each rank on real tensors"))
            print("MEASURED " + json.dumps([r.as_record() for r in ranks]), flush=True)
        clean = True
    finally:
        process_group.shutdown(clean)  # a rank that failed does not wait for the others at a barrier
