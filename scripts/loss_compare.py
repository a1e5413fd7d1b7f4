#!/usr/bin/env -S sh -c 'exec "${0%/*}/project_python.sh" "$0" "$@"'
"""Compares parallel layouts with a single-process run: per-step losses and final gradient norm.

    .venv/bin/python scripts/loss_compare.py --suite dp                 # a whole suite
    .venv/bin/python scripts/loss_compare.py --layout fsdp2 --layout ddp2 --plot outputs/loss.png
    .venv/bin/python scripts/loss_compare.py --custom mine 2 "--training.data_parallel_shard_degree 2"
    .venv/bin/python scripts/loss_compare.py --suite matrix             # every generated layout (about 15 min)
    .venv/bin/python scripts/loss_compare.py --suite matrix-ci          # the subset the test suite runs
    .venv/bin/python scripts/loss_compare.py --list

Every run starts from one seed checkpoint with the same global batch and data order, in
deterministic fp32 on the CPU (torchtitan/tools/parity.py, the harness the parity tests use).
Runs are real processes started in the repository root: `python -m torchtitan.train` for one
process, torchrun (`torchtitan.runtime.launch`) for several ranks.
Prints one table row per layout and exits with 1 when any layout is outside the tolerance.
The `matrix` suites are the generated layout matrix, test machinery this repository tool drives
from the checkout (tests/machinery/layout_matrix.py, its models in tests/machinery/matrix_model.py):
each point is either refused before start-up (its row gives the one-line reason) or compared; any
other outcome (a crash, a missing log line, a difference outside the tolerance, a refusal the
generator did not plan) fails.
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # the checkout's tests/ (the matrix suites), from any folder

from tests.machinery import layout_matrix  # noqa: E402
from torchtitan.config.manager import ConfigError  # noqa: E402
from torchtitan.tools.parity import Layout, ParityError, ParityHarness  # noqa: E402
from torchtitan.tools.parity_layouts import SUITES, all_layouts  # noqa: E402
from torchtitan.tools.runs import Runner, TrainingFailed, run_trainer  # noqa: E402

MATRIX_SUITES = ("matrix", "matrix-ci")
# Real processes in the repository root, where the runs' relative paths (train_configs/...) resolve.
REPO_RUNNER: Runner = functools.partial(run_trainer, cwd=REPO_ROOT)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", action="append", default=[], choices=[*sorted(SUITES), *MATRIX_SUITES],
                   help="run every layout of a suite; 'matrix' is the whole generated layout matrix, 'matrix-ci' the "
                   "part of it the test suite runs")
    p.add_argument("--layout", action="append", default=[], help="run one named layout (see --list)")
    p.add_argument("--custom", action="append", nargs=3, default=[], metavar=("NAME", "NPROC", "OVERRIDES"),
                   help="an ad-hoc layout: a name, a process count and its overrides as one quoted string")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--global-batch", type=int, default=8, help="rows per optimizer step in every run")
    p.add_argument("--tolerance", type=float, default=1e-4, help="largest allowed |loss difference|")
    p.add_argument("--workdir", type=Path, help="keep the runs here (default: a temporary folder)")
    p.add_argument("--plot", type=Path, help="write a PNG of the loss curves and differences (needs matplotlib)")
    p.add_argument("--list", action="store_true", help="list the known layouts and exit")
    return p.parse_args(argv)


def selected_layouts(args: argparse.Namespace) -> list[Layout]:
    known = all_layouts()
    layouts = [layout for suite in args.suite if suite in SUITES for layout in SUITES[suite]]
    for name in args.layout:
        if name not in known:
            sys.exit(f"error: unknown layout {name!r}; see --list")
        layouts.append(known[name])
    layouts += [Layout(name, int(nproc), tuple(overrides.split())) for name, nproc, overrides in args.custom]
    if not layouts and not set(args.suite) & set(MATRIX_SUITES):
        sys.exit("error: choose layouts with --suite, --layout or --custom (see --list)")
    return list({layout.name: layout for layout in layouts}.values())  # each once, in order


def pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("error: --plot needs matplotlib: .venv/bin/pip install -e '.[plot]'")
    return plt


def plot(path: Path, baseline, comparisons) -> None:
    plt = pyplot()
    fig, (curves, diffs) = plt.subplots(1, 2, figsize=(12, 4.5))
    steps = [r["step"] for r in baseline.records]
    curves.plot(steps, baseline.losses, "k-", linewidth=3, alpha=0.4, label="1 process")
    for c in comparisons:
        curves.plot(steps, c.run.losses, marker=".", linewidth=1, label=c.layout.name)
        diffs.semilogy(steps, [max(d, 1e-9) for d in c.loss_diffs], marker=".", label=c.layout.name)
    curves.set(title="loss per step", xlabel="step", ylabel="loss")
    diffs.set(title="|loss - single-process loss| (floored at 1e-9)", xlabel="step")
    curves.legend(fontsize=8)
    diffs.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def run_matrix(points: list[layout_matrix.Point], workdir: Path, steps: int, runner: Runner = REPO_RUNNER) -> int:
    """Runs matrix points and prints their table; returns the number that did not have their
    planned outcome."""
    matrix = layout_matrix.MatrixRunner(workdir / "matrix", steps=steps, runner=runner)
    refused = sum(p.refused_by_design for p in points)
    print(f"layout matrix: {len(points)} points ({len(points) - refused} to compare with one process, {refused} to be "
          f"refused); {', '.join(f'{n} ranks: {sum(p.nproc == n for p in points)}' for n in layout_matrix.WORLD_SIZES)}\n")
    print("| layout | ranks | max \\|loss diff\\| | final grad norm rel. diff | wall s | result |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    failed, worst = 0, (0.0, 0.0)
    for point in points:
        start = time.perf_counter()
        outcome = matrix.run(point)
        planned = outcome.status == ("refused" if point.refused_by_design else "ok")
        failed += not planned
        c = outcome.comparison
        if c is not None:
            worst = (max(worst[0], c.max_loss_diff), max(worst[1], c.grad_norm_rel_diff))
        numbers = f"{c.max_loss_diff:.2e} | {c.grad_norm_rel_diff:.2e}" if c is not None else " | "
        result = {"ok": "ok" if planned else "FAIL (trained, but planned to be refused)", "FAIL": "FAIL",
                  "error": "FAIL (run failed)"}.get(outcome.status, "")
        if outcome.status == "refused":
            result = ("refused: " if planned else "FAIL (refused unplanned): ") + outcome.detail.replace("|", "\\|")
        print(f"| {point.name} | {point.nproc} | {numbers} | {time.perf_counter() - start:.0f} | {result} |", flush=True)
        if outcome.status == "error":
            print(outcome.detail, file=sys.stderr)
    print(f"\nlargest |loss diff| {worst[0]:.2e}, largest final grad-norm difference {worst[1]:.2e} (relative); "
          f"{failed} point(s) without their planned outcome")
    return failed


def main(argv: list[str] | None = None, runner: Runner = REPO_RUNNER) -> int:
    """The command line; `runner` trains each run (the tests pass their warm one)."""
    args = parse_args(argv)
    if args.list:
        for suite, layouts in SUITES.items():
            for layout in layouts:
                print(f"{suite:5} {layout.name:24} {layout.nproc} ranks  {' '.join(layout.overrides)}")
        for point in layout_matrix.generate():
            print(f"matrix {point.name:40} {point.nproc} ranks  {' '.join(point.overrides())}")
        return 0
    layouts = selected_layouts(args)
    matrix = [s for s in args.suite if s in MATRIX_SUITES]
    if matrix:
        points = list(layout_matrix.generate()) if "matrix" in matrix else layout_matrix.ci_points()
        with tempfile.TemporaryDirectory() as tmp:
            failed = run_matrix(points, args.workdir or Path(tmp), args.steps, runner)
        if not layouts:
            return 1 if failed else 0
    else:
        failed = 0
    if args.plot:
        pyplot()  # a missing matplotlib is reported before minutes of training, not after
    with tempfile.TemporaryDirectory() as tmp:
        harness = ParityHarness(args.workdir or Path(tmp), steps=args.steps, global_batch=args.global_batch,
                                loss_tolerance=args.tolerance, runner=runner)
        baseline = harness.baseline()
        print(f"baseline: 1 process, {args.steps} steps, losses {baseline.losses[0]:.4f} -> {baseline.losses[-1]:.4f}\n")
        print("| layout | ranks | max \\|loss diff\\| | final grad norm rel. diff | wall s | result |")
        print("| --- | ---: | ---: | ---: | ---: | --- |")
        comparisons = []
        for layout in layouts:
            try:
                c = harness.compare(layout)
            except ConfigError as e:  # the layout's options do not fit the harness's batch
                failed += 1
                print(f"| {layout.name} | {layout.nproc} | | | | config error |", flush=True)
                print(f"{layout.name}: {e}", file=sys.stderr)
                continue
            except (ParityError, TrainingFailed) as e:
                failed += 1
                print(f"| {layout.name} | {layout.nproc} | | | | run failed |", flush=True)
                print(str(e)[-3000:], file=sys.stderr)
                continue
            ok = c.max_loss_diff <= harness.tolerance_for(layout) and c.grad_norm_rel_diff <= harness.grad_norm_rtol
            failed += not ok
            comparisons.append(c)
            print(f"| {layout.name} | {layout.nproc} | {c.max_loss_diff:.2e} | {c.grad_norm_rel_diff:.2e} | "
                  f"{c.run.seconds:.0f} | {'ok' if ok else 'FAIL'} |", flush=True)
        if args.plot:
            plot(args.plot, baseline, comparisons)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
