"""Attention over one block of keys, the unit context parallelism builds exact attention from.

Context parallelism (ring_attention.py, allgather_attention.py) computes each rank's queries
against blocks of the sequence's keys and values one at a time, and merges the partial results by
their log-sum-exp (online softmax). A block kernel here takes q (B, H, Sq, D) and k, v (B, H, Sk, D)
and returns out (B, H, Sq, D) and lse (B, H, Sq) in fp32; its backward takes the *final* output and
log-sum-exp of the rows (the flash-attention identity), so no (Sq x Sk) score matrix is stored.

`causal` masks the upper triangle of a square diagonal block (where top-left and bottom-right
aligned causal masks agree). `mask`, an additive fp32 (B, 1, Sq, Sk) tensor (0 where a query may
attend, -inf elsewhere), carries document masking; a query row with no key left in a masked block
gets lse -inf and a zero output, so the merge ignores it.

Kernels: PyTorch's fused attention ops that return the log-sum-exp with the output and take it back
in their backward. On CPU the flash-attention ops (masks included); on CUDA the flash ops for
fp16/bf16 (sm80+, head dim a multiple of 8 up to 256) and the memory-efficient ops otherwise (fp32,
older GPUs) and for every masked block (flash takes no mask). "math" (plain fp32 matmuls over
materialised scores) is the exactness reference and the fallback where no fused op takes the
inputs; `check_block_kernels` compares a fused kernel with it.
"""

from __future__ import annotations

import torch

from torchtitan.runtime.torch_compat import ops as torch_compat_ops

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


def _math_scores(q, k, causal: bool, scale: float, mask: torch.Tensor | None):
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        upper = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(upper, float("-inf"))
    return scores if mask is None else scores + mask


def _math_forward(q, k, v, causal: bool, scale: float, mask: torch.Tensor | None = None):
    scores = _math_scores(q, k, causal, scale, mask)
    lse = torch.logsumexp(scores, dim=-1)
    # A row with every key masked has lse -inf; its probabilities are 0, not NaN.
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    return torch.matmul(probs, v.float()), lse


def _math_backward(dout, q, k, v, out, lse, causal: bool, scale: float, mask: torch.Tensor | None = None):
    qf, kf, vf, dof = q.float(), k.float(), v.float(), dout.float()
    scores = _math_scores(q, k, causal, scale, mask)
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


def masked_block_kernel(kernel: str) -> str:
    """The kernel a masked block runs on: CUDA's flash ops take no mask, the memory-efficient ones
    take it as an additive bias (any inputs flash takes, they take too)."""
    return "cuda_efficient" if kernel == "cuda_flash" else kernel


def _efficient_bias(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """An additive mask laid out as the CUDA memory-efficient kernels read their bias: q's dtype,
    every head, and rows whose stride is a multiple of 16 elements (padded, then sliced back)."""
    batch, heads, rows, cols = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    padded = torch.empty(batch, 1, rows, cols + (-cols % 16), dtype=q.dtype, device=q.device)
    padded[..., :cols] = mask
    return padded[..., :cols].expand(batch, heads, rows, cols)


def _no_key_rows(lse: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """lse with -inf for rows whose keys are all masked: the fused kernels report such a row's
    log-sum-exp as 0, which the merge would take for a real block."""
    if mask is None:
        return lse
    return lse.masked_fill(torch.isneginf(mask.amax(dim=-1)), float("-inf"))


def block_forward(q, k, v, causal: bool, scale: float, kernel: str | None = None, mask: torch.Tensor | None = None):
    kernel = block_kernel(q) if kernel is None else kernel
    if mask is not None:
        kernel = masked_block_kernel(kernel)
    if kernel == "math":
        return _math_forward(q, k, v, causal, scale, mask)
    if kernel == "cpu_flash":
        cpu_mask = None if mask is None else mask.to(q.dtype)
        out, lse = torch_compat_ops.flash_attention_cpu(q, k, v, 0.0, causal, attn_mask=cpu_mask, scale=scale)
    elif kernel == "cuda_flash":
        out, lse = torch_compat_ops.flash_attention_cuda(q, k, v, 0.0, causal, False, scale=scale)[:2]
    elif kernel == "cuda_efficient":
        bias = None if mask is None else _efficient_bias(mask, q, k)
        out, lse = torch_compat_ops.efficient_attention_cuda(q, k, v, bias, True, 0.0, causal, scale=scale)[:2]
        lse = lse[..., :q.shape[2]]  # padded to a multiple of 32 queries on CUDA
    else:
        raise ValueError(f"unknown block kernel {kernel!r}; one of {BLOCK_KERNELS}")
    return out.float(), _no_key_rows(lse.float(), mask)


def block_backward(dout, q, k, v, out, lse, causal: bool, scale: float, kernel: str | None = None,
                   mask: torch.Tensor | None = None):
    """Gradients of one block's contribution, given the *final* output and log-sum-exp of the rows."""
    kernel = block_kernel(q) if kernel is None else kernel
    if mask is not None:
        kernel = masked_block_kernel(kernel)
    if kernel == "math":
        return _math_backward(dout, q, k, v, out, lse, causal, scale, mask)
    # The fused backwards read dout and out as q's dtype (the CUDA ones without checking).
    dout, out, lse = dout.to(q.dtype), out.to(q.dtype), lse.float().contiguous()
    if kernel == "cpu_flash":
        cpu_mask = None if mask is None else mask.to(q.dtype)
        grads = torch_compat_ops.flash_attention_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, attn_mask=cpu_mask, scale=scale)
    elif kernel == "cuda_flash":
        # No cumulative sequence lengths: the dense (not varlen) kernel. The rng state is read
        # only with dropout.
        rng = torch.empty(0, device=q.device)
        grads = torch_compat_ops.flash_attention_cuda_backward(
            dout, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, rng, rng, scale=scale)
    elif kernel == "cuda_efficient":
        rng = torch.empty(0, device=q.device)
        bias = None if mask is None else _efficient_bias(mask, q, k)
        grads = torch_compat_ops.efficient_attention_cuda_backward(
            dout, q, k, v, bias, _bmhk(out), _efficient_lse(lse), rng, rng, 0.0, [True, True, True, False],
            causal, scale=scale)
    else:
        raise ValueError(f"unknown block kernel {kernel!r}; one of {BLOCK_KERNELS}")
    dq, dk, dv = grads[:3]
    return dq.float(), dk.float(), dv.float()


def merge(out, lse, block_out, block_lse, rows: slice, masked: bool = False):
    """Folds one block's (out, lse) for query rows `rows` into the running result, in place.
    `masked`: the block may have rows without any key (lse -inf), as may the running result, and
    exp(-inf - -inf) would be NaN; such a row keeps what it had."""
    old_lse = lse[..., rows]
    new_lse = torch.logaddexp(old_lse, block_lse)
    old_weight, block_weight = torch.exp(old_lse - new_lse), torch.exp(block_lse - new_lse)
    if masked:
        old_weight, block_weight = old_weight.nan_to_num(0.0), block_weight.nan_to_num(0.0)
    out[..., rows, :] = out[..., rows, :] * old_weight.unsqueeze(-1) + block_out * block_weight.unsqueeze(-1)
    lse[..., rows] = new_lse


def expand_heads(kv: torch.Tensor, groups: int) -> torch.Tensor:
    return kv if groups == 1 else kv.repeat_interleave(groups, dim=1)


def reduce_head_groups(grad: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return grad
    b, h, s, d = grad.shape
    return grad.view(b, h // groups, groups, s, d).sum(2)



def document_mask(query_docs: torch.Tensor, key_docs: torch.Tensor, causal: bool) -> torch.Tensor:
    """The additive mask (B, 1, Sq, Sk) of queries and keys with these document ids ((B, S) or (S,)):
    0 where both are in the same document (and, with `causal`, the key is not after the query in a
    square diagonal block), -inf elsewhere."""
    query_docs, key_docs = query_docs.view(-1, query_docs.shape[-1]), key_docs.view(-1, key_docs.shape[-1])
    allowed = query_docs.unsqueeze(2) == key_docs.unsqueeze(1)
    if causal:
        allowed &= torch.ones(allowed.shape[-2:], dtype=torch.bool, device=allowed.device).tril()
    zeros = torch.zeros(allowed.shape, dtype=torch.float32, device=allowed.device)
    return zeros.masked_fill_(~allowed, float("-inf")).unsqueeze(1)


def check_block_kernels(device: str | torch.device, dtype: torch.dtype, kernel: str | None = None,
                        seed: int = 0) -> dict:
    """Compares a fused block kernel (by default the one ring attention picks for `device` and
    `dtype`) with the "math" reference on random inputs, forward and backward, as ring attention
    uses them. Returns the kernel's name and, per case, the largest absolute differences of out,
    lse, dq, dk and dv; "max_error" is the largest of them, "ok" compares it with "tolerance".

    Cases: a square causal diagonal block; a full off-diagonal block (half the queries against
    the whole block, as a late query chunk meets a later rank's block); grouped-query attention
    over two blocks (one full, one causal diagonal) whose results are merged by their log-sum-exp,
    with the backward of each block given the merged output and log-sum-exp; and document masking
    over two blocks (an earlier block where most queries have no key of their document, and a
    diagonal block, causal within documents), the masked path of every kernel. The reference runs
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
        """blocks: (k, v, causal, mask) per key/value block, merged over all of q's rows."""
        groups = heads // kv_heads
        dout = randn(*q.shape)
        rows = slice(0, q.shape[2])
        results = {}
        for which in (kernel, "math"):
            out = torch.zeros(q.shape, dtype=torch.float32, device=device)
            lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=device)
            for k, v, causal, mask in blocks:
                o, s = block_forward(q, expand_heads(k, groups), expand_heads(v, groups), causal, scale, which, mask)
                merge(out, lse, o, s, rows, masked=mask is not None)
            dq = torch.zeros(q.shape, dtype=torch.float32, device=device)
            dkv = []
            for k, v, causal, mask in blocks:
                gq, gk, gv = block_backward(dout, q, expand_heads(k, groups), expand_heads(v, groups), out, lse, causal,
                                            scale, which, mask)
                dq += gq
                dkv += [reduce_head_groups(gk, groups), reduce_head_groups(gv, groups)]
            results[which] = {"out": out, "lse": lse, "dq": dq, "dk": torch.cat(dkv[0::2], 2),
                              "dv": torch.cat(dkv[1::2], 2)}
        fused, ref = results[kernel], results["math"]
        errors = {key: (fused[key] - ref[key]).abs().max().item() for key in ref}
        scales[name] = {key: max(1.0, ref[key].abs().max().item()) for key in ref}
        return name, errors

    scales: dict[str, dict[str, float]] = {}
    q = randn(batch, heads, seq, dim)

    def kv(kv_heads=heads):
        return randn(batch, kv_heads, seq, dim), randn(batch, kv_heads, seq, dim)

    # Document masking: keys 0..seq-1 and queries seq..2seq-1 of one sequence; the queries' first
    # rows continue the keys' second document, the rest start a third (no key in the earlier block).
    key_docs = torch.tensor([0] * (seq // 2 + 4) + [1] * (seq // 2 - 4), device=device)
    query_docs = torch.tensor([1] * 10 + [2] * (seq - 10), device=device)
    cases = dict([
        run("diagonal_causal", q, [(*kv(), True, None)], heads),
        run("off_diagonal", randn(batch, heads, seq // 2, dim), [(*kv(), False, None)], heads),
        run("gqa_two_blocks", q, [(*kv(heads // 2), False, None), (*kv(heads // 2), True, None)], heads // 2),
        run("document_masked", q, [(*kv(heads // 2), False, document_mask(query_docs, key_docs, False)),
                                   (*kv(heads // 2), False, document_mask(query_docs, query_docs, True))],
            heads // 2),
    ])
    max_error = max(err for errs in cases.values() for err in errs.values())
    # Relative to the reference's largest magnitude (at least 1): a few units in the last place
    # of the output dtype for fp16/bf16, where the fused kernels round probabilities and outputs.
    tolerance = {torch.float16: 5e-3, torch.bfloat16: 2e-2}.get(dtype, 1e-4)
    ok = all(err <= tolerance * scales[name][key] for name, errs in cases.items() for key, err in errs.items())
    return {"kernel": kernel, "device": str(device), "dtype": str(dtype).removeprefix("torch."), "cases": cases,
            "max_error": max_error, "tolerance": tolerance, "ok": ok}
