"""parallelize_llama: applies parallelisms to a Llama model (or one pipeline stage of it).

Order matters and is fixed: tensor parallelism -> context parallelism -> activation checkpointing
-> torch.compile -> FSDP/HSDP or DDP (under TP, block-level checkpointing wraps the compiled block
instead; see there). Each step is one small `apply_*` that logs one line. `validate_llama` checks,
before any process group exists, that the model's shapes allow the requested layout.
"""

from __future__ import annotations

import logging

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from torchtitan.job_config import JobConfig
from torchtitan.models.llama.model import ModelArgs, ffn_hidden_dim
from torchtitan.models.llama.pipeline_split import split_points_for
from torchtitan.parallelisms.context_parallel import apply_cp
from torchtitan.parallelisms.data_parallel import apply_data_parallel
from torchtitan.parallelisms.float8 import apply_float8, float8_tp_styles, is_float8
from torchtitan.parallelisms.parallel_dims import ParallelDims
from torchtitan.parallelisms.pipeline import PipelinePlan
from torchtitan.parallelisms.tensor_parallel import (
    apply_ac_and_compile,
    apply_async_tp,
    apply_root_tp,
    check_tp_shapes,
)

logger = logging.getLogger(__name__)


def validate_llama(args: ModelArgs, parallel_dims: ParallelDims, plan: PipelinePlan | None,
                   job_config: JobConfig) -> None:
    """Shape requirements of the layout (the TrainSpec's ValidateFn), checked on every rank before
    any process group starts."""
    if plan is not None:
        split_points_for(args, job_config, plan)  # raises when the stages cannot be cut
    tp = parallel_dims.tp
    if tp == 1:
        return
    flavor = f"model {job_config.model.name} {job_config.model.flavor}"
    n_kv_heads = args.n_kv_heads or args.n_heads
    check_tp_shapes(tp, flavor, (("n_heads", args.n_heads), ("n_kv_heads", n_kv_heads),
                                 ("feed-forward hidden size", ffn_hidden_dim(args))), args.vocab_size + args.vocab_padding)


def parallelize_llama(model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig) -> nn.Module:
    t = job_config.training
    ac = job_config.activation_checkpoint
    if job_config.float8.enable_float8_linear:
        apply_float8(model, job_config)  # before TP and FSDP, which then handle the float8 modules
    if parallel_dims.tp_enabled:
        tp_mesh = parallel_dims.tp_mesh
        apply_tp(model, tp_mesh, loss_parallel=parallel_dims.loss_parallel_enabled,
                 sequence_parallel=not t.disable_sequence_parallel, float8=job_config.float8.enable_float8_linear)
        if job_config.experimental.enable_async_tensor_parallel:
            apply_async_tp(tp_mesh)
    if parallel_dims.cp_enabled:
        apply_cp(model, parallel_dims.cp_mesh, t.seq_len)  # before AC wraps the blocks
    apply_ac_and_compile(model, parallel_dims.tp_enabled, ac.mode, ac.selective_ac_option, t.compile)

    apply_data_parallel(model, parallel_dims, t)  # last: FSDP/HSDP or DDP, over the meshes ParallelDims chose
    return model


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool, sequence_parallel: bool,
             float8: bool = False) -> None:
    """Megatron-style tensor parallelism with DTensor plans, applied by module name.

    In each block, q/k/v and w1/w3 are split by output features (column-wise: each rank owns a
    slice of the heads and of the hidden units) and wo/w2 by input features (row-wise), so a block
    needs one reduction after attention and one after the feed-forward. With sequence
    parallelism the activations between those matmuls (norms, residuals) are sharded on the
    sequence dim: each reduction becomes a reduce-scatter and an all-gather feeds the next
    column-wise matmuls. Without it, the reductions are all-reduces and activations are replicated.
    The embedding is split by vocabulary rows; the output projection by vocabulary columns, and
    with loss parallelism its logits stay sharded into the cross-entropy.

    With float8 linear layers, the block's projections use torchao's float8 styles, which cast to
    float8 before the collectives (the embedding and the output stay in high precision).
    """
    seq = Shard(1) if sequence_parallel else Replicate()
    apply_root_tp(model, tp_mesh, loss_parallel, sequence_parallel)

    projections = ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                   "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")
    for block in model.layers.values():
        # torchao's float8 styles need every projection they touch converted (apply_float8 skips
        # shapes float8 matmuls cannot take); otherwise the block keeps the high-precision plan.
        block_float8 = float8 and all(is_float8(block.get_submodule(n)) for n in projections)
        colwise, rowwise, prepare_input = (float8_tp_styles() if block_float8
                                           else (ColwiseParallel, RowwiseParallel, PrepareModuleInput))
        plan = {
            "attention.wq": colwise(),
            "attention.wk": colwise(),
            "attention.wv": colwise(),
            "attention.wo": rowwise(output_layouts=seq),
            "feed_forward.w1": colwise(),
            "feed_forward.w3": colwise(),
            "feed_forward.w2": rowwise(output_layouts=seq),
        }
        if sequence_parallel:
            plan.update({
                "attention_norm": SequenceParallel(),
                "ffn_norm": SequenceParallel(),
                # Gather the sequence before the column-wise projections; the RoPE table passes as is.
                "attention": prepare_input(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
                "feed_forward": prepare_input(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            })
        parallelize_module(block, tp_mesh, plan)
    logger.info(f"applied tensor parallelism over mesh {{'tp': {tp_mesh.size()}}} (sequence parallel "
                f"{'on' if sequence_parallel else 'off'}, loss parallel {'on' if loss_parallel else 'off'}"
                f"{', float8 projections' if float8 else ''})")
