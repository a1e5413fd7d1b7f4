"""The layout matrix: every parallel layout up to 8 ranks, with the variants of how it runs and the
features a run can switch on, placed pairwise, each point proven or refused.

Test machinery (the test suite's and `scripts/loss_compare.py --suite matrix`'s), built on the
product's parity harness (torchtitan/tools/parity.py). What is varied, and what one point is,
lives in matrix_space.py.

Hand-picked layouts and one-feature-at-a-time tests miss the combinations nobody thought of, so
the space is generated instead:

1. **Base points**: every assignment of power-of-two degrees (dp_replicate, dp_shard, cp, tp, pp)
   whose product is 1, 2, 4 or 8 (56 points).
2. **Values placed by an all-pairs covering** (the greedy construction of AETG): each point's
   factor values are chosen one factor at a time, the model first, to meet the most open goals
   for their price: every value of every factor must meet every parallel dim it can run beside
   (weight 10), the combinations that broke before (`NAMED_GOALS`, weight 10), and every pair of
   values of two factors (weight 1). Expensive values (compile, replica groups, resuming, more
   ranks) land on small points; a new one-process reference (another optimizer, data order, ...)
   costs its run. A candidate the product refuses is never chosen; goals the base points left
   open get small extra points on the fewest degrees that carry them.
3. **Refusals**: a goal no accepted point can meet gets a point of its own made of just its
   values, which the product must refuse before any process starts (the rules registry, through
   the same `preflight` every rank runs): one line, counted in the matrix's table.
4. **Outcomes**: a trained point runs a few steps from a seed checkpoint with the global batch of
   one process, and its losses (the replica groups' mean) must match a one-process run with the
   same model and numerics (parity.py); a point that resumes trains again from its own checkpoint
   of step 2 and must repeat the later losses bit for bit. There is no third outcome: a crash,
   hang or divergence is a bug.

`ci_points()` is the subset the test suite runs: the cheapest set of trained points found
greedily that still meets every goal the whole matrix meets (every pair included), every refused
point (an in-process check), with compile kept only where a goal needs it.
`scripts/loss_compare.py --suite matrix` runs all of it.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from tests.machinery.matrix_space import (
    ALL_DIMS,
    DIMS,
    FACTORS,
    RESUME_STEP,
    SCHEDULES,
    WORLD_SIZES,
    Degrees,
    Point,
    all_degrees,
    cost,
    make_point,
)
from tests.machinery.pairwise import Goal, OpenGoals, construct, learn_conflict, make_goal
from tests.machinery.tiny_run import TINY_RUN
from torchtitan.tools.parity import COMPARISON_ARGS, Comparison, ParityError, ParityHarness
from torchtitan.tools.runs import Runner, TrainingFailed, run_trainer

__all__ = ["ALL_DIMS", "DIMS", "FACTORS", "SCHEDULES", "WORLD_SIZES", "Degrees", "MatrixRunner", "Outcome", "Point",
           "Goal", "all_degrees", "ci_points", "coverage_goals", "fast_points", "generate", "make_point", "refusal",
           "uncovered_goals"]

GLOBAL_BATCH, DATASET_SHARDS = 16, 8  # divisible by every data-parallel degree x accumulation (x groups) up to 16
CANDIDATES = 12  # constructions tried per point
# What the test suite's subset may cost in all (matrix_space.cost units: about one eager rank of the
# tiny model each); the required goals are met whatever it costs (173.6 units, 18 points). 200 adds
# the 6 points that meet the most pairs per cost and keeps the matrix's share of the suite near 2.5
# minutes on 2 cores (300 took 3.7); docs/parity.md says how the subset is chosen.
CI_BUDGET = 200.0


# ------------------------------------------------------------------------------------------------
# What the placement must achieve


def _named(text: str, values: dict[str, str], **degrees: int) -> Goal:
    d = Degrees(**degrees)
    goal = make_goal(text, 10, values, degrees=degrees)
    assert goal is not None, text
    return dataclasses.replace(goal, met_by=lambda p, g=goal: p.degrees == d and g.met_by(p), named=True)


# Combinations that broke or were untested before, required by name: issue 15's layouts, issue 52's
# crashes (all-gather CP under compile; replica groups sharded inside), and issue 56's multi-token
# prediction under context parallelism (refused before).
NAMED_GOALS = (
    _named("replicate x context parallel (the KeyError report)", {}, dp_replicate=2, cp=2),
    _named("HSDP x context parallel (its 8-rank sibling)", {}, dp_replicate=2, dp_shard=2, cp=2),
    _named("HSDP x TP x CP", {}, dp_replicate=2, tp=2, cp=2),
    _named("tied embeddings under PP with more than 2 pipeline ranks", {"tied": "tied"}, pp=4),
    _named("tied embeddings under PP x TP", {"tied": "tied"}, pp=2, tp=2),
    _named("PP x CP with a V schedule", {"schedule": "V"}, pp=2, cp=2),
    _named("compile under plain DDP (dynamo's DDP optimizer)", {"compile": "on"}, dp_replicate=2),
    _named("all-gather context parallelism compiled (issue 52)", {"cp_method": "allgather", "compile": "on"}, cp=2),
    _named("all-gather CP with document masks, compiled (docs/context_parallel.md)",
           {"cp_method": "allgather", "compile": "on", "docmask": "on"}, cp=2),
    _named("replica groups with FSDP inside (issue 52)", {"groups": "on"}, dp_shard=2),
    _named("replica groups with TP inside (issue 52)", {"groups": "on"}, tp=2),
    _named("multi-token prediction under context parallelism, on the last pipeline stage (issue 56)",
           {"model": "dsv3", "mtp": "on"}, cp=2, pp=2),
)


@lru_cache(maxsize=None)
def coverage_goals() -> tuple[Goal, ...]:
    """Every goal: named ones, each value with each dim it meets, and every pair of values (at least
    one of them not a plain run's) that some point can hold."""
    goals = list(NAMED_GOALS)
    for f in FACTORS:
        for value, dim in itertools.product(f.values, f.meets):
            goal = make_goal(f"{f.name} {value} with {dim}", 10, {f.name: value}, (dim,))
            goals += [goal] if goal else []
    for f1, f2 in itertools.combinations(FACTORS, 2):
        for v1, v2 in itertools.product(f1.values, f2.values):
            if v1 != f1.values[0] or v2 != f2.values[0]:
                goal = make_goal(f"{f1.name} {v1} with {f2.name} {v2}", 1, {f1.name: v1, f2.name: v2})
                goals += [goal] if goal else []
    return tuple(goals)


def uncovered_goals(points, weight: int = 10) -> list[str]:
    """Goals of at least `weight` that no point meets."""
    return [g.text for g in coverage_goals() if g.weight >= weight and not any(g.met_by(p) for p in points)]


# ------------------------------------------------------------------------------------------------
# Judging a point without starting it


def config_args(point: Point) -> list[str]:
    dp = point.degrees.dp_replicate * point.degrees.dp_shard * int(point.value("accum")) * point.groups
    args = [*TINY_RUN, *COMPARISON_ARGS, "--training.dataset_shards", str(DATASET_SHARDS),
            "--training.batch_size", str(GLOBAL_BATCH // dp), *point.shared(), *point.overrides()]
    if point.on("groups"):  # a lighthouse address is all the refusal needs; nothing is started
        args += ["--fault_tolerance.enable", "--fault_tolerance.group_size", "2", "--fault_tolerance.min_replica_size",
                 "2", "--fault_tolerance.lighthouse", "localhost:29510"]
    return args


@lru_cache(maxsize=None)
def refusal(point: Point) -> str | None:
    """The one-line reason the trainer refuses `point` before any process group exists, or None.
    Runs the trainer's own preflight in this process."""
    from torchtitan.config.manager import parse_args
    from torchtitan.config.preflight import preflight
    from torchtitan.errors import UserError

    try:
        config = parse_args(config_args(point))
        preflight(config, point.degrees.nproc, tokenizer=_tokenizer(config.model.tokenizer_path))
    except UserError as e:
        return str(e)
    return None


@lru_cache(maxsize=None)
def _tokenizer(path: str):
    """Every point reads the debug job's tokenizer: built once, not once per judged point."""
    from torchtitan.config.manager import parse_args
    from torchtitan.datasets.tokenizer import build_tokenizer

    return build_tokenizer(parse_args(["--model.tokenizer_path", path]))


# ------------------------------------------------------------------------------------------------
# Generation


@lru_cache(maxsize=None)
def generate(world_sizes: tuple[int, ...] = WORLD_SIZES) -> tuple[Point, ...]:
    """The whole matrix: one point per base assignment of degrees, small extra points for goals the
    base points left open, then a refused point for each goal only a refused point can hold."""
    rng = random.Random(0)
    state = OpenGoals(coverage_goals())
    turn = dict.fromkeys(SCHEDULES, 0)
    points: list[Point] = []

    def take(p: Point) -> None:
        points.append(p)
        state.take(p)
        if p.schedule:
            turn[p.value("schedule")] += 1

    def best(degrees: Degrees, starts: list[dict[str, str]], must: Goal | None = None) -> Point | None:
        """The accepted candidate that meets the most open goals for its price (and `must`)."""
        candidates = {c for start in starts for c in [construct(degrees, start, state, rng, turn)]
                      if c is not None and (must is None or must.met_by(c))}
        ranked = sorted(candidates, key=lambda p: (state.price(p) - state.gain(p), p.name))
        for p in ranked:
            if state.known_refused(p):
                continue
            reason = refusal(p)
            if reason is None:
                return p
            state.conflicts.append(learn_conflict(p, reason, refusal))
        return None

    for degrees in all_degrees(world_sizes):
        fitting = [g.start for g in state.goals
                   if g.witness is not None and set(g.witness.degrees.active) <= set(degrees.active)]
        chosen = best(degrees, [{}] + rng.sample(fitting, min(len(fitting), CANDIDATES - 1)))
        if chosen is None:  # every candidate of these degrees is refused: the plain one stands for them
            plain = make_point({}, **{d: getattr(degrees, d) for d in DIMS})
            chosen = plain if refusal(plain) is None else dataclasses.replace(plain, refused_by_design=True)
        take(chosen)
    # Goals the base points left open: the smallest points that carry each, most valuable first.
    stuck: list[Goal] = []
    while True:
        open_goals = [g for g in state.goals if g not in stuck and g.witness is not None
                      and g.witness.degrees.nproc in world_sizes]
        if not open_goals:
            break
        goal = min(open_goals, key=lambda g: (-g.weight, g.witness.nproc, g.text))
        chosen = best(goal.witness.degrees, [goal.start] * CANDIDATES, must=goal)
        if chosen is None and refusal(goal.witness) is None:
            chosen = goal.witness
            state.forget_conflicts_of(chosen)  # one learnt too widely: it claimed this accepted point
        if chosen is not None:
            take(chosen)
        if goal in state.goals:
            stuck.append(goal)
    # What no accepted point can hold: its witness, refused, shows the one line that says why.
    for goal in stuck:
        if goal in state.goals:
            take(dataclasses.replace(goal.witness, refused_by_design=True))
    return tuple(points)


# ------------------------------------------------------------------------------------------------
# The test suite's subset


def ci_points(points: tuple[Point, ...] | None = None, budget: float | None = None) -> list[Point]:
    """What the test suite runs (`CI_BUDGET`, how it was chosen: docs/parity.md): every refused point
    (judged in this process, no run), and trained points picked greedily, most goals met per cost
    first: first until every required goal is met (the named combinations, every value of every
    factor at least once, every pair of dims together), then while the cost stays within `budget`
    (each value with each dim, then each pair of values). Compiled only where a goal of weight 10
    needs it (`_compile_sparingly`)."""
    points = generate() if points is None else points
    budget = CI_BUDGET if budget is None else budget
    trained = [p for p in points if not p.refused_by_design]
    values = [make_goal(f"{f.name} {v} trains", 10, {f.name: v}) for f in FACTORS for v in f.values]
    dim_pairs = [make_goal(f"{a} with {b}", 10, {}, (a, b)) for a, b in itertools.combinations(DIMS, 2)]
    required = [g for g in [*NAMED_GOALS, *values, *dim_pairs] if g is not None]
    optional = [g for g in coverage_goals() if g not in NAMED_GOALS]
    chosen: list[Point] = []
    references: set[tuple[str, ...]] = set()

    def price(p: Point) -> float:
        return cost(p) + 1.5 * (p.shared() not in references)

    for goals, capped in ((required, False), (optional, True)):
        met = {p: {i for i, g in enumerate(goals) if g.met_by(p)} for p in trained}
        open_goals = set().union(*met.values())
        while open_goals:
            spent = sum(map(cost, chosen))
            fits = [p for p in trained if not capped or spent + cost(p) <= budget]
            gain = {p: sum(goals[i].weight for i in met[p] & open_goals) for p in fits}
            best = max(fits, key=lambda p: (gain[p] / price(p), p.name), default=None)
            if best is None or gain[best] == 0:
                break
            chosen.append(best)
            trained.remove(best)
            references.add(best.shared())
            open_goals -= met[best]
    order = {p: i for i, p in enumerate(points)}
    picked = sorted([*chosen, *(p for p in points if p.refused_by_design)], key=order.__getitem__)
    return _compile_sparingly(picked)


def fast_points(points: list[Point]) -> list[Point]:
    """The fast tier's share of `points`: the cheapest few of up to 4 processes, eager, that train
    every dim and every value of every factor but compile that a plain run does not (picked greedily,
    most of them per cost first), and the cheapest refused point."""
    small = [p for p in points if p.nproc <= 4 and not p.on("compile") and not p.refused_by_design]
    wanted = {(f.name, v) for f in FACTORS if f.name != "compile" for v in f.values[1:]} | {(d, "") for d in ALL_DIMS}

    def met(p: Point) -> set[tuple[str, str]]:
        return wanted & {*p.variants, *((d, "") for d in p.active_dims)}

    chosen: list[Point] = []
    while wanted:
        best = max(small, key=lambda p: (len(met(p)) / cost(p), p.name))
        if not met(best):
            break
        chosen.append(best)
        wanted -= met(best)
    refused = sorted((p for p in points if p.refused_by_design), key=lambda p: (p.nproc, p.name))
    return chosen + refused[:1]


def _compile_sparingly(points: list[Point]) -> list[Point]:
    """`points` with compile kept on the cheapest set of trained points that still meets every
    goal of weight 10 the points met (compile with every dim, under plain DDP, ...), and off on the
    rest: on a small CPU a compiled point costs 5-10 times an eager one (inductor's C++ build,
    DTensor tracing under TP), and the full matrix (loss_compare.py --suite matrix) runs every
    compiled point as generated. Refused points keep compile: their refusal is what they show."""
    compiled = [p for p in points if p.on("compile") and not p.refused_by_design]
    goals = [g for g in coverage_goals() if g.weight >= 10]
    meets = {p: {i for i, g in enumerate(goals) if g.met_by(p)} for p in {*points, *(p.eager() for p in compiled)}}

    def met(group: list[Point]) -> set[int]:
        return set().union(*(meets[p] for p in group))

    # Every subset of the few compiled points, cheapest first; of equal cost, less TP (tracing
    # DTensor code is compile's dearest part on a CPU).
    subsets = sorted((g for n in range(len(compiled) + 1) for g in itertools.combinations(compiled, n)),
                     key=lambda g: (sum(cost(p) for p in g), sum(p.degrees.tp for p in g)))
    wanted = met(points)
    for keep in subsets:
        candidate = [p.eager() if p in compiled and p not in keep else p for p in points]
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
    resumed: tuple[list[float], list[float]] | None = None  # the losses after RESUME_STEP, uninterrupted and resumed


class MatrixRunner:
    """Judges points: refused by the preflight, or trained and compared with one process (and,
    for a point that resumes, trained again from its checkpoint and compared bit for bit)."""

    def __init__(self, workdir: Path, steps: int = 10, timeout: int = 1200, runner: Runner = run_trainer):
        self.harness = ParityHarness(workdir, steps=steps, global_batch=GLOBAL_BATCH, dataset_shards=DATASET_SHARDS,
                                     timeout=timeout, runner=runner, base_args=TINY_RUN)

    def run(self, point: Point) -> Outcome:
        reason = refusal(point)
        if reason is not None:
            return Outcome(point, "refused", detail=reason)
        layout = point.layout()
        try:
            c = self.harness.compare(layout)
            resumed = self.harness.resume(layout, RESUME_STEP) if point.on("resume") else None
        except (ParityError, TrainingFailed) as e:
            return Outcome(point, "error", detail=str(e)[-3000:])
        grad_norm_rtol = self.harness.grad_norm_rtol if layout.grad_norm_rtol is None else layout.grad_norm_rtol
        ok = c.max_loss_diff <= self.harness.tolerance_for(layout) and c.grad_norm_rel_diff <= grad_norm_rtol
        if resumed is not None and resumed[0] != resumed[1]:
            return Outcome(point, "FAIL", c, f"resumed from step {RESUME_STEP}: losses {resumed[1]}, uninterrupted "
                                             f"{resumed[0]} (must be equal bit for bit)", resumed)
        return Outcome(point, "ok" if ok else "FAIL", c, resumed=resumed)

    def check(self, point: Point) -> Outcome:
        """Runs `point` and raises ParityError unless it had the outcome the generator planned."""
        outcome = self.run(point)
        expected = "refused" if point.refused_by_design else "ok"
        if outcome.status != expected:
            c = outcome.comparison
            numbers = f" (max |loss diff| {c.max_loss_diff:.3e}, grad norm {c.grad_norm_rel_diff:.3e})" if c else ""
            raise ParityError(f"{point.name}: expected {expected}, got {outcome.status}{numbers}: {outcome.detail}")
        return outcome
