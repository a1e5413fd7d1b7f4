"""The layout matrix in CI: the generated points the suite runs (tests/machinery/layout_matrix.py
`ci_points`: every refused point, and the trained points that meet every required goal and as many
others as CI_BUDGET allows) either train like one process (per-step losses within 1e-4 over 4
steps, 1e-3 with float8, final grad norm within 1e-3, from one seed checkpoint and global batch,
against one process with the same model and numerics; a point that resumes repeats its losses bit
for bit from its checkpoint of step 2) or are refused before start-up with one line, as the
generator planned. The whole matrix runs with `scripts/loss_compare.py --suite matrix` (docs/parity.md)."""

import json

import pytest

from tests.machinery.layout_matrix import ci_points, fast_points

POINTS = {p.name: p for p in ci_points()}
# The fast tier's points: the cheapest few of up to 4 processes that train every dim and every value
# of every factor once (compile aside), and a refusal (layout_matrix.fast_points).
FAST = {p.name for p in fast_points(list(POINTS.values()))}


COMPILED = pytest.mark.budget("a compiled point: inductor's C++ build and dynamo's tracing, 20-30 s on 2 cores; CI "
                              "compiles only the points a goal needs (layout_matrix._compile_sparingly)")


# A trained point proves numerics; the refusals and error paths it could meet are the refused
# points' and other tests' (docs/testing.md "Error paths"), so its ranks run without coverage.
UNMEASURED = pytest.mark.unmeasured("numerics only: trains and compares losses")


# A mixture-of-experts model pipelined over 4 ranks runs its 2 to 4 processes per core through
# every schedule action: 15-25 s on 2 cores.
PIPELINED_MOE = pytest.mark.budget("a mixture-of-experts model pipelined over 4 ranks: 15-25 s on 2 cores")
# Two replica groups start a lighthouse and twice the ranks; a resumed point trains a second time.
TWICE = pytest.mark.budget("replica groups (twice the processes and a torchft lighthouse) or a second, resumed "
                           "run: 15-30 s on 2 cores")


def marks(point) -> list:
    compiled = point.on("compile") and not point.refused_by_design
    moe_pipeline = point.moe and point.degrees.pp > 1 and point.nproc >= 4
    twice = (point.on("groups") or point.on("resume")) and not point.refused_by_design
    return [mark for mark, wanted in ((pytest.mark.fast, point.name in FAST), (COMPILED, compiled),
                                      (PIPELINED_MOE, moe_pipeline and not compiled),
                                      (TWICE, twice and not compiled and not moe_pipeline),
                                      (UNMEASURED, not point.refused_by_design)) if wanted]


@pytest.mark.parametrize("name", [pytest.param(n, marks=marks(p), id=n) for n, p in POINTS.items()])
def test_point_trains_like_one_process_or_is_refused(matrix, name):
    point = POINTS[name]
    outcome = matrix.check(point)
    if outcome.status == "refused":
        print(f"{name}: refused: {outcome.detail}")
        assert "\n" not in outcome.detail and len(outcome.detail) < 400, outcome.detail
        return
    c = outcome.comparison
    print(f"{name}: max |loss diff| {c.max_loss_diff:.3e}, final grad norm rel diff {c.grad_norm_rel_diff:.3e}")
    if outcome.resumed is not None:
        print(f"{name}: resumed from step 2, losses {outcome.resumed[1]} (bitwise equal)")
    base = matrix.harness.baseline(point.shared(), point.model_args())
    # Per-batch training losses are noisy over 4 steps; the held-out batch, validated after
    # step 3 and at the last step, shows whether the model learned.
    first, last = base.validations[0]["loss"], base.validations[-1]["loss"]
    assert last < first, "the held-out loss should fall between the first and the last validation"
    check_host_reads(matrix, point)


# Where a steady-state step of an MoE point may still read on the host: the dropless dispatch's
# token counts, one read per MoE layer and micro-batch (docs/performance.md, "Host reads").
MOE_DISPATCH = ("torchtitan/models/moe.py", "torchtitan/parallelisms/expert_parallel.py")


def steady_state_reads(folder) -> list[dict]:
    """Every rank's host reads that stall a steady-state step (torchtitan/observability/host_reads.py)."""
    reports = sorted((folder / "host_reads").glob("rank*.json"))
    assert reports, f"no host-read audit in {folder}"
    reads = []
    for path in reports:
        report = json.loads(path.read_text())
        reads += [r for r in report["reads"] if r["step"] is not None and r["step"] > report["first_step"]
                  and not r["deferred"] and not r["scheduled"]]
    return reads


def check_host_reads(matrix, point) -> None:
    """A trained eager point's steady-state steps read nothing on the host (beyond an MoE point's
    dropless dispatch), on every rank."""
    if point.refused_by_design or not point.audit():
        return
    reads = steady_state_reads(matrix.harness.workdir / point.name)
    outside = [r for r in reads if not (point.moe and r["where"].startswith(MOE_DISPATCH))]
    assert not outside, f"{point.name}: steady-state host reads: {outside[:5]}"
