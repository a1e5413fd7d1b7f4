"""The layout matrix in CI: every point of up to 4 ranks and the chosen 8-rank points either train
like one process (per-step losses within 1e-4 over 4 steps, final grad norm within 1e-3, from one
seed checkpoint and global batch) or are refused before start-up with one line, as the generator
planned. The whole matrix runs with `scripts/loss_compare.py --suite matrix` (docs/parity.md)."""

import json

import pytest

from tests.machinery.layout_matrix import ci_points

POINTS = {p.name: p for p in ci_points()}
# The fast tier's points: FSDP, DDP and HSDP, TP, CP and PP each at least once, with every AC mode,
# tied embeddings, accumulation, zero1, expert parallelism on both MoE models, and a refusal; on 2 to 4 ranks.
FAST = ("fsdp2+ac_selective+moe", "rep4+ac_selective+accum_2+zero1", "rep2_fsdp2+ac_full+tied+accum_2",
        "tp2+sp_off+lp_off+ac_full+dsv3", "cp2+ac_op+accum_2", "pp2+Interleaved1F1B+ac_op+tied", "pp2+ZBVZeroBubble+ac_op")
assert set(FAST) <= set(POINTS), set(FAST) - set(POINTS)


COMPILED = pytest.mark.budget("a compiled point: inductor's C++ build and dynamo's tracing, 20-30 s on 2 cores; CI "
                              "compiles only the points a goal needs (layout_matrix._compile_sparingly)")


# A trained point proves numerics; the refusals and error paths it could meet are the refused
# points' and other tests' (docs/testing.md "Error paths"), so its ranks run without coverage.
UNMEASURED = pytest.mark.unmeasured("numerics only: trains and compares losses")


# A mixture-of-experts model pipelined over 4 ranks runs its 2 to 4 processes per core through
# every schedule action: 15-25 s on 2 cores.
PIPELINED_MOE = pytest.mark.budget("a mixture-of-experts model pipelined over 4 ranks: 15-25 s on 2 cores")


def marks(point) -> list:
    compiled = point.value("compile") == "on" and not point.refused_by_design
    moe_pipeline = point.value("moe") not in (None, "dense") and point.degrees.pp > 1 and point.nproc >= 4
    return [mark for mark, wanted in ((pytest.mark.fast, point.name in FAST), (COMPILED, compiled),
                                      (PIPELINED_MOE, moe_pipeline and not compiled),
                                      (UNMEASURED, not point.refused_by_design)) if wanted]


@pytest.mark.parametrize("name", [pytest.param(n, marks=marks(p)) for n, p in POINTS.items()])
def test_point_trains_like_one_process_or_is_refused(matrix, name):
    outcome = matrix.check(POINTS[name])
    if outcome.status == "refused":
        print(f"{name}: refused: {outcome.detail}")
    else:
        c = outcome.comparison
        print(f"{name}: max |loss diff| {c.max_loss_diff:.3e}, final grad norm rel diff {c.grad_norm_rel_diff:.3e}")
        base = matrix.harness.baseline(POINTS[name].shared())
        # Per-batch training losses are noisy over 4 steps; the held-out batch, validated after
        # step 3 and at the last step, shows whether the model learned.
        first, last = base.validations[0]["loss"], base.validations[-1]["loss"]
        assert last < first, "the held-out loss should fall between the first and the last validation"
        check_host_reads(matrix, POINTS[name])


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
