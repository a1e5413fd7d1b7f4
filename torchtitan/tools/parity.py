"""Parity harness: proves that a parallel layout trains exactly like one process.

Every comparison starts from one seed checkpoint (written by a single process), feeds the same
global batch in the same order (`training.dataset_shards`), runs deterministic fp32 kernels on
the CPU, and compares the per-step losses and the final gradient norm with a single-process
baseline. A layout is a name, a process count and a list of overrides; the harness derives the
per-rank batch size from the layout's data-parallel degree and gradient-accumulation steps, so
the global batch never changes.

A user tool: scripts/loss_compare.py runs it for any layout, prints a table and can plot the
loss curves. The test suite's layout matrix (tests/machinery/layout_matrix.py) and the parity
tests (tests/integration/test_parity.py) use it too. Runs go through a `Runner` (runs.py): real
processes, torchrun for several ranks, unless the caller passes another (the tests' warm one).
"""

from __future__ import annotations

import hashlib
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from torchtitan.config.manager import parse_args
from torchtitan.errors import ConfigError
from torchtitan.parallelisms.parallel_dims import parallel_dims_from_config
from torchtitan.tools.runs import Runner, read_metrics, read_setup, read_validations, run_trainer

# The job a comparison starts from unless the caller gives another (`base_args`): the debug model
# (8 blocks) on short sequences, real text and tokenizer, a few seconds per run on a CPU.
DEBUG_RUN = (
    "--job.config_file", "bundled:train_configs/debug_model.toml",  # found from any working directory
    "--training.seq_len", "64",
    "--training.steps", "10",
    "--training.warmup_steps", "2",
    "--metrics.log_freq", "1",
    "--metrics.disable_color_printing",
)
# What every run of a comparison shares, on top of the base arguments. The baseline uses library defaults
# for everything else (no AC, no compile), and a layout's overrides come last, so they win. Every
# run validates too (a held-out batch every 3 steps and at the last), so each layout's validation
# losses are compared as well, and a layout whose validation disturbs training shows in its losses.
COMPARISON_ARGS = ("--training.deterministic", "--activation_checkpoint.mode", "none", "--validation.enabled",
                   "--validation.freq", "3", "--validation.steps", "1", "--validation.held_out_fraction", "0.05")


@dataclass(frozen=True)
class Check:
    """A test on one value of the setup record, where equality with a value does not say enough."""

    text: str  # what the value must be, in the words a failure shows
    test: Callable[[Any], bool]

    def __call__(self, value: Any) -> bool:
        return bool(self.test(value))

    def __repr__(self) -> str:
        return self.text


# (dotted key of the setup record, the value it must equal or a Check it must pass), e.g.
# ("fsdp.mesh", {"dp_shard_cp": 2}). Setup records: torchtitan/observability/setup_record.py.
Expectations = tuple[tuple[str, Any], ...]
_ABSENT = object()


def lookup(record: dict, key: str) -> Any:
    """The value at dotted `key` of `record`, or _ABSENT."""
    value: Any = record
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return _ABSENT
        value = value[part]
    return value


def unmet(record: dict, expect: Expectations) -> list[str]:
    """One line per expectation the setup record does not meet."""
    failures = []
    for key, want in expect:
        got = lookup(record, key)
        if got is _ABSENT or not (want(got) if isinstance(want, Check) else got == want):
            failures.append(f"{key} should be {want!r}, the run recorded "
                            f"{'nothing' if got is _ABSENT else repr(got)}")
    return failures


@dataclass(frozen=True)
class Layout:
    """One parallel layout under test: `nproc` ranks with `overrides` on top of the shared args.

    `expect` says what the run's setup record must show, proving the layout was really applied (a
    typo in an override must not pass as a trivially equal single-process run). `shared` overrides change
    the model itself (vocabulary padding, for example): the seed checkpoint and the baseline are
    made with them too, so the layout is compared with a single process of the same model.
    `loss_tolerance` and `grad_norm_rtol`, when set, replace the harness's for this layout (float8
    and bf16 only; see there). `model`, when set, are the overrides that define the weights, a
    part of `shared`: the seed checkpoint is made with them alone, so options that change only how
    the same weights train (an optimizer, a data order, a mask) share one seed.
    `replica_groups` > 1 trains that many fault-tolerant replica groups of `nproc` ranks each,
    joined by a torchft lighthouse (fault_tolerance.enable): the groups' mean loss per step is
    compared, and the expectations are read from group 0's setup record.
    """

    name: str
    nproc: int
    overrides: tuple[str, ...]
    expect: Expectations = ()
    shared: tuple[str, ...] = ()
    loss_tolerance: float | None = None
    grad_norm_rtol: float | None = None
    model: tuple[str, ...] | None = None
    replica_groups: int = 1

    @property
    def seed_args(self) -> tuple[str, ...]:
        return self.shared if self.model is None else self.model

    @property
    def processes(self) -> int:
        return self.nproc * self.replica_groups


# The tolerances of an fp32 layout against one process. The two differ only in the order of their
# sums (sharded matmuls, gradient reductions), and the sums are long: a token's loss in the debug
# model goes through about 18,000 additions (8 blocks), so the deterministic bound (n eps x the
# loss, 1.6e-2) says nothing. Their roundings fall either way, though: a token's loss moves by about
# sqrt(n) eps relative (1.6e-5, 1.2e-4 of a loss near 8), and a step's loss, the mean over its 512
# tokens, by about 5e-6; later steps add the weights' differences, each update's rounding times the
# learning rate. 1e-4 is 20x that (measured: at most 1.9e-6 over the layout matrix's 68 trained
# points, docs/parity.md). The final gradient norm sums the squares of millions of elements, each
# already moved by the trajectory: 1e-3 relative against 3.2e-5 measured at most.
LOSS_TOLERANCE = 1e-4
GRAD_NORM_RTOL = 1e-3


POSITIVE = Check("a count above 0", lambda n: n > 0)


@dataclass
class RunResult:
    name: str
    nproc: int
    records: list[dict]  # rank 0's metrics.jsonl rows, one per step
    stdout: str
    seconds: float
    setup: dict = field(default_factory=dict)  # the run's setup record: what it applied and loaded
    validations: list[dict] = field(default_factory=list)  # its validation rows

    @property
    def losses(self) -> list[float]:
        return [r["loss"] for r in self.records]


@dataclass
class Comparison:
    layout: Layout
    run: RunResult
    loss_diffs: list[float] = field(default_factory=list)
    grad_norm_rel_diff: float = 0.0
    validation_diffs: list[float] = field(default_factory=list)

    @property
    def max_loss_diff(self) -> float:
        """Over the training and the validation losses."""
        return max(self.loss_diffs + self.validation_diffs)


class ParityError(AssertionError):
    """A layout that trained but did not match the baseline, or was not applied as declared."""


def local_batch_size(global_batch: int, overrides: tuple[str, ...], nproc: int, replica_groups: int = 1) -> int:
    """Rows per rank and micro-step that keep `global_batch` rows per optimizer step; ConfigError
    when the layout's data-parallel degree x accumulation (x its replica groups) does not divide them."""
    # Every run of a comparison starts from a seed checkpoint (which options like lora need); only
    # the degrees are read here, not the path.
    config = parse_args([*DEBUG_RUN, "--checkpoint.initial_load_path", "seed", *overrides])
    dims = parallel_dims_from_config(config, nproc)
    per_step = dims.dp_degree * config.training.gradient_accumulation_steps * replica_groups
    if global_batch % per_step:
        groups = " x replica groups" if replica_groups > 1 else ""
        raise ConfigError(f"global batch {global_batch} does not divide by data-parallel degree x accumulation{groups} "
                          f"{per_step}")
    return global_batch // per_step


def replica_group_args(groups: int, lighthouse_address: str) -> tuple[str, ...]:
    """The options of a job of `groups` fault-tolerant replica groups that all must take part in
    every step (so each step averages every group's gradients, as one job's replicas would)."""
    return ("--fault_tolerance.enable", "--fault_tolerance.group_size", str(groups),
            "--fault_tolerance.min_replica_size", str(groups), "--fault_tolerance.lighthouse", lighthouse_address)


def mean_over_groups(groups: list[list[dict]], key: str = "loss") -> list[dict]:
    """Group 0's rows with `key` replaced by its mean over the groups, row by row: the loss of one
    job whose replicas are the groups (the gradient norm, taken after the cross-group average, is
    every group's)."""
    if any([r["step"] for r in g] != [r["step"] for r in groups[0]] for g in groups):
        raise ParityError(f"the replica groups logged different steps: {[[r['step'] for r in g] for g in groups]}")
    return [{**row, key: sum(g[i][key] for g in groups) / len(groups)} for i, row in enumerate(groups[0])]


class ParityHarness:
    """Runs the seed checkpoint, the baseline and any number of layouts under `workdir`.

    Each run is done once and cached, so tests of one session share the seed and the baseline.
    Every run goes through `runner`: by default real processes in the current directory (the
    runs' relative paths resolve there); loss_compare.py passes its repository root, the test
    suite its warm runner.
    """

    def __init__(self, workdir: Path, steps: int = 10, global_batch: int = 8, dataset_shards: int = 4,
                 loss_tolerance: float = LOSS_TOLERANCE, grad_norm_rtol: float = GRAD_NORM_RTOL, timeout: int = 400,
                 runner: Runner = run_trainer, base_args: Sequence[str] = DEBUG_RUN):
        self.workdir = Path(workdir)
        self.runner = runner
        self.base_args = tuple(base_args)  # the job every run starts from (DEBUG_RUN: the debug model)
        self.steps, self.global_batch, self.dataset_shards = steps, global_batch, dataset_shards
        self.loss_tolerance, self.grad_norm_rtol, self.timeout = loss_tolerance, grad_norm_rtol, timeout
        self._runs: dict[str, RunResult] = {}

    @staticmethod
    def _variant(shared: tuple[str, ...]) -> str:
        """Folder suffix of the seed and baseline made with `shared` overrides ('' for none); a long
        one is shortened by a digest of it (a folder name has at most 255 bytes)."""
        suffix = "" if not shared else "-" + "_".join(a.lstrip("-").replace(".", "_").replace("/", "_") for a in shared)
        return suffix if len(suffix) <= 120 else f"{suffix[:80]}-{hashlib.sha1(suffix.encode()).hexdigest()[:12]}"

    def common_args(self, shared: tuple[str, ...] = (), model: tuple[str, ...] | None = None) -> list[str]:
        """The arguments every run of a comparison shares (the seed checkpoint included): `model`
        defines the seed's weights (None: `shared` does)."""
        return [*self.base_args, "--training.steps", str(self.steps), *COMPARISON_ARGS,
                "--training.dataset_shards", str(self.dataset_shards),
                "--checkpoint.initial_load_path", str(self.seed_checkpoint(shared if model is None else model)), *shared]

    def seed_checkpoint(self, shared: tuple[str, ...] = ()) -> Path:
        folder = self.workdir / f"seed{self._variant(shared)}"
        path = folder / "checkpoint" / "step-0"
        if not path.exists():
            self.runner([*self.base_args, *shared, "--job.dump_folder", str(folder), "--checkpoint.create_seed_checkpoint"],
                        timeout=self.timeout)
        return path

    def run_args(self, layout: Layout, folder: Path) -> list[str]:
        """The trainer options of `layout`'s run into `folder` (a replica group's own options aside)."""
        batch = local_batch_size(self.global_batch, (*layout.shared, *layout.overrides), layout.nproc,
                                 layout.replica_groups)
        return [*self.common_args(layout.shared, layout.model), "--job.dump_folder", str(folder),
                "--training.batch_size", str(batch), *layout.overrides]

    def run(self, layout: Layout) -> RunResult:
        if layout.name not in self._runs:
            folder = self.workdir / layout.name
            start = time.perf_counter()
            stdout, records, validations, setup = self._train(layout, self.run_args(layout, folder), folder)
            seconds = time.perf_counter() - start
            seed = self.seed_checkpoint(layout.seed_args).resolve()
            from_seed = Check(f"weights loaded from {seed}", lambda load: load is not None and load["weights_only"]
                              and Path(load["path"]).resolve() == seed)
            if unmet(setup, (("initial_load", from_seed),)):
                raise ParityError(f"{layout.name}: the run did not start from the seed checkpoint "
                                  f"(initial_load: {setup.get('initial_load', 'no setup record')})")
            failures = unmet(setup, layout.expect)
            if failures:
                raise ParityError(f"{layout.name}: the layout was not applied: {'; '.join(failures)}")
            self._runs[layout.name] = RunResult(layout.name, layout.processes, records, stdout, seconds, setup,
                                                validations)
        return self._runs[layout.name]

    def _train(self, layout: Layout, args: list[str], folder: Path) -> tuple[str, list[dict], list[dict], dict]:
        """Trains `layout` once; its output, step rows, validation rows and setup record (of the
        groups: the mean losses and group 0's record)."""
        if layout.replica_groups == 1:
            result = self.runner(args, nproc=layout.nproc, timeout=self.timeout)
            return result.stdout, read_metrics(folder), read_validations(folder), read_setup(folder) or {}
        from torchtitan.tools.replica_groups import lighthouse, run_replica_groups  # torchft: an optional extra

        groups = layout.replica_groups
        with lighthouse(min_replicas=groups) as address:
            results = run_replica_groups([*args, *replica_group_args(groups, address)], groups, nproc=layout.nproc,
                                         timeout=self.timeout, runner=self.runner)
        folders = [folder / f"replica_{g}" for g in range(groups)]
        return ("".join(r.stdout for r in results), mean_over_groups([read_metrics(f) for f in folders]),
                mean_over_groups([read_validations(f) for f in folders]), read_setup(folders[0]) or {})

    def baseline(self, shared: tuple[str, ...] = (), model: tuple[str, ...] | None = None) -> RunResult:
        """One process with `shared` (from the seed of `model`, None: of `shared`)."""
        return self.run(Layout(f"baseline{self._variant(shared)}", 1, (), shared=shared, model=model))

    def resume(self, layout: Layout, step: int) -> tuple[list[float], list[float]]:
        """Trains `layout` again from its own checkpoint of `step` (its run must save one) in a copy
        of its folder; returns the losses of the steps after `step`, as the uninterrupted run
        logged them and as the resumed run did. A resumed run must repeat them bit for bit."""
        run = self.run(layout)
        folder, again = self.workdir / layout.name, self.workdir / f"{layout.name}-resumed-{step}"
        shutil.rmtree(again, ignore_errors=True)
        shutil.copytree(folder, again, symlinks=True)
        for group in [again] if layout.replica_groups == 1 else [again / f"replica_{g}" for g in range(layout.replica_groups)]:
            saved = group / "checkpoint"
            later = [c for c in saved.glob("step-*") if int(c.name.split("-")[1].split(".")[0]) > step]
            if not (saved / f"step-{step}").is_dir():
                raise ParityError(f"{layout.name}: no checkpoint of step {step} in {saved} to resume from")
            for c in later:
                shutil.rmtree(c)
        _, records, _, setup = self._train(layout, self.run_args(layout, again), again)
        if unmet(setup, (("initial_load.step", step), ("initial_load.weights_only", False))):
            raise ParityError(f"{layout.name}: the second run did not resume from step {step} "
                              f"(initial_load: {setup.get('initial_load', 'no setup record')})")
        after = [r for r in run.records if r["step"] > step]
        resumed = [r for r in records if r["step"] > step]
        if [r["step"] for r in resumed] != [r["step"] for r in after]:
            raise ParityError(f"{layout.name}: the resumed run logged steps {[r['step'] for r in resumed]}, the "
                              f"uninterrupted one {[r['step'] for r in after]}")
        return [r["loss"] for r in after], [r["loss"] for r in resumed]

    def compare(self, layout: Layout) -> Comparison:
        base, run = self.baseline(layout.shared, layout.model), self.run(layout)
        if [r["step"] for r in run.records] != [r["step"] for r in base.records]:
            raise ParityError(f"{layout.name}: logged steps {[r['step'] for r in run.records]} differ from the baseline's")
        if [r["step"] for r in run.validations] != [r["step"] for r in base.validations]:
            raise ParityError(f"{layout.name}: validated at steps {[r['step'] for r in run.validations]}, the baseline "
                              f"at {[r['step'] for r in base.validations]}")
        diffs = [abs(a - b) for a, b in zip(base.losses, run.losses)]
        validation_diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(base.validations, run.validations)]
        g0, g1 = base.records[-1]["grad_norm"], run.records[-1]["grad_norm"]
        return Comparison(layout, run, diffs, abs(g1 - g0) / abs(g0), validation_diffs)

    def tolerance_for(self, layout: Layout) -> float:
        return self.loss_tolerance if layout.loss_tolerance is None else layout.loss_tolerance

    def check(self, layout: Layout) -> Comparison:
        """Compares and raises ParityError when the layout is outside the tolerances."""
        c = self.compare(layout)
        tolerance = self.tolerance_for(layout)
        if c.max_loss_diff > tolerance:
            base = self.baseline(layout.shared, layout.model)
            pairs = [(round(a, 7), round(b, 7)) for a, b in zip(base.losses, c.run.losses)]
            validation = [(r["step"], round(a["loss"], 7), round(r["loss"], 7)) for a, r in zip(base.validations,
                                                                                              c.run.validations)]
            raise ParityError(f"{layout.name}: max |loss diff| {c.max_loss_diff:.3e} > {tolerance:g}; "
                              f"(baseline, layout) per step: {pairs}; validation (step, baseline, layout): {validation}")
        grad_norm_rtol = self.grad_norm_rtol if layout.grad_norm_rtol is None else layout.grad_norm_rtol
        if c.grad_norm_rel_diff > grad_norm_rtol:
            raise ParityError(f"{layout.name}: final grad norm differs by {c.grad_norm_rel_diff:.3e} (relative) "
                              f"> {grad_norm_rtol:g}")
        return c
