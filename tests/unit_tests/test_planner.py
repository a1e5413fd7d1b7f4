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
    # Every layout dropless; the dropping mode only where no TP or CP rank holds part of a sequence
    # (the trainer refuses that pair, so planning it would only cost a refused dry run).
    whole_sequences = [lay for lay in without if lay.tp * lay.cp == 1]
    assert {lay.capacity for lay in both} == {0.0, 1.25} and len(both) == len(without) + len(whole_sequences)
    assert all(lay.tp * lay.cp == 1 for lay in both if lay.capacity)
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


# The communication model (estimation/step_time.py): every figure below is worked out by hand from
# the llama3 `tiny` flavor (2 blocks of 246,016 parameters, 2 norms of 128 each; embedding 288,768;
# final norm and output 288,896) and qwen3 `tiny_moe` (2 MoE layers of 8 experts, top 2), at
# sequence 64, batch 2, with bf16 gathers and fp32 reductions (Precision()).
BLOCK, ROOT = 246_016, 288_768 + 288_896
SEQ_T, BATCH_T = 64, 2


def _kinds(model, layout, purpose=None, **kwargs):
    collectives = [c for c in planner.traffic(model, layout, Hardware(), SEQ_T, 0, **kwargs)
                   if purpose is None or c.purpose == purpose]
    return {k: (v["count"], v["bytes"]) for k, v in planner.by_kind(collectives).items() if v["count"]}


def test_traffic_of_fsdp_and_the_trainers_own_collectives(tiny_model):
    """FSDP 4: the root gathered once (kept after forward), each block twice but the last, every
    unit reduce-scattered once in fp32; the trainer: the stragglers' all-gather (8 bytes a rank),
    its agreement (3 fp32), the loss tokens and the logged loss (fp64), the gradient norm (one fp32
    per parameter tensor: 2 x 9 + 3)."""
    layout = Layout(1, 4, 1, 1, 1, "none", BATCH_T, 1, 0)
    assert _kinds(tiny_model, layout, "fsdp") == {"all_gather": (4, ROOT * 2 + 3 * BLOCK * 2),
                                                  "reduce_scatter": (3, (ROOT + 2 * BLOCK) * 4)}
    assert _kinds(tiny_model, layout, "trainer") == {"all_gather": (1, 32), "all_reduce": (4, 12 + 8 + 8 + 4 * 21)}
    fp32 = _kinds(tiny_model, layout, "fsdp", precision=planner.Precision.of_job("auto", "float32", "cpu"))
    assert fp32["all_gather"] == (4, ROOT * 4 + 3 * BLOCK * 4)


def test_traffic_of_tensor_parallelism(tiny_model):
    """TP 2 x FSDP 2, per pass of 2 x 64 tokens: 4 all-gathers and 4 reduce-scatters of tokens x
    dim per block, the embedding's and the output's pair, loss parallelism's 3 all-reduces of one
    fp32 per token, one all-reduce per norm weight (2 a block and the final one); FSDP gathers each
    unit's TP shard (norms whole)."""
    layout = Layout(1, 2, 2, 1, 1, "none", BATCH_T, 1, 0)
    activations = BATCH_T * SEQ_T * 128 * 2
    assert _kinds(tiny_model, layout, "tp") == {"all_gather": (10, 10 * activations),
                                                "reduce_scatter": (10, 10 * activations),
                                                "all_reduce": (8, 3 * BATCH_T * SEQ_T * 4 + 5 * 128 * 2)}
    root, block = (ROOT - 128) // 2 + 128, (BLOCK - 256) // 2 + 256
    assert _kinds(tiny_model, layout, "fsdp")["all_gather"] == (4, root * 2 + 3 * block * 2)
    full = dataclasses.replace(layout, ac="full")  # the recomputed forward's 2 pairs a block again
    assert _kinds(tiny_model, full, "tp")["all_gather"] == (14, 14 * activations)


def test_traffic_of_pipeline_context_and_replicas(tiny_model):
    """PP 2 (2 microbatches): a stage sends on and receives back each microbatch's tokens x dim
    (mean over the 2 stages: 4 calls), and gathers each of its FSDP units once; CP 2: per block and
    pass 4 transfers of keys or values forward, 4 backward and 8 of their fp32 gradients, each of
    64 tokens x 8 kv heads x 8; HSDP 2 x 2: each unit's gradient shard all-reduced once."""
    pp = Layout(1, 2, 1, 2, 1, "none", BATCH_T, 1, 2)
    assert _kinds(tiny_model, pp, "pp") == {"send_recv": (4, 4 * SEQ_T * 128 * 2)}
    assert _kinds(tiny_model, pp, "fsdp")["all_gather"] == (2, (ROOT + 2 * BLOCK) * 2 / 2)
    cp = Layout(1, 2, 1, 1, 2, "none", BATCH_T, 1, 0)
    kv = BATCH_T * SEQ_T // 2 * 8 * 8
    assert _kinds(tiny_model, cp, "cp") == {"send_recv": (32, 16 * kv * 2 + 16 * kv * 4)}
    hsdp = Layout(2, 2, 1, 1, 1, "none", BATCH_T, 1, 0)
    assert _kinds(tiny_model, hsdp, "hsdp") == {"all_reduce": (3, (ROOT + 2 * BLOCK) / 2 * 4)}


def test_traffic_of_expert_parallelism(tiny_moe):
    """EP 2 over FSDP 4, dropless: per MoE layer 4 all-to-alls of the rank's 128 tokens x top 2 rows
    (the busiest rank's: x the imbalance) and one exchange of the 8 experts' int64 counts; the
    experts gathered (twice a layer, the last too) over the 2 ranks holding the same ones."""
    layout = Layout(1, 4, 1, 1, 1, "none", BATCH_T, 1, 0, moe=True, ep=2, capacity=0.0)
    rows = BATCH_T * SEQ_T * 2
    assert _kinds(tiny_moe, layout, "ep", imbalance=1.0) == {"all_to_all": (8, 8 * rows * 128 * 2)}
    assert _kinds(tiny_moe, layout, "ep", imbalance=1.5) == {"all_to_all": (8, 8 * 1.5 * rows * 128 * 2)}
    assert _kinds(tiny_moe, layout, "routing") == {"all_to_all": (2, 2 * 64)}
    experts = [c for c in planner.traffic(tiny_moe, layout, Hardware(), SEQ_T) if c.bytes == 393_216 / 2 * 2]
    assert [(c.kind, c.count, c.group) for c in experts] == [("all_gather", 4, 2)]


def test_the_step_times_communication_is_its_traffic(tiny_model):
    """timing's terms are seconds() of traffic's collectives: alpha-beta per call, FSDP's overlapped
    unless the hardware says otherwise (then added to compute)."""
    hw = Hardware(intra_node_latency_us=10.0)
    layout = Layout(1, 2, 2, 1, 1, "none", BATCH_T, 1, 0)
    t = timing(tiny_model, layout, hw, SEQ_T, 4)
    collectives = planner.traffic(tiny_model, layout, hw, SEQ_T, 4)
    assert t.tp == pytest.approx(sum(planner.seconds(c, hw)[1] for c in collectives if c.purpose == "tp"))
    assert t.latency == pytest.approx(sum(planner.seconds(c, hw)[0] for c in collectives if c.purpose != "fsdp"))
    gather = next(c for c in collectives if c.purpose == "tp" and c.kind == "all_gather")
    assert planner.seconds(gather, hw) == pytest.approx((gather.count * 10e-6, gather.total_bytes / 2 / 360e9))
    shared = dataclasses.replace(hw, overlap=False, reduce_scatter_as_all_reduce=True)
    t2 = timing(tiny_model, layout, shared, SEQ_T, 4)
    assert t2.fsdp > t.fsdp and t2.step == pytest.approx(sum(t2.terms().values()))
    wide = planner.Collective("all_reduce", "trainer", 2, 1000, 8, "intra")  # 14 hops of a ring, or one wait
    assert planner.seconds(wide, hw)[0] == pytest.approx(2 * 14 * 10e-6)
    assert planner.seconds(wide, dataclasses.replace(hw, latency_per_call=True))[0] == pytest.approx(2 * 10e-6)
