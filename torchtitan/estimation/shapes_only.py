"""Tensors with shapes but no values: the dry run's stand-ins where shapes depend on values.

How many tokens each expert of an MoE layer receives is data: the routing's count per expert, and under
expert parallelism the counts the ranks exchange. The dry run's fake tensors hold no values, so it
puts these stand-ins into the model's seams (`on_fake_tensors`): tokens spread evenly over the
experts and ranks, so the estimate of an MoE layer is that of perfectly balanced routing; and the
grouped expert matmul always grouped, as the GPUs' kernel it stands for (the loop would need the
groups' sizes as values). The MoE dropping mode (`moe.capacity_factor`) needs none of them: its
sizes are Python ints, so it runs on fake tensors as it runs on real ones.

Document masking under context parallelism plans which attention blocks to compute from the
document ids' values (parallelisms/cp_block_plan.py). On fake tensors it plans plain causal
attention: every block a document mask could skip is computed, an upper bound on time and on the
transient memory of one block (the masks themselves are one block's size).

gpt-oss's attention kernel (sinks, banded blocks) materialises its scores where FlexAttention is
not run (the CPU the dry run simulates on); on the GPUs a job runs on, FlexAttention keeps only the
output and the log-sum-exp. The dry run stands in a fused kernel of those shapes
(`fused_sink_attention`): causal attention over the whole sequence, an upper bound on a banded
block's time.

`expert_load` (the planner's, for dropless routing under expert parallelism): the simulated rank
is the busiest of its expert-parallel group and receives `expert_load` times its even share of
the group's tokens (it still sends its own tokens evenly). Without expert parallelism a rank
computes all of its own (token, choice) pairs whatever the routing, so the load changes nothing
there.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from torchtitan.models.gpt_oss.model import sink_attention
from torchtitan.models.moe import DEVICE_KERNELS, ExpertKernels, expert_token_counts, grouped_mm
from torchtitan.parallelisms.context_parallel import host_document_ids
from torchtitan.parallelisms.expert_parallel import exchange_counts


def causal_under_cp(document_ids: torch.Tensor) -> None:
    """The models' mask seam under CP on fake tensors: no documents, plain causal attention."""
    return None


def balanced_counts(total: int, n: int, device: torch.device) -> torch.Tensor:
    """`total` tokens spread as evenly as they go over `n` experts (or ranks)."""
    return torch.tensor([total // n + (i < total % n) for i in range(n)], device=device)


def balanced_token_counts(flat_experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """`MoE.count_tokens` on fake tensors: every (token, choice) pair spread evenly."""
    return balanced_counts(flat_experts.numel(), num_experts, flat_experts.device)


def balanced_exchange(send_counts: torch.Tensor, tokens: torch.Tensor, group: dist.ProcessGroup,
                      load: float = 1.0) -> tuple[torch.Tensor, list[int], list[int]]:
    """Expert parallelism's `exchange_counts` on fake tensors: every rank is taken to send every
    other an even share, nothing is exchanged; this rank receives `load` times its share (module
    docstring)."""
    ep, local_experts = send_counts.shape
    n = tokens.shape[0]
    received = round(n * load)
    counts = [received // (ep * local_experts) + (i < received % (ep * local_experts)) for i in range(ep * local_experts)]
    recv = [sum(counts[r * local_experts:(r + 1) * local_experts]) for r in range(ep)]
    send = [n // ep + (r < n % ep) for r in range(ep)]
    return torch.tensor(counts, device=tokens.device).view(ep, local_experts), send, recv


def fused_sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor | None = None, *,
                         sinks: torch.Tensor, window: int | None) -> torch.Tensor:
    """gpt-oss's `Attention.kernel` on fake tensors: what a fused kernel keeps (the output and a
    (batch, heads, seq) log-sum-exp-sized factor from the sinks), not a (seq x seq) score matrix."""
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
    factor = torch.sigmoid(out[..., 0] - sinks.view(1, -1, 1))  # (batch, heads, seq), as sinks scale it
    return out * factor.unsqueeze(-1).to(out.dtype)


class _GroupedMatmulShapes(torch.autograd.Function):
    """What `F.grouped_mm` allocates, for fake tensors in a dtype its shape function refuses
    (it takes bf16 only, while CPU runs it in fp32): an (N, out) result holding on to x and the
    weight for backward, and gradients of their shapes."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight_t: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight_t)
        return x.new_empty(x.shape[0], weight_t.shape[-1])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight_t = ctx.saved_tensors
        return torch.empty_like(x), torch.empty_like(weight_t)


def _grouped_mm_available(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    return hasattr(F, "grouped_mm")


def _grouped_mm_shapes(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor | int | list[int],
                       use_grouped: bool) -> torch.Tensor:
    if use_grouped and x.dtype != torch.bfloat16:  # standing for a CPU job: the kernel's shapes alone
        return _GroupedMatmulShapes.apply(x, weight.transpose(-2, -1))
    return grouped_mm(x, weight, counts, use_grouped)


FAKE_KERNELS = ExpertKernels(_grouped_mm_available, _grouped_mm_shapes)


def on_fake_tensors(modules: Iterable[nn.Module], expert_load: float = 1.0) -> None:
    """Puts the stand-ins into the seams of `modules` and their submodules, where the defaults are
    still in place (a seam another component filled keeps its own). `expert_load`: see the module
    docstring."""
    exchange = balanced_exchange if expert_load == 1.0 else functools.partial(balanced_exchange, load=expert_load)
    for root in modules:
        for module in root.modules():
            if getattr(module, "count_tokens", None) is expert_token_counts:
                module.count_tokens = balanced_token_counts
            kernels = getattr(module, "kernels", None)
            # Equal, not the same object: splitting a model into pipeline stages deep-copies it.
            if isinstance(kernels, ExpertKernels) and kernels == DEVICE_KERNELS:
                module.kernels = FAKE_KERNELS
            if getattr(module, "exchange_counts", None) is exchange_counts:
                module.exchange_counts = exchange
            if getattr(module, "attention_mask", None) is host_document_ids:
                module.attention_mask = causal_under_cp
            if getattr(module, "kernel", None) is sink_attention:
                module.kernel = fused_sink_attention
