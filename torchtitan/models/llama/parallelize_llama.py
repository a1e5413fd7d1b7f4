"""parallelize_llama: applies parallelisms to a Llama model (or one pipeline stage of it).

Order matters and is fixed: tensor parallelism -> LoRA -> context parallelism -> activation checkpointing
-> torch.compile -> FSDP/HSDP or DDP (under TP, block-level checkpointing wraps the compiled block
instead; see there). Each step is one small `apply_*` that logs one line. `validate_llama` checks,
before any process group exists, that the model's shapes allow the requested layout.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torchtitan.config.job_config import JobConfig
from torchtitan.models.llama.model import ModelArgs, ffn_hidden_dim
from torchtitan.models.llama.pipeline_split import split_points_for
from torchtitan.parallelisms.context_parallel import apply_cp
from torchtitan.parallelisms.data_parallel import apply_data_parallel
from torchtitan.parallelisms.decoder_tp_plan import apply_decoder_tp, decoder_block_plan
from torchtitan.parallelisms.float8 import apply_float8, uses_float8_tp_styles
from torchtitan.parallelisms.lora import apply_lora
from torchtitan.parallelisms.parallel_dims import ParallelDims
from torchtitan.parallelisms.pipeline import PipelinePlan
from torchtitan.parallelisms.tensor_parallel import (
    apply_ac_and_compile,
    apply_async_tp,
    check_tp_shapes,
)


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
    training = job_config.training
    ac = job_config.activation_checkpoint
    if job_config.float8.enable_float8_linear:
        apply_float8(model, job_config)  # before TP and FSDP, which then handle the float8 modules
    if parallel_dims.tp_enabled:
        tp_mesh = parallel_dims.tp_mesh
        apply_tp(model, tp_mesh, loss_parallel=parallel_dims.loss_parallel_enabled,
                 sequence_parallel=not training.disable_sequence_parallel, float8=uses_float8_tp_styles(job_config))
        if job_config.experimental.enable_async_tensor_parallel:
            apply_async_tp(tp_mesh)
    # After TP, whose layout the adapters follow; before AC, compile and FSDP, which wrap them as any weight.
    apply_lora(model, job_config.lora)
    if parallel_dims.cp_enabled:
        # Before AC wraps the blocks.
        apply_cp(model, parallel_dims.cp_mesh, training.seq_len, job_config.experimental.context_parallel_method)
    apply_ac_and_compile(model, parallel_dims.tp_enabled, ac.mode, ac.selective_ac_option, training.compile,
                         offload=ac.offload)

    apply_data_parallel(model, parallel_dims, training)  # last: FSDP/HSDP or DDP, over the meshes ParallelDims chose
    return model


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool, sequence_parallel: bool,
             float8: bool = False) -> None:
    """Megatron-style tensor parallelism: the shared decoder plan (parallelisms/decoder_tp_plan.py),
    which Llama's blocks need nothing beyond. With float8 linear layers, the block's projections
    use torchao's float8 styles (the embedding and the output stay in high precision)."""
    apply_decoder_tp(model, tp_mesh, loss_parallel, sequence_parallel,
                     lambda block: decoder_block_plan(block, sequence_parallel, float8), float8)
