"""The layout planner: which parallel layouts of a model fit a cluster, and which is fastest.

It enumerates the layouts a job could use (tensor parallel within a node, pipeline stages, FSDP or
HSDP, context parallel for long sequences, activation checkpointing, gradient accumulation; for
mixture-of-experts models also expert parallelism and the routing mode, below), drops those the
stack refuses (the config checks of a real start-up), ranks the rest by the analytic step-time
model (below), and asks the dry run (dry_run.py, fake tensors in this process) whether the fastest
fit in the device's memory, until it has the requested number that do.

Mixture-of-experts models (a model with MoE layers: modules with `num_experts` and `experts`):
- expert parallelism `ep`: every divisor of the expert count that the mesh can hold, i.e. a
  multiple of cp x tp that divides dp_shard x cp x tp (EP borrows those ranks: parallel_dims.py);
  ep 1 too (the experts FSDP-sharded like the rest);
- the routing mode, where this build has `moe.capacity_factor`: dropless (0) and each capacity
  factor asked for (default 1.25). What the mode changes in the plan is the load of the busiest
  rank's experts, `load`, in units of the balanced share of (token, choice) pairs:
    dropless, ep > 1: `expert_imbalance` (an assumption, default 1.5): routing is data, and an
        expert-parallel group waits for its busiest rank, whose buffers and expert matmuls are
        that many times the even share (the dry run simulates that rank receiving that share,
        shapes_only.py); the `experts max/mean` a run logs is the figure to set it from (per
        expert, so an upper bound of the per-rank figure);
    dropless, ep 1: 1 (a rank computes all of its own pairs, however they are routed);
    capacity factor c: c, whatever the routing: the buffers are padded to the capacity and
        computed whole (the dry run sees the fixed shapes themselves). Dropped tokens cost model
        quality, which the plan does not weigh: it shows the mode, the user chooses.

The step-time model (step_time.py, where every assumption is stated): the rank's compute at an
assumed efficiency, plus the time of the collectives it calls (`traffic`: by kind, count and bytes,
over the link each group spans, alpha-beta with a per-hop latency), FSDP's overlapped with compute
and the rest exposed, plus the 1F1B bubble:

    step = max(compute, fsdp) + tp + cp + ep + pp + other + latency + host + bubble

Checked against real gloo ranks by scripts/step_time_check.py (docs/memory.md, "The step-time model
checked"): the calls and bytes of every collective kind match the traces exactly for FSDP, TP, PP,
CP, EP and HSDP x TP; the step time, on a calibrated CPU, within 17 %. What it leaves out:
- the kernels beyond one efficiency figure per device (on CPUs the calibration measures it at the
  rank's shapes; on GPUs it is the assumed 50 %), and the optimizer step;
- imperfect overlap, waiting for a slower peer, stragglers, the schedule's own overheads, DTensor's
  host time under TP, and the bubble's idle time that other ranks use where they share cores;
- by rule but unchecked: activation checkpointing's recomputed collectives, gradient accumulation,
  PP combined with TP or CP (a stage sends its rank's shard of the sequence), capacity routing;
- not at all: interleaved and other pipeline schedules (one stage per rank, 1F1B's transfers),
  DDP's buckets (one all-reduce per FSDP-like unit), CP's all-gather method, FSDP's padding of
  uneven shards, tied embeddings' all-reduce under PP, float8 and compile.
Its figures rank layouts; they are no promise of throughput.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from torchtitan.config.job_config import JobConfig
from torchtitan.config.manager import parse_args
from torchtitan.errors import UserError
from torchtitan.estimation.dry_run import DryRunResult, dry_run
from torchtitan.estimation.model_shape import Block, Model  # noqa: F401 - the planner's names for the model's parts
from torchtitan.estimation.step_time import (  # noqa: F401
    CAPACITY_OPTION,
    EXPERT_IMBALANCE,
    KINDS,
    Collective,
    Hardware,
    Layout,
    Precision,
    Timing,
    by_kind,
    expert_load,
    seconds,
    timing,
    traffic,
)

GiB = 2**30
# The rough memory figure (screened_bytes) lands within -20 % to +5 % of the dry run's in its
# calibration (docs/memory.md); layouts up to this factor over the device's memory are dry-run.
SCREEN_MARGIN = 1.05
# Refusals printed before the rest are counted only (an MoE plan meets the same few rules often:
# the dropping mode under TP, DDP replicas under TP).
MAX_REFUSALS_SHOWN = 5
# The dropping mode's capacity factors the plan compares with dropless routing.
CAPACITY_FACTORS = (1.25,)
# screened_bytes' MoE terms, calibrated on dry runs of DeepSeek-V3 16B (FSDP 8 x EP 2, AC none)
# and 671B (FSDP 64 x PP 8 x EP 64, full AC): bytes per routed (token, choice) row and model dim
# that an MoE layer keeps (about 8 bf16 copies: sorted, sent, received, regrouped, the experts'
# output and its way back, weighted), and per local expert parameter of a pipeline stage under
# FSDP (unsharded bf16 weights and gradients, the fp32 gradient reduced, their temporaries).
MOE_ROW_DIMS = 16
STAGE_EXPERT_BYTES = 16


def capacity_option_available() -> bool:
    """Whether this build has the dropping mode (`moe.capacity_factor`); without it the plan
    enumerates dropless routing only and pastes no such option."""
    return hasattr(JobConfig().moe, CAPACITY_OPTION)


@dataclass
class Choice:
    layout: Layout
    timing: Timing
    screened_bytes: int  # the analytic screen's memory figure
    estimate: DryRunResult | None = None  # the dry run's, once asked
    refused: str = ""  # the stack's one line, if it refuses the layout

    @property
    def peak_bytes(self) -> int | None:
        return None if self.estimate is None else self.estimate.largest.memory.peak


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _powers_of_two_dividing(n: int, limit: int) -> list[int]:
    return [d for d in (1, 2, 4, 8, 16, 32, 64) if d <= limit and n % d == 0]


def expert_degrees(num_experts: int, dp_shard: int, cp: int, tp: int) -> list[int]:
    """The expert-parallel degrees a mesh can hold (parallel_dims.py's rule): divisors of the
    expert count that are multiples of cp x tp and divide the dp_shard x cp x tp ranks EP borrows."""
    return [ep for ep in _divisors(num_experts) if ep == 1 or (ep % (cp * tp) == 0 and (dp_shard * cp * tp) % ep == 0)]


def enumerate_layouts(model: Model, ngpu: int, hw: Hardware, seq_len: int, global_batch: int,
                      ac_modes: tuple[str, ...] = ("none", "selective", "full"),
                      capacity_factors: tuple[float, ...] | None = None) -> Iterator[Layout]:
    """Every layout of the model on `ngpu` devices that the plan considers (before the stack's
    checks). For an MoE model, each expert-parallel degree the mesh holds and each of
    `capacity_factors` (0: dropless; None: the build has no moe.capacity_factor)."""
    modes = list(capacity_factors) if capacity_factors is not None else [None]
    for tp in _powers_of_two_dividing(ngpu, hw.gpus_per_node):
        if model.n_heads % tp or model.n_kv_heads % tp:
            continue
        for cp in _powers_of_two_dividing(ngpu // tp, hw.gpus_per_node):
            # Context parallelism for long sequences: each rank keeps at least 4K tokens of each.
            if cp > 1 and seq_len // cp < 4096:
                continue
            for pp in [d for d in _divisors(ngpu // (tp * cp)) if d <= model.n_layers and d <= 64]:
                dp = ngpu // (tp * cp * pp)
                if global_batch % dp:
                    continue
                local = global_batch // dp
                replicas = [1]
                within_node = max(1, hw.gpus_per_node // (tp * cp))
                if dp > within_node and dp % within_node == 0:
                    replicas.append(dp // within_node)  # HSDP: shards within a node, replicas across
                for dp_replicate in replicas:
                    for accum in (a for a in _divisors(local) if a <= 8):
                        batch = local // accum
                        if pp > 1 and batch % pp:
                            continue  # the trainer's default: one microbatch per stage, of equal size
                        for ac in ac_modes:
                            base = Layout(dp_replicate, dp // dp_replicate, tp, pp, cp, ac, batch, accum,
                                          pp if pp > 1 else 0)
                            if not model.is_moe:
                                yield base
                                continue
                            for ep in expert_degrees(model.num_experts, base.dp_shard, cp, tp):
                                for capacity in modes:
                                    # The dropping mode caps each whole sequence, which TP and CP split
                                    # over ranks: the trainer refuses the pair, so it is never planned.
                                    if capacity and tp * cp > 1:
                                        continue
                                    yield dataclasses.replace(base, moe=True, ep=ep, capacity=capacity)


def screened_bytes(model: Model, layout: Layout, seq_len: int, imbalance: float = EXPERT_IMBALANCE) -> int:
    """A quick per-rank memory figure, for skipping dry runs (not the estimate). Calibrated against
    dry runs of Llama 3 8B to 405B (bf16 compute, docs/memory.md):
    - state: the rank's fp32 parameter shard and Adam's two moments, plus the fp32 gradient shard
      that gradient accumulation keeps between micro-steps;
    - the root module's embedding and output, which FSDP keeps gathered (bf16) through the step,
      and two gathered bf16 blocks;
    - activations per token and block, in bytes: 4 x dim for the two sequence-parallel inputs TP
      gathers (saved whole by every TP rank) and (18 x dim + 8 x hidden) / tp for the rest, with
      AC none; 2 x dim / tp (the block's input) with full AC; every other block each way with
      selective AC (checkpointing every 2nd block); times the microbatches the first pipeline
      rank keeps in flight;
    - the loss: 12 bytes per token and vocabulary entry / tp (bf16 logits, fp32 logits and their
      gradient);
    - with FSDP under PP, the stage's bf16 parameters and gradients, unsharded: PyTorch's pipeline
      stage reshards and reduces them only after the last microbatch's backward (5 bytes per
      parameter of the stage, calibrated on Llama 3 405B over FSDP 8 x TP 8 x PP 8).
    MoE models (terms calibrated on DeepSeek-V3 16B and 671B, MOE_ROW_DIMS): a gathered MoE
    layer holds 1/ep of its experts (not split by TP); an MoE block keeps, in place of the dense
    FFN's 8 x hidden, top_k x load x (MOE_ROW_DIMS x dim + 8 x expert hidden) per token (load:
    expert_load), and one such layer's buffers more as its transient; under PP with FSDP a
    stage's local experts cost STAGE_EXPERT_BYTES each.
    It leaves out the recomputation's transients and most other temporaries: 0 to 20 % under the
    dry run's figure in the calibration runs (MoE: 5 to 11 % under), up to 5 % over for small
    models under PP."""
    shard = layout.dp_shard * layout.cp
    # (Experts are sharded over shard x tp ranks in every layout, as the rest over tp x shard.)
    state = model.n_params / (layout.tp * layout.pp * shard) * (16 if layout.accum > 1 else 12)
    ends = model.vocab_size * model.dim * (2 if layout.pp == 1 else 1)  # embedding, output
    dense = model.n_params - model.expert_params
    block = (dense - 2 * model.vocab_size * model.dim) / model.n_layers / layout.tp
    if model.is_moe:  # a gathered MoE layer holds its rank's experts: 1/ep of them, not split by TP
        block += model.expert_params / model.moe_layers / layout.ep
    gathered = (ends / layout.tp + 2 * block) * 2
    tokens = layout.batch_size * seq_len / layout.cp / (layout.microbatches or 1)
    full = 2 * model.dim / layout.tp
    in_flight = min(layout.pp, layout.microbatches) if layout.pp > 1 else 1

    # The attention's share: 18 x dim, calibrated on Llama (projections up to 4 x dim wide); much
    # wider ones (multi-head latent attention's up-projections) at Llama 8B's bytes per output.
    attention = 7.2 * model.attention_width if model.attention_width > 4 * model.dim else 18 * model.dim

    def kept(per_token_ffn: float, blocks: int) -> float:
        none = 4 * model.dim + (attention + per_token_ffn) / layout.tp
        per_token_block = {"none": none, "selective": (none + full) / 2, "full": full}[layout.ac]
        return tokens * per_token_block * blocks / layout.pp * in_flight

    activations = kept(8 * model.hidden_dim, model.n_layers - model.moe_layers)
    dispatch = 0.0
    if model.is_moe:
        # An MoE layer keeps, per token, top_k x load copies of its routed rows (sorted, sent,
        # received, their outputs) and the experts' intermediates; the same buffers are one
        # layer's transient under AC.
        routed = model.top_k * expert_load(layout, imbalance) * (MOE_ROW_DIMS * model.dim + 8 * model.moe_hidden_dim)
        activations += kept(routed, model.moe_layers)
        dispatch = tokens * routed / layout.tp
    logits = tokens * model.vocab_size / layout.tp * 12
    stage = 0
    if layout.pp > 1 and shard > 1:
        stage = (dense / layout.tp * 5 + model.expert_params / layout.ep * STAGE_EXPERT_BYTES) / layout.pp
    return int(state + gathered + activations + dispatch + logits + stage)


def routing_modes(capacity_factors: tuple[float, ...] | None = None) -> tuple[float, ...] | None:
    """The capacity factors an MoE plan compares: dropless (0) and `capacity_factors` (default
    CAPACITY_FACTORS); None where this build has no moe.capacity_factor (dropless only)."""
    if not capacity_option_available():
        return None
    return (0.0, *(c for c in (CAPACITY_FACTORS if capacity_factors is None else capacity_factors) if c > 0))


def plan(model: Model, ngpu: int, hw: Hardware, seq_len: int, global_batch: int, base_args: list[str],
         top: int = 3, max_dry_runs: int = 8, log: Callable[[str], None] = lambda line: print(line, flush=True),
         capacity_factors: tuple[float, ...] | None = None, imbalance: float = EXPERT_IMBALANCE) -> list[Choice]:
    """The `top` fastest layouts that fit, each confirmed by the dry run. `base_args`: trainer
    options every layout shares (the model, a config file, the tokenizer...). MoE models:
    `capacity_factors` besides dropless (routing_modes) and the dropless `imbalance` (module
    docstring)."""
    choices = []
    modes = routing_modes(capacity_factors)
    for layout in enumerate_layouts(model, ngpu, hw, seq_len, global_batch, capacity_factors=modes):
        choices.append(Choice(layout, timing(model, layout, hw, seq_len, global_batch, imbalance),
                              screened_bytes(model, layout, seq_len, imbalance)))
    if not choices:
        raise UserError(f"no layout of {model.name} {model.flavor} on {ngpu} devices (nodes of {hw.gpus_per_node}) "
                        f"takes a global batch of {global_batch} sequences of {seq_len}: the batch must divide by the "
                        "data-parallel degree, with at least as many sequences per rank as pipeline stages")
    choices.sort(key=lambda c: -c.timing.tokens_per_second)
    budget = hw.device_memory_gib * GiB
    under = sum(1 for c in choices if c.screened_bytes <= budget * SCREEN_MARGIN)
    # Each dry run is a whole simulated step of the model (minutes for 70B on 2 cores): a line
    # when each ends, with its time, is the plan's progress.
    log(f"{len(choices)} layouts of {model.name} {model.flavor} on {ngpu} devices, {under} under the device's memory by "
        "the rough figure" + (f"; dry-running them fastest first until {top} fit (at most {max_dry_runs})" if under
                              else ": none to dry-run"))
    fitting, dry_runs, refused = [], 0, 0
    for choice in choices:
        if len(fitting) == top or dry_runs == max_dry_runs:
            break
        # A layout the rough figure already puts over the device's memory (with its margin of
        # error) would only spend a dry run.
        if choice.screened_bytes > budget * SCREEN_MARGIN:
            continue
        args = [*base_args, *choice.layout.overrides(), "--training.seq_len", str(seq_len), "--job.dry_run",
                "--job.dry_run_world_size", str(ngpu), "--job.dry_run_device", "cuda",
                "--memory_estimation.device_memory_gib", str(hw.device_memory_gib)]
        try:
            job_config = parse_args(args)
            dry_runs += 1
            # Dropless under EP: the busiest rank's share; the dropping mode's shapes are fixed.
            load = expert_load(choice.layout, imbalance) if model.is_moe and not choice.layout.capacity else 1.0
            start = time.perf_counter()
            choice.estimate = dry_run(job_config, expert_load=load)
        except UserError as e:
            choice.refused = str(e)
            refused += 1
            if refused <= MAX_REFUSALS_SHOWN:
                log(f"  refused: {choice.layout.text()}: {e}")
            continue
        peak = choice.peak_bytes / GiB
        log(f"  dry run {dry_runs}: {choice.layout.text()}: {peak:.1f} GiB at the peak "
            f"({'fits' if choice.estimate.fits else 'does not fit'}); predicted "
            f"{choice.timing.tokens_per_second / ngpu:,.0f} tokens/s per device ({time.perf_counter() - start:.0f}s)")
        if choice.estimate.fits:
            fitting.append(choice)
    if refused > MAX_REFUSALS_SHOWN:
        log(f"  ... and {refused - MAX_REFUSALS_SHOWN} more layouts the config checks refused")
    if not fitting:
        nothing = NothingFits(f"no layout of {model.name} {model.flavor} on {ngpu} devices fits")
        nothing.choices, nothing.dry_runs = choices, dry_runs
        raise nothing
    return fitting


class NothingFits(UserError):
    """No layout fits: plan() sets `choices` (every layout ranked, each with its screen figure, dry
    run or refusal) and `dry_runs` (how many it spent); scripts/plan_layout.py says why in its
    options' terms."""

    choices: list[Choice] = []
    dry_runs: int = 0


def as_record(choice: Choice) -> dict[str, Any]:
    """A choice as a record (for tests and JSON output)."""
    return {"layout": dataclasses.asdict(choice.layout), "overrides": choice.layout.overrides(),
            "tokens_per_second": choice.timing.tokens_per_second, "step_seconds": choice.timing.step,
            "peak_gib": None if choice.peak_bytes is None else choice.peak_bytes / GiB,
            "at_peak_gib": None if choice.estimate is None else
            {k: v / GiB for k, v in choice.estimate.largest.memory.at_peak.items()},
            "experts_gib": None if choice.estimate is None else
            {k: v / GiB for k, v in choice.estimate.largest.memory.experts.items()}}

