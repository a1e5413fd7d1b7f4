"""Expert-parallel layouts, judged before any process group exists: the world mesh dims that
ParallelDims plans for each valid layout, and the one-line refusals of the ones that cannot run
(ParallelDims, validate_qwen3, and the trainer's preflight for models without experts or a dense flavor)."""

import dataclasses
import math
import re

import pytest
import torch

from tests.helpers import TINY_RUN
from torchtitan.config.manager import ConfigError, parse_args, validate_world_size
from torchtitan.config.preflight import check_experts, preflight
from torchtitan.models import get_train_spec
from torchtitan.models.qwen3.flavors import qwen3_configs
from torchtitan.models.qwen3.parallelize_qwen3 import validate_qwen3
from torchtitan.parallelisms.parallel_dims import ParallelDims
from torchtitan.parallelisms.pipeline import plan_pipeline

MOE = qwen3_configs["debugmodel_moe"]  # 8 experts, top-2
DENSE = qwen3_configs["debugmodel"]


def dims(world_size, dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1) -> ParallelDims:
    return ParallelDims(dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, pp=pp, world_size=world_size,
                        enable_loss_parallel=True, ep=ep)


def refused(fragments):
    """pytest.raises for a ConfigError whose one-line message holds every fragment."""
    return pytest.raises(ConfigError, match="".join(f"(?=.*{re.escape(f)})" for f in fragments))


# ---------------------------------------------------------------------------------------------
# ParallelDims: the mesh dims of valid layouts

@pytest.mark.parametrize("kwargs,expected", [
    # dp_shard splits into the ranks holding the same experts (outer) x the ep group (inner).
    (dict(world_size=4, dp_shard=4, ep=2), dict(dp_shard_mod_ep=2, dp_shard_in_ep=2, cp=1, tp=1)),
    (dict(world_size=4, dp_shard=4, ep=4), dict(dp_shard_mod_ep=1, dp_shard_in_ep=4, cp=1, tp=1)),
    (dict(world_size=4, dp_shard=-1, ep=4), dict(dp_shard_mod_ep=1, dp_shard_in_ep=4, cp=1, tp=1)),
    # ep == tp: the ep group is the tp ranks; every dp_shard rank holds the same experts.
    (dict(world_size=4, dp_shard=2, tp=2, ep=2), dict(dp_shard_mod_ep=2, dp_shard_in_ep=1, cp=1, tp=2)),
    (dict(world_size=4, dp_shard=2, tp=2, ep=4), dict(dp_shard_mod_ep=1, dp_shard_in_ep=2, cp=1, tp=2)),
    (dict(world_size=2, tp=2, ep=2), dict(dp_shard_mod_ep=1, dp_shard_in_ep=1, cp=1, tp=2)),
    # ep == cp: the ep group is the cp ranks.
    (dict(world_size=4, dp_shard=2, cp=2, ep=2), dict(dp_shard_mod_ep=2, dp_shard_in_ep=1, cp=2, tp=1)),
    (dict(world_size=4, dp_shard=2, cp=2, ep=4), dict(dp_shard_mod_ep=1, dp_shard_in_ep=2, cp=2, tp=1)),
    (dict(world_size=8, dp_shard=2, cp=2, tp=2, ep=8), dict(dp_shard_mod_ep=1, dp_shard_in_ep=2, cp=2, tp=2)),
    # Replicas and pipeline stages stay outside the ep group.
    (dict(world_size=4, dp_replicate=2, dp_shard=2, ep=2), dict(dp_replicate=2, dp_shard_mod_ep=1, dp_shard_in_ep=2)),
    (dict(world_size=8, pp=2, dp_shard=4, ep=2), dict(pp=2, dp_shard_mod_ep=2, dp_shard_in_ep=2)),
])
def test_valid_layouts_split_dp_shard_around_the_ep_group(kwargs, expected):
    d = dims(**kwargs)
    sizes = d._mesh_dim_sizes()
    assert list(sizes) == ["pp", "dp_replicate", "dp_shard_mod_ep", "dp_shard_in_ep", "cp", "tp"]  # outermost first
    assert {k: sizes[k] for k in expected} == expected
    assert math.prod(sizes.values()) == d.world_size  # ep borrows ranks, it adds none
    assert sizes["dp_shard_in_ep"] * sizes["cp"] * sizes["tp"] == d.ep
    assert d.moe_gradient_divide_factor == d.dp_replicate * d.dp_shard * d.cp


def test_without_ep_dp_shard_is_one_dim():
    assert list(dims(4, dp_shard=2, tp=2)._mesh_dim_sizes()) == ["pp", "dp_replicate", "dp_shard", "cp", "tp"]


# ---------------------------------------------------------------------------------------------
# ParallelDims: refusals

@pytest.mark.parametrize("kwargs,fragments", [
    # ep does not divide the ranks it is taken from (dp_shard x cp x tp): the advice is a divisor of
    # ep (it divides the experts if ep does), ep on the ranks it needs, or 1; never a degree that
    # only the ranks allow (the experts are not known before the model: the pre-check is torch-free).
    (dict(world_size=2, dp_shard=2, ep=3), ["training.expert_parallel_degree 3", "(dp_shard 2 = 2)",
                                            ": keep 3 with training.data_parallel_shard_degree 3, or set it to 1"]),
    (dict(world_size=4, dp_shard=4, ep=8), ["training.expert_parallel_degree 8", "(dp_shard 4 = 4)",
                                            ": set it to 4 or 2 (divisors of 8, so they divide the experts as 8 does)"]),
    (dict(world_size=4, dp_shard=2, tp=2, ep=8), ["training.expert_parallel_degree 8", "dp_shard 2 x tp 2 = 4",
                                                  "keep 8 with training.data_parallel_shard_degree 4"]),
    # DeepSeek-V3's configs on a world of 7 (16B: ep 2) and 3 (671B: ep 64) ranks, dp_shard -1.
    (dict(world_size=7, dp_shard=-1, ep=2), ["(dp_shard 7 = 7)", ": keep 2 on 8 ranks (NGPU), or set it to 1 (no "]),
    (dict(world_size=3, dp_shard=-1, ep=64), ["(dp_shard 3 = 3)", ": keep 64 on 64 ranks (NGPU), or set it to 1"]),
    # ep is not a multiple of cp x tp (it must take whole sequences' ranks).
    (dict(world_size=8, dp_shard=2, cp=2, tp=2, ep=2),
     ["training.expert_parallel_degree 2", "dp_shard 2 x cp 2 x tp 2 = 8", "multiple of context x tensor parallel (4)",
      "set it to a multiple of 4 that divides both these ranks and the model's experts (4 or 8 here)"]),
    (dict(world_size=4, cp=2, tp=2, ep=2), ["training.expert_parallel_degree 2", "(4)", "experts (4 here)"]),
    # Nothing to borrow: one process, or replicas without sharding.
    (dict(world_size=1, dp_shard=-1, ep=2), ["training.expert_parallel_degree 2", ": keep 2 on 2 ranks (NGPU), or set "
                                             "it to 1 (no expert parallelism)"]),
    (dict(world_size=2, dp_replicate=2, dp_shard=-1, ep=2), ["training.expert_parallel_degree 2", "(dp_shard 1 = 1)",
                                                             "keep 2 on 4 ranks"]),
    # Not a degree at all.
    (dict(world_size=2, dp_shard=2, ep=0), ["training.expert_parallel_degree must be >= 1, got 0"]),
    (dict(world_size=2, dp_shard=2, ep=-2), ["training.expert_parallel_degree must be >= 1, got -2"]),
])
def test_impossible_ep_is_refused_with_one_line(kwargs, fragments):
    with refused(fragments) as caught:
        dims(**kwargs)
    assert "\n" not in str(caught.value)


def test_ep_zero_is_refused_by_the_config_already():
    with refused(["training.expert_parallel_degree must be >= 1, got 0"]):
        parse_args(["--training.expert_parallel_degree", "0"])


# ---------------------------------------------------------------------------------------------
# validate_qwen3: what the model's shapes allow

def qwen3_job(flavor="debugmodel_moe", *extra):
    return parse_args([*TINY_RUN, "--model.name", "qwen3", "--model.flavor", flavor, *extra])


@pytest.mark.parametrize("kwargs", [
    dict(world_size=2, dp_shard=2, ep=2), dict(world_size=8, dp_shard=8, ep=8), dict(world_size=4, dp_shard=2, tp=2, ep=4),
    dict(world_size=4, dp_shard=2, cp=2, ep=2), dict(world_size=4, dp_replicate=2, dp_shard=2, ep=2),
])
def test_moe_layouts_that_fit_pass(kwargs):
    validate_qwen3(MOE, dims(**kwargs), None, qwen3_job())


def test_ep_on_a_dense_flavor_is_refused():
    """By the one rule every family shares (preflight's `experts`), which validate_qwen3 leaves to it."""
    spec = get_train_spec("qwen3")
    with torch.device("meta"):
        model = spec.model_cls.from_model_args(DENSE)
    with refused(["training.expert_parallel_degree 2 needs a mixture-of-experts model", "qwen3 debugmodel is dense"]):
        check_experts(qwen3_job("debugmodel"), spec, dims(2, dp_shard=2, ep=2), model)


def test_ep_must_divide_the_experts():
    six = dataclasses.replace(MOE, num_experts=6)
    validate_qwen3(six, dims(2, dp_shard=2, ep=2), None, qwen3_job())  # 3 experts per rank
    with refused(["training.expert_parallel_degree 4 must divide the 6 experts", "qwen3 debugmodel_moe",
                  ": set it to 2 (dividing both the 6 experts and the 4 ranks it is taken from), or to 1"]):
        validate_qwen3(six, dims(4, dp_shard=4, ep=4), None, qwen3_job())
    with refused(["training.expert_parallel_degree 3 must divide the 8 experts", ": no degree above 1 divides both the 8 "
                  "experts and the 3 ranks it is taken from; set it to 1 (no expert parallelism)"]):
        validate_qwen3(MOE, dims(3, dp_shard=3, ep=3), None, qwen3_job())


def test_moe_under_tp_needs_each_ranks_slice_of_the_sequence_whole():
    """Each tp rank routes seq_len / cp / tp tokens: 68 / cp 2 = 34 tokens do not split over tp 4."""
    validate_qwen3(MOE, dims(8, cp=2, tp=4), None, qwen3_job("debugmodel_moe", "--training.seq_len", "64"))
    with refused(["training.tensor_parallel_degree 4", "training.seq_len 68", "experimental.context_parallel_degree 2",
                  "= 34 tokens must divide by 4"]):
        validate_qwen3(MOE, dims(8, cp=2, tp=4), None, qwen3_job("debugmodel_moe", "--training.seq_len", "68"))
    with refused(["training.tensor_parallel_degree 4", "training.seq_len 66", "= 66 tokens must divide by 4"]):
        validate_qwen3(MOE, dims(4, tp=4), None, qwen3_job("debugmodel_moe", "--training.seq_len", "66"))
    # The dense flavor routes nothing: the same sequence is fine for it.
    validate_qwen3(DENSE, dims(4, tp=4), None, qwen3_job("debugmodel", "--training.seq_len", "66"))


def test_moe_under_tp_refuses_a_schedule_with_a_second_backward_pass():
    """Zero-bubble schedules compute weight gradients in a backward of their own, which does not
    reach the MoE layers' parameters under TP; a schedule without one passes."""
    pipelined = ["--experimental.pipeline_parallel_degree", "2", "--experimental.pipeline_parallel_schedule"]
    job = qwen3_job("debugmodel_moe", *pipelined, "ZBVZeroBubble")
    with refused(["experimental.pipeline_parallel_schedule ZBVZeroBubble computes weight gradients in a second "
                  "backward pass", "training.tensor_parallel_degree > 1", "use a schedule without zero bubble"]):
        validate_qwen3(MOE, dims(4, tp=2, pp=2), plan_pipeline(job), job)
    validate_qwen3(MOE, dims(4, dp_shard=2, pp=2), plan_pipeline(job), job)  # no TP: the schedule is fine
    job = qwen3_job("debugmodel_moe", *pipelined, "Interleaved1F1B")
    validate_qwen3(MOE, dims(4, tp=2, pp=2), plan_pipeline(job), job)


def test_moe_under_tp_with_ddp_is_refused():
    with refused(["training.tensor_parallel_degree 2", "training.data_parallel_replicate_degree 2",
                  "training.data_parallel_shard_degree > 1"]):
        validate_qwen3(MOE, dims(4, dp_replicate=2, tp=2), None, qwen3_job())
    validate_qwen3(MOE, dims(8, dp_replicate=2, dp_shard=2, tp=2), None, qwen3_job())  # HSDP holds them
    validate_qwen3(DENSE, dims(4, dp_replicate=2, tp=2), None, qwen3_job("debugmodel"))  # no MoE layers


# ---------------------------------------------------------------------------------------------
# The trainer's preflight (every check before the process group), as a run meets them

EP2 = ["--training.data_parallel_shard_degree", "2", "--training.expert_parallel_degree", "2"]


def test_preflight_refuses_ep_for_a_llama_model():
    with refused(["training.expert_parallel_degree 2 needs a mixture-of-experts model", "llama3 tiny",
                  "leave it at 1"]):
        preflight(parse_args([*TINY_RUN, *EP2]), world_size=2)


def test_preflight_refuses_ep_for_a_dense_qwen3_and_passes_the_moe_flavor():
    with refused(["training.expert_parallel_degree 2 needs a mixture-of-experts model", "qwen3 debugmodel is dense"]):
        preflight(qwen3_job("debugmodel", *EP2), world_size=2)
    checked = preflight(qwen3_job("debugmodel_moe", *EP2), world_size=2)
    assert checked.parallel_dims.ep == 2 and checked.parallel_dims._mesh_dim_sizes()["dp_shard_in_ep"] == 2


def test_preflight_refuses_more_ep_ranks_than_the_world_lends():
    with refused(["training.expert_parallel_degree 4", "(dp_shard 2 = 2)", "set it to 2 (divisors of 4"]):
        preflight(qwen3_job("debugmodel_moe", "--training.expert_parallel_degree", "4"), world_size=2)


def test_an_expert_parallel_refusal_in_a_huge_world_is_answered_at_once():
    # Found by the config fuzzing (test_config_fuzz.py): the hint listed the allowed degrees by
    # trying every multiple up to the world size, minutes for a WORLD_SIZE of 2**40 (a hang).
    config = parse_args(["--training.expert_parallel_degree", "3"])
    with pytest.raises(ConfigError) as refused:
        validate_world_size(config, 2**40)
    assert refused.value.line == ("error: training.expert_parallel_degree 3 must divide the ranks it is taken from "
                                  f"(dp_shard {2**40} = {2**40}) and be a multiple of context x tensor parallel (1): "
                                  f"keep 3 on {2**40 + 2} ranks (NGPU), or set it to 1 (no expert parallelism)")
