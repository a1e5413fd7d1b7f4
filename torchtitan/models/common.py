"""Building blocks shared by the model families (Llama, Qwen3): RoPE, normalization, the causal
attention kernel and the SwiGLU feed-forward.

Nothing here knows about parallelism. Each block keeps the idioms that let parallelism reach it
from outside by module name (see torchtitan/models/llama/model.py's docstring): head counts are
recovered with `view(..., -1, head_dim)`, the attention kernel is an attribute, and weights are
initialised by `init_weights`, separately from construction.

Document masking (training.document_mask): a packed window holds several documents, and each
token attends only to earlier tokens of its own document. The trainer passes the model document
ids per position (`document_ids`: end-of-text tokens before it); the model builds the mask once
per forward (`document_causal_mask`) and hands it to every block's attention kernel.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

# ---------------------------------------------------------------------------------------------
# Rotary position embedding


@dataclass
class RopeScaling:
    """Llama 3.1 frequency scaling: long wavelengths are slowed down, short ones kept."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


def rope_table(head_dim: int, theta: float, max_seq_len: int, scaling: RopeScaling | None = None,
               device: torch.device | None = None) -> torch.Tensor:
    """Returns (max_seq_len, head_dim // 2, 2): cos and sin of every position's rotation angles."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim))
    if scaling is not None:
        freqs = _scale_rope_freqs(freqs, scaling)
    positions = torch.arange(max_seq_len, device=device, dtype=torch.float64)
    angles = torch.outer(positions, freqs)
    return torch.stack((angles.cos(), angles.sin()), dim=-1).float()


def _scale_rope_freqs(freqs: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / freqs
    # Between the two wavelengths, blend smoothly between scaled and unscaled frequencies.
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    blended = (1 - smooth) * freqs / s.factor + smooth * freqs
    scaled = torch.where(wavelen > low_freq_wavelen, freqs / s.factor, blended)
    return torch.where(wavelen < high_freq_wavelen, freqs, scaled)


def yarn_blend(freqs: torch.Tensor, theta: float, factor: float, original_max_position_embeddings: int,
               beta_fast: float, beta_slow: float, truncate: bool = True) -> torch.Tensor:
    """YaRN's frequencies (DeepSeek-V3, gpt-oss): each of `freqs` (head_dim / 2 RoPE frequencies)
    blended between itself and itself / `factor` by a linear ramp over the dims between the
    correction dims of `beta_fast` and `beta_slow` rotations; `truncate` rounds those bounds
    outwards (DeepSeek's reference and transformers' default; gpt-oss's config turns it off)."""
    dim = 2 * freqs.shape[0]

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    span = max(high - low, 1e-3)  # equal bounds: a step at `low`, as the references do
    ramp = ((torch.arange(dim // 2, device=freqs.device, dtype=freqs.dtype) - low) / span).clamp(0, 1)
    return freqs / factor * ramp + freqs * (1 - ramp)


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotates adjacent feature pairs of x (batch, seq, heads, head_dim) by rope (seq, head_dim/2, 2).

    Pairs are adjacent (Meta's layout): each pair (a, b) is multiplied as the complex number a + ib
    by cos + i sin. Eager mode uses one complex multiply (4x faster than the real-valued form on
    CPU); under torch.compile the same product is written with real tensors, because inductor
    cannot generate code for complex ops and would fall back to eager kernels. Hugging Face's
    checkpoints pair dims i and i + head_dim/2 instead; the families' converters permute q and k.
    """
    if torch.compiler.is_compiling():
        cos, sin = rope.float().unsqueeze(1).unbind(-1)  # each (seq, 1, head_dim/2)
        a, b = x.float().unflatten(-1, (-1, 2)).unbind(-1)
        return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2).type_as(x)
    rotation = torch.view_as_complex(rope.float().contiguous()).unsqueeze(1)  # (seq, 1, head_dim/2)
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * rotation).flatten(-2).type_as(x)


# ---------------------------------------------------------------------------------------------
# Normalization


def build_norm(norm_type: str, dim: int, eps: float = 1e-6) -> nn.Module:
    """Returns the normalization layer named by `norm_type` over the last `dim` features."""
    if norm_type in ("rmsnorm", "fused_rmsnorm"):  # the same math; compile fuses it
        return nn.RMSNorm(dim, eps=eps)
    if norm_type == "layernorm":
        return nn.LayerNorm(dim, eps=eps, bias=False)
    if norm_type == "np_layernorm":  # no learnable parameters
        return nn.LayerNorm(dim, eps=eps, elementwise_affine=False, bias=False)
    raise ValueError(f"unknown norm_type {norm_type!r}; expected rmsnorm, layernorm or np_layernorm")


def norm_params(norm_type: str, dim: int) -> int:
    """Parameters of the norm `build_norm(norm_type, dim)` makes (a weight, or nothing), from the
    shapes alone, for the FLOP counts."""
    return 0 if norm_type == "np_layernorm" else dim


def reset_norm(norm: nn.Module) -> None:
    """Re-initialises a norm's parameters in place (weights to one)."""
    if getattr(norm, "weight", None) is not None:
        with torch.no_grad():
            nn.init.ones_(norm.weight)


# ---------------------------------------------------------------------------------------------
# Attention kernel


# What `document_causal_mask` builds: FlexAttention's block mask, or an additive fp32 mask
# (batch, 1, seq, seq) for SDPA (0 where a query may attend, -inf elsewhere).
AttentionMask = BlockMask | torch.Tensor


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask | None = None) -> torch.Tensor:
    """Causal scaled-dot-product attention on (batch, heads, seq, head_dim) tensors.

    k and v may have fewer heads than q (grouped-query attention). On CPU, bf16/fp16 inputs are
    computed in fp32: PyTorch's CPU flash-attention backward is about 2.5x slower in bf16 than in
    fp32 for small head dims (debug model, 2-core Xeon: 1.8 s vs 0.7 s per step), and the fp32
    result is at least as accurate. On CUDA the flash kernels run in the input dtype.

    `mask` (from `document_causal_mask`) replaces plain causality by document-causal attention:
    a BlockMask runs FlexAttention (compiled on CUDA; eager on CPU, forward only, where a test
    compares it with the SDPA path), an additive mask runs SDPA with it.
    """
    grouped = q.shape[1] != k.shape[1]
    if isinstance(mask, BlockMask):
        # Inside a compiled block (training.compile) flex_attention is traced into the block's graph;
        # outside one it needs its own compiled form on CUDA. On CPU it runs eagerly.
        plain = q.device.type == "cpu" or torch.compiler.is_compiling()
        attend = flex_attention if plain else _compiled_flex_attention()
        return attend(q, k, v, block_mask=mask, enable_gqa=grouped)
    upcast = q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16)
    causal = mask is None
    if mask is not None:
        # In the dtype SDPA computes in: a no-op, except where FSDP's mixed precision cast the fp32
        # mask to bf16 with the block's inputs (0 and -inf are exact in both).
        mask = mask.to(torch.float32 if upcast else q.dtype)
    if upcast:
        # Autocast (mixed precision without FSDP) would cast the fp32 operands back to bf16.
        with torch.autocast("cpu", enabled=False):
            out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, is_causal=causal,
                                                 enable_gqa=grouped)
        return out.type_as(q)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=grouped)


@functools.cache
def _compiled_flex_attention() -> Callable[..., torch.Tensor]:
    """flex_attention compiled once per process, as PyTorch asks (eager FlexAttention materialises
    every score). Made on first use rather than at import: torch.compile imports inductor, about
    1.5 s, which every process importing the models would otherwise pay."""
    return torch.compile(flex_attention, dynamic=False)


@functools.cache
def _compiled_create_block_mask() -> Callable[..., BlockMask]:
    """create_block_mask compiled once per process: eager, it stores the mask of every (q, kv)
    pair of the batch (batch x seq x seq booleans); compiled, that evaluation is fused into the
    per-block counts and never stored. A new mask function per forward reuses the compiled graph."""
    return torch.compile(create_block_mask)


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """(batch, seq) document index of every position: the number of `eos_id` tokens strictly
    before it. A document ends with its end-of-text token; the next one starts right after it, and
    tokens before a window's first end-of-text (a document begun in an earlier window) are document 0."""
    ends = (tokens == eos_id).to(torch.int32)
    return ends.cumsum(dim=1, dtype=torch.int32) - ends


def document_causal_mask(ids: torch.Tensor, flex: bool | None = None) -> AttentionMask:
    """The attention mask of document ids (batch, seq): position q may attend to kv <= q of its
    own document. `flex` None picks by device: FlexAttention's BlockMask on CUDA, elsewhere an
    additive fp32 (batch, 1, seq, seq) mask for SDPA; True forces the BlockMask (a CPU test's way to
    check both paths against each other).

    Additive rather than boolean: SDPA turns a boolean mask into this very float mask inside every
    call and keeps that copy for backward, one per block (debug model, 8 blocks, 2 x 2048 tokens:
    256 MiB more saved than plain causal attention); made once here, every block shares it (32 MiB),
    and the numbers are the same bit for bit."""
    batch, seq = ids.shape
    if flex is None:
        flex = ids.device.type == "cuda"
    if flex:
        def same_document_causal(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (ids[b, q_idx] == ids[b, kv_idx])

        compiled = ids.device.type == "cuda" and not torch.compiler.is_compiling()  # (as the kernel's flex_attention)
        build = _compiled_create_block_mask() if compiled else create_block_mask
        return build(same_document_causal, batch, None, seq, seq, device=ids.device)
    causal = torch.ones(seq, seq, dtype=torch.bool, device=ids.device).tril()
    allowed = ((ids.unsqueeze(2) == ids.unsqueeze(1)) & causal).unsqueeze(1)
    return torch.zeros(allowed.shape, device=ids.device).masked_fill_(~allowed, float("-inf"))


# ---------------------------------------------------------------------------------------------
# Feed-forward


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x). Tensor parallelism splits w1/w3 by output, w2 by input."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        for linear in (self.w2, self.w3):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class PaddedVocabMask(nn.Module):
    """Sets the logits of padding rows (ids >= vocab_size) to -inf: softmax gives them zero
    probability, so the loss, its gradients and the predictions are those of the real vocabulary."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        ids = torch.arange(logits.shape[-1], device=logits.device)
        return logits.masked_fill(ids >= self.vocab_size, float("-inf"))


def trunc_normal(weight: torch.Tensor, std: float) -> None:
    """Normal init cut at three standard deviations."""
    nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-3 * std, b=3 * std)
