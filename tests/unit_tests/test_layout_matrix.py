"""The layout matrix generator (tests/machinery/layout_matrix.py, matrix_space.py): the points it must
contain, the pairwise coverage it promises, its refusals, and the CI and fast subsets. No training
runs here; refusals use the in-process preflight, runs the fake runner."""

import itertools

import pytest

from tests.machinery import layout_matrix as lm
from tests.machinery.fake_runner import FakeRunner
from tests.machinery.matrix_model import flavor_name
from tests.machinery.matrix_space import FACTOR, GROUP_RANKS, cost, make_point
from torchtitan.tools.parity import ParityError, unmet
from torchtitan.tools.parity_layouts import FLOAT8_SPLIT_TOLERANCE

Degrees = lm.Degrees


@pytest.fixture(scope="module")
def points():
    return lm.generate()


@pytest.fixture(scope="module")
def ci(points):
    return lm.ci_points(points)


def test_base_points_are_every_power_of_two_assignment():
    base = lm.all_degrees()
    assert len(base) == len(set(base)) == 1 + 5 + 15 + 35  # C(k+4, 4) assignments of 2^k over 5 dims
    assert {d.nproc for d in base} == {1, 2, 4, 8}
    assert Degrees(dp_replicate=2, cp=2) in base and Degrees(dp_replicate=2, dp_shard=2, cp=2) in base


def test_every_base_point_is_in_the_matrix(points):
    degrees = {p.degrees for p in points if not p.refused_by_design}
    assert set(lm.all_degrees()) - degrees == set()
    assert len({p.name for p in points}) == len(points)


def test_every_pair_of_values_and_every_value_with_every_dim_is_met(points):
    """The all-pairs promise: every goal (a value with each dim it can run beside, two values of two
    factors, a named combination) is met by a trained point or shown by a refused one."""
    assert lm.uncovered_goals(points, weight=1) == []
    goals = lm.coverage_goals()
    pairs = [g for g in goals if g.weight == 1]
    # Every factor meets every other: some pair of their values is a goal (unless one needs a model
    # the other excludes: no factor does).
    for f1, f2 in itertools.combinations(lm.FACTORS, 2):
        assert any({f1.name, f2.name} == {f for f, _ in g.values} for g in pairs), (f1.name, f2.name)
    for factor in lm.FACTORS:
        for value, dim in itertools.product(factor.values, factor.meets):
            holders = [p for p in points if p.value(factor.name) == value and dim in p.active_dims]
            if factor.models or dim == "ep":  # a factor of MoE models only meets ep on them; dense has no ep
                continue
            assert holders, (factor.name, value, dim)


def test_pairs_no_model_offers_are_not_goals():
    goals = {g.text for g in lm.coverage_goals()}
    assert "tied tied with model dsv3" not in goals and "model dsv3 with tied tied" not in goals
    assert not any("capacity on" in g and "model dense" in g for g in goals)  # capacity exists on MoE models only
    assert not any("mtp off" in g and "model moe" in g for g in goals)  # MTP is DeepSeek-V3's


def test_points_are_refused_exactly_when_planned_and_each_refusal_is_one_line(points):
    for p in points:
        reason = lm.refusal(p)
        assert (reason is not None) == p.refused_by_design, (p.name, reason)
        if reason is not None:
            assert "\n" not in reason and len(reason) < 400, reason
    refused = [p for p in points if p.refused_by_design]
    trained = [p for p in points if not p.refused_by_design]
    assert refused
    # A refused point is there to show a goal no trained point could meet.
    for p in refused:
        assert any(g.met_by(p) and not any(g.met_by(q) for q in trained) for g in lm.coverage_goals()), p.name


def test_a_pair_the_product_cannot_hold_is_shown_refused(points):
    """DeepSeek-V3's multi-token prediction with the chunked loss (whose output head returns a
    loss, where MTP needs logits): its goals are met only by refused points."""
    chunked = [p for p in points if p.mtp and p.on("chunked")]
    assert chunked and all(p.refused_by_design for p in chunked)
    assert "does not compose with multi-token prediction" in lm.refusal(chunked[0])
    assert any(p.dsv3 and not p.mtp and p.on("chunked") and not p.refused_by_design for p in points)


def test_multi_token_prediction_trains_under_context_parallelism(points, ci):
    """MTP takes the labels ahead from the next chunk's cp rank: the matrix trains it beside CP, in CI too."""
    assert any(p.mtp and p.degrees.over("cp") and not p.refused_by_design for p in ci)


def test_ci_subset(points, ci):
    """Every refused point; trained points meeting every required goal; the rest within the budget."""
    assert [p for p in points if p.refused_by_design] == [p for p in ci if p.refused_by_design]
    trained = [p for p in ci if not p.refused_by_design]
    assert lm.uncovered_goals(trained) == [] or all(  # the named combinations run in CI
        not any(g.text == t for g in lm.NAMED_GOALS) for t in lm.uncovered_goals(trained))
    for f in lm.FACTORS:
        for v in f.values:
            assert any(p.value(f.name) == v for p in trained), (f.name, v)
    for pair in itertools.combinations(lm.DIMS, 2):
        assert any(all(p.degrees.over(d) for d in pair) for p in trained), pair
    required = lm.ci_points(points, budget=0)
    assert sum(map(cost, trained)) <= max(lm.CI_BUDGET, sum(cost(p) for p in required if not p.refused_by_design))
    assert {p.schedule for p in trained if p.schedule} >= {kind[0] for kind in lm.SCHEDULES.values()}


def test_ci_compiles_only_the_points_a_goal_needs(points, ci):
    """A compiled point costs 5-10 eager ones on a CPU: CI keeps compile where a goal needs it and
    runs the other compiled points eager; refused points keep compile, their refusal being the point."""
    as_generated = {p.eager(): p for p in points}
    assert all(p == as_generated[p.eager()] or not p.on("compile") for p in ci)
    compiled = [p for p in ci if p.on("compile") and not p.refused_by_design]
    assert compiled
    assert all(as_generated[p.eager()] == p for p in ci if p.refused_by_design)
    for p in compiled:  # none of them is spare: without it, a goal goes unmet
        assert lm.uncovered_goals([q.eager() if q == p else q for q in ci]) != [], p.name


def test_the_fast_tier_trains_every_value_once(ci):
    """Every dim and every factor's value but a plain run's (compile's aside) that CI's small eager
    points train."""
    fast = lm.fast_points(ci)
    trained = [p for p in fast if not p.refused_by_design]
    small = [p for p in ci if p.nproc <= 4 and not p.on("compile") and not p.refused_by_design]
    assert all(p.nproc <= 4 and not p.on("compile") for p in trained)
    for f in lm.FACTORS:
        for v in f.values[1:] if f.name != "compile" else ():
            if any(p.value(f.name) == v for p in small):
                assert any(p.value(f.name) == v for p in trained), (f.name, v)
        assert any(p.on(f.name) for p in trained) or f.name == "compile", f.name  # every feature once
    assert {d for p in trained for d in p.active_dims} == set(lm.ALL_DIMS)
    assert sum(p.refused_by_design for p in fast) == 1


def test_points_run_the_depth_their_pipeline_needs(points):
    for p in points:
        stages = p.degrees.pp * (2 if p.value("schedule") in ("interleaved", "V") else 1)
        assert p.depth >= stages and p.depth in (2, 4, 8, 16)


def test_generation_is_deterministic(points):
    lm.coverage_goals.cache_clear()
    assert lm.generate.__wrapped__() == points


def test_a_point_refused_against_the_plan_fails_the_check(tmp_path):
    op_ac_with_split_backward = make_point({"ac": "op", "schedule": "V"}, pp=2)
    assert lm.refusal(op_ac_with_split_backward) is not None and not op_ac_with_split_backward.refused_by_design
    with pytest.raises(ParityError, match="expected ok, got refused"):
        lm.MatrixRunner(tmp_path).check(op_ac_with_split_backward)


def plain_record(point) -> dict:
    """A setup record of `point` as the run writes it when every factor is at its plain value."""
    return {"world_size": point.degrees.nproc, "mesh": point.mesh(), "model": {"flavor": point.flavor},
            "fsdp": None, "ddp": None, "tp": None, "cp": None, "pipeline": None, "zero1": None, "moe": None,
            "mtp": None, "muon": None, "float8": None, "chunked_loss": None, "compile": {"compiled_modules": 0},
            "optimizer": {"names": ["AdamW"], "state_dtypes": ["float32"]},
            "data": {"workers": 0, "shuffle": False, "document_mask": False},
            "activation_checkpoint": {"blocks": ["layers.0", "layers.1"], "wrapped": [], "op_level": False, "offloaded": []}}


def test_a_point_expects_its_layout_and_variants_in_the_setup_record():
    """Point.expect() against a hand-made setup record (torchtitan/observability/setup_record.py): met, and a
    variant or feature that was not applied as declared is named."""
    point = make_point({"ac": "selective", "zero1": "on", "sp": "off", "state": "bf16", "workers": "2"},
                       dp_replicate=2, tp=2)
    record = {**plain_record(point), "ddp": {"kind": "fsdp_replicate", "mesh": {"dp_replicate": 2}},
              "tp": {"mesh": {"tp": 2}, "sequence_parallel": False, "loss_parallel": True}, "zero1": {"replicas": 2},
              "optimizer": {"names": ["LowPrecisionAdam"], "state_dtypes": ["bfloat16"]},
              "data": {"workers": 2, "shuffle": False, "document_mask": False}}
    record["activation_checkpoint"]["wrapped"] = ["layers.0"]
    assert unmet(record, point.expect()) == []
    record["activation_checkpoint"]["wrapped"] = ["layers.0", "layers.1"]  # full, not every second block
    record["tp"]["sequence_parallel"] = True
    record["optimizer"]["state_dtypes"] = ["float32"]
    del record["mesh"]
    assert unmet(record, point.expect()) == [
        "mesh should be {'dp_replicate': 2, 'tp': 2}, the run recorded nothing",
        "tp.sequence_parallel should be False, the run recorded True",
        "activation_checkpoint should be every second block wrapped, whole (selective 2), the run recorded "
        "{'blocks': ['layers.0', 'layers.1'], 'wrapped': ['layers.0', 'layers.1'], 'op_level': False, 'offloaded': []}",
        "optimizer.state_dtypes should be ['bfloat16'], the run recorded ['float32']"]


def test_a_feature_point_splits_its_options_by_what_the_reference_runs():
    """Options that define the weights go to the seed; those that change one process's numbers to the
    reference too; those that must not change them only to the point's own run."""
    point = make_point({"model": "dsv3", "mtp": "off", "optimizer": "muon", "docmask": "on", "chunked": "on",
                        "offload": "on", "resume": "on", "cp_method": "allgather", "float8": "on"}, cp=2)
    model, shared, own = point.model_args(), point.shared(), point.overrides()
    assert "--model.mtp_depth" in model and "--optimizer.name" not in model
    assert shared[:len(model)] == model and {"--optimizer.name", "--training.document_mask",
                                             "--float8.enable_float8_linear"} <= set(shared)
    assert {"--training.loss_chunk_size", "--activation_checkpoint.offload", "--checkpoint.enable_checkpoint",
            "--experimental.context_parallel_method"} <= set(own)
    assert not set(own) & {"--optimizer.name", "--model.mtp_depth", "--training.document_mask"}
    layout = point.layout()
    assert layout.model == model and layout.shared == shared and layout.loss_tolerance == FLOAT8_SPLIT_TOLERANCE
    assert point.name == "cp2+dsv3+allgather+muon+chunked+offload+no_mtp+docmask+float8+resume"


def test_a_replica_group_point_runs_two_groups_of_its_ranks():
    point = make_point({"groups": "on"}, dp_shard=2)
    assert point.nproc == 4 and point.layout().nproc == 2 and point.layout().replica_groups == 2
    assert point.audit() == ()  # the groups' verdict is read on the host every step
    # Groups exist on points of up to GROUP_RANKS ranks (twice that many processes).
    assert make_point({"groups": "on"}, dp_shard=2, tp=2).nproc == 2 * GROUP_RANKS
    assert make_point({"groups": "on"}, dp_shard=2, tp=2, pp=2).value("groups") is None


def test_an_expert_parallel_point_expects_the_split_mesh_and_its_experts():
    """The MoE model: qwen3_moe_matrix, expert parallelism takes every rank it can borrow (here dp_shard
    2 x tp 2 = 4), dp_shard shows as two mesh dims, and each rank must hold 8 / 4 experts."""
    point = make_point({"model": "moe"}, dp_shard=2, tp=2)
    assert point.ep_degree == 4 and "--training.expert_parallel_degree" in point.overrides()
    assert "qwen3_moe_matrix" in point.shared() and point.flavor == flavor_name(2, False, moe=True)
    assert "ep" in point.active_dims
    expect = dict(point.expect())
    assert expect["mesh"] == {"dp_shard_mod_ep": 1, "dp_shard_in_ep": 2, "tp": 2}
    assert expect["moe.ep_mesh"] == {"ep": 4} and expect["moe.experts_per_rank"] == 2
    dense = make_point({}, dp_shard=2, tp=2)
    assert dict(dense.expect())["moe"] is None and "qwen3_moe_matrix" not in dense.shared()
    alone = make_point({"model": "moe"}, pp=2)  # nothing for EP to borrow: experts whole on each rank
    assert alone.ep_degree == 1 and "ep" not in alone.active_dims and dict(alone.expect())["moe.ep_mesh"] is None


def test_a_point_whose_run_fails_is_an_error_with_its_output(tmp_path):
    """A crashed run (TrainingFailed) is the point's outcome "error" with the run's output, not an
    exception that ends the matrix; the runner trains nothing (tests/machinery/fake_runner.py)."""
    point = make_point({}, dp_shard=2)
    runner = FakeRunner(fail=[point.name])
    outcome = lm.MatrixRunner(tmp_path, steps=2, runner=runner).run(point)
    assert outcome.status == "error" and outcome.comparison is None
    assert outcome.detail.startswith(f"training failed (1): {point.name}") and "a rank crashed" in outcome.detail
    assert [name.split("-")[0] for name in runner.calls] == ["seed", "baseline", point.name]  # the baseline trained
    with pytest.raises(ParityError, match=f"^{point.name}: expected ok, got error: training failed"):
        lm.MatrixRunner(tmp_path, steps=2, runner=runner).check(point)


def test_a_resumed_point_must_repeat_its_losses_bit_for_bit(tmp_path):
    """A point that resumes trains again from its checkpoint of step 2: equal losses pass, a resumed
    run one ulp off fails; the setup expectations of the fake record are switched off here."""
    point = make_point({"resume": "on"}, dp_shard=2)
    layout = point.layout().__class__(point.name, 2, point.overrides(), (), point.shared(), model=point.model_args())
    harness = lm.MatrixRunner(tmp_path / "same", steps=4, runner=FakeRunner()).harness
    assert harness.resume(layout, 2) == ([9.7, 9.6], [9.7, 9.6])
    off = FakeRunner(change={f"{point.name}-resumed-2": lambda rows: [
        {**r, "loss": r["loss"] + 1e-15} if r.get("step") == 4 and "record" not in r else r for r in rows]})
    harness = lm.MatrixRunner(tmp_path / "off", steps=4, runner=off).harness
    uninterrupted, resumed = harness.resume(layout, 2)
    assert uninterrupted[0] == resumed[0] and uninterrupted[1] != resumed[1]


def test_a_deepseek_v3_point_expects_experts_and_mtp_where_they_were_applied():
    """The DeepSeek-V3 model: deepseek_v3_matrix with experts over every rank EP can borrow, and its
    MTP module on every rank, or on the last pipeline stage's ranks (pp rank 0's under a V schedule,
    where the stages fold back); with MTP off, no MTP module is expected; context parallelism runs MTP too."""
    point = make_point({"model": "dsv3"}, dp_shard=2, tp=2)
    assert point.name == "fsdp2_tp2+dsv3" and point.flavor == "D2" and point.ep_degree == 4
    assert "deepseek_v3_matrix" in point.shared() and "--model.mtp_depth" not in point.shared()
    expect = dict(point.expect())
    assert expect["moe.ep_mesh"] == {"ep": 4} and expect["moe.experts_per_rank"] == 2
    assert expect["mtp.depth"] == 1 and expect["mtp.ranks"] == [0, 1, 2, 3]
    one_f_one_b = dict(make_point({"model": "dsv3"}, dp_shard=2, pp=2).expect())
    assert one_f_one_b["mtp.ranks"] == [2, 3] and one_f_one_b["pipeline.schedule"] == "1F1B"
    v_shaped = make_point({"model": "dsv3", "schedule": "V"}, dp_shard=2, pp=2)
    assert dict(v_shaped.expect())["mtp.ranks"] == [0, 1] and v_shaped.depth == 4
    with_cp = make_point({"model": "dsv3", "mtp": "off"}, dp_shard=2, cp=2)
    assert with_cp.model_args()[-2:] == ("--model.mtp_depth", "0") and dict(with_cp.expect())["mtp"] is None
    assert lm.refusal(with_cp) is None
    with_mtp = make_point({"model": "dsv3"}, dp_shard=2, cp=2)
    assert lm.refusal(with_mtp) is None and dict(with_mtp.expect())["mtp.ranks"] == [0, 1, 2, 3]


def test_deepseek_v3_meets_every_dim_and_never_ties_embeddings(points, ci):
    dsv3 = [p for p in points if p.dsv3]
    for dim in lm.DIMS:
        assert any(p.degrees.over(dim) for p in dsv3 if not p.refused_by_design), dim
    assert all(p.value("tied") != "tied" for p in dsv3)  # the family has no tied embeddings
    assert any(p.dsv3 and p.degrees.over("cp") and p.mtp for p in ci if not p.refused_by_design)


def test_gpt_oss_meets_every_dim_and_never_ties_embeddings(points, ci):
    """The gpt-oss variant (sinks, banded blocks, biased experts): trained beside every parallel dim
    in the whole matrix, and in the CI subset beside some (its parity rows, test_parity.py's 10-step
    ones, train it beside each dim in CI, context parallelism's banded ring included)."""
    gpt = [p for p in points if p.gptoss]
    for dim in (*lm.DIMS, "ep"):
        assert any(dim in p.active_dims for p in gpt if not p.refused_by_design), dim
    assert all(p.value("tied") != "tied" for p in gpt)
    assert any(p.gptoss and p.active_dims for p in ci if not p.refused_by_design)
    point = make_point({"model": "gptoss"}, dp_shard=2, tp=2)
    assert point.name == "fsdp2_tp2+gptoss" and point.flavor == "G2" and point.ep_degree == 4
    assert "gpt_oss_matrix" in point.shared()


def test_the_gpt_oss_matrix_flavors_alternate_banded_and_full_blocks():
    from torchtitan.models.train_spec import get_train_spec

    flavors = get_train_spec("gpt_oss_matrix").config
    assert sorted(flavors) == sorted(flavor_name(d, False, gptoss=True) for d in (2, 4, 8, 16))
    for depth in (2, 4, 8, 16):
        args = flavors[flavor_name(depth, False, gptoss=True)]
        assert args.n_layers == depth and [args.layer_window(i) for i in range(2)] == [8, None]


def test_the_deepseek_v3_matrix_flavors_keep_a_dense_first_block_and_mtp():
    from torchtitan.models.train_spec import get_train_spec

    flavors = get_train_spec("deepseek_v3_matrix").config
    assert sorted(flavors) == sorted(flavor_name(d, False, dsv3=True) for d in (2, 4, 8, 16))
    for depth in (2, 4, 8, 16):
        args = flavors[flavor_name(depth, False, dsv3=True)]
        assert (args.n_layers, args.n_dense_layers, args.mtp_depth, args.num_experts) == (depth, 1, 1, 8)


def test_every_factor_declares_how_it_relates_to_the_reference():
    assert {f.kind for f in lm.FACTORS} == {"model", "numerics", "layout"}
    assert FACTOR["model"] is lm.FACTORS[0]  # the others' existence depends on it
    for f in lm.FACTORS:
        assert set(f.args) <= set(f.values[1:]) | set(f.values), f.name
