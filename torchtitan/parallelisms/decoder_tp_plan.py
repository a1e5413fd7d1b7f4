"""The tensor-parallel plan of a standard decoder block, written once for every model family.

Megatron-style, applied by module name: in each block q/k/v and w1/w3 are split by output
features (column-wise: each rank owns a slice of the heads and of the hidden units) and wo/w2 by
input features (row-wise), so a block needs one reduction after attention and one after the
feed-forward. With sequence parallelism the activations between those matmuls (norms,
residuals) are sharded on the sequence dim: each reduction becomes a reduce-scatter and an
all-gather feeds the next column-wise matmuls. Without it, the reductions are all-reduces and
activations are replicated. The model's root (embedding, final norm, output) is planned by
`tensor_parallel.apply_root_tp`.

A family's parallelize function calls `apply_decoder_tp` with its per-block plan: this module's
`decoder_block_plan` plus only what its blocks have beyond the standard one (Qwen3: per-head q/k
norms and MoE layers). Module names assumed: `attention.{wq,wk,wv,wo}`, `attention_norm`,
`ffn_norm`, and `feed_forward.{w1,w2,w3}`, where `feed_forward` may be None (a block whose
feed-forward is something else, such as an MoE layer, which the family then plans itself).
"""

from __future__ import annotations

import logging
from typing import Callable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from torchtitan.parallelisms.float8 import float8_tp_styles, is_float8
from torchtitan.parallelisms.tensor_parallel import apply_root_tp

logger = logging.getLogger(__name__)

ATTENTION_PROJECTIONS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo")
FFN_PROJECTIONS = ("feed_forward.w1", "feed_forward.w2", "feed_forward.w3")


def decoder_block_plan(block: nn.Module, sequence_parallel: bool, float8: bool = False) -> dict[str, ParallelStyle]:
    """The plan of one standard decoder block: attention and, where the block has one, the dense
    feed-forward; under sequence parallelism also the two norms and the gathers in front of the
    column-wise projections.

    `float8`: the block's projections use torchao's float8 styles, which cast to float8 before the
    collectives, provided apply_float8 converted every one of them (it skips shapes float8 matmuls
    cannot take); otherwise the block keeps the high-precision plan.
    """
    seq = Shard(1) if sequence_parallel else Replicate()
    dense_ffn = getattr(block, "feed_forward", None) is not None
    projections = ATTENTION_PROJECTIONS + (FFN_PROJECTIONS if dense_ffn else ())
    block_float8 = float8 and all(is_float8(block.get_submodule(name)) for name in projections)
    colwise, rowwise, prepare_input = (float8_tp_styles() if block_float8
                                       else (ColwiseParallel, RowwiseParallel, PrepareModuleInput))
    plan: dict[str, ParallelStyle] = {
        "attention.wq": colwise(),
        "attention.wk": colwise(),
        "attention.wv": colwise(),
        "attention.wo": rowwise(output_layouts=seq),
    }
    if dense_ffn:
        plan.update({
            "feed_forward.w1": colwise(),
            "feed_forward.w3": colwise(),
            "feed_forward.w2": rowwise(output_layouts=seq),
        })
    if sequence_parallel:
        plan.update({
            "attention_norm": SequenceParallel(),
            "ffn_norm": SequenceParallel(),
            # Gather the sequence before the column-wise projections; the RoPE table passes as is.
            "attention": prepare_input(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
        })
        if dense_ffn:
            plan["feed_forward"] = prepare_input(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return plan


def apply_decoder_tp(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool, sequence_parallel: bool,
                     block_plan: Callable[[nn.Module], dict[str, ParallelStyle]], float8: bool = False) -> None:
    """Tensor parallelism for a decoder of the shared layout: the root plan, then `block_plan(block)`
    for each block (the family's: `decoder_block_plan` plus what its blocks add). `float8` only
    names float8 projections in the log line; the block plan chooses the styles."""
    apply_root_tp(model, tp_mesh, loss_parallel, sequence_parallel)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan(block))
    logger.info(f"applied tensor parallelism over mesh {{'tp': {tp_mesh.size()}}} (sequence parallel "
                f"{'on' if sequence_parallel else 'off'}, loss parallel {'on' if loss_parallel else 'off'}"
                f"{', float8 projections' if float8 else ''})")
