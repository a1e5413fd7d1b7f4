"""Context parallelism's block kernels (attention_blocks.py): which fused kernel each device, dtype and head dim gets, and
that each one agrees with the materialised-scores ("math") reference.

The CUDA kernels cannot run on this machine. Their calls are checked here against CPU stand-ins
registered for the same aten ops: the stand-ins compute with the math kernel but assert what the
CUDA kernels assume without checking (dtypes, the dense rather than varlen flash path, the
memory-efficient backward's (B, S, H, D) output layout and +inf-padded log-sum-exp), so a wrong
argument order or layout fails here; the numbers on a GPU come from `check_block_kernels` there.
"""

import pytest
import torch

import torchtitan.parallelisms.attention_blocks as ra
from torchtitan.parallelisms.cp_attention import cp_attention


@pytest.mark.parametrize("device_type,dtype,head_dim,capability,flash_built,expected", [
    ("cpu", torch.float32, 64, (0, 0), True, "cpu_flash"),
    ("cpu", torch.bfloat16, 60, (0, 0), True, "cpu_flash"),
    ("cuda", torch.bfloat16, 128, (9, 0), True, "cuda_flash"),
    ("cuda", torch.float16, 64, (8, 0), True, "cuda_flash"),
    ("cuda", torch.bfloat16, 256, (8, 0), True, "cuda_flash"),
    ("cuda", torch.bfloat16, 256, (8, 6), True, "cuda_flash"),
    ("cuda", torch.bfloat16, 224, (8, 0), True, "cuda_flash"),
    ("cuda", torch.bfloat16, 224, (8, 9), True, "cuda_efficient"),   # flash backward fails there
    ("cuda", torch.bfloat16, 200, (12, 0), True, "cuda_efficient"),
    ("cuda", torch.float32, 64, (9, 0), True, "cuda_efficient"),     # flash takes no fp32
    ("cuda", torch.float32, 60, (9, 0), True, "cuda_efficient"),     # fp32 loads align to 4
    ("cuda", torch.bfloat16, 64, (9, 0), False, "cuda_efficient"),   # a build without flash
    ("cuda", torch.bfloat16, 512, (9, 0), True, "cuda_efficient"),   # flash stops at head dim 256
    ("cuda", torch.float16, 64, (7, 5), True, "cuda_efficient"),     # flash needs sm80
    ("cuda", torch.bfloat16, 64, (7, 5), True, "math"),              # bf16 kernels need sm80
    ("cuda", torch.float16, 60, (9, 0), True, "math"),               # half loads align to 8
    ("mps", torch.float32, 64, (0, 0), True, "math"),
])
def test_kernel_choice(device_type, dtype, head_dim, capability, flash_built, expected):
    assert ra.choose_block_kernel(device_type, dtype, head_dim, capability, flash_built) == expected


def test_block_kernel_of_a_tensor():
    assert ra.block_kernel(torch.empty(1, 2, 4, 8)) == "cpu_flash"
    assert ra.block_kernel(torch.empty(1, 2, 4, 8, device="meta")) == "math"


def test_unknown_kernel_is_refused():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="unknown block kernel 'flash'"):
        cp_attention(q, q, q, group_name="unused", kernel="flash")
    with pytest.raises(ValueError, match="unknown context parallel method 'alltoall'"):
        cp_attention(q, q, q, group_name="unused", method="alltoall")
    with pytest.raises(ValueError, match="unknown block kernel"):
        ra.block_forward(q, q, q, True, 1.0, kernel="cuda")


@pytest.mark.parametrize("dtype,bound", [(torch.float32, 1e-5), (torch.bfloat16, 0.1)])
def test_cpu_flash_matches_math(dtype, bound):
    result = ra.check_block_kernels("cpu", dtype)
    assert result["kernel"] == "cpu_flash" and result["dtype"] == str(dtype).removeprefix("torch.")
    assert set(result["cases"]) == {"diagonal_causal", "off_diagonal", "gqa_two_blocks", "document_masked"}
    assert all(set(errs) == {"out", "lse", "dq", "dk", "dv"} for errs in result["cases"].values())
    assert result["ok"] and 0 < result["max_error"] < bound, result


def test_math_against_itself_is_exact():
    assert ra.check_block_kernels("cpu", torch.float32, kernel="math")["max_error"] == 0


# CPU stand-ins for the CUDA ops, with the CUDA kernels' unchecked assumptions made explicit.

def _flash_forward(q, k, v, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    assert dropout_p == 0.0 and not return_debug_mask
    out, lse = ra._math_forward(q, k, v, is_causal, scale)
    empty = torch.empty(0)
    return out.to(q.dtype), lse, empty, empty, q.shape[2], k.shape[2], empty, empty, empty


def _flash_backward(dout, q, k, v, out, lse, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                    philox_seed, philox_offset, *, scale=None):
    assert cum_seq_q is None and cum_seq_k is None, "the varlen kernel would run"
    assert dropout_p == 0.0 and out.dtype == dout.dtype == q.dtype
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:3] and lse.is_contiguous()
    return tuple(g.to(q.dtype) for g in ra._math_backward(dout, q, k, v, out, lse, is_causal, scale))


def _bias_as_mask(attn_bias, q, k):
    """The efficient kernels' bias, checked as they read it: q's dtype, every head, rows 16-aligned."""
    if attn_bias is None:
        return None
    assert attn_bias.dtype == q.dtype and attn_bias.shape == (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    assert attn_bias.stride(-1) == 1 and attn_bias.stride(-2) % 16 == 0, "bias rows must be 16-aligned"
    return attn_bias.float()


def _efficient_forward(q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None):
    assert compute_log_sumexp and dropout_p == 0.0
    out, lse = ra._math_forward(q, k, v, is_causal, scale, _bias_as_mask(attn_bias, q, k))
    padded = torch.full((*lse.shape[:2], -(-lse.shape[2] // 32) * 32), float("nan"))
    padded[..., :lse.shape[2]] = lse  # NaN past the end: the caller must slice it off
    empty = torch.empty(0)
    return ra._bmhk(out.to(q.dtype)), padded, empty, empty


def _efficient_backward(dout, q, k, v, attn_bias, out, lse, philox_seed, philox_offset, dropout_p,
                        grad_input_mask, is_causal=False, *, scale=None):
    assert dropout_p == 0.0 and list(grad_input_mask) == [True, True, True, False]
    assert out.dtype == dout.dtype == q.dtype
    assert out.transpose(1, 2).is_contiguous(), "the kernel takes out's row stride to be heads x head_dim"
    rows = q.shape[2]
    assert lse.dtype == torch.float32 and lse.shape[2] % 32 == 0 and lse.shape[2] - rows < 32
    assert torch.isposinf(lse[..., rows:]).all(), "the kernel reads whole 32-row tiles of lse"
    grads = ra._math_backward(dout, q, k, v, out, lse[..., :rows], is_causal, scale, _bias_as_mask(attn_bias, q, k))
    return (*(g.to(q.dtype) for g in grads), None)


@pytest.fixture
def cuda_ops_on_cpu():
    lib = torch.library.Library("aten", "IMPL")
    for name, fn in (("_scaled_dot_product_flash_attention", _flash_forward),
                     ("_scaled_dot_product_flash_attention_backward", _flash_backward),
                     ("_scaled_dot_product_efficient_attention", _efficient_forward),
                     ("_scaled_dot_product_efficient_attention_backward", _efficient_backward)):
        lib.impl(name, fn, "CPU")
    yield
    lib._destroy()


@pytest.mark.parametrize("kernel", ["cuda_flash", "cuda_efficient"])
def test_cuda_kernel_calls(cuda_ops_on_cpu, kernel):
    """The calls of the CUDA kernels, through the real op schemas, against the stand-ins: block
    lengths 72 and 36 are not multiples of 32, so the efficient kernel's lse is padded both ways."""
    result = ra.check_block_kernels("cpu", torch.float32, kernel=kernel)
    assert result["kernel"] == kernel and result["ok"] and result["max_error"] < 1e-5, result
