"""Tests for pipeline-parallel planning, all on one process without any process group.

Covers `torchtitan.parallelisms.pipeline` (schedule table, `plan_pipeline` validation both
directly and through the config checks before start-up, stage placement, the cost-balanced split, bubble formulas)
and the model-dependent part of `torchtitan.models.llama.pipeline_llama` (cost estimate, split
points, pre-flight validation and cutting a model into stage modules).
"""

import dataclasses
import itertools
import random
from pathlib import Path

import pytest
import torch

from torchtitan.config import rules
from torchtitan.config.manager import ConfigError, JobConfig, parse_args
from torchtitan.models.llama.model import ModelArgs, Transformer
from torchtitan.models.llama.parallelize_llama import validate_llama
from torchtitan.models.llama.pipeline_llama import build_stage_module
from torchtitan.models.llama.pipeline_split import parse_split_points, split_points_for, unit_costs
from torchtitan.parallelisms import pipeline
from torchtitan.parallelisms.parallel_dims import parallel_dims_from_config
from torchtitan.parallelisms.pipeline import (
    SCHEDULES,
    PipelinePlan,
    balanced_split,
    plan_pipeline,
    stage_ids_for_rank,
    stage_ranks,
    theoretical_bubble,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
SHIPPED_CSV = REPO_ROOT / "train_configs" / "pipeline_schedules" / "1f1b_pp2_2microbatches.csv"
SMALL_ARGS = ModelArgs(dim=64, n_layers=8, n_heads=4, vocab_size=100)


def checked(argv: list[str]) -> JobConfig:
    """parse_args (the options phase), then the shapes phase that makes the pipeline plan: the
    checks the launcher runs, and each rank before start-up."""
    config = parse_args(argv)
    rules.check_shapes(config)
    return config


def pp_config(pp=2, schedule="1F1B", batch_size=8, **experimental) -> JobConfig:
    """The config checks with pipeline options; `foo=3` becomes --experimental.pipeline_parallel_foo 3."""
    argv = [
        "--experimental.pipeline_parallel_degree", str(pp),
        "--experimental.pipeline_parallel_schedule", schedule,
        "--training.batch_size", str(batch_size),
    ]
    for key, value in experimental.items():
        argv += [f"--experimental.pipeline_parallel_{key}", str(value)]
    return checked(argv)


def raw_config(pp=2, schedule="1F1B", batch_size=8, **experimental) -> JobConfig:
    """The same options set without validate(), so plan_pipeline itself must catch mistakes."""
    config = JobConfig()
    config.training.batch_size = batch_size
    config.experimental = dataclasses.replace(
        config.experimental,
        pipeline_parallel_degree=pp,
        pipeline_parallel_schedule=schedule,
        **{f"pipeline_parallel_{key}": value for key, value in experimental.items()},
    )
    return config


# ----------------------------------------------------------------------------- plan_pipeline: defaults


def test_single_stage_default_is_one_stage_per_rank_and_one_microbatch_per_stage():
    plan = plan_pipeline(pp_config(pp=2, schedule="1F1B"))
    assert plan == PipelinePlan("1F1B", pp=2, stages_per_rank=1, microbatches=2)
    assert plan.num_stages == 2
    assert plan.v_shape is False


@pytest.mark.parametrize("schedule", ["Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"])
def test_multi_stage_default_is_two_stages_per_rank(schedule):
    plan = plan_pipeline(pp_config(pp=2, schedule=schedule))
    assert (plan.stages_per_rank, plan.num_stages, plan.microbatches) == (2, 4, 4)
    assert plan.v_shape == (schedule in ("ZBVZeroBubble", "DualPipeV"))


def test_schedule_table_flags():
    # Exactly the two V schedules are V-shaped, and V implies several stages per rank.
    assert {name for name, kind in SCHEDULES.items() if kind.v_shape} == {"ZBVZeroBubble", "DualPipeV"}
    assert all(kind.multi_stage for kind in SCHEDULES.values() if kind.v_shape)
    assert not SCHEDULES["GPipe"].multi_stage and not SCHEDULES["1F1B"].multi_stage


@pytest.mark.parametrize("typed, canonical", [("interleaved1f1b", "Interleaved1F1B"), ("GPIPE", "GPipe"),
                                              ("zbvZeroBubble", "ZBVZeroBubble")])
def test_schedule_name_is_case_insensitive(typed, canonical):
    assert plan_pipeline(pp_config(schedule=typed)).schedule == canonical


def test_explicit_stages_and_microbatch_size():
    # 3 stages per rank is fine for a looped schedule; 12 / 2 = 6 microbatches, a multiple of pp.
    plan = plan_pipeline(pp_config(pp=2, schedule="Interleaved1F1B", batch_size=12, stages_per_rank=3,
                                   microbatch_size=2))
    assert (plan.num_stages, plan.microbatches) == (6, 6)


def test_plan_for_pp1_without_validate():
    # validate() skips planning when pp == 1, but a direct call must still give a sane plan.
    assert plan_pipeline(JobConfig()) == PipelinePlan("1F1B", 1, 1, 1)


# ----------------------------------------------------------------------------- plan_pipeline: refusals


def test_unknown_schedule_lists_choices():
    with pytest.raises(ConfigError) as info:
        pp_config(schedule="Zigzag")
    message = str(info.value)
    assert "'Zigzag'" in message
    assert all(name in message for name in SCHEDULES)


# Each case: options, a fragment the message must contain. Checked via the config checks and directly.
REFUSED = {
    "stages_per_rank_on_single_stage": (dict(schedule="1F1B", stages_per_rank=2), "one stage per rank"),
    "stages_per_rank_on_gpipe": (dict(schedule="GPipe", stages_per_rank=3), "one stage per rank"),
    "stages_per_rank_zero": (dict(schedule="Interleaved1F1B", stages_per_rank=0), "stages_per_rank must be >= 1"),
    "zbv_three_stages": (dict(schedule="ZBVZeroBubble", stages_per_rank=3, batch_size=6), "exactly 2 stages"),
    "dualpipev_three_stages": (dict(schedule="DualPipeV", stages_per_rank=3, batch_size=6), "exactly 2 stages"),
    "size_and_count": (dict(microbatch_size=2, microbatches=4), "not both"),
    "batch_not_divisible_by_count": (dict(batch_size=6, microbatches=4), "must split into"),
    "batch_not_divisible_by_size": (dict(batch_size=6, microbatch_size=4), "must divide training.batch_size"),
    "zero_microbatches": (dict(microbatches=0), "must split into"),
    # 1F1B's warm-up puts one microbatch in flight per stage, so 2 cannot fill 4 stages.
    "1f1b_too_few": (dict(pp=4, schedule="1F1B", microbatches=2), "needs at least 4 microbatches"),
    "zbv_too_few": (dict(pp=2, schedule="ZBVZeroBubble", microbatches=2), "needs at least 4 microbatches"),
    "interleaved_too_few": (dict(pp=4, schedule="Interleaved1F1B", microbatches=2), "needs at least 4 microbatches"),
    # 3 microbatches are enough for pp 2 but do not form whole rounds of 2.
    "interleaved_not_multiple": (dict(pp=2, schedule="Interleaved1F1B", batch_size=6, microbatches=3), "rounds"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_refused_by_the_config_checks(case):
    options, fragment = REFUSED[case]
    with pytest.raises(ConfigError, match=fragment):
        pp_config(**options)


@pytest.mark.parametrize("case", REFUSED)
def test_refused_by_plan_pipeline(case):
    options, fragment = REFUSED[case]
    with pytest.raises(ConfigError, match=fragment):
        plan_pipeline(raw_config(**options))


def test_a_schedule_the_installed_pytorch_lacks_is_one_line(monkeypatch):
    """SCHEDULES lists what this project knows; an older PyTorch may lack one (simulated here)."""
    from torchtitan.parallelisms import pipeline_runtime

    def unknown(name):
        raise ValueError(f"Unknown schedule type {name}")

    monkeypatch.setattr(pipeline_runtime.schedules, "get_schedule_class", unknown)
    with pytest.raises(ConfigError) as e:
        pipeline_runtime.build_schedule(plan_pipeline(pp_config(pp=2, schedule="Interleaved1F1B")), [], None)
    assert str(e.value) == (f"pipeline schedule Interleaved1F1B is not in the installed PyTorch {torch.__version__}; "
                            "pick another experimental.pipeline_parallel_schedule")


def test_just_enough_microbatches_accepted():
    # The boundary of the refusals above: exactly num_stages for 1F1B, exactly pp rounds for interleaved.
    assert plan_pipeline(pp_config(pp=4, schedule="1F1B", microbatches=4)).microbatches == 4
    assert plan_pipeline(pp_config(pp=2, schedule="Interleaved1F1B", batch_size=6, microbatches=2)).microbatches == 2
    assert plan_pipeline(pp_config(pp=4, schedule="GPipe", microbatches=1)).microbatches == 1


def test_missing_csv_refused(tmp_path):
    missing = tmp_path / "no_such_schedule.csv"
    with pytest.raises(ConfigError, match="no such file"):
        pp_config(schedule_csv=missing)
    with pytest.raises(ConfigError, match="no such file"):
        plan_pipeline(raw_config(schedule_csv=str(missing)))


def test_a_csv_that_cannot_be_read_as_text_is_one_line(tmp_path, monkeypatch):
    # Found by the config fuzzing (test_config_fuzz.py): a binary file was a UnicodeDecodeError traceback.
    binary = tmp_path / "schedule.csv"
    binary.write_bytes(b"0F0,\x80\x81")
    with pytest.raises(ConfigError) as refused:
        plan_pipeline(raw_config(schedule_csv=str(binary)))
    assert refused.value.line == (f"error: experimental.pipeline_parallel_schedule_csv {binary} is not a CSV text "
                                  "file (byte 4 is not UTF-8)")

    def unreadable(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(pipeline, "open", unreadable, raising=False)  # root reads any file: a refused read stands in
    with pytest.raises(ConfigError, match=r"schedule_csv .*schedule.csv: cannot read it: Permission denied$"):
        plan_pipeline(raw_config(schedule_csv=str(binary)))


def test_shipped_csv_gives_csv_plan():
    assert SHIPPED_CSV.is_file()
    plan = plan_pipeline(pp_config(pp=2, schedule_csv=SHIPPED_CSV))
    assert plan == PipelinePlan("CSV", pp=2, stages_per_rank=1, microbatches=2, csv_path=str(SHIPPED_CSV))
    # The shipped CSV by its bundled name, from any working directory: the plan carries its path.
    bundled = plan_pipeline(pp_config(pp=2, schedule_csv="bundled:train_configs/pipeline_schedules/1f1b_pp2_2microbatches.csv"))
    assert Path(bundled.csv_path).read_text() == SHIPPED_CSV.read_text()
    assert plan.v_shape is False
    # Its file is two rows (one per rank) of forward/backward actions on 2 microbatches.
    rows = SHIPPED_CSV.read_text().split()
    assert len(rows) == plan.pp and all(len(row.split(",")) == 2 * plan.microbatches for row in rows)


@pytest.mark.parametrize("schedule", [s for s, kind in SCHEDULES.items() if kind.split_backward])
def test_op_level_checkpointing_refused_with_split_backward_schedules(schedule):
    op_ac = ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"]
    base = ["--experimental.pipeline_parallel_degree", "2", "--experimental.pipeline_parallel_schedule", schedule]
    with pytest.raises(ConfigError, match="selective_ac_option 'op' cannot run under pipeline schedule"):
        checked([*base, *op_ac])
    # Block-level checkpointing, and op-level with a schedule that runs backward in one pass, are fine.
    assert plan_pipeline(parse_args([*base, "--activation_checkpoint.mode", "full"])).split_backward
    assert not plan_pipeline(parse_args([*op_ac, *base[:3], "Interleaved1F1B"])).split_backward


def test_csv_with_weight_gradient_actions_splits_backward(tmp_path):
    csv = tmp_path / "zb.csv"
    csv.write_text("0F0,0I0,0W0\n1F0,1I0,1W0\n")
    assert plan_pipeline(pp_config(pp=2, schedule_csv=csv, microbatches=1)).split_backward
    assert not plan_pipeline(pp_config(pp=2, schedule_csv=SHIPPED_CSV)).split_backward
    with pytest.raises(ConfigError, match="schedule CSV"):
        checked(["--experimental.pipeline_parallel_degree", "2", "--experimental.pipeline_parallel_schedule_csv",
                 str(csv), "--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option",
                 "op"])


# ----------------------------------------------------------------------------- stage placement


def test_loop_placement():
    plan = PipelinePlan("Interleaved1F1B", pp=2, stages_per_rank=2, microbatches=4)
    assert stage_ids_for_rank(0, plan) == [0, 2]
    assert stage_ids_for_rank(1, plan) == [1, 3]


def test_v_placement():
    plan = PipelinePlan("ZBVZeroBubble", pp=2, stages_per_rank=2, microbatches=4)
    assert stage_ids_for_rank(0, plan) == [0, 3]
    assert stage_ids_for_rank(1, plan) == [1, 2]


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("schedule, stages_per_rank", [("1F1B", 1), ("Interleaved1F1B", 2), ("LoopedBFS", 3),
                                                       ("DualPipeV", 2), ("ZBVZeroBubble", 2)])
def test_every_stage_placed_exactly_once(pp, schedule, stages_per_rank):
    plan = PipelinePlan(schedule, pp, stages_per_rank, microbatches=pp * stages_per_rank)
    placed = [s for rank in range(pp) for s in stage_ids_for_rank(rank, plan)]
    assert sorted(placed) == list(range(plan.num_stages))
    assert all(len(stage_ids_for_rank(rank, plan)) == stages_per_rank for rank in range(pp))
    # stage_ranks is the same placement seen from the stages.
    assert stage_ranks(plan) == {s: rank for rank in range(pp) for s in stage_ids_for_rank(rank, plan)}
    assert sorted(stage_ranks(plan)) == list(range(plan.num_stages))


# ----------------------------------------------------------------------------- balanced_split


def brute_force_best(costs, num_stages):
    """Smallest possible maximum part cost over every way to place the cuts."""
    best = float("inf")
    for starts in itertools.combinations(range(1, len(costs)), num_stages - 1):
        bounds = [0, *starts, len(costs)]
        best = min(best, max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


def test_balanced_split_is_optimal_on_random_costs():
    rng = random.Random(1234)
    for _ in range(20):
        n = rng.randint(1, 9)
        costs = [rng.uniform(0.1, 10.0) for _ in range(n)]
        for num_stages in range(1, n + 1):
            starts = balanced_split(costs, num_stages)
            bounds = [0, *starts, n]
            assert len(starts) == num_stages - 1
            assert all(a < b for a, b in zip(bounds, bounds[1:])), f"empty part in {bounds}"
            worst = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
            assert worst == pytest.approx(brute_force_best(costs, num_stages)), (costs, num_stages, starts)


def test_balanced_split_equal_costs_split_evenly():
    assert balanced_split([1.0] * 8, 2) == [4]
    assert balanced_split([1.0] * 8, 4) == [2, 4, 6]
    assert balanced_split([3.0] * 6, 6) == [1, 2, 3, 4, 5]


def test_balanced_split_isolates_a_dominant_unit():
    # The last unit alone outweighs all others together, so it must be a stage by itself.
    assert balanced_split([1.0, 1.0, 1.0, 1.0, 10.0], 2) == [4]


@pytest.mark.parametrize("num_stages", [0, 4])
def test_balanced_split_refuses_impossible_counts(num_stages):
    with pytest.raises(ConfigError, match="cannot split 3 units"):
        balanced_split([1.0, 2.0, 3.0], num_stages)


# ----------------------------------------------------------------------------- theoretical_bubble


def test_bubble_1f1b():
    # p=2, m=2: each rank spans m + p - 1 = 3 slots and works in 2 of them, so it idles 1/3.
    assert theoretical_bubble("1F1B", p=2, m=2, v=1) == pytest.approx(1 / 3)
    # More microbatches amortize the fill and drain.
    assert theoretical_bubble("1F1B", p=4, m=16, v=1) < theoretical_bubble("1F1B", p=4, m=4, v=1)


def test_bubble_interleaved_smaller_than_1f1b():
    for p, m in [(2, 4), (4, 8), (8, 16)]:
        assert theoretical_bubble("Interleaved1F1B", p, m, v=2) < theoretical_bubble("1F1B", p, m, v=1)


def test_bubble_looped_bfs():
    # p=2, m=4, v=2 in chunk-times: rank 0 runs stage 0 on mb 0-3 (t 0-4), then stage 2, whose
    # input (stage 1, mb 0) is ready at t=2, so it never waits; rank 1 ends at t=9 -> 8 of 9 busy.
    assert theoretical_bubble("LoopedBFS", p=2, m=4, v=2) == pytest.approx(1 / 9)
    # p=4, m=2, v=2: rank 0 idles t 2-4 waiting for mb 0 to come round; the last rank ends at
    # 4 + 2 + 3 = 9 having worked 4 -> 5/9.
    assert theoretical_bubble("LoopedBFS", p=4, m=2, v=2) == pytest.approx(5 / 9)
    # One stage per rank is plain GPipe.
    assert theoretical_bubble("LoopedBFS", p=4, m=8, v=1) == pytest.approx(theoretical_bubble("GPipe", 4, 8, 1))


@pytest.mark.parametrize("schedule", ["InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"])
def test_bubble_unknown_for_zero_bubble_schedules(schedule):
    assert theoretical_bubble(schedule, p=4, m=8, v=2) is None


# ----------------------------------------------------------------------------- llama: split points


def test_auto_split_small_vocab_is_even():
    # With a 100-token vocabulary the 8 blocks cost nearly the same, so two stages take 4 each.
    plan = plan_pipeline(pp_config(pp=2))
    assert split_points_for(SMALL_ARGS, pp_config(pp=2), plan) == [4]


def test_auto_split_huge_vocab_lightens_last_stage():
    args = ModelArgs(dim=64, n_layers=8, n_heads=4, vocab_size=200_000)
    costs = unit_costs(args, seq_len=2048)
    # The output projection (6 * vocab * dim FLOPs per token) is charged to the last block only.
    assert costs[-1] - costs[1] == pytest.approx(6 * 200_000 * 64)
    config = pp_config(pp=2)
    starts = split_points_for(args, config, plan_pipeline(config))
    assert len(starts) == 1
    first_blocks, last_blocks = starts[0], args.n_layers - starts[0]
    assert last_blocks < first_blocks
    # Here the projection outweighs the 7 other blocks together, so the last block stands alone.
    assert sum(costs[:7]) < costs[7]
    assert starts == [7]


def test_unit_costs_grow_with_sequence_length():
    # Attention scores cost more per token for longer sequences; the blocks must reflect that.
    short, long = unit_costs(SMALL_ARGS, 128), unit_costs(SMALL_ARGS, 4096)
    assert len(short) == SMALL_ARGS.n_layers
    assert long[3] > short[3]


def test_given_split_points_are_used():
    config = pp_config(pp=2, split_points="layers.3")
    assert split_points_for(SMALL_ARGS, config, plan_pipeline(config)) == [3]


@pytest.mark.parametrize("points", [["layer.3"], ["layers.0"], ["layers.8"], ["layers.x"], ["layers.-1"],
                                    ["layers.4.attention"], ["layers.5", "layers.2"], ["layers.3", "layers.3"]])
def test_parse_split_points_refuses(points):
    with pytest.raises(ConfigError, match="pipeline_parallel_split_points"):
        parse_split_points(points, n_layers=8)


def test_parse_split_points_accepts_valid():
    assert parse_split_points(["layers.1", "layers.4", "layers.7"], n_layers=8) == [1, 4, 7]


def test_split_point_count_must_match_stages():
    # Two points make 3 stages, but pp 2 with 1 stage per rank has 2.
    config = pp_config(pp=2, split_points="layers.2,layers.4")
    with pytest.raises(ConfigError, match="need 2"):
        split_points_for(SMALL_ARGS, config, plan_pipeline(config))


def _validate_pp(args: ModelArgs, config: JobConfig) -> None:
    """validate_llama as preflight calls it: with the job's one pipeline plan."""
    pp = config.experimental.pipeline_parallel_degree
    validate_llama(args, parallel_dims_from_config(config, pp), plan_pipeline(config), config)


def test_validate_llama_checks_the_pipeline_split():
    _validate_pp(SMALL_ARGS, pp_config(pp=2))
    _validate_pp(dataclasses.replace(SMALL_ARGS, tie_word_embeddings=True), pp_config(pp=2))  # tied: fine
    # 4 ranks x 2 stages need 8 blocks; a 4-block model cannot give each stage one.
    with pytest.raises(ConfigError, match="at least as many transformer blocks"):
        _validate_pp(dataclasses.replace(SMALL_ARGS, n_layers=4), pp_config(pp=4, schedule="Interleaved1F1B"))


# ----------------------------------------------------------------------------- llama: stage modules


@pytest.fixture(scope="module")
def meta_model():
    with torch.device("meta"):
        return Transformer(dataclasses.replace(SMALL_ARGS, vocab_padding=4))


BOUNDS = [0, 2, 4, 8]  # three stages: blocks 0-1, 2-3, 4-7


def stages_of(model):
    return [build_stage_module(model, BOUNDS[i], BOUNDS[i + 1], len(BOUNDS) - 1, i) for i in range(len(BOUNDS) - 1)]


def test_stage_modules_keep_their_parts(meta_model):
    first, middle, last = stages_of(meta_model)
    assert first.tok_embeddings is not None and first.norm is None and first.output is None
    assert first.vocab_mask is None
    assert middle.tok_embeddings is None and middle.norm is None and middle.output is None
    assert last.tok_embeddings is None and last.norm is not None and last.output is not None
    assert last.vocab_mask is not None  # the padded logits are masked where the logits are made
    assert [list(s.layers.keys()) for s in (first, middle, last)] == [["0", "1"], ["2", "3"], ["4", "5", "6", "7"]]
    # The stages are copies: cutting them must not touch the full model.
    assert len(meta_model.layers) == 8 and meta_model.tok_embeddings is not None


def test_stage_parameter_names_partition_the_model(meta_model):
    names = [{name for name, _ in stage.named_parameters()} for stage in stages_of(meta_model)]
    assert "layers.5.attention.wq.weight" in names[2]
    assert "layers.5.attention.wq.weight" not in names[0] | names[1]
    assert "tok_embeddings.weight" in names[0] and "output.weight" in names[2]
    full = {name for name, _ in meta_model.named_parameters()}
    assert set().union(*names) == full
    assert sum(len(n) for n in names) == len(full)  # no name on two stages


def test_stages_chained_equal_full_model():
    # On real (CPU) weights, running the stages one after another must reproduce the model.
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(SMALL_ARGS, vocab_padding=4, max_seq_len=16))
    tokens = torch.randint(0, SMALL_ARGS.vocab_size, (2, 8))
    with torch.no_grad():
        h = tokens
        for stage in stages_of(model):
            h = stage(h)
        torch.testing.assert_close(h, model(tokens), rtol=0, atol=0)
