"""The layout planner: which parallel layouts of a model fit a cluster, and which is fastest.

It enumerates the layouts a job could use (tensor parallel within a node, pipeline stages, FSDP or
HSDP, context parallel for long sequences, activation checkpointing, gradient accumulation; for
mixture-of-experts models also expert parallelism and the routing mode, below), drops those the
stack refuses (the config checks of a real start-up), ranks the rest by the analytic step-time
model below, and asks the dry run (dry_run.py, fake tensors in this process) whether the fastest
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

The step-time model (per optimizer step, per rank; every figure a stated assumption):

    compute   = FLOPs of the rank's tokens (6 x parameters + attention, per token; x4/3 with full
                activation checkpointing, x7/6 with selective: every 2nd block recomputed) /
                (peak FLOP/s x efficiency),
                for 1/(tp x pp x cp) of the model's work on the rank's share of the batch
    tp        = 4 all-gathers and 4 reduce-scatters of a block's activations per block, forward
                and backward (sequence parallelism), each moving (tp-1)/tp of the bytes, over
                the intra-node bandwidth; on the critical path
    cp        = each block's keys and values passed around the ring, (cp-1)/cp of them, forward
                and backward twice; intra- or inter-node by where the cp ranks sit; exposed
    fsdp      = parameters gathered twice (forward, backward) and gradients reduce-scattered once
                per micro-step, (n-1)/n of the rank's bf16 parameters each, over the bandwidth of the
                slowest link the shard group spans; HSDP adds an all-reduce of the fp32 gradient
                shard across replicas (inter-node); overlapped with compute: only what exceeds it
                counts
    bubble    = compute x (pp - 1) / (microbatches x stages per rank) (1F1B-like schedules)
    ep        = MoE layers: the routed pairs (tokens x top_k x load, of the rank's tp/cp slice)
                all-to-all'ed 4 times per layer (dispatch and combine, forward and backward; 6
                with full AC's recompute, 5 with selective), (ep-1)/ep of them over the link the
                ep group spans (its ranks are adjacent: intra-node up to a node); exposed. The
                experts' share of `compute` is scaled by `load`, and FSDP gathers the experts over
                the ranks holding the same experts (ep > 1) or whole (ep 1; not split by TP)

    step      = max(compute, fsdp) + tp + cp + ep + bubble; tokens/s = global batch tokens / step

What it leaves out: the schedule's own overheads, kernel launch and Python time, imperfect
overlap, stragglers. Its figures rank layouts; they are no promise of throughput.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from torch import nn

from torchtitan.config.job_config import JobConfig
from torchtitan.config.manager import parse_args
from torchtitan.errors import UserError
from torchtitan.estimation.dry_run import DryRunResult, dry_run
from torchtitan.estimation.tracker import is_moe_layer
from torchtitan.models import get_train_spec

GB = 10**9
GiB = 2**30
# The rough memory figure (screened_bytes) lands within -20 % to +5 % of the dry run's in its
# calibration (docs/memory.md); layouts up to this factor over the device's memory are dry-run.
SCREEN_MARGIN = 1.05
# Refusals printed before the rest are counted only (an MoE plan meets the same few rules often:
# the dropping mode under TP, DDP replicas under TP).
MAX_REFUSALS_SHOWN = 5
# Dropless routing under EP: the busiest rank's load over the even share the plan budgets for
# (module docstring); the dropping mode's capacity factors it compares with dropless.
EXPERT_IMBALANCE = 1.5
CAPACITY_FACTORS = (1.25,)
CAPACITY_OPTION = "capacity_factor"  # moe.capacity_factor: 0 dropless, > 0 the dropping mode
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


@dataclass(frozen=True)
class Hardware:
    """The cluster the plan is for; defaults: H100 SXM nodes of 8 with NVLink and 400 Gb/s links."""

    gpus_per_node: int = 8
    device_memory_gib: float = 80.0
    peak_tflops: float = 989.0  # dense bf16 per GPU
    efficiency: float = 0.5  # share of the peak that the model's matmuls reach
    intra_node_gbps: float = 360.0  # GB/s per GPU that a collective moves within a node (NVLink)
    inter_node_gbps: float = 45.0  # GB/s per GPU across nodes (one 400 Gb/s NIC per GPU)


@dataclass(frozen=True)
class Layout:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    cp: int
    ac: str  # none, selective, full
    batch_size: int  # sequences per data-parallel rank and micro-step
    accum: int  # gradient accumulation steps
    microbatches: int  # pipeline microbatches per micro-step (0 without PP)
    schedule: str = "1F1B"
    moe: bool = False  # a mixture-of-experts model: the options below are pasted
    ep: int = 1  # expert parallelism (borrows dp_shard x cp x tp ranks: no factor of the world)
    capacity: float | None = None  # moe.capacity_factor: 0 dropless; None: a build without the option

    def overrides(self) -> list[str]:
        """Ready-to-paste trainer options."""
        args = ["--training.data_parallel_replicate_degree", str(self.dp_replicate),
                "--training.data_parallel_shard_degree", str(self.dp_shard),
                "--training.tensor_parallel_degree", str(self.tp),
                "--experimental.context_parallel_degree", str(self.cp),
                "--experimental.pipeline_parallel_degree", str(self.pp),
                "--activation_checkpoint.mode", self.ac,
                "--training.batch_size", str(self.batch_size),
                "--training.gradient_accumulation_steps", str(self.accum)]
        if self.pp > 1:
            args += ["--experimental.pipeline_parallel_schedule", self.schedule,
                     "--experimental.pipeline_parallel_microbatches", str(self.microbatches)]
        if self.moe:
            args += ["--training.expert_parallel_degree", str(self.ep)]
            if self.capacity is not None:
                args += [f"--moe.{CAPACITY_OPTION}", f"{self.capacity:g}"]
        return args

    def text(self) -> str:
        dims = [f"{name} {value}" for name, value in (("dp_replicate", self.dp_replicate), ("dp_shard", self.dp_shard),
                                                      ("tp", self.tp), ("cp", self.cp), ("pp", self.pp)) if value > 1]
        pp = f", {self.schedule} x{self.microbatches}" if self.pp > 1 else ""
        if self.moe:
            pp += f", ep {self.ep}" + ("" if self.capacity is None else
                                       ", dropless" if not self.capacity else f", capacity {self.capacity:g}")
        return (f"{' x '.join(dims) or '1 rank'}, AC {self.ac}, batch {self.batch_size}"
                + (f" x accum {self.accum}" if self.accum > 1 else "") + pp)


@dataclass
class Timing:
    compute: float
    tp: float
    cp: float
    fsdp: float
    bubble: float
    tokens: int  # per optimizer step, whole job
    ep: float = 0.0  # expert parallelism's all-to-alls

    @property
    def step(self) -> float:
        return max(self.compute, self.fsdp) + self.tp + self.cp + self.ep + self.bubble

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.step


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


@dataclass
class Model:
    """What the plan needs of a model, read from its flavor on the meta device."""

    name: str
    flavor: str
    n_params: int
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_dim: int
    vocab_size: int
    flops_per_token: Callable[[int], int] = field(repr=False)
    # Mixture-of-experts models (0 for dense ones): routed experts per MoE layer and chosen per
    # token, MoE layers, the routed experts' parameters in all of them, an expert's hidden width.
    num_experts: int = 0
    top_k: int = 0
    attention_width: int = 0  # outputs of one block's attention projections (0: unknown)
    moe_layers: int = 0
    expert_params: int = 0
    moe_hidden_dim: int = 0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @classmethod
    def from_flavor(cls, name: str, flavor: str, vocab_size: int = 0) -> Model:
        """`vocab_size`: the tokenizer's (the vocabulary always comes from it); 0: the flavor's."""
        import torch

        spec = get_train_spec(name)
        if flavor not in spec.config:
            raise UserError(f"unknown flavor {flavor!r} of model {name!r}; choose from {', '.join(spec.config)}")
        args = spec.config[flavor]
        if vocab_size:
            args = dataclasses.replace(args, vocab_size=vocab_size)
        with torch.device("meta"):
            model = spec.model_cls.from_model_args(args)
        heads = args.n_heads
        head_dim = getattr(args, "head_dim", None) or args.dim // heads
        hidden = max((m.out_features for m in model.modules() if isinstance(m, torch.nn.Linear)
                      and m.in_features == args.dim and m.out_features != args.vocab_size), default=4 * args.dim)
        moe = [m for m in model.modules() if is_moe_layer(m)]
        attention = next((m.attention for m in model.modules() if isinstance(getattr(m, "attention", None), nn.Module)),
                         None)
        experts = {"attention_width": 0 if attention is None else
                   sum(m.out_features for m in attention.modules() if isinstance(m, nn.Linear))}
        if moe:
            w1 = getattr(moe[0].experts, "w1", None)
            experts.update(num_experts=moe[0].num_experts, top_k=moe[0].top_k, moe_layers=len(moe),
                           expert_params=sum(p.numel() for m in moe for p in m.experts.parameters()),
                           moe_hidden_dim=w1.shape[1] if w1 is not None else args.dim)
        return cls(name, flavor, sum(p.numel() for p in model.parameters()), args.n_layers, args.dim, heads,
                   getattr(args, "n_kv_heads", None) or heads, head_dim, hidden, args.vocab_size, model.flops_per_token,
                   **experts)


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
                                    yield dataclasses.replace(base, moe=True, ep=ep, capacity=capacity)


def expert_load(layout: Layout, imbalance: float = EXPERT_IMBALANCE) -> float:
    """The busiest rank's routed pairs over the even share (module docstring)."""
    if layout.capacity:
        return layout.capacity
    return imbalance if layout.ep > 1 else 1.0


def timing(model: Model, layout: Layout, hw: Hardware, seq_len: int, global_batch: int,
           imbalance: float = EXPERT_IMBALANCE) -> Timing:
    """The analytic step time of the module docstring."""
    tokens = global_batch * seq_len
    local_tokens = layout.batch_size * layout.accum * seq_len  # per data-parallel rank and step
    per_token = model.flops_per_token(seq_len)
    load = expert_load(layout, imbalance) if model.is_moe else 1.0
    if model.is_moe:  # the experts' share of the work at the busiest rank's load
        per_token += (load - 1) * 6 * model.top_k * model.expert_params / model.num_experts
    flops = per_token * local_tokens / (layout.tp * layout.pp * layout.cp)
    flops *= {"none": 1.0, "selective": 7 / 6, "full": 4 / 3}[layout.ac]
    compute = flops / (hw.peak_tflops * 1e12 * hw.efficiency)
    layers = model.n_layers / layout.pp
    bf16 = 2
    intra, inter = hw.intra_node_gbps * GB, hw.inter_node_gbps * GB
    tp = 0.0
    if layout.tp > 1:
        block_bytes = local_tokens / layout.cp * model.dim * bf16
        tp = 8 * layers * block_bytes * (layout.tp - 1) / layout.tp / intra
    cp = 0.0
    if layout.cp > 1:
        kv_bytes = local_tokens / layout.cp * 2 * model.n_kv_heads * model.head_dim * bf16 / layout.tp
        link = intra if layout.tp * layout.cp <= hw.gpus_per_node else inter
        cp = 3 * layers * kv_bytes * (layout.cp - 1) / link
    ep = 0.0
    if model.is_moe and layout.ep > 1:
        pairs = local_tokens / (layout.cp * layout.tp) * model.top_k * load  # routed by each tp/cp rank
        passes = {"none": 4, "selective": 5, "full": 6}[layout.ac]
        link = intra if layout.ep <= hw.gpus_per_node else inter
        ep = passes * model.moe_layers / layout.pp * pairs * model.dim * bf16 * (layout.ep - 1) / layout.ep / link
    fsdp = 0.0
    shard = layout.dp_shard * layout.cp  # FSDP shards over dp_shard x cp
    experts = model.expert_params / layout.pp  # a stage's experts, not split by TP
    params = (model.n_params - model.expert_params) / (layout.tp * layout.pp)
    span = layout.tp * shard  # ranks from the first of a shard group to its last
    link = intra if span <= hw.gpus_per_node else inter
    if shard > 1:
        # Gathered for every micro-step's forward and backward and reduce-scattered after its
        # backward (training.defer_sharded_gradient_reduction, which the plan leaves off, would
        # reduce once per step for a whole unsharded copy of the gradients).
        fsdp += 3 * layout.accum * params * bf16 * (shard - 1) / shard / link
    # The experts' FSDP: over the ranks holding the same experts (ep > 1), or over the MoE
    # layers' dp_shard x cp (x tp) ranks, gathering every expert (ep 1).
    holders = shard * layout.tp // layout.ep
    if model.is_moe and holders > 1:
        fsdp += 3 * layout.accum * experts / layout.ep * bf16 * (holders - 1) / holders / link
    params += experts / layout.tp  # for HSDP's all-reduce of the shards (experts: over shard x tp ranks), below
    if layout.dp_replicate > 1:
        fsdp += 2 * params / shard * 4 * (layout.dp_replicate - 1) / layout.dp_replicate / inter
    bubble = compute * (layout.pp - 1) / max(1, layout.microbatches) if layout.pp > 1 else 0.0
    return Timing(compute, tp, cp, fsdp, bubble, tokens, ep)


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

