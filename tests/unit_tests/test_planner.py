"""The planner's parts in this process: the rough memory figure that decides which layouts are worth
a dry run lands near the dry run's own figure, and the enumeration keeps to the rules the docs
state. That the planner's choices pass the dry run and train is tests/integration/test_memory_estimate.py."""

import pytest

from torchtitan.assets import resolve_path
from torchtitan.config.manager import parse_args
from torchtitan.datasets.tokenizer import tokenizer_from_file
from torchtitan.estimation.dry_run import dry_run
from torchtitan.estimation.planner import SCREEN_MARGIN, Hardware, Layout, Model, enumerate_layouts, screened_bytes

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
