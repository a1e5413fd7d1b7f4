"""The layout matrix: every parallel layout up to 8 ranks, with its variants, proven or refused.

Test machinery (the test suite's and `scripts/loss_compare.py --suite matrix`'s), built on the
product's parity harness (torchtitan/tools/parity.py).

Hand-picked parity layouts miss the combinations nobody thought of, so the layout space is
generated instead:

1. **Base points**: every assignment of power-of-two degrees (dp_replicate, dp_shard, cp, tp, pp)
   whose product is 1, 2, 4 or 8 (56 points).
2. **Variants** that change how a layout runs (`FACTORS`: pipeline schedule kind, sequence and
   loss parallelism, activation checkpointing, compile, tied embeddings, gradient accumulation,
   ZeRO-1, and the model: dense, Qwen3-MoE or DeepSeek-V3 with expert parallelism)
   are placed on the base points greedily, as a pairwise covering rather than the full product:
   each value of each variant must meet every parallel dim it interacts with at least once
   (weight 10), the known holes in `NAMED_GOALS` must be met (weight 10), and every pair of
   variant values (weight 1) meets on some point: on a base point where one has room, else on a
   small extra point (a pair no model offers, `IMPOSSIBLE`, is neither placed nor required).
   Expensive values (compile, accumulation,
   more blocks) cost in proportion to the ranks they run on, so they land on small points.
   A placement the product refuses is never chosen for a base point; a goal that only refused
   placements can meet gets a point of its own (for a pair of variants, only then), which must
   then be refused.
3. **Outcomes**: a point is either refused before any process starts (the same `preflight` every
   rank runs before joining the process group, so the refusal is one `ConfigError` line) or
   trained 10 steps from a seed checkpoint with the global batch of one process, and its losses
   compared (parity.py). There is no third outcome: a crash, hang or divergence is a bug.

Runs use the `llama3_matrix` model (matrix_model.py), or its MoE twins `qwen3_moe_matrix` and
`deepseek_v3_matrix` on the MoE variant's points, as deep as each point's pipeline needs.
`ci_points()` is the subset the test suite runs (every point up to 4 ranks and at least 12
8-rank points covering every pair of dims); `scripts/loss_compare.py --suite matrix` runs all.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable

from tests.machinery.matrix_model import DEPTHS, DSV3_MODEL_NAME, MODEL_NAME, MOE_MODEL_NAME, flavor_name
from tests.machinery.tiny_run import TINY_RUN
from torchtitan.tools.parity import (
    COMPARISON_ARGS,
    POSITIVE,
    Check,
    Comparison,
    Expectations,
    Layout,
    ParityError,
    ParityHarness,
)
from torchtitan.tools.runs import Runner, TrainingFailed, run_trainer

DIMS = ("dp_replicate", "dp_shard", "cp", "tp", "pp")
_SHORT = {"dp_replicate": "rep", "dp_shard": "fsdp", "cp": "cp", "tp": "tp", "pp": "pp"}
_OPTION = {"dp_replicate": "--training.data_parallel_replicate_degree", "dp_shard": "--training.data_parallel_shard_degree",
           "cp": "--experimental.context_parallel_degree", "tp": "--training.tensor_parallel_degree",
           "pp": "--experimental.pipeline_parallel_degree"}
# The mesh's dim order (outermost first), as ParallelDims logs it.
_MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
WORLD_SIZES = (1, 2, 4, 8)
GLOBAL_BATCH, DATASET_SHARDS = 16, 8  # divisible by every data-parallel degree x accumulation up to 8 x 2
CI_EIGHT_RANK_POINTS = 12


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
    """A variant of how a layout runs. `values[0]` is what a plain run does; `applies` says on
    which degrees the variant exists at all; each value must meet every dim in `meets`. `args`
    are the overrides of each value, `expect` what a run's setup record must show with it."""

    name: str
    values: tuple[str, ...]
    applies: Callable[[Degrees], bool]
    meets: tuple[str, ...]
    args: dict[str, tuple[str, ...]] = field(default_factory=dict)
    expect: dict[str, Expectations] = field(default_factory=dict)


def _even_blocks(ac: dict) -> list[str]:
    return [b for b in ac["blocks"] if int(b.rsplit(".", 1)[1]) % 2 == 0]


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


_AC = "--activation_checkpoint.mode"
_SAC = "--activation_checkpoint.selective_ac_option"
FACTORS = (
    # Single-stage (1F1B, GPipe), multi-stage round-robin (Interleaved1F1B, ...) or V-shaped stages;
    # the concrete schedule is the point's own (Point.schedule).
    Factor("schedule", ("single", "interleaved", "V"), lambda d: d.pp > 1, ("dp_replicate", "dp_shard", "cp", "tp")),
    Factor("sp", ("on", "off"), lambda d: d.tp > 1, ("dp_replicate", "dp_shard", "cp", "pp"),
           {"off": ("--training.disable_sequence_parallel",)},
           {"on": (("tp.sequence_parallel", True),), "off": (("tp.sequence_parallel", False),)}),
    Factor("lp", ("on", "off"), lambda d: d.tp > 1, ("dp_replicate", "dp_shard", "cp", "pp"),  # loss parallel
           {"off": ("--training.disable_loss_parallel",)},
           {"on": (("tp.loss_parallel", True),), "off": (("tp.loss_parallel", False),)}),
    Factor("ac", ("none", "full", "selective", "op"), lambda d: True, DIMS,
           {"full": (_AC, "full"), "selective": (_AC, "selective", _SAC, "2"), "op": (_AC, "selective", _SAC, "op")},
           {v: (("activation_checkpoint", check),) for v, check in _AC_APPLIED.items()}),
    Factor("compile", ("off", "on"), lambda d: True, DIMS,
           {"on": ("--training.compile",)},
           {"off": (("compile.compiled_modules", 0),), "on": (("compile.compiled_modules", POSITIVE),)}),
    Factor("tied", ("untied", "tied"), lambda d: True, DIMS),  # a model flavor: Point.shared()
    Factor("accum", ("1", "2"), lambda d: True, DIMS, {"2": ("--training.gradient_accumulation_steps", "2")}),
    # A mixture-of-experts model with its experts split over every rank expert parallelism can borrow
    # (dp_shard x cp x tp; Point.ep_degree): matrix_model's qwen3_moe_matrix ("ep") or
    # deepseek_v3_matrix ("dsv3": latent attention, a dense first block, shared experts, MTP).
    Factor("moe", ("dense", "ep", "dsv3"), lambda d: d.dp_shard * d.cp * d.tp > 1, DIMS),
    Factor("zero1", ("off", "on"), lambda d: d.dp_replicate > 1, ("dp_shard", "cp", "tp", "pp"),
           {"on": ("--optimizer.zero1",)},
           {"off": (("zero1", None),), "on": (("zero1", Check("shared over the replicas", lambda z: z is not None
                                                               and z["replicas"] > 1)),)}),
)
_FACTOR = {f.name: f for f in FACTORS}
# Pairs of variant values no model offers (not refusals: there is nothing to run). DeepSeek-V3 has
# no tied embeddings.
IMPOSSIBLE = (frozenset({("tied", "tied"), ("moe", "dsv3")}),)


def possible(variants: tuple[tuple[str, str], ...] | dict[str, str]) -> bool:
    chosen = set(dict(variants).items())
    return not any(pair <= chosen for pair in IMPOSSIBLE)

# The concrete schedules of each kind, used in turn so the full matrix runs each of them.
SCHEDULES = {"single": ("1F1B", "GPipe"), "interleaved": ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble"),
             "V": ("ZBVZeroBubble", "DualPipeV")}


@dataclass(frozen=True)
class Point:
    """One layout of the matrix: degrees, the value of every applicable variant, the concrete
    pipeline schedule, and whether the generator placed it to be refused."""

    degrees: Degrees
    variants: tuple[tuple[str, str], ...]  # (factor, value) for every factor that applies, in FACTORS order
    schedule: str = ""  # the concrete schedule when pp > 1
    refused_by_design: bool = field(default=False, compare=False)

    def value(self, factor: str) -> str | None:
        return dict(self.variants).get(factor)

    @property
    def nproc(self) -> int:
        return self.degrees.nproc

    @property
    def name(self) -> str:
        extras = [f"{f}_{v}" if f in ("ac", "accum", "sp", "lp") else v if (f, v) == ("moe", "dsv3") else f
                  for f, v in self.variants if v != _FACTOR[f].values[0] and f != "schedule"]
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
        return self.value("moe") in ("ep", "dsv3")

    @property
    def dsv3(self) -> bool:
        return self.value("moe") == "dsv3"

    @property
    def mtp(self) -> bool:
        """DeepSeek-V3 predicts further tokens (one MTP module), except under context parallelism,
        which refuses it."""
        return self.dsv3 and not self.degrees.over("cp")

    @property
    def ep_degree(self) -> int:
        """Expert parallelism over every rank it can borrow: dp_shard x cp x tp."""
        d = self.degrees
        return d.dp_shard * d.cp * d.tp if self.moe else 1

    @property
    def flavor(self) -> str:
        return flavor_name(self.depth, self.value("tied") == "tied", moe=self.moe, dsv3=self.dsv3)

    def shared(self) -> tuple[str, ...]:
        """Overrides that define the model (the seed checkpoint and the baseline use them too)."""
        name = DSV3_MODEL_NAME if self.dsv3 else MOE_MODEL_NAME if self.moe else MODEL_NAME
        no_mtp = ("--model.mtp_depth", "0") if self.dsv3 and not self.mtp else ()
        return ("--experimental.custom_import", "tests.machinery.matrix_model", "--model.name", name,
                "--model.flavor", self.flavor, *no_mtp)

    def overrides(self) -> tuple[str, ...]:
        args = [a for d in DIMS for a in (_OPTION[d], str(getattr(self.degrees, d)))]
        if self.moe:
            args += ["--training.expert_parallel_degree", str(self.ep_degree)]
        if self.schedule:
            args += ["--experimental.pipeline_parallel_schedule", self.schedule]
        for f, v in self.variants:
            args += _FACTOR[f].args.get(v, ())
        return tuple(args)

    def expect(self) -> Expectations:
        """What the run's setup record must show, proving that the layout and every variant were
        applied: the mesh, each parallelism over its own dims, and each variant's mark."""
        d = self.degrees
        shard = d.dp_shard * d.cp
        expect: list[tuple[str, object]] = [("world_size", self.nproc), ("mesh", self.mesh()), ("model.flavor", self.flavor)]
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
            expect += [("moe.ep_mesh", {"ep": self.ep_degree}), ("moe.experts_per_rank", 8 // self.ep_degree)]
        else:
            expect.append(("moe", None))
        expect += [("mtp.depth", 1), ("mtp.ranks", self.mtp_ranks())] if self.mtp else [("mtp", None)]
        return tuple(expect + [e for f, v in self.variants for e in _FACTOR[f].expect.get(v, ())])

    def mtp_ranks(self) -> list[int]:
        """The ranks that hold the MTP modules: the last pipeline stage's (pp rank 0 with a V
        schedule, whose stages fold back, else the last pp rank; pp is the mesh's outermost dim)."""
        per_stage = self.nproc // self.degrees.pp
        holder = 0 if self.value("schedule") == "V" else self.degrees.pp - 1
        return list(range(holder * per_stage, (holder + 1) * per_stage))

    def mesh(self) -> dict[str, int]:
        """The world mesh the setup record shows: under expert parallelism dp_shard is split in two."""
        mesh = self.degrees.mesh()
        if not self.moe:
            return mesh
        d = self.degrees
        in_ep = self.ep_degree // (d.cp * d.tp)
        split = {"dp_shard_mod_ep": d.dp_shard // in_ep, "dp_shard_in_ep": in_ep}
        order = ("pp", "dp_replicate", "dp_shard_mod_ep", "dp_shard_in_ep", "cp", "tp")
        sizes = {**{k: v for k, v in mesh.items() if k != "dp_shard"}, **split}
        return {k: sizes[k] for k in order if k in sizes}

    def layout(self) -> Layout:
        return Layout(self.name, self.nproc, (*self.overrides(), *self.audit()), self.expect(), self.shared())

    def audit(self) -> tuple[str, ...]:
        """Every eager point also counts its host reads (profiling.audit_host_reads, which compile refuses)."""
        return () if self.value("compile") == "on" else ("--profiling.audit_host_reads",)


# ------------------------------------------------------------------------------------------------
# What the placement must achieve


@dataclass(frozen=True)
class Goal:
    text: str
    weight: int
    met_by: Callable[[Point], bool]
    witness: Point | None = None  # a point that meets it on its own, if the base points do not


def _point(variants: dict[str, str], **degrees: int) -> Point:
    """A point with the given degrees and variant values, every other applicable variant at its default."""
    d = Degrees(**degrees)
    values = tuple((f.name, variants.get(f.name, f.values[0])) for f in FACTORS if f.applies(d))
    kind = dict(values).get("schedule")
    return Point(d, values, SCHEDULES[kind][0] if kind else "")


# Combinations that broke or were untested before (issue 15), required by name.
NAMED_GOALS = (
    Goal("replicate x context parallel (the KeyError report)", 10,
         lambda p: p.degrees == Degrees(dp_replicate=2, cp=2), _point({}, dp_replicate=2, cp=2)),
    Goal("HSDP x context parallel (its 8-rank sibling)", 10,
         lambda p: p.degrees == Degrees(dp_replicate=2, dp_shard=2, cp=2), _point({}, dp_replicate=2, dp_shard=2, cp=2)),
    Goal("HSDP x TP x CP", 10, lambda p: all(p.degrees.over(d) for d in ("dp_replicate", "tp", "cp")),
         _point({}, dp_replicate=2, tp=2, cp=2)),
    Goal("tied embeddings under PP with more than 2 pipeline ranks", 10,
         lambda p: p.value("tied") == "tied" and p.degrees.pp > 2, _point({"tied": "tied"}, pp=4)),
    Goal("tied embeddings under PP x TP", 10,
         lambda p: p.value("tied") == "tied" and p.degrees.over("pp") and p.degrees.over("tp"),
         _point({"tied": "tied"}, pp=2, tp=2)),
    Goal("PP x CP with a V schedule", 10, lambda p: p.value("schedule") == "V" and p.degrees.over("cp"),
         _point({"schedule": "V"}, pp=2, cp=2)),
    Goal("compile under plain DDP (dynamo's DDP optimizer)", 10,
         lambda p: p.value("compile") == "on" and p.degrees.active == ("dp_replicate",), _point({"compile": "on"}, dp_replicate=2)),
)


def _witness_degrees(*factors: Factor, dim: str | None = None) -> dict[str, int]:
    """The smallest degrees on which every one of `factors` applies (and `dim` > 1)."""
    needs = {"schedule": "pp", "sp": "tp", "zero1": "dp_replicate", "moe": "dp_shard"}
    return {d: 2 for d in {dim, *(needs.get(f.name) for f in factors)} if d}


def coverage_goals() -> list[Goal]:
    goals = list(NAMED_GOALS)
    for f in FACTORS:
        for value in f.values:
            for dim in f.meets:
                goals.append(Goal(f"{f.name} {value} with {dim}", 10,
                                  lambda p, f=f.name, v=value, d=dim: p.value(f) == v and p.degrees.over(d),
                                  _point({f.name: value}, **_witness_degrees(f, dim=dim))))
    for f1, f2 in itertools.combinations(FACTORS, 2):
        for v1, v2 in itertools.product(f1.values, f2.values):
            if (v1 != f1.values[0] or v2 != f2.values[0]) and possible({f1.name: v1, f2.name: v2}):
                goals.append(Goal(f"{f1.name} {v1} with {f2.name} {v2}", 1,
                                  lambda p, a=(f1.name, v1), b=(f2.name, v2): p.value(a[0]) == a[1] and p.value(b[0]) == b[1],
                                  _point({f1.name: v1, f2.name: v2}, **_witness_degrees(f1, f2))))
    return goals


def cost(point: Point) -> float:
    """Relative price of a point on a small CPU: per rank, compile costs most; accumulation,
    activation checkpointing and deeper (multi-stage) models a little."""
    v = point.value
    per_rank = (1 + 4 * (v("compile") == "on") + 0.5 * (v("accum") == "2") + 0.5 * (v("ac") != "none")
                + 0.3 * (point.depth > 2) + 0.1 * (v("tied") == "tied") + 0.1 * (v("zero1") == "on")
                + 0.3 * (v("moe") == "ep") + 0.6 * (v("moe") == "dsv3"))
    return point.nproc * per_rank


# ------------------------------------------------------------------------------------------------
# Judging a point without starting it


def _config_args(point: Point) -> list[str]:
    dp = point.degrees.dp_replicate * point.degrees.dp_shard * int(point.value("accum"))
    return [*TINY_RUN, *COMPARISON_ARGS, "--training.dataset_shards", str(DATASET_SHARDS),
            "--training.batch_size", str(GLOBAL_BATCH // dp), *point.shared(), *point.overrides()]


@lru_cache(maxsize=None)
def refusal(point: Point) -> str | None:
    """The one-line reason the trainer refuses `point` before any process group exists, or None.
    Runs the trainer's own preflight in this process."""
    from torchtitan.config.manager import parse_args
    from torchtitan.config.preflight import preflight
    from torchtitan.errors import UserError

    try:
        preflight(parse_args(_config_args(point)), point.nproc)
    except UserError as e:
        return str(e)
    return None


# ------------------------------------------------------------------------------------------------
# Generation


def _candidates(degrees: Degrees, turn: dict[str, int]) -> list[Point]:
    applicable = [f for f in FACTORS if f.applies(degrees)]
    points = []
    for values in itertools.product(*(f.values for f in applicable)):
        variants = tuple(zip((f.name for f in applicable), values))
        if not possible(variants):
            continue
        kind = dict(variants).get("schedule")
        schedule = SCHEDULES[kind][turn[kind] % len(SCHEDULES[kind])] if kind else ""
        points.append(Point(degrees, variants, schedule))
    return points


@lru_cache(maxsize=None)
def generate(world_sizes: tuple[int, ...] = WORLD_SIZES) -> tuple[Point, ...]:
    """The whole matrix: one point per base assignment of degrees, small extra points for pairs of
    variant values the base points left apart, then one point for each required goal still open
    (parity-tested if the product accepts it, else refused) and for each refused pair."""
    goals = coverage_goals()
    open_goals = list(goals)
    turn = dict.fromkeys(SCHEDULES, 0)
    points: list[Point] = []

    def gain(p: Point) -> int:
        return sum(g.weight for g in open_goals if g.met_by(p))

    def take(p: Point) -> None:
        points.append(p)
        open_goals[:] = [g for g in open_goals if not g.met_by(p)]
        if p.schedule:
            turn[p.value("schedule")] += 1

    for degrees in all_degrees(world_sizes):
        ranked = sorted(_candidates(degrees, turn), key=lambda p: cost(p) - gain(p))
        chosen = next((p for p in ranked if refusal(p) is None), None)
        if chosen is None:  # every variant of these degrees is refused: the plain one stands for them
            chosen = _point({}, **{d: getattr(degrees, d) for d in DIMS})
            chosen = Point(chosen.degrees, chosen.variants, chosen.schedule, refused_by_design=True)
        take(chosen)
    # Pairs of variant values the base points left apart: small extra points on the fewest degrees
    # that carry both, each chosen to bring together as many open pairs as it can.
    pair_degrees = sorted({g.witness.degrees for g in open_goals if g.weight < 10}, key=lambda d: (d.nproc, d))
    while True:
        ranked = sorted((p for d in pair_degrees for p in _candidates(d, turn) if gain(p) > 0),
                        key=lambda p: (-gain(p), cost(p)))
        chosen = next((p for p in ranked if refusal(p) is None), None)
        if chosen is None:
            break
        take(chosen)
    # Goals no point met yet: a point of their own. A required goal gets one whatever its outcome;
    # a pair of variants only when the product refuses the pair (so that the refusal is shown).
    for goal in list(open_goals):
        w = goal.witness
        if goal not in open_goals or w is None or w.nproc not in world_sizes:
            continue
        refused = refusal(w) is not None
        if goal.weight >= 10 or refused:
            take(Point(w.degrees, w.variants, w.schedule, refused_by_design=refused))
    return tuple(points)


def uncovered_goals(points: tuple[Point, ...] | list[Point], weight: int = 10) -> list[str]:
    """Goals of at least `weight` that no point meets."""
    return [g.text for g in coverage_goals() if g.weight >= weight and not any(g.met_by(p) for p in points)]


def ci_points(points: tuple[Point, ...] | None = None) -> list[Point]:
    """What the test suite runs: every point of up to 4 ranks, and the 8-rank points chosen greedily
    to cover every pair of dims (then triples, then variant goals the small points left open),
    at least CI_EIGHT_RANK_POINTS of them; compiled only where a goal needs it (`_compile_sparingly`)."""
    points = generate() if points is None else points
    chosen = [p for p in points if p.nproc <= 4]
    eight = [p for p in points if p.nproc == 8]
    pairs = {frozenset(c) for c in itertools.combinations(DIMS, 2)}
    triples = {frozenset(c) for c in itertools.combinations(DIMS, 3)}
    variant_goals = [g for g in coverage_goals() if g.weight >= 10 and not any(g.met_by(p) for p in chosen)]

    def gain(p: Point) -> float:
        active = set(p.degrees.active)
        return (100 * sum(s <= active for s in pairs) + 10 * sum(s <= active for s in triples)
                + sum(g.met_by(p) for g in variant_goals) - 0.01 * cost(p))

    def goals_left() -> bool:  # variant goals only 8-rank points can still meet
        return any(g.met_by(p) for g in variant_goals for p in eight)

    picked: list[Point] = []
    while eight and (pairs or len(picked) < CI_EIGHT_RANK_POINTS or goals_left()):
        best = max(eight, key=gain)
        eight.remove(best)
        picked.append(best)
        active = set(best.degrees.active)
        pairs = {s for s in pairs if not s <= active}
        triples = {s for s in triples if not s <= active}
        variant_goals = [g for g in variant_goals if not g.met_by(best)]
    return _compile_sparingly(chosen + picked)


def _compile_sparingly(points: list[Point]) -> list[Point]:
    """`points` with compile kept on the cheapest set of trained points that still meets every
    goal of weight 10 the points met (compile with every dim, under plain DDP, ...), and off on the
    rest: on a small CPU a compiled point costs 5-10 times an eager one (inductor's C++ build,
    DTensor tracing under TP), and the full matrix (loss_compare.py --suite matrix) runs every
    compiled point as generated. Refused points keep compile: their refusal is what they show."""
    compiled = [p for p in points if p.value("compile") == "on" and not p.refused_by_design]
    goals = [g for g in coverage_goals() if g.weight >= 10]

    def met(group: list[Point]) -> set[str]:
        return {g.text for g in goals if any(g.met_by(p) for p in group)}

    def eager(p: Point) -> Point:
        return dataclasses.replace(p, variants=tuple((f, "off" if f == "compile" else v) for f, v in p.variants))

    # Every subset of the few compiled points, cheapest first; of equal cost, less TP (tracing
    # DTensor code is compile's dearest part on a CPU).
    subsets = sorted((g for n in range(len(compiled) + 1) for g in itertools.combinations(compiled, n)),
                     key=lambda g: (sum(cost(p) for p in g), sum(p.degrees.tp for p in g)))
    wanted = met(points)
    for keep in subsets:
        candidate = [eager(p) if p in compiled and p not in keep else p for p in points]
        if met(candidate) >= wanted:
            return candidate
    return points


# ------------------------------------------------------------------------------------------------
# Running


@dataclass
class Outcome:
    point: Point
    status: str  # "ok", "FAIL" (trained, outside the tolerance), "refused", or "error" (crashed or not applied)
    comparison: Comparison | None = None
    detail: str = ""  # the refusal line, or what went wrong


class MatrixRunner:
    """Judges points: refused by the preflight, or trained and compared with one process."""

    def __init__(self, workdir: Path, steps: int = 10, timeout: int = 400, runner: Runner = run_trainer):
        self.harness = ParityHarness(workdir, steps=steps, global_batch=GLOBAL_BATCH, dataset_shards=DATASET_SHARDS,
                                     timeout=timeout, runner=runner, base_args=TINY_RUN)

    def run(self, point: Point) -> Outcome:
        reason = refusal(point)
        if reason is not None:
            return Outcome(point, "refused", detail=reason)
        try:
            c = self.harness.compare(point.layout())
        except (ParityError, TrainingFailed) as e:
            return Outcome(point, "error", detail=str(e)[-3000:])
        ok = c.max_loss_diff <= self.harness.loss_tolerance and c.grad_norm_rel_diff <= self.harness.grad_norm_rtol
        return Outcome(point, "ok" if ok else "FAIL", c)

    def check(self, point: Point) -> Outcome:
        """Runs `point` and raises ParityError unless it had the outcome the generator planned."""
        outcome = self.run(point)
        expected = "refused" if point.refused_by_design else "ok"
        if outcome.status != expected:
            c = outcome.comparison
            numbers = f" (max |loss diff| {c.max_loss_diff:.3e}, grad norm {c.grad_norm_rel_diff:.3e})" if c else ""
            raise ParityError(f"{point.name}: expected {expected}, got {outcome.status}{numbers}: {outcome.detail}")
        return outcome
