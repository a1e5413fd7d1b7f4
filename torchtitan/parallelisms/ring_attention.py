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

Block kernels (`block_kernel`): PyTorch's fused attention ops that return the log-sum-exp and
take it back in their backward, so no (Sq x Sk) score matrix is ever stored and memory stays linear
in the local sequence. On CPU the CPU flash-attention ops; on CUDA the flash ops for fp16/bf16
(sm80+, head dim a multiple of 8 up to 256) and the memory-efficient ops otherwise (fp32, older
GPUs). "math" (plain fp32 matmuls over materialised scores) is the exactness reference and the
fallback where no fused op takes the inputs; `check_block_kernels` compares a fused kernel with it.
Grouped-query attention is handled by sending the smaller key/value heads around and expanding
them per block.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from torchtitan.runtime.torch_compat import ops as torch_compat_ops


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
# lse (B, H, Sq) in fp32; `causal` masks the upper triangle (only used for square diagonal blocks,
# where top-left and bottom-right aligned causal masks agree).
#
# Every fused kernel here returns the log-sum-exp with its output and has a backward that takes
# an output and log-sum-exp from outside, which is all that ring attention needs of a kernel.
# "math" materialises fp32 (Sq, Sk) score matrices: the exactness reference, and the fallback
# where no fused kernel takes the inputs.

BLOCK_KERNELS = ("cpu_flash", "cuda_flash", "cuda_efficient", "math")


def choose_block_kernel(device_type: str, dtype: torch.dtype, head_dim: int,
                        capability: tuple[int, int] = (0, 0), flash_built: bool = True) -> str:
    """The block kernel for inputs of this device type, dtype and head dim. `capability` and
    `flash_built` describe a CUDA device (see `block_kernel`); they are ignored elsewhere."""
    if device_type == "cpu":
        return "cpu_flash"
    if device_type != "cuda":
        return "math"
    half = dtype in (torch.float16, torch.bfloat16)
    ampere = capability >= (8, 0)
    # Flash: fp16/bf16 only, sm80+, and the op does not pad the head dim itself (F.sdpa does).
    # Its backward fails for head dims 193-224 on sm86-89 and sm120-121 (F.sdpa declines them too).
    small_smem = (8, 6) <= capability < (9, 0) or (12, 0) <= capability < (12, 2)
    head_dim_ok = head_dim % 8 == 0 and head_dim <= 256 and not (small_smem and 192 < head_dim <= 224)
    if flash_built and half and ampere and head_dim_ok:
        return "cuda_flash"
    # Memory-efficient: any head dim aligned to its vector loads; bf16 needs sm80 here too.
    dtype_ok = dtype in (torch.float32, torch.float16) or (dtype == torch.bfloat16 and ampere)
    if dtype_ok and capability >= (5, 0) and head_dim % (8 if half else 4) == 0:
        return "cuda_efficient"
    return "math"


def block_kernel(q: torch.Tensor) -> str:
    """The block kernel ring attention uses for queries like `q` (device, dtype, head dim)."""
    capability, flash_built = (0, 0), True
    if q.device.type == "cuda":
        capability = torch.cuda.get_device_capability(q.device)
        flash_built = torch.backends.cuda.is_flash_attention_available()
    return choose_block_kernel(q.device.type, q.dtype, q.shape[-1], capability, flash_built)


def _math_forward(q, k, v, causal: bool, scale: float):
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v.float())
    return out, lse


def _math_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
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


def _efficient_lse(lse: torch.Tensor) -> torch.Tensor:
    """The log-sum-exp laid out as the CUDA memory-efficient backward reads it: padded along the
    queries to a multiple of 32 with +inf (it loads whole 32-row tiles without bound checks, and
    exp(s - inf) = 0 keeps the rows past the end out of dk/dv). ROCm's kernel wants it compact."""
    pad = -lse.shape[-1] % 32
    if pad == 0 or torch.version.hip:
        return lse.contiguous()
    return torch.nn.functional.pad(lse, (0, pad), value=float("inf"))


def _bmhk(t: torch.Tensor) -> torch.Tensor:
    """A (B, H, S, D) tensor stored as (B, S, H, D), as the memory-efficient forward returns its
    output: its backward takes the output's row stride to be H x D without reading the strides."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def block_forward(q, k, v, causal: bool, scale: float, kernel: str | None = None):
    kernel = block_kernel(q) if kernel is None else kernel
    if kernel == "math":
        return _math_forward(q, k, v, causal, scale)
    if kernel == "cpu_flash":
        out, lse = torch_compat_ops.flash_attention_cpu(q, k, v, 0.0, causal, scale=scale)
    elif kernel == "cuda_flash":
        out, lse = torch_compat_ops.flash_attention_cuda(q, k, v, 0.0, causal, False, scale=scale)[:2]
    elif kernel == "cuda_efficient":
        out, lse = torch_compat_ops.efficient_attention_cuda(q, k, v, None, True, 0.0, causal, scale=scale)[:2]
        lse = lse[..., :q.shape[2]]  # padded to a multiple of 32 queries on CUDA
    else:
        raise ValueError(f"unknown block kernel {kernel!r}; one of {BLOCK_KERNELS}")
    return out.float(), lse.float()


def block_backward(dout, q, k, v, out, lse, causal: bool, scale: float, kernel: str | None = None):
    """Gradients of one block's contribution, given the *final* output and log-sum-exp of the rows."""
    kernel = block_kernel(q) if kernel is None else kernel
    if kernel == "math":
        return _math_backward(dout, q, k, v, out, lse, causal, scale)
    # The fused backwards read dout and out as q's dtype (the CUDA ones without checking).
    dout, out, lse = dout.to(q.dtype), out.to(q.dtype), lse.float().contiguous()
    if kernel == "cpu_flash":
        grads = torch_compat_ops.flash_attention_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale)
    elif kernel == "cuda_flash":
        # No cumulative sequence lengths: the dense (not varlen) kernel. The rng state is read
        # only with dropout.
        rng = torch.empty(0, device=q.device)
        grads = torch_compat_ops.flash_attention_cuda_backward(
            dout, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, rng, rng, scale=scale)
    elif kernel == "cuda_efficient":
        rng = torch.empty(0, device=q.device)
        grads = torch_compat_ops.efficient_attention_cuda_backward(
            dout, q, k, v, None, _bmhk(out), _efficient_lse(lse), rng, rng, 0.0, [True, True, True, False],
            causal, scale=scale)
    else:
        raise ValueError(f"unknown block kernel {kernel!r}; one of {BLOCK_KERNELS}")
    dq, dk, dv = grads[:3]
    return dq.float(), dk.float(), dv.float()


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
    def forward(ctx, q, k, v, group, scale, kernel):
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
                o, s = block_forward(q[:, :, rows], bk[:, :, cols], bv[:, :, cols], causal, scale, kernel)
                _merge(out, lse, o, s, rows)
            if pending is not None:
                kv = _Ring.finish(pending)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.scale, ctx.kernel = group, scale, kernel
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
                                            ctx.kernel)
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
                   scale: float | None = None, kernel: str | None = None) -> torch.Tensor:
    """Causal attention of this rank's load-balanced queries over the whole sequence's keys/values.

    q (batch, heads, local_seq, head_dim); k, v (batch, kv_heads, local_seq, head_dim), where
    local_seq holds this rank's two chunks (shard_sequence) and kv_heads divides heads.
    kernel: the block kernel, one of BLOCK_KERNELS; None picks the fused one for q's device and
    dtype (`block_kernel`), "math" is the materialised-scores reference.
    """
    if q.shape[2] % 2:
        raise ValueError(f"local sequence length {q.shape[2]} must be even (two chunks per cp rank)")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads {q.shape[1]} must be a multiple of key/value heads {k.shape[1]}")
    kernel = block_kernel(q) if kernel is None else kernel
    if kernel not in BLOCK_KERNELS:
        raise ValueError(f"unknown block kernel {kernel!r}; one of {BLOCK_KERNELS}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return RingAttention.apply(q, k, v, group, scale, kernel)


def check_block_kernels(device: str | torch.device, dtype: torch.dtype, kernel: str | None = None,
                        seed: int = 0) -> dict:
    """Compares a fused block kernel (by default the one ring attention picks for `device` and
    `dtype`) with the "math" reference on random inputs, forward and backward, as ring attention
    uses them. Returns the kernel's name and, per case, the largest absolute differences of out,
    lse, dq, dk and dv; "max_error" is the largest of them, "ok" compares it with "tolerance".

    Cases: a square causal diagonal block; a full off-diagonal block (half the queries against
    the whole block, as a late query chunk meets a later rank's block); and grouped-query attention
    over two blocks (one full, one causal diagonal) whose results are merged by their log-sum-exp,
    with the backward of each block given the merged output and log-sum-exp. The reference runs
    in fp32 on the same (rounded) inputs, so for fp16/bf16 the differences include the fused
    kernel's low-precision output and intermediate rounding: hence the looser tolerance there.
    Sequence lengths are not multiples of 32, to exercise padded log-sum-exps.
    """
    device = torch.device(device)
    probe = torch.empty(1, 1, 1, 64, dtype=dtype, device=device)
    kernel = block_kernel(probe) if kernel is None else kernel
    gen = torch.Generator().manual_seed(seed)
    batch, heads, seq, dim = 2, 4, 72, 64
    scale = dim**-0.5

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    def run(name, q, blocks, kv_heads):
        """blocks: (k, v, causal) per key/value block, merged over all of q's rows."""
        groups = heads // kv_heads
        dout = randn(*q.shape)
        rows = slice(0, q.shape[2])
        results = {}
        for which in (kernel, "math"):
            out = torch.zeros(q.shape, dtype=torch.float32, device=device)
            lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=device)
            for k, v, causal in blocks:
                o, s = block_forward(q, _expand(k, groups), _expand(v, groups), causal, scale, which)
                _merge(out, lse, o, s, rows)
            dq = torch.zeros(q.shape, dtype=torch.float32, device=device)
            dkv = []
            for k, v, causal in blocks:
                gq, gk, gv = block_backward(dout, q, _expand(k, groups), _expand(v, groups), out, lse, causal,
                                            scale, which)
                dq += gq
                dkv += [_reduce_groups(gk, groups), _reduce_groups(gv, groups)]
            results[which] = {"out": out, "lse": lse, "dq": dq, "dk": torch.cat(dkv[0::2], 2),
                              "dv": torch.cat(dkv[1::2], 2)}
        fused, ref = results[kernel], results["math"]
        errors = {key: (fused[key] - ref[key]).abs().max().item() for key in ref}
        scales[name] = {key: max(1.0, ref[key].abs().max().item()) for key in ref}
        return name, errors

    scales: dict[str, dict[str, float]] = {}
    q = randn(batch, heads, seq, dim)
    cases = dict([
        run("diagonal_causal", q, [(randn(batch, heads, seq, dim), randn(batch, heads, seq, dim), True)], heads),
        run("off_diagonal", randn(batch, heads, seq // 2, dim),
            [(randn(batch, heads, seq, dim), randn(batch, heads, seq, dim), False)], heads),
        run("gqa_two_blocks", q, [(randn(batch, heads // 2, seq, dim), randn(batch, heads // 2, seq, dim), False),
                                  (randn(batch, heads // 2, seq, dim), randn(batch, heads // 2, seq, dim), True)],
            heads // 2),
    ])
    max_error = max(err for errs in cases.values() for err in errs.values())
    # Relative to the reference's largest magnitude (at least 1): a few units in the last place
    # of the output dtype for fp16/bf16, where the fused kernels round probabilities and outputs.
    tolerance = {torch.float16: 5e-3, torch.bfloat16: 2e-2}.get(dtype, 1e-4)
    ok = all(err <= tolerance * scales[name][key] for name, errs in cases.items() for key, err in errs.items())
    return {"kernel": kernel, "device": str(device), "dtype": str(dtype).removeprefix("torch."), "cases": cases,
            "max_error": max_error, "tolerance": tolerance, "ok": ok}
