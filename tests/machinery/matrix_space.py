"""What the layout matrix varies: the parallel degrees, the variants of how a layout runs and the
features a run can switch on, and what one point of the matrix is (its options, its one-process
reference, what its setup record must show, its price).

Test machinery; the generator that places the values on points is layout_matrix.py.

A point is a set of degrees (dp_replicate, dp_shard, cp, tp, pp; expert parallelism borrows every
rank of dp_shard x cp x tp when the model has experts) and a value for each factor that applies
to them. A factor's value relates to the one-process reference in one of three ways (`Factor.kind`):
- "model": it defines the weights (the model family, tied embeddings, MTP): the seed checkpoint
  and the reference are made with it;
- "numerics": it changes what one process computes from the same weights (the optimizer and its
  state dtype, document masking, the MoE capacity, float8, the data order): the reference runs
  it too, from the model's seed;
- "layout": it must not change the numbers at all (a parallelism's variant, compile, checkpointing,
  offload, chunked loss, workers, resuming, replica groups): the reference runs without it.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

from tests.machinery.matrix_model import (
    DEPTHS,
    DSV3_MODEL_NAME,
    GPT_OSS_MODEL_NAME,
    MODEL_NAME,
    MOE_MODEL_NAME,
    flavor_name,
)
from torchtitan.tools.parity import POSITIVE, Check, Expectations, Layout
from torchtitan.tools.parity_layouts import FLOAT8, FLOAT8_GRAD_NORM_RTOL, FLOAT8_SPLIT_TOLERANCE

DIMS = ("dp_replicate", "dp_shard", "cp", "tp", "pp")
# Every dim a value must meet: the five degrees and expert parallelism.
ALL_DIMS = (*DIMS, "ep")
_SHORT = {"dp_replicate": "rep", "dp_shard": "fsdp", "cp": "cp", "tp": "tp", "pp": "pp"}
_OPTION = {"dp_replicate": "--training.data_parallel_replicate_degree", "dp_shard": "--training.data_parallel_shard_degree",
           "cp": "--experimental.context_parallel_degree", "tp": "--training.tensor_parallel_degree",
           "pp": "--experimental.pipeline_parallel_degree"}
# The mesh's dim order (outermost first), as ParallelDims logs it.
_MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
WORLD_SIZES = (1, 2, 4, 8)
# Replica groups run two groups of the point's ranks: on points of up to this many ranks.
GROUPS, GROUP_RANKS = 2, 4
LOSS_CHUNK = 24  # positions per chunk of the chunked loss: not a divisor of the 64-token sequences


@dataclass(frozen=True, order=True)
class Degrees:
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1

    @property
    def nproc(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp

    def over(self, dim: str) -> bool:
        return getattr(self, dim) > 1

    @property
    def active(self) -> tuple[str, ...]:
        return tuple(d for d in DIMS if self.over(d))

    @property
    def name(self) -> str:
        return "_".join(f"{_SHORT[d]}{getattr(self, d)}" for d in DIMS if self.over(d)) or "single"

    def mesh(self) -> dict[str, int]:
        """The world mesh as the setup record shows it: {"dp_replicate": 2, "cp": 2}."""
        return {d: getattr(self, d) for d in _MESH_ORDER if self.over(d)}


def all_degrees(world_sizes: tuple[int, ...] = WORLD_SIZES) -> list[Degrees]:
    """Every power-of-two assignment of the five degrees whose product is in `world_sizes`, fewest
    ranks first."""
    powers = [1, 2, 4, 8]
    points = [Degrees(*d) for d in itertools.product(powers, repeat=len(DIMS))]
    return sorted((p for p in points if p.nproc in world_sizes), key=lambda p: (p.nproc, [-getattr(p, d) for d in DIMS]))


@dataclass(frozen=True)
class Factor:
    """A variant of how a layout runs, or a feature. `values[0]` is what a plain run does. The
    factor exists on a point when every dim of `needs` is over 1, the model is one of `models`
    (when given) and the point has at most `max_ranks` ranks; each value must meet every dim of
    `meets`. `args` are each value's overrides, `expect` what the setup record must show with it,
    `label` its part of a point's name, `cost` its price per rank (see `cost`)."""

    name: str
    values: tuple[str, ...]
    kind: str  # "model", "numerics" or "layout" (the module's docstring)
    meets: tuple[str, ...] = ALL_DIMS
    needs: tuple[str, ...] = ()
    models: tuple[str, ...] = ()
    max_ranks: int = 8
    args: dict[str, tuple[str, ...]] = field(default_factory=dict)
    expect: dict[str, Expectations] = field(default_factory=dict)
    label: dict[str, str] = field(default_factory=dict)
    cost: dict[str, float] = field(default_factory=dict)

    def applies(self, degrees: Degrees, model: str) -> bool:
        return (all(degrees.over(d) for d in self.needs) and (not self.models or model in self.models)
                and degrees.nproc <= self.max_ranks)


def _even_blocks(ac: dict) -> list[str]:
    """The blocks of even index: the main blocks by their key; the MTP module's block (`mtp.0.block`,
    DeepSeek-V3) by its layer id, the model's block count, even in every deepseek_v3_matrix flavor."""
    return [b for b in ac["blocks"] if b.startswith("mtp.0.") or int(b.rsplit(".", 1)[1]) % 2 == 0]


# What activation checkpointing leaves on rank 0's blocks (setup record "activation_checkpoint").
_AC_APPLIED = {
    "none": Check("no block wrapped", lambda ac: ac["wrapped"] == []),
    "full": Check("every block wrapped, whole", lambda ac: ac["blocks"] != [] and sorted(ac["wrapped"]) == sorted(ac["blocks"])
                  and not ac["op_level"]),
    "selective": Check("every second block wrapped, whole (selective 2)",
                       lambda ac: ac["wrapped"] != [] and sorted(ac["wrapped"]) == sorted(_even_blocks(ac))
                       and not ac["op_level"]),
    "op": Check("every block wrapped with the op-level policy", lambda ac: ac["blocks"] != []
                and sorted(ac["wrapped"]) == sorted(ac["blocks"]) and ac["op_level"]),
}
_WITH_MUON = Check("Muon among them", lambda names: "Muon" in names)
_WITHOUT_MUON = Check("no Muon", lambda names: "Muon" not in names)
_NO_OFFLOAD = Check("no block offloaded", lambda blocks: blocks == [])
_OFFLOADED = Check("every block offloaded", lambda blocks: blocks != [])


def _on_off(name: str, kind: str, args: tuple[str, ...], expect_off: Expectations, expect_on: Expectations,
            label: str, cost: float, **kwargs) -> Factor:
    """A feature switched on by `args`."""
    return Factor(name, ("off", "on"), kind, args={"on": args}, expect={"off": expect_off, "on": expect_on},
                  label={"on": label}, cost={"on": cost}, **kwargs)


_AC = "--activation_checkpoint.mode"
_SAC = "--activation_checkpoint.selective_ac_option"
_MOE = ("moe", "dsv3", "gptoss")
FACTORS = (
    # The model first: whether later factors exist depends on it. A mixture-of-experts model has its
    # experts split over every rank expert parallelism can borrow (dp_shard x cp x tp; Point.ep_degree):
    # matrix_model's qwen3_moe_matrix ("moe") or deepseek_v3_matrix ("dsv3": latent attention, a
    # dense first block, shared experts, MTP) or gpt_oss_matrix ("gptoss": sinks, banded and full
    # attention blocks, biased router and experts, clamped SwiGLU).
    Factor("model", ("dense", "moe", "dsv3", "gptoss"), "model", meets=DIMS,
           label={"moe": "moe", "dsv3": "dsv3", "gptoss": "gptoss"}, cost={"moe": 0.3, "dsv3": 0.6, "gptoss": 0.5}),
    Factor("tied", ("untied", "tied"), "model", meets=ALL_DIMS, label={"tied": "tied"}, cost={"tied": 0.1}),
    # Single-stage (1F1B, GPipe), multi-stage round-robin (Interleaved1F1B, ...) or V-shaped stages;
    # the concrete schedule is the point's own (Point.schedule).
    Factor("schedule", ("single", "interleaved", "V"), "layout", meets=("dp_replicate", "dp_shard", "cp", "tp", "ep"),
           needs=("pp",)),
    Factor("sp", ("on", "off"), "layout", meets=("dp_replicate", "dp_shard", "cp", "pp", "ep"), needs=("tp",),
           args={"off": ("--training.disable_sequence_parallel",)},
           expect={"on": (("tp.sequence_parallel", True),), "off": (("tp.sequence_parallel", False),)},
           label={"off": "sp_off"}),
    Factor("lp", ("on", "off"), "layout", meets=("dp_replicate", "dp_shard", "cp", "pp", "ep"), needs=("tp",),  # loss parallel
           args={"off": ("--training.disable_loss_parallel",)},
           expect={"on": (("tp.loss_parallel", True),), "off": (("tp.loss_parallel", False),)},
           label={"off": "lp_off"}),
    Factor("ac", ("none", "full", "selective", "op"), "layout",
           args={"full": (_AC, "full"), "selective": (_AC, "selective", _SAC, "2"), "op": (_AC, "selective", _SAC, "op")},
           expect={v: (("activation_checkpoint", check),) for v, check in _AC_APPLIED.items()},
           label={"full": "ac_full", "selective": "ac_selective", "op": "ac_op"},
           cost={"full": 0.5, "selective": 0.5, "op": 0.5}),
    # Compiling a pipeline stage of MoE blocks takes minutes before the first step on a loaded CPU.
    _on_off("compile", "layout", ("--training.compile", "--comm.init_timeout_seconds", "900"),
            (("compile.compiled_modules", 0),), (("compile.compiled_modules", POSITIVE),), "compile", 4.0),
    Factor("accum", ("1", "2"), "layout", args={"2": ("--training.gradient_accumulation_steps", "2")},
           label={"2": "accum_2"}, cost={"2": 0.5}),
    Factor("zero1", ("off", "on"), "layout", meets=("dp_shard", "cp", "tp", "pp", "ep"), needs=("dp_replicate",),
           args={"on": ("--optimizer.zero1",)},
           expect={"off": (("zero1", None),), "on": (("zero1", Check("shared over the replicas", lambda z: z is not None
                                                                     and z["replicas"] > 1)),)},
           label={"on": "zero1"}, cost={"on": 0.1}),
    Factor("cp_method", ("ring", "allgather"), "layout", meets=("dp_replicate", "dp_shard", "tp", "pp", "ep"),
           needs=("cp",), args={"allgather": ("--experimental.context_parallel_method", "allgather")},
           expect={"ring": (("cp.methods", ["ring"]),), "allgather": (("cp.methods", ["allgather"]),)},
           label={"allgather": "allgather"}),
    Factor("optimizer", ("adamw", "muon"), "numerics", args={"muon": ("--optimizer.name", "Muon")},
           # Rank 0's optimizers: under ZeRO-1 rank 0 may own no matrix (the embedding alone), so
           # Muon shows by its optimizer, not by its matrices.
           expect={"adamw": (("optimizer.names", _WITHOUT_MUON),), "muon": (("optimizer.names", _WITH_MUON),)},
           label={"muon": "muon"}, cost={"muon": 0.3}),
    Factor("state", ("fp32", "bf16"), "numerics", args={"bf16": ("--optimizer.state_dtype", "bfloat16")},
           expect={"fp32": (("optimizer.state_dtypes", ["float32"]),), "bf16": (("optimizer.state_dtypes", ["bfloat16"]),)},
           label={"bf16": "bf16_state"}, cost={"bf16": 0.1}),
    _on_off("chunked", "layout", ("--training.loss_chunk_size", str(LOSS_CHUNK)), (("chunked_loss", None),),
            (("chunked_loss.chunk_size", LOSS_CHUNK),), "chunked", 0.2),
    _on_off("offload", "layout", ("--activation_checkpoint.offload", "all"),
            (("activation_checkpoint.offloaded", _NO_OFFLOAD),), (("activation_checkpoint.offloaded", _OFFLOADED),),
            "offload", 0.3),
    # The dropping mode at a factor that drops a few percent of the matrix models' token choices.
    _on_off("capacity", "numerics", ("--moe.capacity_factor", "1.0"), (("moe.capacity_factor", 0.0),),
            (("moe.capacity_factor", 1.0),), "capacity", 0.1, models=_MOE),
    Factor("mtp", ("on", "off"), "model", models=("dsv3",), args={"off": ("--model.mtp_depth", "0")},
           expect={"off": (("mtp", None),)}, label={"off": "no_mtp"}),
    _on_off("docmask", "numerics", ("--training.document_mask",), (("data.document_mask", False),),
            (("data.document_mask", True),), "docmask", 0.2),
    _on_off("float8", "numerics", tuple(FLOAT8.split()), (("float8", None),), (("float8.linears", POSITIVE),),
            "float8", 0.5),
    _on_off("shuffle", "numerics", ("--training.dataset_shuffle",), (("data.shuffle", False),), (("data.shuffle", True),),
            "shuffle", 0.05),
    Factor("workers", ("0", "2"), "layout", args={"2": ("--training.dataset_num_workers", "2")},
           expect={"0": (("data.workers", 0),), "2": (("data.workers", 2),)}, label={"2": "workers2"}, cost={"2": 0.4}),
    # A checkpoint every 2 steps, and a second run resumed from step 2 that must repeat the rest bit for bit.
    _on_off("resume", "layout", ("--checkpoint.enable_checkpoint", "--checkpoint.interval", "2"), (), (), "resume", 0.7),
    # Two fault-tolerant replica groups of the point's ranks, joined by torchft (Layout.replica_groups).
    Factor("groups", ("off", "on"), "layout", max_ranks=GROUP_RANKS, label={"on": "groups2"}, cost={"on": 1.5}),
)
FACTOR = {f.name: f for f in FACTORS}
# Pairs of values no model offers (not refusals: there is nothing to run). DeepSeek-V3 and gpt-oss have
# no tied embeddings.
IMPOSSIBLE = (frozenset({("tied", "tied"), ("model", "dsv3")}), frozenset({("tied", "tied"), ("model", "gptoss")}))
RESUME_STEP = 2


def possible(variants: tuple[tuple[str, str], ...] | dict[str, str]) -> bool:
    chosen = set(dict(variants).items())
    return not any(pair <= chosen for pair in IMPOSSIBLE)


# The concrete schedules of each kind, used in turn so the full matrix runs each of them.
SCHEDULES = {"single": ("1F1B", "GPipe"), "interleaved": ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble"),
             "V": ("ZBVZeroBubble", "DualPipeV")}


@dataclass(frozen=True)
class Point:
    """One layout of the matrix: degrees, the value of every applicable factor, the concrete
    pipeline schedule, and whether the generator placed it to be refused."""

    degrees: Degrees
    variants: tuple[tuple[str, str], ...]  # (factor, value) for every factor that applies, in FACTORS order
    schedule: str = ""  # the concrete schedule when pp > 1
    refused_by_design: bool = field(default=False, compare=False)

    def value(self, factor: str) -> str | None:
        return dict(self.variants).get(factor)

    def on(self, factor: str) -> bool:
        """Whether `factor` exists here with another value than a plain run's."""
        value = self.value(factor)
        return value is not None and value != FACTOR[factor].values[0]

    @property
    def groups(self) -> int:
        return GROUPS if self.on("groups") else 1

    @property
    def nproc(self) -> int:
        """Processes the point trains with: its ranks, times its replica groups."""
        return self.degrees.nproc * self.groups

    @property
    def name(self) -> str:
        extras = [FACTOR[f].label[v] for f, v in self.variants if f != "schedule" and v in FACTOR[f].label]
        if self.schedule:
            extras.insert(0, self.schedule)
        return "+".join([self.degrees.name, *extras])

    @property
    def depth(self) -> int:
        """Blocks the model needs: one per pipeline stage, at least 2."""
        stages = self.degrees.pp * (2 if self.value("schedule") in ("interleaved", "V") else 1)
        return next(d for d in DEPTHS if d >= stages)

    @property
    def moe(self) -> bool:
        return self.value("model") in _MOE

    @property
    def dsv3(self) -> bool:
        return self.value("model") == "dsv3"

    @property
    def gptoss(self) -> bool:
        return self.value("model") == "gptoss"

    @property
    def mtp(self) -> bool:
        return self.dsv3 and self.value("mtp") == "on"

    @property
    def ep_degree(self) -> int:
        """Expert parallelism over every rank it can borrow: dp_shard x cp x tp."""
        d = self.degrees
        return d.dp_shard * d.cp * d.tp if self.moe else 1

    @property
    def active_dims(self) -> tuple[str, ...]:
        """The dims over 1, expert parallelism included."""
        return (*self.degrees.active, *(("ep",) if self.ep_degree > 1 else ()))

    @property
    def flavor(self) -> str:
        return flavor_name(self.depth, self.value("tied") == "tied", moe=self.moe, dsv3=self.dsv3, gptoss=self.gptoss)

    def _factor_args(self, kind: str) -> list[str]:
        return [a for f, v in self.variants if FACTOR[f].kind == kind for a in FACTOR[f].args.get(v, ())]

    def model_args(self) -> tuple[str, ...]:
        """Overrides that define the weights (the seed checkpoint uses them)."""
        name = (DSV3_MODEL_NAME if self.dsv3 else GPT_OSS_MODEL_NAME if self.gptoss else MOE_MODEL_NAME if self.moe
                else MODEL_NAME)
        return ("--experimental.custom_import", "tests.machinery.matrix_model", "--model.name", name,
                "--model.flavor", self.flavor, *self._factor_args("model"))

    def shared(self) -> tuple[str, ...]:
        """Overrides the one-process reference runs with: the model's and what changes its numerics."""
        return (*self.model_args(), *self._factor_args("numerics"))

    def overrides(self) -> tuple[str, ...]:
        args = [a for d in DIMS for a in (_OPTION[d], str(getattr(self.degrees, d)))]
        if self.moe:
            args += ["--training.expert_parallel_degree", str(self.ep_degree)]
        if self.schedule:
            args += ["--experimental.pipeline_parallel_schedule", self.schedule]
        return (*args, *self._factor_args("layout"))

    def expect(self) -> Expectations:
        """What the run's setup record must show, proving that the layout and every variant were
        applied: the mesh, each parallelism over its own dims, and each variant's mark."""
        d = self.degrees
        shard = d.dp_shard * d.cp
        expect: list[tuple[str, object]] = [("world_size", d.nproc), ("mesh", self.mesh()), ("model.flavor", self.flavor)]
        if shard > 1:  # FSDP over dp_shard x cp, HSDP with replicas
            mesh = {"dp_replicate": d.dp_replicate, "dp_shard_cp": shard} if d.over("dp_replicate") else {"dp_shard_cp": shard}
            expect += [("fsdp.mesh", mesh), ("ddp", None)]
        elif d.over("dp_replicate"):
            expect += [("fsdp", None), ("ddp.mesh", {"dp_replicate": d.dp_replicate})]
        else:
            expect += [("fsdp", None), ("ddp", None)]
        expect.append(("tp.mesh", {"tp": d.tp}) if d.over("tp") else ("tp", None))
        expect += [("cp.mesh", {"cp": d.cp}), ("cp.ring_attention_modules", POSITIVE)] if d.over("cp") else [("cp", None)]
        if self.schedule:
            stages = d.pp * (2 if self.value("schedule") in ("interleaved", "V") else 1)
            expect += [("pipeline.schedule", self.schedule), ("pipeline.stages", stages)]
        else:
            expect.append(("pipeline", None))
        if self.moe:
            ep_mesh = {"ep": self.ep_degree} if self.ep_degree > 1 else None
            expect += [("moe.ep_mesh", ep_mesh), ("moe.experts_per_rank", 8 // self.ep_degree)]
        else:
            expect.append(("moe", None))
        expect += [("mtp.depth", 1), ("mtp.ranks", self.mtp_ranks())] if self.mtp else [("mtp", None)]
        return tuple(expect + [e for f, v in self.variants for e in FACTOR[f].expect.get(v, ())])

    def mtp_ranks(self) -> list[int]:
        """The ranks that hold the MTP modules: the last pipeline stage's (pp rank 0 with a V
        schedule, whose stages fold back, else the last pp rank; pp is the mesh's outermost dim)."""
        per_stage = self.degrees.nproc // self.degrees.pp
        holder = 0 if self.value("schedule") == "V" else self.degrees.pp - 1
        return list(range(holder * per_stage, (holder + 1) * per_stage))

    def mesh(self) -> dict[str, int]:
        """The world mesh the setup record shows: under expert parallelism dp_shard is split in two."""
        mesh = self.degrees.mesh()
        if self.ep_degree == 1:
            return mesh
        d = self.degrees
        in_ep = self.ep_degree // (d.cp * d.tp)
        split = {"dp_shard_mod_ep": d.dp_shard // in_ep, "dp_shard_in_ep": in_ep}
        order = ("pp", "dp_replicate", "dp_shard_mod_ep", "dp_shard_in_ep", "cp", "tp")
        sizes = {**{k: v for k, v in mesh.items() if k != "dp_shard"}, **split}
        return {k: sizes[k] for k in order if k in sizes}

    def layout(self) -> Layout:
        return Layout(self.name, self.degrees.nproc, (*self.overrides(), *self.audit()), self.expect(), self.shared(),
                      loss_tolerance=FLOAT8_SPLIT_TOLERANCE if self.on("float8") else None,
                      grad_norm_rtol=FLOAT8_GRAD_NORM_RTOL if self.on("float8") else None, model=self.model_args(),
                      replica_groups=self.groups)

    def audit(self) -> tuple[str, ...]:
        """Every eager point also counts its host reads (profiling.audit_host_reads, which compile
        refuses), but for replica groups, whose step reads the groups' verdict on the host."""
        return () if self.on("compile") or self.on("groups") else ("--profiling.audit_host_reads",)

    def eager(self) -> Point:
        """This point with compile off."""
        return dataclasses.replace(self, variants=tuple((f, "off" if f == "compile" else v) for f, v in self.variants))


def make_point(variants: dict[str, str], **degrees: int) -> Point:
    """A point with the given degrees and factor values, every other applicable factor at its default."""
    d = Degrees(**degrees)
    model = variants.get("model", "dense")
    values = tuple((f.name, variants.get(f.name, f.values[0])) for f in FACTORS if f.applies(d, model))
    kind = dict(values).get("schedule")
    return Point(d, values, SCHEDULES[kind][0] if kind else "")


def cost(point: Point) -> float:
    """Relative price of a point on a small CPU: per rank, compile costs most; the other factors'
    values a little each (`Factor.cost`); deeper (multi-stage) models a little more."""
    per_rank = 1 + 0.3 * (point.depth > 2) + sum(FACTOR[f].cost.get(v, 0.0) for f, v in point.variants)
    return point.nproc * per_rank
