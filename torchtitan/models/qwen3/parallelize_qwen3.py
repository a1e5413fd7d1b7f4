"""parallelize_qwen3: applies parallelisms to a Qwen3 model (dense or MoE) or one pipeline stage.

The order is Llama's (float8 -> TP -> LoRA -> CP -> AC -> compile -> FSDP/HSDP or DDP), with expert
parallelism after TP, and the MoE layers' own FSDP units wrapped before their blocks
(torchtitan/parallelisms/expert_parallel.py). `validate_qwen3` checks before any process group
exists that the shapes allow the layout.
"""

from __future__ import annotations

import logging

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel

from torchtitan.config.job_config import JobConfig
from torchtitan.models.qwen3.model import Qwen3ModelArgs
from torchtitan.models.qwen3.pipeline_qwen3 import stage_starts_for
from torchtitan.parallelisms.context_parallel import apply_cp
from torchtitan.parallelisms.data_parallel import apply_data_parallel
from torchtitan.parallelisms.decoder_tp_plan import apply_decoder_tp, decoder_block_plan
from torchtitan.parallelisms.expert_parallel import (
    apply_expert_parallel,
    check_moe_layout,
    compile_moe_parts,
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

logger = logging.getLogger(__name__)


def validate_qwen3(args: Qwen3ModelArgs, parallel_dims: ParallelDims, plan: PipelinePlan | None,
                   job_config: JobConfig) -> None:
    """Shape requirements of the layout (the TrainSpec's ValidateFn), on every rank before start-up."""
    flavor = f"model {job_config.model.name} {job_config.model.flavor}"
    if plan is not None:
        stage_starts_for(args, job_config, plan)  # raises when the stages cannot be cut
    if args.is_moe:
        check_moe_layout(args.num_experts, parallel_dims, plan, job_config, flavor)
    tp = parallel_dims.tp
    if tp == 1:
        return
    sizes = (("n_heads", args.n_heads), ("n_kv_heads", args.n_kv_heads))
    if not args.is_moe:  # MoE layers are not split by TP
        sizes += (("feed-forward hidden size", args.hidden_dim),)
    check_tp_shapes(tp, flavor, sizes, args.vocab_size + args.vocab_padding)


def parallelize_qwen3(model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig) -> nn.Module:
    training = job_config.training
    ac = job_config.activation_checkpoint
    moe_layers = [block.moe for block in model.layers.values() if block.moe is not None]
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
    # Every block compiles whole, but for MoE layers that EP or TP shard on their own (moe_compiles_whole).
    whole = not moe_layers or moe_compiles_whole(parallel_dims)
    apply_ac_and_compile(model, parallel_dims.tp_enabled, ac.mode, ac.selective_ac_option, training.compile,
                         apply_compile if whole else lambda m: apply_compile_attention(m, parallel_dims),
                         offload=ac.offload)
    apply_data_parallel(model, parallel_dims, training, units=moe_fsdp_units(moe_layers, parallel_dims))
    return model


def apply_compile_attention(model: nn.Module, parallel_dims: ParallelDims) -> None:
    """MoE blocks whose layer cannot compile whole (expert_parallel.moe_compiles_whole) compile their
    attention; their MoE layer runs eagerly, but for the parts whose shapes the dropping mode fixes
    under EP (expert_parallel.compile_moe_parts)."""
    parts = 0
    for block in model.layers.values():
        block.attention.compile(fullgraph=True)
        if block.moe is not None:
            parts += compile_moe_parts(block.moe, parallel_dims)
    moe = f"router, placement, experts and read-back of {parts} MoE layers compiled" if parts else "MoE layers eager"
    logger.info(f"compiled the attention of {len(model.layers)} MoE blocks with torch.compile ({moe})")


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool, sequence_parallel: bool) -> None:
    """The shared decoder plan (parallelisms/decoder_tp_plan.py) plus what Qwen3's blocks add."""
    apply_decoder_tp(model, tp_mesh, loss_parallel, sequence_parallel,
                     lambda block: qwen3_block_plan(block, sequence_parallel))


def qwen3_block_plan(block: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The per-head q/k norms see a slice of the heads (their weights stay whole and get the sum of
    the slices' gradients); MoE layers take their rank's slice of the sequence
    (expert_parallel.moe_tp_plan) in place of the dense feed-forward's plan."""
    plan = decoder_block_plan(block, sequence_parallel)
    # q and k are (batch, seq, local heads, head_dim): sharded on dim 2.
    plan["attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    plan["attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    if block.moe is not None:
        plan["moe"] = moe_tp_plan(sequence_parallel)
    return plan
