"""parallelize_deepseek_v3: applies parallelisms to a DeepSeek-V3 model or one pipeline stage.

The order is Qwen3-MoE's (float8 -> TP -> LoRA -> EP -> CP -> AC -> compile -> FSDP/HSDP or DDP), with the
MoE layers' own FSDP units wrapped before their blocks (torchtitan/parallelisms/expert_parallel.py).

Tensor parallelism of multi-head latent attention: the projections that produce per-head
outputs (`wq` or `wq_b`, `wkv_b`) are split by heads (column-wise), `wo` row-wise; the
compressions (`wq_a`, `wkv_a`) and their norms are small and shared by all heads, so they stay
whole on every tp rank (replicated, their gradients identical across tp). The rotated key part of
`wkv_a`'s output serves all heads too, but a rank's heads give it only their share of the
gradient: `sum_gradient_over_tp` adds the shares up, or the ranks' copies of `wkv_a` would drift
apart. The shared experts are split like a dense feed-forward; the routed ones take their rank's
slice of the sequence, as in Qwen3-MoE. The MTP modules get the same block plan, and their
`eh_proj` and norms, which act per token, run on the sequence slice under sequence parallelism.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from torchtitan.config.job_config import JobConfig
from torchtitan.errors import ConfigError
from torchtitan.models.deepseek_v3.model import DeepSeekV3ModelArgs
from torchtitan.models.deepseek_v3.pipeline_deepseek_v3 import stage_starts_for
from torchtitan.parallelisms.activation_checkpoint import BlockSlot
from torchtitan.parallelisms.context_parallel import apply_cp, labels_ahead_over_cp
from torchtitan.parallelisms.data_parallel import apply_data_parallel
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
    apply_root_tp,
    check_tp_shapes,
)
from torchtitan.runtime.torch_compat import collectives as torch_compat_collectives

logger = logging.getLogger(__name__)


def validate_deepseek_v3(args: DeepSeekV3ModelArgs, parallel_dims: ParallelDims, plan: PipelinePlan | None,
                         job_config: JobConfig) -> None:
    """Shape and combination requirements of the layout (the TrainSpec's ValidateFn)."""
    flavor = f"model {job_config.model.name} {job_config.model.flavor}"
    if plan is not None:
        stage_starts_for(args, job_config, plan)  # raises when the stages cannot be cut
    tp = parallel_dims.tp
    if args.mtp_depth and job_config.training.seq_len <= args.mtp_depth:
        raise ConfigError(f"model.mtp_depth {args.mtp_depth} needs training.seq_len above it "
                          f"({job_config.training.seq_len})")
    if job_config.float8.enable_float8_linear and job_config.float8.recipe == "tensorwise" and tp > 1:
        raise ConfigError(f"float8.enable_float8_linear (tensorwise) with training.tensor_parallel_degree {tp}: "
                          f"{flavor} has no float8 tensor-parallel plan yet; use float8.recipe rowwise (TP's plain "
                          "styles), float8 without TP, or TP in bf16")
    check_moe_layout(args.num_experts, parallel_dims, plan, job_config, flavor)
    if tp == 1:
        return
    sizes = (("n_heads", args.n_heads), ("dense feed-forward hidden size", args.hidden_dim),
             ("shared experts' hidden size", args.moe_hidden_dim * args.n_shared_experts))
    check_tp_shapes(tp, flavor, sizes, args.vocab_size + args.vocab_padding)


def _mtp(model: nn.Module) -> list[nn.Module]:
    """The MTP modules of this model part (none on a pipeline stage without them)."""
    return list(getattr(model, "mtp", None) or ())


def _blocks(model: nn.Module) -> list[nn.Module]:
    """Every transformer block of this model part: the main ones, then the MTP modules' ones."""
    return [*model.layers.values(), *(m.block for m in _mtp(model))]


def mtp_block_slots(model: nn.Module) -> list[BlockSlot]:
    """The MTP modules' blocks for activation checkpointing, indexed by their layer id (after the
    main blocks'), so that a selective interval counts them as the blocks they follow."""
    return [BlockSlot(module, "block", model.args.n_layers + k) for k, module in enumerate(_mtp(model))]


def configure_mtp(model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig) -> None:
    """Sets the model's MTP seams (model.py) for this layout and batch: the step's sequences per
    rank; under context parallelism the labels ahead, whose first ones past a rank's chunks the
    next chunks' ranks hold; and the sum of valid targets over the loss mesh (the ranks whose
    losses and gradients the trainer averages), which makes each rank's part of the loss a part of
    the mean over all of their targets. The ignored targets fall unevenly: the last `depth`
    positions of every sequence lie on cp rank 0 (its second chunk ends the sequence), and masked
    labels wherever the data puts them."""
    training = job_config.training
    # MTP's loss is a mean over the step's sequences, like the main loss.
    model.sequences_per_step = training.batch_size * training.gradient_accumulation_steps
    if parallel_dims.cp_enabled:
        model.labels_ahead = labels_ahead_over_cp(parallel_dims.cp_mesh)
    mesh = parallel_dims.loss_mesh
    if mesh is not None:
        def sum_over_loss_ranks(counts: torch.Tensor) -> torch.Tensor:
            return torch_compat_collectives.wait(torch_compat_collectives.all_reduce(counts, "sum", mesh.get_group()))

        model.sum_over_loss_ranks = sum_over_loss_ranks
        model.loss_ranks = mesh.size()


def parallelize_deepseek_v3(model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig) -> nn.Module:
    training = job_config.training
    ac = job_config.activation_checkpoint
    moe_layers = [block.moe for block in _blocks(model) if block.moe is not None]
    configure_moe(moe_layers, parallel_dims, job_config)
    configure_mtp(model, parallel_dims, job_config)
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
        # The MTP blocks' attention too: each MTP depth attends over the whole sequence, as the main blocks do.
        named = [*((f"layers.{n}", b) for n, b in model.layers.items()),
                 *((f"mtp.{k}.block", m.block) for k, m in enumerate(_mtp(model)))]
        apply_cp(model, parallel_dims.cp_mesh, training.seq_len, job_config.experimental.context_parallel_method,
                 blocks=named)
        for block in _blocks(model):
            block.attention.pad_values = True  # ring attention's block kernels need equal head sizes
    whole = moe_compiles_whole(parallel_dims)
    apply_ac_and_compile(model, parallel_dims.tp_enabled, ac.mode, ac.selective_ac_option, training.compile,
                         lambda m: apply_compile(m, moe_whole=whole, parallel_dims=parallel_dims), offload=ac.offload,
                         more_blocks=mtp_block_slots(model))
    # Each MTP module (its norms, eh_proj, block and final norm) is an FSDP unit of its own after the
    # main blocks, in forward order; its MoE layer's units are among the MoE layers' (wrapped first).
    apply_data_parallel(model, parallel_dims, training, units=moe_fsdp_units(moe_layers, parallel_dims),
                        blocks=[*model.layers.values(), *_mtp(model)])
    return model


def apply_compile(model: nn.Module, moe_whole: bool = True, parallel_dims: ParallelDims | None = None) -> None:
    """Every block (the MTP modules' too) compiles whole, in one graph; with `moe_whole` False
    (expert_parallel.moe_compiles_whole: EP or TP) MoE blocks compile their attention and shared
    experts, their MoE layer running eagerly but for the parts whose shapes the dropping mode fixes
    under EP (expert_parallel.compile_moe_parts, given `parallel_dims`)."""
    blocks = _blocks(model)
    parts = 0
    for block in blocks:
        if block.moe is None or moe_whole:
            block.compile(fullgraph=True)
        else:
            block.attention.compile(fullgraph=True)
            if block.shared_experts is not None:
                block.shared_experts.compile(fullgraph=True)
            if parallel_dims is not None:
                parts += compile_moe_parts(block.moe, parallel_dims)
    how = ("whole" if moe_whole else "whole but for the MoE layers of MoE blocks"
           + (f", of which {parts} compile their router, placement, experts and read-back" if parts else ""))
    logger.info(f"compiled {len(blocks)} DeepSeek-V3 blocks with torch.compile ({how})")


# ---------------------------------------------------------------------------------------------
# Tensor parallelism


def replicate_on_tp(module: nn.Module, tp_mesh: DeviceMesh) -> None:
    """A module computed whole on every tp rank from a replicated input: its parameters become
    replicated DTensors (so gradient clipping and checkpoints see them as the other TP weights, and
    their gradients, identical on every tp rank, stay so), its input and output plain tensors."""

    def inputs(mod, args, mesh):
        return tuple(DTensor.from_local(a, mesh, [Replicate()], run_check=False)
                     if isinstance(a, torch.Tensor) and not isinstance(a, DTensor) else a for a in args)

    distribute_module(module, tp_mesh, input_fn=inputs,
                      output_fn=lambda mod, out, mesh: out.to_local() if isinstance(out, DTensor) else out)


def sum_gradient_over_tp(tp_mesh: DeviceMesh) -> Callable[[torch.Tensor], torch.Tensor]:
    """Identity in forward; in backward, the gradient summed over the tp ranks. For a tensor computed
    whole on every tp rank but used by each rank's heads only (latent attention's rotated key, shared
    by all heads): each rank's gradient is then its heads' share, and the replicated weights that
    made the tensor need the sum to stay identical across tp (and equal to one process's)."""

    def summed_in_backward(t: torch.Tensor) -> torch.Tensor:
        # The gradient of to_local is taken as a partial sum; from_local's backward makes it Replicate.
        return DTensor.from_local(t, tp_mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])

    return summed_in_backward


def replicated_parts(block: nn.Module) -> list[str]:
    """Latent attention's compressions and their norms: small, shared by every head, kept whole."""
    names = ["attention.wkv_a", "attention.kv_norm"]
    if block.attention.wq is None:
        names += ["attention.wq_a", "attention.q_norm"]
    return names


def block_plan(block: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The block's plan beside `replicated_parts`: the per-head projections split by heads (column-wise),
    `wo` row-wise, the dense or shared feed-forward as a dense one, the routed experts on their rank's
    slice of the sequence."""
    seq = Shard(1) if sequence_parallel else Replicate()
    per_head = "attention.wq" if block.attention.wq is not None else "attention.wq_b"
    plan: dict[str, ParallelStyle] = {per_head: ColwiseParallel(), "attention.wkv_b": ColwiseParallel(),
                                      "attention.wo": RowwiseParallel(output_layouts=seq)}
    ffn = "feed_forward" if block.feed_forward is not None else "shared_experts"
    if getattr(block, ffn) is not None:
        plan.update({f"{ffn}.w1": ColwiseParallel(), f"{ffn}.w3": ColwiseParallel(),
                     f"{ffn}.w2": RowwiseParallel(output_layouts=seq)})
        if sequence_parallel:
            plan[ffn] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    if block.moe is not None:
        plan["moe"] = moe_tp_plan(sequence_parallel)
    if sequence_parallel:
        plan.update({
            "attention_norm": SequenceParallel(),
            "ffn_norm": SequenceParallel(),
            # Gather the sequence before the projections; the RoPE table passes as is.
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
        })
    return plan


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool, sequence_parallel: bool) -> None:
    apply_root_tp(model, tp_mesh, loss_parallel, sequence_parallel)
    mtp = list(getattr(model, "mtp", None) or ())
    for block in [*model.layers.values(), *(m.block for m in mtp)]:
        parallelize_module(block, tp_mesh, block_plan(block, sequence_parallel))
        for name in replicated_parts(block):
            replicate_on_tp(block.get_submodule(name), tp_mesh)
        block.attention.shared_by_heads = sum_gradient_over_tp(tp_mesh)
    # MTP modules' per-token parts: on the sequence slice, or whole without sequence parallelism.
    for module in mtp:
        for part in (module.enorm, module.hnorm, module.eh_proj, module.norm):
            if sequence_parallel:
                parallelize_module(part, tp_mesh, SequenceParallel(use_local_output=True))
            else:
                replicate_on_tp(part, tp_mesh)
    logger.info(f"applied tensor parallelism over mesh {{'tp': {tp_mesh.size()}}} (sequence parallel "
                f"{'on' if sequence_parallel else 'off'}, loss parallel {'on' if loss_parallel else 'off'}; "
                "multi-head latent attention split by heads)")
