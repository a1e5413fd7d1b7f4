"""parallelize_llama: applies parallelisms to a Llama model (or one pipeline stage of it).

Order matters and is fixed: tensor parallelism -> context parallelism -> activation checkpointing
-> torch.compile -> FSDP/HSDP or DDP. Each step is one small `apply_*` that logs one line. `validate_llama` checks,
before any process group exists, that the model's shapes allow the requested layout.
"""

from __future__ import annotations

import inspect
import logging

import torch
from torch import nn
from torch.distributed._composable.replicate import replicate
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.nn.parallel import DistributedDataParallel

from torchtitan.config_manager import ConfigError, JobConfig
from torchtitan.models.llama.model import ModelArgs, ffn_hidden_dim
from torchtitan.parallelisms.activation_checkpoint import apply_ac
from torchtitan.parallelisms.context_parallel import apply_cp
from torchtitan.parallelisms.distributed import resolve_param_dtype
from torchtitan.parallelisms.float8 import apply_float8, float8_tp_styles, is_float8
from torchtitan.parallelisms.parallel_dims import ParallelDims

logger = logging.getLogger(__name__)
_DDP_ARGS = inspect.signature(DistributedDataParallel.__init__).parameters


def validate_llama(args: ModelArgs, parallel_dims: ParallelDims, job_config: JobConfig) -> None:
    """Shape requirements of the layout, checked on every rank before any process group starts."""
    if parallel_dims.pp_enabled:
        from torchtitan.models.llama.pipeline_llama import validate_pipeline_llama

        validate_pipeline_llama(args, job_config)
    tp = parallel_dims.tp
    if tp == 1:
        return
    flavor = f"model {job_config.model.name} {job_config.model.flavor}"
    n_kv_heads = args.n_kv_heads or args.n_heads
    for what, value in (("n_heads", args.n_heads), ("n_kv_heads", n_kv_heads), ("feed-forward hidden size", ffn_hidden_dim(args))):
        if value % tp:
            raise ConfigError(f"training.tensor_parallel_degree {tp} must divide the {what} ({value}) of {flavor}")
    vocab = args.vocab_size + args.vocab_padding
    if vocab % tp:
        raise ConfigError(f"training.tensor_parallel_degree {tp} must divide the vocabulary ({vocab} tokens); set "
                          f"model.vocab_size_divisible_by to {tp} (or a multiple of it) to pad it")


def parallelize_llama(model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig) -> nn.Module:
    t = job_config.training
    ac = job_config.activation_checkpoint
    if job_config.float8.enable_float8_linear:
        apply_float8(model, job_config)  # before TP and FSDP, which then handle the float8 modules
    if parallel_dims.tp_enabled:
        tp_mesh = parallel_dims.get_mesh("tp")
        apply_tp(model, tp_mesh, loss_parallel=parallel_dims.loss_parallel_enabled,
                 sequence_parallel=not t.disable_sequence_parallel, float8=job_config.float8.enable_float8_linear)
        if job_config.experimental.enable_async_tensor_parallel:
            apply_async_tp(tp_mesh)
    if parallel_dims.cp_enabled:
        apply_cp(model, parallel_dims.get_mesh("cp"), t.seq_len)  # before AC wraps the blocks
    if ac.mode != "none":
        apply_ac(model, ac.mode, ac.selective_ac_option)
    if t.compile:
        apply_compile(model)
        if parallel_dims.tp_enabled and model.tok_embeddings is not None:
            # PyTorch 2.13: when a compiled block's input is the view that DTensor.to_local() returned
            # (the embedding's output), its input gradient skips the to_local's backward, and the
            # embedding's redistribute then receives a plain tensor. A copy breaks the alias.
            model.tok_embeddings.register_forward_hook(lambda module, args, output: output.clone())

    if parallel_dims.fsdp_enabled:
        if parallel_dims.dp_replicate_enabled:
            # HSDP: replicate over the outer dim, shard within each replica group.
            fsdp_mesh = parallel_dims.get_mesh("world")[("dp_replicate", "dp_shard")]
        else:
            fsdp_mesh = parallel_dims.get_mesh("dp_shard_cp")
        apply_fsdp(
            model,
            fsdp_mesh,
            param_dtype=resolve_param_dtype(t.mixed_precision_param, fsdp_mesh.device_type),
            reduce_dtype=resolve_param_dtype(t.mixed_precision_reduce, fsdp_mesh.device_type),
            # A pipeline stage runs forward once per microbatch before its backwards: freeing the
            # gathered parameters after each forward would gather them again every microbatch.
            reshard_after_forward=("never" if parallel_dims.pp_enabled and t.fsdp_reshard_after_forward == "default"
                                   else t.fsdp_reshard_after_forward),
            cpu_offload=t.enable_cpu_offload,
        )
    elif parallel_dims.ddp_enabled and (parallel_dims.tp_enabled or parallel_dims.pp_enabled):
        apply_fsdp_replicate(model, parallel_dims.get_mesh("dp_replicate"),
                             reduce_dtype=resolve_param_dtype(t.mixed_precision_reduce, "cpu"))
    elif parallel_dims.ddp_enabled:
        apply_ddp(
            model,
            parallel_dims.get_mesh("dp_replicate"),
            bucket_cap_mb=t.ddp_bucket_cap_mb,
            reduce_dtype=resolve_param_dtype(t.mixed_precision_reduce, "cpu"),
            compiled=t.compile,
        )
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
    root_plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "output": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                  use_local_output=not loss_parallel),
    }
    if sequence_parallel:
        root_plan["norm"] = SequenceParallel()
    parallelize_module(model, tp_mesh, {k: v for k, v in root_plan.items() if getattr(model, k, None) is not None})
    if loss_parallel and getattr(model, "vocab_mask", None) is not None:
        model.vocab_mask = ShardedVocabMask(model.vocab_mask.vocab_size)

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


def apply_async_tp(tp_mesh: DeviceMesh) -> None:
    """Async TP: inductor splits each TP all-gather / reduce-scatter and its matmul into chunks that
    overlap, exchanging data through symmetric memory (CUDA only; needs training.compile)."""
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    torch._inductor.config._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)
    logger.info("enabled async tensor parallelism (micro-pipelined collectives)")


class ShardedVocabMask(nn.Module):
    """The model's padded-vocabulary mask for vocabulary-sharded logits (loss parallelism): each
    rank masks the padding ids that fall into its own slice of the columns."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size

    def forward(self, logits: DTensor) -> DTensor:
        local = logits.to_local()
        first = logits.device_mesh.get_local_rank() * local.shape[-1]  # the vocabulary divides by TP
        ids = torch.arange(first, first + local.shape[-1], device=local.device)
        masked = local.masked_fill(ids >= self.vocab_size, float("-inf"))
        return DTensor.from_local(masked, logits.device_mesh, logits.placements, shape=logits.shape, stride=logits.stride())


def apply_compile(model: nn.Module) -> None:
    """Compiles each transformer block on its own (in place, so parameter names do not change).

    Blocks share one code object, so the compiled graph is reused by every block; compiling
    block by block keeps graphs small and lets FSDP / DDP hooks sit between them.
    """
    for block in model.layers.values():
        block.compile(fullgraph=True)
    logger.info(f"compiled {len(model.layers)} transformer blocks with torch.compile")


def apply_ddp(model: nn.Module, mesh: DeviceMesh, bucket_cap_mb: int, reduce_dtype: torch.dtype, compiled: bool) -> None:
    """Replicated data parallelism (DDP) through PyTorch's composable `replicate`.

    Gradients are all-reduced in buckets of `bucket_cap_mb` as backward produces them, so
    communication overlaps the rest of backward.
    """
    if compiled:
        # Dynamo splits compiled graphs at bucket boundaries so the all-reduces still overlap.
        torch._dynamo.config.optimize_ddp = "ddp_optimizer"
    # Buffers (the RoPE table) are computed alike on every rank: no broadcast before each forward.
    no_buffer_sync = ({"forward_sync_buffers": False} if "forward_sync_buffers" in _DDP_ARGS
                      else {"broadcast_buffers": False})  # torch < 2.13
    replicate(model, device_mesh=mesh, bucket_cap_mb=bucket_cap_mb, **no_buffer_sync)
    if reduce_dtype == torch.bfloat16:
        if mesh.device_type != "cuda":
            raise ConfigError("training.mixed_precision_reduce bfloat16 under DDP uses PyTorch's bf16 compression hook, "
                              "which needs CUDA and NCCL; on CPU leave it at float32")
        # Halves the all-reduce volume; gradients are cast back to their own dtype afterwards.
        model.register_comm_hook(mesh.get_group(), default_hooks.bf16_compress_hook)
    logger.info(f"applied DDP over mesh {dict(zip(mesh.mesh_dim_names, mesh.shape))} "
                f"(bucket {bucket_cap_mb} MB, reduce {reduce_dtype})")


def apply_fsdp_replicate(model: nn.Module, mesh: DeviceMesh, reduce_dtype: torch.dtype) -> None:
    """Replicated data parallelism for a model that other parallelisms already touched: PyTorch's
    FSDP-based `replicate`, per block and at the root. Unlike the composable DDP it accepts TP's
    DTensor parameters, and a pipeline stage can defer its all-reduce to the last microbatch."""
    try:
        from torch.distributed._composable.replicate_with_fsdp import replicate as replicate_fsdp
    except ImportError:
        raise ConfigError(f"DDP combined with tensor or pipeline parallelism needs PyTorch's FSDP-based replicate, "
                          f"which torch {torch.__version__} lacks; shard instead (data_parallel_shard_degree > 1)") from None
    policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=reduce_dtype)
    for block in model.layers.values():
        replicate_fsdp(block, mesh=mesh, mp_policy=policy)
    replicate_fsdp(model, mesh=mesh, mp_policy=policy)
    logger.info(f"applied DDP (FSDP-based replicate) over mesh {dict(zip(mesh.mesh_dim_names, mesh.shape))} "
                f"(reduce {reduce_dtype})")


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: str,
    cpu_offload: bool = False,
) -> None:
    """FSDP2 `fully_shard` per transformer block, then at the root (embedding, norm, output)."""
    config = {"mesh": mesh, "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)}
    if cpu_offload:
        # Pinned host memory makes the host-device copies asynchronous; it needs an accelerator.
        config["offload_policy"] = CPUOffloadPolicy(pin_memory=mesh.device_type != "cpu")
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        if reshard_after_forward == "default":
            # The last block's parameters would be gathered again at once for backward, so
            # keeping them after forward saves one all-gather at no extra peak memory.
            reshard = i < len(blocks) - 1
        else:
            reshard = reshard_after_forward == "always"
        fully_shard(block, **config, reshard_after_forward=reshard)
    # The root's parameters (embedding, final norm, output) are used first in backward.
    fully_shard(model, **config, reshard_after_forward=reshard_after_forward == "always")
    kind = "HSDP" if mesh.ndim > 1 else "FSDP"
    offload = "; parameters, gradients and optimizer state offloaded to CPU" if cpu_offload else ""
    logger.info(f"applied {kind} over mesh {dict(zip(mesh.mesh_dim_names, mesh.shape))} (params {param_dtype}, "
                f"reduce {reduce_dtype}, reshard after forward: {reshard_after_forward}{offload})")
