"""The analytic step time of one parallel layout, and the collectives it is built from.

What the planner (planner.py) ranks layouts by. Every figure is per rank and per optimizer step,
every constant a stated assumption; scripts/step_time_check.py measures both on real ranks
(docs/memory.md, "The step-time model checked").

The traffic (`traffic`): the collectives a rank calls, by kind (all_gather, reduce_scatter,
all_reduce, all_to_all, send_recv), each with its count of calls, its payload per call and the
ranks and link it runs over. The payload convention is the whole buffer of a call, which a trace
records exactly: the output of an all-gather, the input of a reduce-scatter, the tensor of an
all-reduce, the input of an all-to-all (what the rank sends, its own share included), the tensor
of a send or a receive (each counted as a call). Element sizes come from `Precision`: the gathered
parameters and the activations in `mixed_precision_param` (bf16 on GPUs, fp32 on CPUs), the
gradients' reductions in `mixed_precision_reduce` (fp32 by default). A "pass" below is the forward
and backward of one micro-batch (one pipeline microbatch under PP); r is the share of blocks that
activation checkpointing recomputes (none 0, selective 1/2: every 2nd block, full 1).

    fsdp   FSDP2 units: the root (embedding, final norm, output; under PP the embedding on the first
           stage and the rest on the last), each block, and under EP each MoE layer's experts (and
           under TP the whole MoE layer) over their own ranks. Per micro-step each unit is gathered
           in forward and again in backward, except the root and the last block, which keep their
           parameters after forward (data_parallel.apply_fsdp; `always`/`never` change that); the
           expert units are gathered twice, the last layer's too. Under PP every unit is gathered once
           per micro-step (never resharded). Each unit's gradients are reduce-scattered once per
           micro-step. HSDP all-reduces each unit's gradient shard once per step across replicas.
    tp     sequence parallelism, per pass: per block 2 all-gathers and 2 reduce-scatters of the
           block's activations (tokens x dim) forward and as many backward (a block whose
           feed-forward is an MoE layer half of that), plus r x the forward's again; the embedding's
           reduce-scatter and the output's all-gather (and their backward); loss parallelism's 3
           all-reduces of one fp32 value per token; one all-reduce per norm weight of the gradient
           TP leaves partial.
    cp     ring attention, per block and pass: keys and values each sent and received cp - 1 times
           forward (again for a recomputed block) and backward, and their fp32 gradient
           accumulators cp times.
    ep     per MoE layer and pass: 4 all-to-alls of the routed rows (dispatch and combine, forward
           and backward; + 2r), each of tokens x top_k x load rows, and dropless routing's exchange
           of the expert counts (1 + r, int64).
    pp     per microbatch, a stage sends its activations on and receives its gradients back
           (the first and last stage half of that; tokens x dim each).
    trainer  the step's own agreements: the stop/finite-loss all-reduce, the loss-token count,
           one gradient-norm all-reduce per gradient mesh (of one value per parameter tensor), and
           on logging steps the loss, the stragglers' all-gather (and the pipeline's loss and idle
           time); MoE models add the routing statistics' all-reduce.

The time of a collective (`seconds`) is alpha-beta: each call costs the link's per-hop latency
times its hops (a ring's n - 1 steps; 2 (n - 1) for an all-reduce; 1 for a transfer, or for a batch
of transfers issued together and waited for once, as ring attention's exchange of keys and values
both ways) plus its bytes on the wire over the link's bandwidth ((n - 1)/n of the payload; twice
that for an all-reduce, and for a reduce-scatter where the backend runs it as an all-reduce, as
gloo does; a send and its receive move the bytes once, each call counting half). Where ranks share
cores, a collective costs one latency whatever its hops (`Hardware.latency_per_call`). The link is
intra-node when the group's ranks fit in one node (mesh order pp, dp_replicate, dp_shard, cp, tp,
tp innermost), else inter-node.

The step (`timing`):

    compute = FLOPs of the rank's tokens (6 x parameters + attention, per token; x4/3 with full
              AC, x7/6 with selective) / (peak FLOP/s x efficiency), for 1/(tp x pp x cp) of the
              model's work on the rank's share of the batch; an MoE model's experts at the busiest
              rank's load
    fsdp    = the bandwidth and latency of the fsdp collectives; overlapped with compute (only what
              exceeds it counts) where the hardware overlaps them (`Hardware.overlap`)
    tp, cp, ep, pp, other = the bandwidth time of those collectives (other: the trainer's and the
              MoE routing counts'); exposed
    latency = the latency of every exposed collective
    host    = `Hardware.layer_overhead_ms` per block and pass (Python and dispatch where the host,
              not the device, sets the pace)
    bubble  = compute x (pp - 1) / microbatches (1F1B-like schedules)

    step    = max(compute, fsdp) + tp + cp + ep + pp + other + latency + host + bubble
              (compute + fsdp + ... where the collectives share the cores with compute)

What it leaves out, and how close it comes on real ranks: planner.py's docstring.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan.estimation.model_shape import Model

GB = 10**9
KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send_recv")
# Where each purpose's time goes in the step (Timing's terms); the fsdp term may overlap compute.
TERMS = {"fsdp": "fsdp", "hsdp": "fsdp", "ddp": "fsdp", "tp": "tp", "cp": "cp", "ep": "ep", "pp": "pp",
         "routing": "other", "trainer": "other"}
# Dropless routing under EP: the busiest rank's load over the even share the plan budgets for
# (planner.py's docstring).
EXPERT_IMBALANCE = 1.5
CAPACITY_OPTION = "capacity_factor"  # moe.capacity_factor: 0 dropless, > 0 the dropping mode
RECOMPUTED = {"none": 0.0, "selective": 0.5, "full": 1.0}  # share of blocks AC recomputes
DDP_BUCKET_BYTES = 100 * 2**20  # training.ddp_bucket_cap_mb's default


@dataclass(frozen=True)
class Hardware:
    """The cluster the plan is for; defaults: H100 SXM nodes of 8 with NVLink and 400 Gb/s links.

    Latencies are per hop of a collective (a ring's step): NCCL's small-message collectives take
    15 to 25 us over 8 NVLink GPUs (7 hops of 3 us) and a few us more per hop across nodes."""

    gpus_per_node: int = 8
    device_memory_gib: float = 80.0
    peak_tflops: float = 989.0  # dense bf16 per GPU
    efficiency: float = 0.5  # share of the peak that the model's matmuls reach
    intra_node_gbps: float = 360.0  # GB/s per GPU that a collective moves within a node (NVLink)
    inter_node_gbps: float = 45.0  # GB/s per GPU across nodes (one 400 Gb/s NIC per GPU)
    intra_node_latency_us: float = 3.0  # per hop within a node
    inter_node_latency_us: float = 8.0  # per hop across nodes
    layer_overhead_ms: float = 0.0  # host time per block and pass; 0 where kernels are queued ahead
    overlap: bool = True  # FSDP's collectives run beside compute (own streams), not on its cores
    reduce_scatter_as_all_reduce: bool = False  # gloo reduce-scatters by all-reducing the whole buffer
    # Each call costs one latency whatever its hops: ranks that share cores wait for their peers'
    # turns on a core, which hardly grows with the group (measured: torchtitan/tools/comm_bench.py).
    latency_per_call: bool = False


@dataclass(frozen=True)
class Precision:
    """Bytes per element of what the collectives move (module docstring)."""

    param: int = 2  # gathered parameters and activations: training.mixed_precision_param (bf16 on GPUs)
    reduce: int = 4  # gradient reductions: training.mixed_precision_reduce (float32 by default)

    @classmethod
    def of_job(cls, param: str = "auto", reduce: str = "float32", device_type: str = "cuda") -> Precision:
        """From the trainer's option values; `auto` is bf16 on CUDA and fp32 elsewhere."""
        size = {"float32": 4, "bfloat16": 2}
        return cls(size["bfloat16" if param == "auto" and device_type == "cuda" else
                        "float32" if param == "auto" else param], size[reduce])


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
    reshard_after_forward: str = "default"  # training.fsdp_reshard_after_forward

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp

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


@dataclass(frozen=True)
class Collective:
    """Calls of one collective a rank makes per optimizer step (module docstring's convention)."""

    kind: str  # one of KINDS
    purpose: str  # fsdp, hsdp, ddp, tp, cp, ep, pp, routing, trainer
    count: float  # calls per step (a mean over ranks where stages differ; logging amortised)
    bytes: float  # payload per call
    group: int  # ranks taking part
    link: str  # intra or inter (node)
    batch: int = 1  # calls issued together and waited for once (a ring exchange's sends and receives)

    @property
    def total_bytes(self) -> float:
        return self.count * self.bytes


def seconds(c: Collective, hw: Hardware) -> tuple[float, float]:
    """(latency, bandwidth time) of `c`'s calls per step, by the alpha-beta rule of the docstring."""
    n = c.group
    gbps = hw.intra_node_gbps if c.link == "intra" else hw.inter_node_gbps
    hop = (hw.intra_node_latency_us if c.link == "intra" else hw.inter_node_latency_us) * 1e-6
    twice = c.kind == "all_reduce" or (c.kind == "reduce_scatter" and hw.reduce_scatter_as_all_reduce)
    if c.kind == "send_recv":
        hops, wire = 1 / c.batch, 0.5 * c.bytes
    else:
        hops, wire = (n - 1) * (2 if twice else 1), c.bytes * (n - 1) / n * (2 if twice else 1)
        hops = 1 if hw.latency_per_call else hops
    return c.count * hops * hop, c.count * wire / (gbps * GB)


def by_kind(collectives: list[Collective]) -> dict[str, dict[str, float]]:
    """Calls and bytes per step of each kind (every kind present, zeros included)."""
    table = {kind: {"count": 0.0, "bytes": 0.0} for kind in KINDS}
    for c in collectives:
        table[c.kind]["count"] += c.count
        table[c.kind]["bytes"] += c.total_bytes
    return table


def expert_load(layout: Layout, imbalance: float = EXPERT_IMBALANCE) -> float:
    """The busiest rank's routed pairs over the even share (planner.py's docstring)."""
    if layout.capacity:
        return layout.capacity
    return imbalance if layout.ep > 1 else 1.0


def _link(span: int, hw: Hardware) -> str:
    """The link a group uses whose ranks lie within `span` consecutive ranks."""
    return "intra" if span <= hw.gpus_per_node else "inter"


@dataclass(frozen=True)
class _Pass:
    """What each part of the traffic needs of a layout's passes (module docstring)."""

    passes: int  # forward-backward passes per step (micro-steps x pipeline microbatches)
    tokens: float  # per rank and pass, before TP's sequence split
    recomputed: float  # r: the share of blocks AC recomputes
    stage: float  # the share of the blocks (and of each end of the model) a rank holds, on average
    act: int  # bytes per activation element


# Call patterns: (kind, purpose, calls per step, bytes per call, ranks, span of ranks[, batch]).
Calls = list[tuple]


def traffic(model: Model, layout: Layout, hw: Hardware, seq_len: int, global_batch: int = 0,
            imbalance: float = EXPERT_IMBALANCE, precision: Precision = Precision(),
            log_freq: int = 1) -> list[Collective]:
    """The collectives each rank calls per optimizer step (module docstring). MoE all-to-alls are
    the busiest rank's at `imbalance` (1: the mean over ranks). `log_freq`: steps per logged step.
    `global_batch` is the layout's own (batch x accumulation x data-parallel degree), unused."""
    micro = max(1, layout.microbatches) if layout.pp > 1 else 1
    fsdp = layout.dp_shard * layout.cp > 1
    shape = _Pass(layout.accum * micro, layout.batch_size * seq_len / micro / layout.cp, RECOMPUTED[layout.ac],
                  1 / layout.pp, precision.param if fsdp else 4)  # without FSDP the residual stays fp32 (autocast)
    calls = _fsdp_calls(model, layout, precision) + _tp_calls(model, layout, shape, precision)
    calls += _cp_calls(model, layout, shape) + _moe_calls(model, layout, shape, imbalance)
    if layout.pp > 1:  # each microbatch's activations sent on, its gradients received back
        calls.append(("send_recv", "pp", 4 * (layout.pp - 1) / layout.pp * layout.microbatches * layout.accum,
                      shape.tokens / layout.tp * model.dim * shape.act, 2, 2 * layout.world // layout.pp))
    out = [Collective(kind, purpose, count, nbytes, group, _link(span, hw), *batch)
           for kind, purpose, count, nbytes, group, span, *batch in calls if count > 0 and group > 1]
    return _merge(out) + _trainer_collectives(model, layout, hw, log_freq)


def _fsdp_calls(model: Model, layout: Layout, precision: Precision) -> Calls:
    """FSDP / HSDP units: each unit's gathers, reduce-scatter and replica all-reduce (docstring)."""
    tp, shard, pp, ep = layout.tp, layout.dp_shard * layout.cp, layout.pp, layout.ep
    never, always = layout.reshard_after_forward == "never" or pp > 1, layout.reshard_after_forward == "always"
    head = (model.head_params - sum(model.head_replicated)) / tp + sum(model.head_replicated)
    # (parameters per rank before sharding, ranks sharding them, gathers per micro-step where held)
    units = ([(model.embedding_params / tp + head, shard, 2 if always else 1)] if pp == 1 else
             [(model.embedding_params / tp, shard, 1), (head, shard, 1)])
    for i, b in enumerate(model.blocks):
        whole = sum(b.replicated) + b.moe_params  # what TP does not split
        moe_unit = tp > 1 and b.experts > 0  # under TP the MoE layer is a unit of its own, over shard x tp
        dense = (b.params - whole) / tp + whole - (b.moe_params if moe_unit else 0)
        dense += b.experts if b.experts and ep == 1 and tp == 1 else 0
        last = i == len(model.blocks) - 1
        units.append((dense, shard, 1 if never or (last and not always) else 2))
        if b.experts and ep > 1:
            units.append((b.experts / ep, shard * tp // ep, 1 if never else 2))
        if moe_unit:
            units.append((b.moe_params + (b.experts if ep == 1 else 0), shard * tp, 1 if never else 2))
    calls: Calls = []
    for params, ranks, gathers in units:  # each unit is held by 1/pp of the ranks on average
        calls += [("all_gather", "fsdp", gathers / pp * layout.accum, params * precision.param, ranks, tp * shard),
                  ("reduce_scatter", "fsdp", layout.accum / pp, params * precision.reduce, ranks, tp * shard)]
        if layout.dp_replicate > 1:  # once per step, after the last micro-step
            calls.append(("all_reduce", "hsdp" if ranks > 1 else "ddp", 1 / pp, params / ranks * precision.reduce,
                          layout.dp_replicate, layout.world // pp))
    return calls


def _tp_calls(model: Model, layout: Layout, shape: _Pass, precision: Precision) -> Calls:
    """Sequence parallelism's collectives (docstring), over the tp ranks of a node."""
    tp = layout.tp
    if tp == 1:
        return []
    block = shape.tokens * model.dim * shape.act
    per_pass = shape.passes * shape.stage
    calls: Calls = []
    for b in model.blocks:
        pairs = (2 if b.dense_ffn else 1) * (2 + shape.recomputed) * per_pass
        calls += [("all_gather", "tp", pairs, block, tp, tp), ("reduce_scatter", "tp", pairs, block, tp, tp)]
        calls += [("all_reduce", "tp", per_pass, size * precision.param, tp, tp) for size in b.replicated]
    calls += [("all_gather", "tp", 2 * per_pass, block, tp, tp),  # the output's forward, the embedding's backward
              ("reduce_scatter", "tp", 2 * per_pass, block, tp, tp),  # the embedding's forward, the output's backward
              ("all_reduce", "tp", 3 * per_pass, shape.tokens * 4, tp, tp)]  # loss parallelism
    return calls + [("all_reduce", "tp", per_pass, size * precision.param, tp, tp) for size in model.head_replicated]


def _cp_calls(model: Model, layout: Layout, shape: _Pass) -> Calls:
    """Ring attention's transfers (each send and each receive a call), per block and pass."""
    cp, tp = layout.cp, layout.tp
    if cp == 1:
        return []
    kv = shape.tokens * model.n_kv_heads / tp * model.head_dim  # one of keys, values
    blocks = len(model.blocks) * shape.passes * shape.stage
    # Each exchange sends and receives both tensors as one batch (ring_attention._Ring), waited for once.
    return [("send_recv", "cp", 4 * (cp - 1) * (2 + shape.recomputed) * blocks, kv * shape.act, 2, cp * tp, 4),
            ("send_recv", "cp", 4 * cp * blocks, kv * 4, 2, cp * tp, 4)]  # the fp32 gradient accumulators


def _moe_calls(model: Model, layout: Layout, shape: _Pass, imbalance: float) -> Calls:
    """Expert parallelism's all-to-alls and the routing counts' collectives, per MoE layer and pass."""
    if not model.is_moe:
        return []
    tp, cp, ep, r = layout.tp, layout.cp, layout.ep, shape.recomputed
    layers = sum(1 for b in model.blocks if b.experts) * shape.passes * shape.stage
    rows = shape.tokens / tp * model.top_k * expert_load(layout, imbalance)
    calls: Calls = [("all_to_all", "ep", (4 + 2 * r) * layers, rows * model.dim * shape.act, ep, ep)]
    if not layout.capacity:  # dropless: each rank's counts per expert, int64
        calls.append(("all_to_all", "routing", (1 + r) * layers, model.num_experts * 8, ep, ep))
    # The counts summed over the ranks holding parts of the same sequences.
    return calls + [("all_reduce", "routing", (1 + r) * layers, model.num_experts * 4, tp * cp, tp * cp)]


def _merge(collectives: list[Collective]) -> list[Collective]:
    """Calls of the same kind, purpose, size and group as one entry."""
    merged: dict[tuple, float] = {}
    for c in collectives:
        key = (c.kind, c.purpose, c.bytes, c.group, c.link, c.batch)
        merged[key] = merged.get(key, 0.0) + c.count
    return [Collective(kind, purpose, count, nbytes, group, link, batch)
            for (kind, purpose, nbytes, group, link, batch), count in merged.items()]


def _trainer_collectives(model: Model, layout: Layout, hw: Hardware, log_freq: int) -> list[Collective]:
    """The trainer's own collectives per step (module docstring): host-side agreements, the loss,
    the gradient norm, the step line's figures."""
    world, pp = layout.world, layout.pp
    logged = 1 / max(1, log_freq)
    losses = layout.dp_replicate * layout.dp_shard * layout.cp
    stage_ranks = world // pp
    blocks = model.blocks
    tensors = (sum(b.tensors for b in blocks) + model.embedding_tensors + model.head_tensors) / pp
    rows = [("all_reduce", 1.0, 12, world, world),  # stop signal, background save, non-finite loss
            ("all_reduce", 1.0, 8, losses, stage_ranks),  # the step's tokens with a loss
            ("all_reduce", logged, 8, losses, stage_ranks),  # the logged loss
            ("all_gather", logged, 8 * world, world, world)]  # the stragglers' step times
    if layout.dp_shard * layout.cp * layout.tp > 1:  # DTensor gradients: the norm is reduced
        rows.append(("all_reduce", 1.0, 4 * tensors, stage_ranks, stage_ranks))
    if model.is_moe and layout.ep > 1:
        expert_tensors = sum(b.expert_tensors for b in blocks) / pp
        rows.append(("all_reduce", 1.0, 4 * expert_tensors, stage_ranks, stage_ranks))
    if model.is_moe:
        moe = sum(1 for b in blocks if b.experts) / pp
        rows.append(("all_reduce", 1.0, 4 * moe * (model.num_experts + 2), stage_ranks, stage_ranks))
    if pp > 1:
        rows += [("all_reduce", 1.0, 4, pp, world), ("all_reduce", logged, 4, pp, world),
                 ("all_reduce", logged, 8, pp, world)]  # the norm, the loss over stages, their idle time
    return [Collective(kind, "trainer", count, nbytes, group, _link(span, hw))
            for kind, count, nbytes, group, span in rows if group > 1]


@dataclass
class Timing:
    compute: float
    tp: float
    cp: float
    fsdp: float
    bubble: float
    tokens: int  # per optimizer step, whole job
    ep: float = 0.0  # expert parallelism's all-to-alls
    pp: float = 0.0  # pipeline transfers
    other: float = 0.0  # the trainer's own collectives and the MoE routing counts
    latency: float = 0.0  # every exposed collective's per-call latency
    host: float = 0.0  # host overhead per block and pass
    overlap: bool = True  # fsdp hidden under compute up to its length

    @property
    def step(self) -> float:
        data_parallel = max(self.compute, self.fsdp) if self.overlap else self.compute + self.fsdp
        return data_parallel + self.tp + self.cp + self.ep + self.pp + self.other + self.latency + self.host + self.bubble

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.step

    def terms(self) -> dict[str, float]:
        """Every term in seconds, in the step's sum order."""
        return {name: getattr(self, name) for name in ("compute", "fsdp", "tp", "cp", "ep", "pp", "other", "latency",
                                                       "host", "bubble")}


def timing(model: Model, layout: Layout, hw: Hardware, seq_len: int, global_batch: int,
           imbalance: float = EXPERT_IMBALANCE, precision: Precision = Precision(), log_freq: int = 1) -> Timing:
    """The analytic step time of the module docstring; its communication from `traffic`."""
    tokens = global_batch * seq_len
    local_tokens = layout.batch_size * layout.accum * seq_len  # per data-parallel rank and step
    per_token = model.flops_per_token(seq_len)
    load = expert_load(layout, imbalance) if model.is_moe else 1.0
    if model.is_moe:  # the experts' share of the work at the busiest rank's load
        per_token += (load - 1) * 6 * model.top_k * model.expert_params / model.num_experts
    flops = per_token * local_tokens / (layout.tp * layout.pp * layout.cp)
    flops *= {"none": 1.0, "selective": 7 / 6, "full": 4 / 3}[layout.ac]
    compute = flops / (hw.peak_tflops * 1e12 * hw.efficiency)
    terms = dict.fromkeys(("fsdp", "tp", "cp", "ep", "pp", "other", "latency"), 0.0)
    for c in traffic(model, layout, hw, seq_len, global_batch, imbalance, precision, log_freq):
        latency, transfer = seconds(c, hw)
        term = TERMS[c.purpose]
        terms[term] += transfer
        terms["fsdp" if term == "fsdp" else "latency"] += latency
    passes = layout.accum * (max(1, layout.microbatches) if layout.pp > 1 else 1)
    host = hw.layer_overhead_ms * 1e-3 * model.n_layers / layout.pp * passes * (1 + RECOMPUTED[layout.ac] / 2)
    bubble = compute * (layout.pp - 1) / max(1, layout.microbatches) if layout.pp > 1 else 0.0
    return Timing(compute, terms["tp"], terms["cp"], terms["fsdp"], bubble, tokens, terms["ep"], terms["pp"],
                  terms["other"], terms["latency"], host, hw.overlap)

