"""The all-pairs construction behind the layout matrix (layout_matrix.py): goals (a value with a
dim, two values, a named combination), the open goals indexed by the values that meet them, one
candidate point built the way AETG builds a row, and the conflicts learnt from the points the
product refuses, so that later candidates avoid them. Test machinery."""

from __future__ import annotations

import dataclasses
import random
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

from tests.machinery.matrix_space import DIMS, FACTOR, FACTORS, SCHEDULES, Degrees, Point, cost, make_point, possible


@dataclass(frozen=True)
class Goal:
    text: str
    weight: int
    met_by: Callable[[Point], bool]
    values: tuple[tuple[str, str], ...] = ()  # the factor values it needs (a construction starts from them)
    witness: Point | None = None  # the smallest point that meets it alone
    dims: tuple[str, ...] = ()  # the dims it needs over 1
    named: bool = False  # a combination required by name (met_by also checks its degrees)

    @property
    def start(self) -> dict[str, str]:
        """What a construction meant to meet it starts from: its values, and the witness's model
        where its values or dims need one (a factor of MoE models, expert parallelism)."""
        needs_model = "ep" in self.dims or any(FACTOR[f].models for f, _ in self.values)
        return {**({"model": self.witness.value("model")} if needs_model and self.witness else {}), **dict(self.values)}


def goal_degrees(values: dict[str, str], dims: tuple[str, ...] = ()) -> dict[str, int]:
    """The fewest degrees on which every factor of `values` exists, and every dim of `dims` is over 1."""
    wanted = {d for d in dims if d != "ep"} | {d for f in values for d in FACTOR[f].needs}
    if "ep" in dims and not wanted & {"dp_shard", "cp", "tp"}:
        wanted.add("dp_shard")
    return {d: 2 for d in wanted}


def make_goal(text: str, weight: int, values: dict[str, str], dims: tuple[str, ...] = (),
          degrees: dict[str, int] | None = None) -> Goal | None:
    """A goal met by a point holding `values` with every dim of `dims` over 1 (on `degrees` if
    given); None when no point can hold them (a factor absent on its own degrees or model, or an
    impossible pair)."""
    if "ep" in dims and values.get("model", "moe") == "dense":
        return None
    # The witness's model: one that has every factor of `values` (and experts, for ep).
    needs = [FACTOR[f].models for f in values if FACTOR[f].models] + [("moe", "dsv3")] * ("ep" in dims)
    model = values.get("model", next((m for m in FACTOR["model"].values if all(m in n for n in needs)), "dense"))
    witness = make_point({"model": model, **values}, **(degrees or goal_degrees(values, dims)))
    if any(witness.value(f) != v for f, v in values.items()) or not possible(witness.variants):
        return None
    if not set(dims) <= set(witness.active_dims):
        return None
    items = tuple(values.items())
    return Goal(text, weight, lambda p: all(p.value(f) == v for f, v in items) and all(d in p.active_dims for d in dims),
                items, witness, dims)


@dataclass(frozen=True)
class Conflict:
    """Values the product refuses together beside every dim of `dims` (on `model`; None: any)."""

    model: str | None
    values: frozenset[tuple[str, str]]
    dims: frozenset[str]

    def completed_by(self, model: str, chosen: dict[str, str], factor: str, value: str, dims: tuple[str, ...]) -> bool:
        """Whether choosing `value` for `factor` next to `chosen` would hold the whole conflict."""
        return (factor, value) in self.values and self.held_by(model, {**chosen, factor: value}, dims)

    def held_by(self, model: str, chosen: dict[str, str], dims: tuple[str, ...]) -> bool:
        return (self.model in (None, model) and self.dims <= set(dims)
                and all(chosen.get(f) == v for f, v in self.values))


def learn_conflict(p: Point, reason: str, refusal: Callable[[Point], str | None]) -> Conflict:
    """The part of refused point `p` its refusal needs: each value whose change (and each dim whose
    removal) lets the point pass or be refused for another reason; every dim when no single one
    does; the model when another that has those values is not refused alike."""
    def other(factor: str, value: str) -> str:
        values = FACTOR[factor].values
        return values[0] if value != values[0] else values[1]

    def verdict(variants: dict[str, str], degrees: Degrees) -> str | None:
        q = make_point(variants, **{d: getattr(degrees, d) for d in DIMS})
        if q.value("schedule") == p.value("schedule"):  # the same kind: the same concrete schedule
            q = dataclasses.replace(q, schedule=p.schedule)
        return refusal(q)

    def same(variants: dict[str, str], degrees: Degrees) -> bool:
        return verdict(variants, degrees) == reason

    current = dict(p.variants)
    flipped = {(f, v): verdict({**current, f: other(f, v)}, p.degrees) for f, v in p.variants if f != "model"}
    # Needed: a value whose change lets the point pass; where no single one does (two causes, or a
    # change that trips an earlier rule), each whose change stops this refusal.
    values = frozenset(kv for kv, result in flipped.items() if result is None) or frozenset(
        kv for kv, result in flipped.items() if result != reason)
    dims = frozenset(d for d in p.degrees.active if not same(current, dataclasses.replace(p.degrees, **{d: 1})))
    if not dims and not same(current, Degrees()):  # refused beside any one of several dims: beside all of these
        dims = frozenset(p.active_dims)
    # A dim that only brings expert parallelism: the conflict is with ep if another dim that brings
    # it is refused alike.
    carriers = {"dp_shard", "cp", "tp"}
    if "ep" in p.active_dims and len(dims) == 1 and dims <= carriers:
        alone = dataclasses.replace(Degrees(), **{d: getattr(p.degrees, d) for d in p.degrees.active if d not in dims})
        if any(same(current, dataclasses.replace(alone, **{d: 2})) for d in sorted(carriers - dims - set(alone.active))[:1]):
            dims = frozenset({"ep"})
    others = [m for m in FACTOR["model"].values if m != p.value("model") and possible({**dict(values), "model": m})
              and all(not FACTOR[f].models or m in FACTOR[f].models for f, _ in values)]
    model = None if others and all(same({**current, "model": m}, p.degrees) for m in others) else p.value("model")
    return Conflict(model, values, dims)


class OpenGoals:
    """The goals not met yet, indexed by the values that meet them, and the one-process
    references (and seeds) the points taken so far need."""

    def __init__(self, goals: tuple[Goal, ...]):
        self.goals = list(goals)
        self.meets: dict[tuple[str, str], set[str]] = defaultdict(set)  # (factor, value) -> dims still to meet
        self.pairs: dict[tuple[str, str], set[tuple[str, str]]] = defaultdict(set)
        self.named = [g for g in goals if g.named]
        for g in goals:
            if g.named:
                continue
            if g.weight >= 10:
                (key,) = [kv for kv in g.values if kv[0] != "model" or len(g.values) == 1]
                self.meets[key].update(g.dims)
            else:
                a, b = g.values
                self.pairs[a].add(b)
                self.pairs[b].add(a)
        self.references: set[tuple[str, ...]] = set()
        self.seeds: set[tuple[str, ...]] = set()
        self.conflicts: list[Conflict] = []  # learned from refused candidates, avoided by later ones

    def known_refused(self, p: Point) -> bool:
        """Whether `p` holds a conflict learned before (so the product would refuse it)."""
        return any(c.held_by(p.value("model"), dict(p.variants), p.active_dims) for c in self.conflicts)

    def forget_conflicts_of(self, p: Point) -> None:
        self.conflicts = [c for c in self.conflicts if not c.held_by(p.value("model"), dict(p.variants), p.active_dims)]

    def value_gain(self, factor: str, value: str, chosen: dict[str, str], dims: tuple[str, ...]) -> int:
        """What choosing `value` adds, given the values chosen so far and the point's dims."""
        key = (factor, value)
        return 10 * len(self.meets[key].intersection(dims)) + sum(chosen.get(f) == v for f, v in self.pairs[key])

    def gain(self, p: Point) -> int:
        dims, items = p.active_dims, p.variants
        met = sum(10 * len(self.meets[kv].intersection(dims)) for kv in items)
        position = {kv: i for i, kv in enumerate(items)}
        met += sum(position.get(b, -1) > i for i, a in enumerate(items) for b in self.pairs[a])
        return met + 10 * sum(g.met_by(p) for g in self.named)

    def price(self, p: Point) -> float:
        """The point's cost, plus its one-process reference and seed when no point needs them yet."""
        return cost(p) + 1.5 * (p.shared() not in self.references) + 0.5 * (p.model_args() not in self.seeds)

    def take(self, p: Point) -> None:
        dims = p.active_dims
        for kv in p.variants:
            self.meets[kv].difference_update(dims)
            self.pairs[kv].difference_update(p.variants)
        self.named = [g for g in self.named if not g.met_by(p)]
        self.goals = [g for g in self.goals if not g.met_by(p)]
        if not p.refused_by_design:
            self.references.add(p.shared())
            self.seeds.add(p.model_args())


def construct(degrees: Degrees, start: dict[str, str], state: OpenGoals, rng: random.Random,
               turn: dict[str, int]) -> Point | None:
    """One candidate on `degrees` holding `start`: the model first, then the other factors in a
    random order, each given the value that meets the most open goals for its price."""
    chosen = dict(start)
    model = chosen.get("model")
    if model is None:
        models = [v for v in FACTOR["model"].values if possible({**chosen, "model": v})]
        model = max(models, key=lambda v: (score(state, degrees, "model", v, chosen, v), rng.random()))
        chosen["model"] = model
    dims = make_point({"model": model}, **{d: getattr(degrees, d) for d in DIMS}).active_dims
    rest = [f for f in FACTORS if f.name != "model"]
    rng.shuffle(rest)
    for f in rest:
        if not f.applies(degrees, model):
            if f.name in start:
                return None
            continue
        if f.name not in chosen:
            values = [v for v in f.values if possible({**chosen, f.name: v})
                      and not any(c.completed_by(model, chosen, f.name, v, dims) for c in state.conflicts)]
            if not values:
                return None
            chosen[f.name] = max(values, key=lambda v: (score(state, degrees, f.name, v, chosen, model, dims), rng.random()))
    values = tuple((f.name, chosen[f.name]) for f in FACTORS if f.applies(degrees, model))
    if not possible(values):
        return None
    kind = dict(values).get("schedule")
    return Point(degrees, values, SCHEDULES[kind][turn[kind] % len(SCHEDULES[kind])] if kind else "")


def score(state: OpenGoals, degrees: Degrees, factor: str, value: str, chosen: dict[str, str], model: str,
           dims: tuple[str, ...] | None = None) -> float:
    if dims is None:
        dims = make_point({"model": model}, **{d: getattr(degrees, d) for d in DIMS}).active_dims
    return state.value_gain(factor, value, chosen, dims) - degrees.nproc * FACTOR[factor].cost.get(value, 0.0)
