"""Ring attention for context parallelism: causal attention over a sequence split across cp ranks.

Load balancing. The sequence is cut into 2 x cp chunks, and rank i holds chunks i and 2cp-1-i
(`shard_sequence`). Under a causal mask, chunk c attends to chunks 0..c, so an early chunk paired
with a late one gives every rank the same amount of work.

Forward. Each rank keeps its queries. Key/value blocks travel around the ring: at step s, rank r
holds the block of rank (r - s) mod cp, and sends it on to r + 1 while it computes. What rank r's
two query chunks (i, 2cp-1-i) need from the block of rank j (chunks j, 2cp-1-j):
  j == i: both chunks, causal on the diagonal (q_i x k_i, q_late x k_late) and full q_late x k_i;
  j <  i: only the block's early chunk j, for both query chunks (the late chunk is in the future);
  j >  i: only the late query chunk, against the whole block.
Partial results are merged with their log-sum-exp (online softmax), so the output is exact.

Backward. A custom autograd function recomputes each block's gradients from the final output
and log-sum-exp (the flash-attention identity), accumulating dq locally. dk/dv accumulators
travel around the ring with their key/value block and arrive back at the owner after cp steps.

Block kernels: PyTorch's CPU flash-attention ops (which return the log-sum-exp) on CPU, plain
matmuls elsewhere; both are exact in fp32. Grouped-query attention is handled by sending the
smaller key/value heads around and expanding them per block.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def load_balanced_chunks(cp_rank: int, cp: int) -> tuple[int, int]:
    """The two sequence chunks (of 2 x cp) that a cp rank holds."""
    return cp_rank, 2 * cp - 1 - cp_rank


def shard_sequence(x: torch.Tensor, cp_rank: int, cp: int, dim: int = 1) -> torch.Tensor:
    """This rank's load-balanced part of a full-sequence tensor (inputs, labels, positions)."""
    if x.shape[dim] % (2 * cp):
        raise ValueError(f"sequence length {x.shape[dim]} must divide by 2 x cp = {2 * cp}")
    chunks = x.chunk(2 * cp, dim=dim)
    first, second = load_balanced_chunks(cp_rank, cp)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def unshard_sequence(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Inverse of shard_sequence, given every cp rank's part in rank order (for tests and tools)."""
    cp = len(parts)
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for rank, part in enumerate(parts):
        a, b = part.chunk(2, dim=dim)
        first, second = load_balanced_chunks(rank, cp)
        chunks[first], chunks[second] = a, b
    return torch.cat(chunks, dim=dim)


# ---------------------------------------------------------------------------------------------
# Block kernels: attention of q (B, H, Sq, D) over k, v (B, H, Sk, D) -> out (B, H, Sq, D) and
# lse (B, H, Sq) in fp32; `causal` masks the upper triangle (only used for square diagonal blocks).

def _use_flash(q: torch.Tensor) -> bool:
    return q.device.type == "cpu"


def block_forward(q, k, v, causal: bool, scale: float, flash: bool | None = None):
    if flash if flash is not None else _use_flash(q):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out.float(), lse.float()
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v.float())
    return out, lse


def block_backward(dout, q, k, v, out, lse, causal: bool, scale: float, flash: bool | None = None):
    """Gradients of one block's contribution, given the *final* output and log-sum-exp of the rows."""
    if flash if flash is not None else _use_flash(q):
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.to(q.dtype), q, k, v, out.to(q.dtype), lse, 0.0, causal, scale=scale)
        return dq.float(), dk.float(), dv.float()
    qf, kf, vf, dof = q.float(), k.float(), v.float(), dout.float()
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    p = torch.exp(scores - lse.unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), dof)
    dp = torch.matmul(dof, vf.transpose(-1, -2))
    delta = (dof * out.float()).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    return torch.matmul(ds, kf) * scale, torch.matmul(ds.transpose(-1, -2), qf) * scale, dv


def _merge(out, lse, block_out, block_lse, rows: slice):
    """Folds one block's (out, lse) for query rows `rows` into the running result, in place."""
    old_lse = lse[..., rows]
    new_lse = torch.logaddexp(old_lse, block_lse)
    out[..., rows, :] = (out[..., rows, :] * torch.exp(old_lse - new_lse).unsqueeze(-1)
                         + block_out * torch.exp(block_lse - new_lse).unsqueeze(-1))
    lse[..., rows] = new_lse


def _expand(kv: torch.Tensor, groups: int) -> torch.Tensor:
    return kv if groups == 1 else kv.repeat_interleave(groups, dim=1)


def _reduce_groups(grad: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return grad
    b, h, s, d = grad.shape
    return grad.view(b, h // groups, groups, s, d).sum(2)


def _plan(rank: int, src: int, c: int) -> list[tuple[slice, slice, bool]]:
    """(query rows, key rows, causal) pairs that rank `rank` computes against the block of `src`."""
    early, late, both = slice(0, c), slice(c, 2 * c), slice(0, 2 * c)
    if src == rank:
        return [(early, early, True), (late, early, False), (late, late, True)]
    if src < rank:
        return [(both, early, False)]
    return [(late, both, False)]


class _Ring:
    """Sends a list of tensors to the next cp rank and receives the same shapes from the previous."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def start(self, tensors: list[torch.Tensor]):
        received = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
        ops = [dist.P2POp(dist.isend, t.contiguous(), self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, r, self.prev, self.group) for r in received]
        return dist.batch_isend_irecv(ops), received

    @staticmethod
    def finish(handle) -> list[torch.Tensor]:
        works, received = handle
        for work in works:
            work.wait()
        return received


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, scale, flash):
        ring = _Ring(group)
        rank, cp = ring.rank, ring.size
        c = q.shape[2] // 2
        groups = q.shape[1] // k.shape[1]
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        kv = [k, v]
        for step in range(cp):
            src = (rank - step) % cp
            pending = ring.start(kv) if step < cp - 1 else None  # the next block travels during compute
            bk, bv = _expand(kv[0], groups), _expand(kv[1], groups)
            for rows, cols, causal in _plan(rank, src, c):
                o, s = block_forward(q[:, :, rows], bk[:, :, cols], bv[:, :, cols], causal, scale, flash)
                _merge(out, lse, o, s, rows)
            if pending is not None:
                kv = _Ring.finish(pending)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.scale, ctx.flash = group, scale, flash
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring = _Ring(ctx.group)
        rank, cp = ring.rank, ring.size
        c = q.shape[2] // 2
        groups = q.shape[1] // k.shape[1]
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        # The key/value block and its gradient accumulators travel together.
        travelling = [k, v, torch.zeros(k.shape, dtype=torch.float32, device=k.device),
                      torch.zeros(v.shape, dtype=torch.float32, device=v.device)]
        for step in range(cp):
            src = (rank - step) % cp
            bk, bv = _expand(travelling[0], groups), _expand(travelling[1], groups)
            dk_block = torch.zeros(bk.shape, dtype=torch.float32, device=k.device)
            dv_block = torch.zeros(bv.shape, dtype=torch.float32, device=v.device)
            for rows, cols, causal in _plan(rank, src, c):
                gq, gk, gv = block_backward(dout[:, :, rows], q[:, :, rows], bk[:, :, cols], bv[:, :, cols],
                                            out[:, :, rows], lse[:, :, rows].contiguous(), causal, ctx.scale,
                                            ctx.flash)
                dq[:, :, rows] += gq
                dk_block[:, :, cols] += gk
                dv_block[:, :, cols] += gv
            travelling[2] = travelling[2] + _reduce_groups(dk_block, groups)
            travelling[3] = travelling[3] + _reduce_groups(dv_block, groups)
            if step < cp - 1:
                travelling = _Ring.finish(ring.start(travelling))
            elif cp > 1:
                # One more hop brings each accumulator home: after the last step its owner is next.
                travelling = [None, None, *_Ring.finish(ring.start(travelling[2:]))]
        return dq.to(q.dtype), travelling[2].to(k.dtype), travelling[3].to(v.dtype), None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup,
                   scale: float | None = None, flash: bool | None = None) -> torch.Tensor:
    """Causal attention of this rank's load-balanced queries over the whole sequence's keys/values.

    q (batch, heads, local_seq, head_dim); k, v (batch, kv_heads, local_seq, head_dim), where
    local_seq holds this rank's two chunks (shard_sequence) and kv_heads divides heads.
    flash: force (True) or avoid (False) the CPU flash kernels; None picks by device.
    """
    if q.shape[2] % 2:
        raise ValueError(f"local sequence length {q.shape[2]} must be even (two chunks per cp rank)")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads {q.shape[1]} must be a multiple of key/value heads {k.shape[1]}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return RingAttention.apply(q, k, v, group, scale, flash)
