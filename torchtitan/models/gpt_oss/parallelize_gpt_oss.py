"""parallelize_gpt_oss: applies parallelisms to a gpt-oss model or one pipeline stage.

The order is Qwen3-MoE's (float8 -> TP -> LoRA -> EP -> CP -> AC -> compile -> FSDP/HSDP or DDP),
with the MoE layers' own FSDP units wrapped before their blocks
(torchtitan/parallelisms/expert_parallel.py). What gpt-oss adds:
- tensor parallelism: the shared decoder plan splits q/k/v (and their biases) by heads and wo by
  input (its bias added once, after the reduction); each head's sink goes with its head (the
  `attention.sinks` parameter sharded on dim 0 over the tp ranks);
- context parallelism: ring or all-gather attention with the sinks and each block's window, which
  skips the key blocks wholly outside the band (torchtitan/parallelisms/cp_attention.py).
`validate_gpt_oss` checks before any process group exists that the shapes allow the layout.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from torchtitan.config.job_config import JobConfig
from torchtitan.models.gpt_oss.model import GptOssModelArgs
from torchtitan.models.gpt_oss.pipeline_gpt_oss import stage_starts_for
from torchtitan.models.qwen3.parallelize_qwen3 import apply_compile_attention
from torchtitan.parallelisms.context_parallel import apply_cp
from torchtitan.parallelisms.data_parallel import apply_data_parallel
from torchtitan.parallelisms.decoder_tp_plan import apply_decoder_tp, decoder_block_plan
from torchtitan.parallelisms.expert_parallel import (
    apply_expert_parallel,
    check_moe_layout,
    configure_moe,
    moe_compiles_whole,
    moe_fsdp_units,
    moe_tp_plan,
)
from torchtitan.parallelisms.float8 import apply_float8
from torchtitan.parallelisms.lora import apply_lora
from torchtitan.parallelisms.parallel_dims import ParallelDims
from torchtitan.parallelisms.pipeline import PipelinePlan
from torchtitan.parallelisms.tensor_parallel import (
    apply_ac_and_compile,
    apply_async_tp,
    apply_compile,
    check_tp_shapes,
)


def validate_gpt_oss(args: GptOssModelArgs, parallel_dims: ParallelDims, plan: PipelinePlan | None,
                     job_config: JobConfig) -> None:
    """Shape requirements of the layout (the TrainSpec's ValidateFn), on every rank before start-up."""
    flavor = f"model {job_config.model.name} {job_config.model.flavor}"
    if plan is not None:
        stage_starts_for(args, job_config, plan)  # raises when the stages cannot be cut
    check_moe_layout(args.num_experts, parallel_dims, plan, job_config, flavor)
    if parallel_dims.tp > 1:
        check_tp_shapes(parallel_dims.tp, flavor, (("n_heads", args.n_heads), ("n_kv_heads", args.n_kv_heads)),
                        args.vocab_size + args.vocab_padding)


def parallelize_gpt_oss(model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig) -> nn.Module:
    training = job_config.training
    ac = job_config.activation_checkpoint
    moe_layers = [block.moe for block in model.layers.values()]
    configure_moe(moe_layers, parallel_dims, job_config)
    if job_config.float8.enable_float8_linear:
        apply_float8(model, job_config)
    if parallel_dims.tp_enabled:
        apply_tp(model, parallel_dims.tp_mesh, loss_parallel=parallel_dims.loss_parallel_enabled,
                 sequence_parallel=not training.disable_sequence_parallel)
        if job_config.experimental.enable_async_tensor_parallel:
            apply_async_tp(parallel_dims.tp_mesh)
    apply_lora(model, job_config.lora)  # after TP, whose layout the adapters follow; before AC, compile, FSDP
    if parallel_dims.ep > 1:
        apply_expert_parallel(moe_layers, parallel_dims.ep_mesh)
    if parallel_dims.cp_enabled:
        apply_cp(model, parallel_dims.cp_mesh, training.seq_len, job_config.experimental.context_parallel_method)
    whole = moe_compiles_whole(parallel_dims)
    apply_ac_and_compile(model, parallel_dims.tp_enabled, ac.mode, ac.selective_ac_option, training.compile,
                         apply_compile if whole else lambda m: apply_compile_attention(m, parallel_dims),
                         offload=ac.offload)
    apply_data_parallel(model, parallel_dims, training, units=moe_fsdp_units(moe_layers, parallel_dims))
    return model


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool, sequence_parallel: bool) -> None:
    """The shared decoder plan (parallelisms/decoder_tp_plan.py), MoE layers on their rank's slice
    of the sequence, and the sinks sharded with the heads."""
    def block_plan(block: nn.Module) -> dict:
        plan = decoder_block_plan(block, sequence_parallel)
        plan["moe"] = moe_tp_plan(sequence_parallel)
        return plan

    apply_decoder_tp(model, tp_mesh, loss_parallel, sequence_parallel, block_plan)
    for block in model.layers.values():
        attention = block.attention
        attention.sinks = nn.Parameter(distribute_tensor(attention.sinks, tp_mesh, [Shard(0)]))
