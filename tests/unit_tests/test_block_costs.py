"""One per-block cost per model family (`block_flops` in its model file), shared by the FLOP count
(MFU) and the pipeline split: the figures of the registered flavors are those the two separate
formulas gave before they were made one, and Llama's count is still 6 per parameter of the built
model (minus an untied embedding) plus the attention scores."""

import dataclasses
import importlib

import pytest
import torch

from torchtitan.models import get_train_spec
from torchtitan.models.llama.flavors import llama3_configs
from torchtitan.models.llama.model import ModelArgs, Transformer
from torchtitan.models.llama.model import block_flops as llama_block_flops
from torchtitan.models.qwen3.flavors import qwen3_configs
from torchtitan.models.qwen3.model import block_flops as qwen3_block_flops
from torchtitan.parallelisms.pipeline import balanced_split

# The packages re-export the pipelining functions under the modules' names, so import the modules.
llama_split = importlib.import_module("torchtitan.models.llama.pipeline_split")
qwen3_pipeline = importlib.import_module("torchtitan.models.qwen3.pipeline_qwen3")

SEQ_LEN = 8192
# (family, flavor): (flops_per_token at SEQ_LEN, {pipeline stages: where stages 2.. start}), as the
# FLOP counts and the pipelines' cost models gave them before they shared one block cost.
BEFORE = {
    ("llama3", "debugmodel"): (439248384, {2: [7], 4: [2, 4, 7], 8: [1, 2, 3, 4, 5, 6, 7]}),
    ("llama3", "debugmodel_tied"): (439248384, {2: [7], 4: [2, 4, 7], 8: [1, 2, 3, 4, 5, 6, 7]}),
    ("llama3", "1B"): (10636111872, {2: [9], 4: [4, 9, 14], 8: [2, 4, 6, 8, 10, 12, 15]}),
    ("llama3", "8B"): (57914449920, {2: [17], 4: [8, 16, 25], 8: [4, 8, 12, 16, 20, 24, 29]}),
    ("llama3", "70B"): (481442709504, {2: [41], 4: [20, 40, 61], 8: [10, 20, 30, 40, 50, 60, 71]}),
    ("llama3", "405B"): (2625449459712, {2: [63], 4: [31, 63, 95], 8: [15, 31, 47, 63, 79, 95, 111]}),
    ("qwen3", "debugmodel"): (242250240, {2: [4], 4: [2, 4, 6], 8: [1, 2, 3, 4, 5, 6, 7]}),
    ("qwen3", "debugmodel_moe"): (118029312, {2: [2], 4: [1, 2, 3]}),
    ("qwen3", "0.6B"): (9213444096, {2: [16], 4: [8, 16, 24], 8: [3, 7, 11, 15, 19, 23, 27]}),
    ("qwen3", "8B"): (59905947648, {2: [19], 4: [9, 19, 29], 8: [4, 9, 14, 19, 24, 29, 34]}),
    ("qwen3", "32B"): (243444873216, {2: [33], 4: [16, 32, 49], 8: [8, 16, 24, 32, 40, 48, 57]}),
    ("qwen3", "30B-A3B"): (37578559488, {2: [25], 4: [12, 25, 38], 8: [6, 12, 18, 24, 30, 37, 44]}),
    ("qwen3", "235B-A22B"): (205109400576, {2: [48], 4: [24, 48, 72], 8: [12, 24, 36, 48, 60, 72, 84]}),
}
FAMILY = {"llama3": (llama3_configs, llama_split.unit_costs, llama_block_flops),
          "qwen3": (qwen3_configs, qwen3_pipeline.unit_costs, qwen3_block_flops)}


def build_on_meta(family: str, args):
    with torch.device("meta"):
        return get_train_spec(family).model_cls.from_model_args(args)


@pytest.mark.parametrize("family,flavor", list(BEFORE))
def test_flops_and_pipeline_splits_unchanged(family, flavor):
    configs, unit_costs, _ = FAMILY[family]
    args = configs[flavor]
    flops, splits = BEFORE[(family, flavor)]
    assert build_on_meta(family, args).flops_per_token(SEQ_LEN) == flops
    costs = unit_costs(args, SEQ_LEN)
    assert {stages: balanced_split(costs, stages) for stages in splits} == splits


@pytest.mark.parametrize("family", list(FAMILY))
def test_flop_count_and_pipeline_split_share_the_block_cost(family):
    configs, unit_costs, block_flops = FAMILY[family]
    for flavor, args in configs.items():
        model = build_on_meta(family, args)
        blocks = args.n_layers * block_flops(args, SEQ_LEN)
        # What the FLOP count adds to the blocks: the final norm and the output projection.
        assert 0 < model.flops_per_token(SEQ_LEN) - blocks <= 6 * (args.vocab_size + 1) * args.dim, flavor
        # The pipeline charges the same cost to every block; only the ends carry extra.
        costs = unit_costs(args, SEQ_LEN)
        assert costs[1:-1] == [block_flops(args, SEQ_LEN)] * (args.n_layers - 2), flavor


@pytest.mark.parametrize("norm_type", ["rmsnorm", "layernorm", "np_layernorm"])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("padding", [0, 48])
def test_llama_flops_are_six_per_parameter_of_the_built_model(norm_type, tied, padding):
    """The count from the shapes equals the definition it replaced: 6 per parameter of the built
    model (an untied embedding left out: a lookup, not a matmul) plus the attention scores."""
    for flavor in ("debugmodel", "tiny", "1B", "8B", "70B", "405B"):
        args = dataclasses.replace(llama3_configs[flavor], norm_type=norm_type, tie_word_embeddings=tied,
                                   vocab_padding=padding)
        with torch.device("meta"):
            model = Transformer(args)
        params = sum(p.numel() for p in model.parameters())
        if not tied:
            params -= model.tok_embeddings.weight.numel()
        head_dim = args.dim // args.n_heads
        assert model.flops_per_token(SEQ_LEN) == 6 * params + 12 * args.n_layers * args.n_heads * head_dim * SEQ_LEN


def test_llama_block_cost_counts_grouped_query_attention():
    full, grouped = ModelArgs(dim=64, n_heads=4), ModelArgs(dim=64, n_heads=4, n_kv_heads=2)
    # Half the key/value heads halve wk and wv (64 x 64 -> 64 x 32 each): 2 x 64 x 32 parameters fewer.
    assert llama_block_flops(full, 16) - llama_block_flops(grouped, 16) == 6 * 2 * 64 * 32
