"""Dynamo, inductor and AOTAutograd settings with no public switch in torch 2.11-2.13
(`torch.compiler.config` does not hold them). Imported where set, as before: importing inductor
costs start-up time that runs without compile need not pay."""

from __future__ import annotations

from torchtitan.runtime.torch_compat import CPU, PrivateName

PRIVATE_NAMES = (
    PrivateName("torch._dynamo.config.optimize_ddp", checked=CPU),
    PrivateName("torch._inductor.config._micro_pipeline_tp"),
    PrivateName("torch._functorch.config.enable_autograd_cache"),
    PrivateName("torch._functorch.config.donated_buffer"),
    PrivateName("torch._inductor.config.emulate_precision_casts", checked=CPU),
    PrivateName("torch.distributed._symmetric_memory.enable_symm_mem_for_group", ("group_name",)),
)


def split_graphs_at_ddp_buckets() -> None:
    """Dynamo splits compiled graphs at DDP's bucket boundaries, so the all-reduces still overlap
    backward."""
    import torch._dynamo.config

    torch._dynamo.config.optimize_ddp = "ddp_optimizer"


def enable_micro_pipelined_tp(group_name: str) -> None:
    """Async TP: inductor splits each TP all-gather / reduce-scatter and its matmul into chunks that
    overlap, exchanging data through symmetric memory enabled for the TP group."""
    import torch._inductor.config
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    torch._inductor.config._micro_pipeline_tp = True
    enable_symm_mem_for_group(group_name)


def disable_autograd_cache() -> None:
    """Bypasses AOTAutograd's cache (inductor's FX graph cache stays on)."""
    import torch._functorch.config

    torch._functorch.config.enable_autograd_cache = False


def keep_donated_buffers() -> None:
    """Compiled graphs keep the buffers they would otherwise donate to the backward, so a backward
    can run in two passes over one graph (zero-bubble schedules)."""
    import torch._functorch.config

    torch._functorch.config.donated_buffer = False


def emulate_precision_casts() -> None:
    """Inductor rounds each low-precision cast in compiled code as eager would (it otherwise keeps
    some intermediates in fp32): float8's rowwise scaling under compile needs it (pytorch#150859)."""
    import torch._inductor.config

    torch._inductor.config.emulate_precision_casts = True
