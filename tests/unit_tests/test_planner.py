"""The planner's parts in this process: the rough memory figure that decides which layouts are worth
a dry run lands near the dry run's own figure, and the enumeration keeps to the rules the docs
state. That the planner's choices pass the dry run and train is tests/integration/test_memory_estimate.py."""

import dataclasses

import pytest

from torchtitan.assets import resolve_path
from torchtitan.config.manager import parse_args
from torchtitan.datasets.tokenizer import tokenizer_from_file
from torchtitan.errors import ConfigError
from torchtitan.estimation import planner
from torchtitan.estimation.dry_run import dry_run
from torchtitan.estimation.planner import (
    SCREEN_MARGIN,
    Hardware,
    Layout,
    Model,
    enumerate_layouts,
    expert_degrees,
    screened_bytes,
    timing,
)
from torchtitan.parallelisms.parallel_dims import ParallelDims

TOKENIZER = "bundled:stdlib_docs/tokenizer.model"
SEQ = 256


@pytest.fixture(scope="module")
def tiny_model() -> Model:
    vocab = tokenizer_from_file(resolve_path(TOKENIZER, "tokenizer", ValueError), "tokenizer").n_words
    return Model.from_flavor("llama3", "tiny", vocab)


# (replicate, shard, tp, pp, cp, AC, batch, accumulation): every term of the figure in play.
LAYOUTS = [
    (1, 4, 1, 1, 1, "none", 2, 1),
    (1, 4, 1, 1, 1, "selective", 2, 2),
    (1, 4, 1, 1, 1, "full", 2, 1),
    (1, 2, 2, 1, 1, "none", 2, 1),
    (1, 2, 1, 2, 1, "full", 2, 1),
    (1, 2, 1, 1, 2, "selective", 2, 1),
]


@pytest.mark.parametrize("spec", LAYOUTS, ids=lambda s: "-".join(map(str, s)))
def test_the_rough_figure_is_near_the_dry_run(tiny_model, spec):
    """Within -25 % and the planner's margin of the dry run standing for a GPU (bf16), on a model
    far smaller than the 8B to 405B it was calibrated on: the terms scale with the model."""
    rep, shard, tp, pp, cp, ac, batch, accum = spec
    layout = Layout(rep, shard, tp, pp, cp, ac, batch, accum, pp if pp > 1 else 0)
    result = dry_run(parse_args(["--job.config_file", "bundled:train_configs/debug_model.toml", "--model.flavor", "tiny",
                                 "--model.tokenizer_path", TOKENIZER, "--training.mixed_precision_param", "auto",
                                 *layout.overrides(), "--training.seq_len", str(SEQ), "--job.dry_run",
                                 "--job.dry_run_world_size", "4", "--job.dry_run_device", "cuda"]))
    ratio = screened_bytes(tiny_model, layout, SEQ) / result.largest.memory.peak
    assert 0.75 < ratio <= SCREEN_MARGIN, f"{layout.text()}: rough figure / dry run = {ratio:.2f}"


def test_layouts_keep_to_the_enumeration_rules(tiny_model):
    """TP within a node and dividing the heads, CP only with 4K tokens per rank, every layout
    using every device, the global batch kept, PP with at least one microbatch per stage."""
    hw = Hardware(gpus_per_node=4)
    layouts = list(enumerate_layouts(tiny_model, 16, hw, 16384, 32))
    assert layouts
    seen_cp = set()
    for lay in layouts:
        assert lay.dp_replicate * lay.dp_shard * lay.tp * lay.pp * lay.cp == 16
        assert lay.tp <= 4 and tiny_model.n_heads % lay.tp == 0
        assert 16384 // lay.cp >= 4096
        assert lay.batch_size * lay.accum * lay.dp_replicate * lay.dp_shard == 32
        assert lay.pp == 1 or (lay.microbatches == lay.pp and lay.batch_size % lay.pp == 0)
        seen_cp.add(lay.cp)
    assert seen_cp == {1, 2, 4}
    assert not [lay for lay in enumerate_layouts(tiny_model, 16, hw, 4096, 32) if lay.cp > 1]


@pytest.fixture(scope="module")
def tiny_moe() -> Model:
    return Model.from_flavor("qwen3", "tiny_moe")


def test_expert_parallelism_is_enumerated_for_moe_models_only(tiny_model, tiny_moe):
    """An MoE model's layouts carry the expert-parallel degrees its mesh can hold, and paste the
    option; a dense model's carry none and paste nothing about experts."""
    hw = Hardware(gpus_per_node=8)
    moe = list(enumerate_layouts(tiny_moe, 8, hw, 256, 16))
    assert tiny_moe.is_moe and tiny_moe.num_experts == 8 and tiny_moe.moe_layers == 2
    assert all(lay.moe for lay in moe) and {lay.ep for lay in moe} == {1, 2, 4, 8}
    for lay in moe:
        assert lay.ep == 1 or (tiny_moe.num_experts % lay.ep == 0 and lay.ep % (lay.cp * lay.tp) == 0
                               and (lay.dp_shard * lay.cp * lay.tp) % lay.ep == 0)
        assert lay.overrides()[-2:] == ["--training.expert_parallel_degree", str(lay.ep)]
    dense = list(enumerate_layouts(tiny_model, 8, hw, 256, 16))
    assert dense and not tiny_model.is_moe
    assert all(not lay.moe and lay.ep == 1 and "--training.expert_parallel_degree" not in lay.overrides()
               for lay in dense)


@pytest.mark.parametrize("dp_shard,cp,tp", [(8, 1, 1), (4, 1, 2), (2, 2, 2), (1, 1, 4), (3, 1, 2)])
def test_an_expert_degree_the_mesh_cannot_hold_is_not_proposed(dp_shard, cp, tp):
    """The planner proposes exactly the degrees ParallelDims accepts (and that divide the experts)."""
    for ep in range(1, 17):
        accepted = 16 % ep == 0
        try:
            ParallelDims(1, dp_shard, cp, tp, 1, dp_shard * cp * tp, False, ep=ep)
        except ConfigError:
            accepted = False
        assert (ep in expert_degrees(16, dp_shard, cp, tp)) == accepted, ep


def test_the_routing_mode_is_enumerated_where_the_build_has_it(tiny_moe, monkeypatch):
    """With moe.capacity_factor: dropless (0) and each capacity factor, pasted as the option; a
    build without it plans dropless only and pastes no such option."""
    hw = Hardware(gpus_per_node=8)
    monkeypatch.setattr(planner, "capacity_option_available", lambda: False)
    assert planner.routing_modes() is None
    without = list(enumerate_layouts(tiny_moe, 4, hw, 256, 8, capacity_factors=planner.routing_modes()))
    assert {lay.capacity for lay in without} == {None}
    assert not any(arg.startswith("--moe.") for lay in without for arg in lay.overrides())
    monkeypatch.setattr(planner, "capacity_option_available", lambda: True)
    assert planner.routing_modes() == (0.0, 1.25) and planner.routing_modes((1.0, 2.0)) == (0.0, 1.0, 2.0)
    both = list(enumerate_layouts(tiny_moe, 4, hw, 256, 8, capacity_factors=planner.routing_modes()))
    assert {lay.capacity for lay in both} == {0.0, 1.25} and len(both) == 2 * len(without)
    assert both[1].overrides()[-2:] == ["--moe.capacity_factor", "1.25"] and "dropless" in both[0].text()


def test_the_busiest_experts_cost_time_and_memory(tiny_moe):
    """Dropless under EP budgets for the busiest rank (the imbalance); without EP a rank computes
    its own pairs whatever the routing; the dropping mode costs its capacity factor whatever it."""
    hw = Hardware(gpus_per_node=8)
    base = Layout(1, 4, 1, 1, 1, "none", 2, 1, 0, moe=True, ep=4, capacity=0.0)
    even, busy = (timing(tiny_moe, base, hw, 256, 8, imbalance=i) for i in (1.0, 2.0))
    assert even.ep > 0 and busy.ep == pytest.approx(2 * even.ep) and busy.compute > even.compute
    assert screened_bytes(tiny_moe, base, 256, imbalance=2.0) > screened_bytes(tiny_moe, base, 256, imbalance=1.0)
    no_ep = dataclasses.replace(base, ep=1)
    assert timing(tiny_moe, no_ep, hw, 256, 8, imbalance=2.0).ep == 0
    assert timing(tiny_moe, no_ep, hw, 256, 8, imbalance=2.0).compute == timing(tiny_moe, no_ep, hw, 256, 8).compute
    capped = dataclasses.replace(base, capacity=1.25)
    assert timing(tiny_moe, capped, hw, 256, 8, imbalance=2.0).ep == pytest.approx(1.25 * even.ep)
