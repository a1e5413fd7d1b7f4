"""The layout matrix generator (tests/machinery/layout_matrix.py): the points it must contain, the
coverage it promises, and the CI subset. No training runs here; refusals use the in-process preflight."""

import dataclasses
import itertools

import pytest

from tests.machinery import layout_matrix as lm
from tests.machinery.fake_runner import FakeRunner
from tests.machinery.matrix_model import flavor_name
from torchtitan.config.manager import parse_args
from torchtitan.config.preflight import preflight
from torchtitan.errors import UserError
from torchtitan.tools.parity import ParityError, unmet

Degrees = lm.Degrees


@pytest.fixture(scope="module")
def points():
    return lm.generate()


def test_base_points_are_every_power_of_two_assignment():
    base = lm.all_degrees()
    assert len(base) == len(set(base)) == 1 + 5 + 15 + 35  # C(k+4, 4) assignments of 2^k over 5 dims
    assert {d.nproc for d in base} == {1, 2, 4, 8}
    assert Degrees(dp_replicate=2, cp=2) in base and Degrees(dp_replicate=2, dp_shard=2, cp=2) in base



def test_every_base_point_is_in_the_matrix_once(points):
    degrees = [p.degrees for p in points]
    for d in lm.all_degrees():
        assert d in degrees
    assert len({p.name for p in points}) == len(points)


def test_required_eight_rank_points_are_all_present(points):
    """Every 8-rank point with dp_replicate > 1 or cp > 1 or three or more dims > 1 (issue 15)."""
    present = {p.degrees for p in points}
    required = [d for d in lm.all_degrees((8,)) if d.dp_replicate > 1 or d.cp > 1 or len(d.active) >= 3]
    assert len(required) == 26 and all(d in present for d in required)


def test_every_variant_meets_every_dim_it_interacts_with(points):
    assert lm.uncovered_goals(points) == []
    for factor in lm.FACTORS:
        for value, dim in itertools.product(factor.values, factor.meets):
            assert any(p.value(factor.name) == value and p.degrees.over(dim) for p in points), (factor.name, value, dim)


def test_points_are_refused_exactly_when_planned(points):
    for p in points:
        reason = lm.refusal(p)
        assert (reason is not None) == p.refused_by_design, (p.name, reason)
        if reason is not None:
            assert "\n" not in reason and len(reason) < 400, reason
    # No base point is given up: every refused point is an extra one, added to show its refusal.
    base = set(lm.all_degrees())
    assert all(p.degrees in base for p in points if not p.refused_by_design)
    assert sum(p.refused_by_design for p in points) >= 1


def eager(p: lm.Point) -> lm.Point:
    return dataclasses.replace(p, variants=tuple((f, "off" if f == "compile" else v) for f, v in p.variants))


def test_ci_subset(points):
    ci = lm.ci_points(points)
    # Every point of up to 4 ranks, compiled as generated or run eager (the next test).
    assert [eager(p) for p in points if p.nproc <= 4] == [eager(p) for p in ci if p.nproc <= 4]
    eight = [p for p in ci if p.nproc == 8]
    assert len(eight) >= lm.CI_EIGHT_RANK_POINTS
    for pair in itertools.combinations(lm.DIMS, 2):
        assert any(all(p.degrees.over(d) for d in pair) for p in eight), pair
    # The reported layouts and the known holes run in CI; so do every variant goal and every schedule.
    assert lm.uncovered_goals(ci) == []
    assert {p.schedule for p in ci if p.schedule} == {s for kind in lm.SCHEDULES.values() for s in kind}
    assert Degrees(dp_replicate=2, dp_shard=2, cp=2) in {p.degrees for p in eight}


def test_ci_compiles_only_the_points_a_goal_needs(points):
    """A compiled point costs 5-10 eager ones on a CPU: CI keeps compile where a goal needs it
    (compile with every dim, under plain DDP) and runs the other compiled points eager; refused
    points keep compile, their refusal being the point."""
    ci = lm.ci_points(points)
    as_generated = {eager(p): p for p in points}
    assert all(p == as_generated[eager(p)] or p.value("compile") == "off" for p in ci)
    compiled = [p for p in ci if p.value("compile") == "on" and not p.refused_by_design]
    generated_compiled = [p for p in ci if as_generated[eager(p)].value("compile") == "on"
                          and not p.refused_by_design]
    assert 0 < len(compiled) < len(generated_compiled)
    assert all(as_generated[eager(p)] == p for p in ci if p.refused_by_design)
    for p in compiled:  # none of them is spare: without it, a goal goes unmet
        assert lm.uncovered_goals([eager(q) if q == p else q for q in ci]) != [], p.name


def test_points_run_the_depth_their_pipeline_needs(points):
    for p in points:
        stages = p.degrees.pp * (2 if p.value("schedule") in ("interleaved", "V") else 1)
        assert p.depth >= stages and p.depth in (2, 4, 8, 16)


def test_generation_is_deterministic(points):
    assert lm.generate.__wrapped__() == points


def test_a_point_refused_against_the_plan_fails_the_check(tmp_path):
    op_ac_with_split_backward = lm._point({"ac": "op", "schedule": "V"}, pp=2)
    assert lm.refusal(op_ac_with_split_backward) is not None and not op_ac_with_split_backward.refused_by_design
    with pytest.raises(ParityError, match="expected ok, got refused"):
        lm.MatrixRunner(tmp_path).check(op_ac_with_split_backward)


def test_a_point_expects_its_layout_and_variants_in_the_setup_record():
    """Point.expect() against a hand-made setup record (torchtitan/observability/setup_record.py): met, and a
    variant that was not applied as declared is named."""
    point = lm._point({"ac": "selective", "zero1": "on", "sp": "off"}, dp_replicate=2, tp=2)
    record = {"world_size": 4, "mesh": {"dp_replicate": 2, "tp": 2}, "model": {"flavor": flavor_name(2, False)},
              "fsdp": None, "ddp": {"kind": "fsdp_replicate", "mesh": {"dp_replicate": 2}}, "cp": None, "pipeline": None,
              "tp": {"mesh": {"tp": 2}, "sequence_parallel": False, "loss_parallel": True},
              "activation_checkpoint": {"blocks": ["layers.0", "layers.1"], "wrapped": ["layers.0"], "op_level": False},
              "compile": {"compiled_modules": 0}, "zero1": {"replicas": 2}, "moe": None, "mtp": None}
    assert unmet(record, point.expect()) == []
    record["activation_checkpoint"]["wrapped"] = ["layers.0", "layers.1"]  # full, not every second block
    record["tp"]["sequence_parallel"] = True
    del record["mesh"]
    assert unmet(record, point.expect()) == [
        "mesh should be {'dp_replicate': 2, 'tp': 2}, the run recorded nothing",
        "tp.sequence_parallel should be False, the run recorded True",
        "activation_checkpoint should be every second block wrapped, whole (selective 2), the run recorded "
        "{'blocks': ['layers.0', 'layers.1'], 'wrapped': ['layers.0', 'layers.1'], 'op_level': False}"]


def test_an_expert_parallel_point_expects_the_split_mesh_and_its_experts():
    """The MoE variant: the model switches to qwen3_moe_matrix, expert parallelism takes every rank it
    can borrow (here dp_shard 2 x tp 2 = 4), dp_shard shows as two mesh dims, and each rank must
    hold 8 / 4 experts."""
    point = lm._point({"moe": "ep"}, dp_shard=2, tp=2)
    assert point.ep_degree == 4 and "--training.expert_parallel_degree" in point.overrides()
    assert "qwen3_moe_matrix" in point.shared() and point.flavor == flavor_name(2, False, moe=True)
    expect = dict(point.expect())
    assert expect["mesh"] == {"dp_shard_mod_ep": 1, "dp_shard_in_ep": 2, "tp": 2}
    assert expect["moe.ep_mesh"] == {"ep": 4} and expect["moe.experts_per_rank"] == 2
    dense = lm._point({}, dp_shard=2, tp=2)
    assert dict(dense.expect())["moe"] is None and "qwen3_moe_matrix" not in dense.shared()


def test_a_point_whose_run_fails_is_an_error_with_its_output(tmp_path):
    """A crashed run (TrainingFailed) is the point's outcome "error" with the run's output, not an
    exception that ends the matrix; the runner trains nothing (tests/machinery/fake_runner.py)."""
    point = lm._point({}, dp_shard=2)
    runner = FakeRunner(fail=[point.name])
    outcome = lm.MatrixRunner(tmp_path, steps=2, runner=runner).run(point)
    assert outcome.status == "error" and outcome.comparison is None
    assert outcome.detail.startswith(f"training failed (1): {point.name}") and "a rank crashed" in outcome.detail
    assert [name.split("-")[0] for name in runner.calls] == ["seed", "baseline", point.name]  # the baseline trained
    with pytest.raises(ParityError, match=f"^{point.name}: expected ok, got error: training failed"):
        lm.MatrixRunner(tmp_path, steps=2, runner=runner).check(point)


def test_a_deepseek_v3_point_expects_experts_and_mtp_where_they_were_applied():
    """The DeepSeek-V3 variant: deepseek_v3_matrix with experts over every rank EP can borrow, and its
    MTP module on every rank, or on the last pipeline stage's ranks (pp rank 0's under a V schedule,
    where the stages fold back); context parallelism runs it without MTP, which it refuses."""
    point = lm._point({"moe": "dsv3"}, dp_shard=2, tp=2)
    assert point.name == "fsdp2_tp2+dsv3" and point.flavor == "D2" and point.ep_degree == 4
    assert "deepseek_v3_matrix" in point.shared() and "--model.mtp_depth" not in point.shared()
    expect = dict(point.expect())
    assert expect["moe.ep_mesh"] == {"ep": 4} and expect["moe.experts_per_rank"] == 2
    assert expect["mtp.depth"] == 1 and expect["mtp.ranks"] == [0, 1, 2, 3]
    one_f_one_b = dict(lm._point({"moe": "dsv3"}, dp_shard=2, pp=2).expect())
    assert one_f_one_b["mtp.ranks"] == [2, 3] and one_f_one_b["pipeline.schedule"] == "1F1B"
    v_shaped = lm._point({"moe": "dsv3", "schedule": "V"}, dp_shard=2, pp=2)
    assert dict(v_shaped.expect())["mtp.ranks"] == [0, 1] and v_shaped.depth == 4
    with_cp = lm._point({"moe": "dsv3"}, dp_shard=2, cp=2)
    assert with_cp.shared()[-2:] == ("--model.mtp_depth", "0") and dict(with_cp.expect())["mtp"] is None
    assert lm.refusal(with_cp) is None
    # Without the override the product refuses it (in one line naming the option).
    args = lm._config_args(with_cp)
    at = args.index("--model.mtp_depth")
    with pytest.raises(UserError, match="set model.mtp_depth 0 to train with context parallelism"):
        preflight(parse_args(args[:at] + args[at + 2:]), with_cp.nproc)
    assert dict(lm._point({"moe": "ep"}, dp_shard=2).expect())["mtp"] is None


def test_deepseek_v3_meets_every_dim_and_never_ties_embeddings(points):
    dsv3 = [p for p in points if p.value("moe") == "dsv3"]
    for dim in lm.DIMS:
        assert any(p.degrees.over(dim) for p in dsv3 if not p.refused_by_design), dim
    assert all(p.value("tied") != "tied" for p in dsv3)  # the family has no tied embeddings
    assert not [g.text for g in lm.coverage_goals() if "tied tied" in g.text and "dsv3" in g.text]
    assert any(p.dsv3 and p.degrees.over("cp") and not p.mtp for p in lm.ci_points(points))


def test_the_deepseek_v3_matrix_flavors_keep_a_dense_first_block_and_mtp():
    from torchtitan.models.train_spec import get_train_spec

    flavors = get_train_spec("deepseek_v3_matrix").config
    assert sorted(flavors) == sorted(flavor_name(d, False, dsv3=True) for d in (2, 4, 8, 16))
    for depth in (2, 4, 8, 16):
        args = flavors[flavor_name(depth, False, dsv3=True)]
        assert (args.n_layers, args.n_dense_layers, args.mtp_depth, args.num_experts) == (depth, 1, 1, 8)
