"""The attention kernel context parallelism installs: ring or all-gather attention, with or without
document masks, eager or inside a compiled block.

`cp_attention(q, k, v, documents=None, *, group_name, method, ...)` is what each attention
module's `kernel` becomes (context_parallel.apply_cp). `documents` is what the model's mask seam
hands every block under CP: the host copy of the whole sequence's document ids (batch, seq), from
which the kernel plans its blocks without waiting for the device (cp_block_plan.py).

Eager, it is an autograd function over the method's forward and backward (ring_attention.py,
allgather_attention.py). Inside a block compiled by torch.compile (training.compile) the same
forward and backward run as two custom operators that the compiler treats as opaque calls: the
blocks' matmuls, norms and RoPE are compiled around them, and the point-to-point exchange or the
collectives stay outside the graph. The process group reaches the operators by name, registered
here when CP is applied (operators take no process-group objects).
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from torchtitan.parallelisms.allgather_attention import allgather_backward, allgather_forward
from torchtitan.parallelisms.attention_blocks import BLOCK_KERNELS, block_kernel
from torchtitan.parallelisms.cp_block_plan import DEFAULT_TILE, DocumentPlan
from torchtitan.parallelisms.ring_attention import ring_backward, ring_forward

METHODS = {"ring": (ring_forward, ring_backward), "allgather": (allgather_forward, allgather_backward)}
_GROUPS: dict[str, dist.ProcessGroup] = {}
# Every block of a forward gets the same host ids: planned once (a few tenths of a second at 64k
# positions on a CPU core). The last ids seen and their plan; a weak reference, so the batch's ids
# are not kept alive, and identity (not equal values) decides.
_last_plan: tuple[weakref.ref, DocumentPlan] | None = None


def register_group(group: dist.ProcessGroup) -> str:
    """The name under which the kernel finds `group` (its c10d name)."""
    _GROUPS[group.group_name] = group
    return group.group_name


def _group(name: str) -> dist.ProcessGroup:
    if name not in _GROUPS:
        raise KeyError(f"process group {name!r} was not registered for context parallelism (register_group)")
    return _GROUPS[name]


def _on_device(documents: torch.Tensor | None, like: torch.Tensor) -> tuple[torch.Tensor | None, DocumentPlan | None]:
    """The device copy of the document ids (for the masks) and their plan (from the host copy)."""
    if documents is None:
        return None, None
    global _last_plan
    if _last_plan is None or _last_plan[0]() is not documents:
        _last_plan = (weakref.ref(documents), DocumentPlan(documents))
    return documents.to(like.device, non_blocking=True), _last_plan[1]


def _add_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The output and log-sum-exp with attention sinks (gpt-oss): each head's sink logit joins
    every query's softmax denominator and attends to nothing, which scales the merged output by
    exp(lse - lse'), lse' = log(exp(lse) + exp(sink)). The backward of every block given these
    final (out, lse') is then exact for q, k and v (the sink adds a probability whose value is zero)."""
    if sinks is None:
        return out, lse
    with_sink = torch.logaddexp(lse, sinks.float().view(1, -1, 1))
    return out * torch.exp(lse - with_sink).unsqueeze(-1), with_sink


def _sinks_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """d loss / d sink: the sink's probability exp(sink - lse') times -(dout . out), summed over
    the rows and the batch (the softmax gradient of a column whose value is zero)."""
    p_sink = torch.exp(sinks.float().view(1, -1, 1) - lse)
    return -(p_sink * (dout.float() * out).sum(-1)).sum(dim=(0, 2)).to(sinks.dtype)


class _CPAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, documents, sinks, group_name, method, scale, kernel, tile, window):
        ids, plan = _on_device(documents, q)
        forward, _ = METHODS[method]
        out, lse = _add_sinks(*forward(q, k, v, _group(group_name), scale, kernel, ids, plan, tile, window), sinks)
        ctx.save_for_backward(q, k, v, out, lse, *(() if sinks is None else (sinks,)))
        ctx.args = (ids, plan, group_name, method, scale, kernel, tile, window)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, *sinks = ctx.saved_tensors
        ids, plan, group_name, method, scale, kernel, tile, window = ctx.args
        _, backward = METHODS[method]
        dq, dk, dv = backward(dout, q, k, v, out, lse, _group(group_name), scale, kernel, ids, plan, tile, window)
        dsinks = _sinks_grad(dout, out, lse, sinks[0]) if sinks else None
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, dsinks, None, None, None, None, None, None


# The compiled path: the same forward and backward as opaque operators.

@torch.library.custom_op("torchtitan::cp_attention", mutates_args=())
def _cp_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor | None,
                     sinks: torch.Tensor | None, group_name: str, method: str, scale: float, kernel: str, tile: int,
                     window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    ids, plan = _on_device(documents, q)
    out, lse = _add_sinks(*METHODS[method][0](q, k, v, _group(group_name), scale, kernel, ids, plan, tile, window),
                          sinks)
    return out.to(q.dtype), lse


@_cp_attention_op.register_fake
def _(q, k, v, documents, sinks, group_name, method, scale, kernel, tile, window):
    # Contiguous, as the real outputs are (q itself is usually a transposed view).
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("torchtitan::cp_attention_backward", mutates_args=())
def _cp_attention_backward_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                              lse: torch.Tensor, documents: torch.Tensor | None, sinks: torch.Tensor | None,
                              group_name: str, method: str, scale: float, kernel: str, tile: int,
                              window: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    ids, plan = _on_device(documents, q)
    dq, dk, dv = METHODS[method][1](dout, q, k, v, out, lse, _group(group_name), scale, kernel, ids, plan, tile, window)
    # An operator's outputs may not alias each other: the all-gather method's key and value
    # gradients are two views of one reduce-scattered buffer, which `to` would return as they are
    # when the dtype already matches (fp32). `copy=True` gives each its own memory in one copy,
    # the one a cast to bf16 makes anyway. Without sinks their gradient is an empty tensor.
    dsinks = _sinks_grad(dout, out, lse, sinks) if sinks is not None else q.new_empty(0)
    return dq.to(q.dtype), dk.to(k.dtype, copy=True), dv.to(v.dtype, copy=True), dsinks


@_cp_attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, documents, sinks, group_name, method, scale, kernel, tile, window):
    dsinks = sinks.new_empty(sinks.shape) if sinks is not None else q.new_empty(0)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks


def _setup_context(ctx, inputs, output):
    q, k, v, documents, sinks, group_name, method, scale, kernel, tile, window = inputs
    ctx.save_for_backward(q, k, v, *output, documents, sinks)
    ctx.args = (group_name, method, scale, kernel, tile, window)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, documents, sinks = ctx.saved_tensors
    dq, dk, dv, dsinks = _cp_attention_backward_op(dout, q, k, v, out, lse, documents, sinks, *ctx.args)
    return dq, dk, dv, None, dsinks if sinks is not None else None, None, None, None, None, None, None


_cp_attention_op.register_autograd(_backward, setup_context=_setup_context)


def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor | None = None, *,
                 group_name: str, method: str = "ring", scale: float | None = None, kernel: str | None = None,
                 tile: int = DEFAULT_TILE, sinks: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """Causal attention of this rank's load-balanced queries over the whole sequence's keys/values.

    q (batch, heads, local_seq, head_dim); k, v (batch, kv_heads, local_seq, head_dim), where
    local_seq holds this rank's two chunks (ring_attention.shard_sequence) and kv_heads divides
    heads. documents: the host's document ids of the whole sequence (batch, seq), or None for plain
    causal attention. method: "ring" or "allgather". kernel: the block kernel, one of
    BLOCK_KERNELS; None picks the fused one for q's device and dtype, "math" is the
    materialised-scores reference. tile: query rows per block under document masking or a window.
    sinks: one logit per (local) head that joins each softmax's denominator (gpt-oss), or None.
    window: banded attention, each query seeing the `window` latest positions (itself included);
    the blocks wholly outside the band are skipped, those it cuts masked; None: full causal.
    """
    if q.shape[2] % 2:
        raise ValueError(f"local sequence length {q.shape[2]} must be even (two chunks per cp rank)")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads {q.shape[1]} must be a multiple of key/value heads {k.shape[1]}")
    kernel = block_kernel(q) if kernel is None else kernel
    if kernel not in BLOCK_KERNELS:
        raise ValueError(f"unknown block kernel {kernel!r}; one of {BLOCK_KERNELS}")
    if method not in METHODS:
        raise ValueError(f"unknown context parallel method {method!r}; one of {tuple(METHODS)}")
    if window is not None and window < 1:
        raise ValueError(f"attention window {window} must be at least 1 (the query itself)")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if torch.compiler.is_compiling():
        return _cp_attention_op(q, k, v, documents, sinks, group_name, method, scale, kernel, tile, window)[0]
    return _CPAttention.apply(q, k, v, documents, sinks, group_name, method, scale, kernel, tile, window)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup,
                   scale: float | None = None, kernel: str | None = None) -> torch.Tensor:
    """Plain causal ring attention over `group` (cp_attention with method "ring")."""
    return cp_attention(q, k, v, group_name=register_group(group), scale=scale, kernel=kernel)
