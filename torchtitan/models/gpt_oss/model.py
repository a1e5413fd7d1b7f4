"""gpt-oss (OpenAI, 2025) in plain single-device PyTorch: a mixture-of-experts decoder whose
attention alternates banded (sliding-window) and full layers and has learned sinks.

Against Qwen3-MoE:
- attention: q, k, v and o projections with biases; grouped-query heads of 64 dims; every other
  block (the even ones, from block 0) attends only to the `sliding_window` latest positions,
  itself included (key j is seen by query i iff i - window < j <= i); each head has a learned
  sink, a logit that joins the softmax's denominator and attends to nothing, so a head may give
  a query less than all of its weight: out = softmax-weighted values x sigmoid(lse - sink), with
  lse the log-sum-exp of the query's scores;
- RoPE: YaRN-scaled (factor 32 over 4K positions), Hugging Face's layout (rotated halves rather
  than adjacent pairs: the published q/k weights and biases are used as they are), cos and sin
  times YaRN's attention factor;
- the router's gate has a bias; it chooses the top 4 experts and softmaxes their logits (the same
  weights as a softmax over every expert renormalised over the chosen ones);
- the experts have biases and a clamped SwiGLU (torchtitan/models/moe.py's `GroupedExperts`);
- RMSNorm epsilon 1e-5, no shared experts, no dense blocks, the output projection untied.

The attention kernel is a seam, as for the other families: `Attention.kernel(q, k, v, documents,
sinks=..., window=...)` -> out. The default, `sink_attention`, computes the scores once with
every mask (causal, window, documents) and the sinks; context parallelism replaces it by ring or
all-gather attention that skips the blocks a window leaves out (torchtitan/parallelisms/). The
model hands every block the document ids themselves (None without document masking), not a
mask: each block's kernel masks by its own window.

Idioms shared with the other families (torchtitan/models/llama/model.py): `view(..., -1,
head_dim)`, blocks in a ModuleDict keyed by index, optional embedding/norm/output for pipeline
stages, a RoPE table passed to each block, `init_weights` separate from construction. The sinks
are a parameter of the attention module (`attention.sinks`, one per head): tensor parallelism
shards it with the heads, and the kernel reads this rank's part (`_local`).
"""

from __future__ import annotations

import functools
import math
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

try:  # PyTorch 2.9+ asks for the log-sum-exp this way (return_lse warns there); older ones take return_lse
    from torch.nn.attention.flex_attention import AuxRequest
except ImportError:  # pragma: no cover - older PyTorch
    AuxRequest = None

from torchtitan.models.common import PaddedVocabMask, build_norm, reset_norm, trunc_normal, yarn_blend
from torchtitan.models.moe import MoE, _local


@dataclass
class YarnRope:
    """YaRN RoPE scaling as gpt-oss's config.json gives it. `truncate` False: the ramp's bounds
    are the exact correction dims (DeepSeek's YaRN rounds them)."""

    factor: float = 32.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = False


@dataclass
class GptOssModelArgs:
    dim: int = 2880
    n_layers: int = 24
    n_heads: int = 64
    n_kv_heads: int = 8
    head_dim: int = 64
    vocab_size: int = 201088  # replaced by the tokenizer's size when training
    vocab_padding: int = 0
    norm_eps: float = 1e-5
    norm_type: str = "rmsnorm"
    max_seq_len: int = 4096
    depth_init: bool = True
    rope_theta: float = 150000.0
    rope_scaling: YarnRope | None = field(default_factory=YarnRope)
    # Banded attention: block i attends within `sliding_window` positions when `layer_types[i]` is
    # "sliding_attention" (empty: the even blocks, as every published gpt-oss).
    sliding_window: int = 128
    layer_types: tuple[str, ...] = ()
    attention_bias: bool = True
    # Mixture of experts (every block)
    num_experts: int = 32
    top_k: int = 4
    moe_hidden_dim: int = 2880
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    # Load balancing; the trainer sets both from the [moe] options.
    moe_aux_loss_coef: float = 0.0
    moe_bias_update_rate: float = 0.0

    @property
    def is_moe(self) -> bool:
        return True

    def layer_window(self, layer_id: int) -> int | None:
        """The attention window of block `layer_id`, None for full attention."""
        kinds = self.layer_types or tuple("sliding_attention" if i % 2 == 0 else "full_attention"
                                          for i in range(self.n_layers))
        return self.sliding_window if kinds[layer_id] == "sliding_attention" else None


def yarn_rope_table(args: GptOssModelArgs, device: torch.device | None = None) -> torch.Tensor:
    """(max_seq_len, head_dim // 2, 2): cos and sin of each position's angles, YaRN-blended
    between interpolated and original frequencies by a linear ramp over the dims, both times the
    attention factor 0.1 ln(factor) + 1 (transformers' `yarn` RoPE)."""
    dim, theta = args.head_dim, args.rope_theta
    freqs = 1.0 / theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float64) / dim)
    factor = 1.0
    y = args.rope_scaling
    if y is not None:
        freqs = yarn_blend(freqs, theta, y.factor, y.original_max_position_embeddings, y.beta_fast, y.beta_slow,
                           y.truncate)
        factor = 0.1 * math.log(y.factor) + 1.0 if y.factor > 1 else 1.0
    angles = torch.outer(torch.arange(args.max_seq_len, device=device, dtype=torch.float64), freqs)
    return (torch.stack((angles.cos(), angles.sin()), dim=-1) * factor).float()


def apply_rope_halves(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotates x (batch, seq, heads, head_dim) by rope (seq, head_dim/2, 2), pairing dim i with dim
    i + head_dim/2 (Hugging Face's layout, which gpt-oss's weights are trained in)."""
    cos, sin = rope.float().unsqueeze(1).unbind(-1)  # each (seq, 1, head_dim/2)
    a, b = x.float().chunk(2, dim=-1)
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1).type_as(x)


# ---------------------------------------------------------------------------------------------
# The attention kernel: causal, banded and document masks, and sinks


def allowed_keys(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None, q_docs: torch.Tensor | None = None,
                 k_docs: torch.Tensor | None = None) -> torch.Tensor:
    """Which keys each query may attend: (Sq, Sk) from positions, or (B, Sq, Sk) with document
    ids (B, Sq) / (B, Sk): key not after the query, within `window` of it (None: any distance),
    in its document."""
    allowed = k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)
    if window is not None:
        allowed &= k_pos.unsqueeze(0) > q_pos.unsqueeze(1) - window
    if q_docs is not None:
        allowed = allowed & (q_docs.unsqueeze(2) == k_docs.unsqueeze(1))
    return allowed


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention output with sinks from the output and log-sum-exp without them: each head's sink
    adds exp(sink) to the softmax's denominator, which scales the output by sigmoid(lse - sink).
    out (B, H, S, D), lse (B, H, S), sinks (H,)."""
    return out * torch.sigmoid(lse - sinks.float().view(1, -1, 1)).unsqueeze(-1).to(out.dtype)


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor | None = None, *,
                   sinks: torch.Tensor, window: int | None, flex: bool | None = None) -> torch.Tensor:
    """Causal attention with sinks on (batch, heads, seq, head_dim) tensors, banded to `window`
    positions (None: full), within documents (`documents` (batch, seq) ids, or None).

    `flex` None picks by device: FlexAttention on CUDA (its block mask skips the blocks outside
    the band, compiled once per process, the log-sum-exp returned with the output and
    differentiable); elsewhere the scores are materialised in fp32 (CPU runs are small) and every
    mask applied to them. True forces FlexAttention (a CPU test's way to compare both)."""
    if flex is None:
        flex = q.device.type == "cuda"
    if flex:
        mask = _flex_mask(documents, window, q.shape[0], q.shape[2], q.device)
        attend = flex_attention if q.device.type == "cpu" or torch.compiler.is_compiling() else _compiled_flex()
        gqa = q.shape[1] != k.shape[1]
        if AuxRequest is not None:
            out, aux = attend(q, k, v, block_mask=mask, enable_gqa=gqa, return_aux=AuxRequest(lse=True))
            lse = aux.lse
        else:  # pragma: no cover - older PyTorch
            out, lse = attend(q, k, v, block_mask=mask, enable_gqa=gqa, return_lse=True)
        return with_sinks(out, lse, sinks)
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    positions = torch.arange(q.shape[2], device=q.device)
    allowed = allowed_keys(positions, positions, window, documents, documents)
    scores = scores.masked_fill(~(allowed if documents is None else allowed.unsqueeze(1)), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.softmax(scores, dim=-1), v.float())
    return with_sinks(out, lse, sinks).type_as(q)


@functools.cache
def _compiled_flex() -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """flex_attention compiled once per process (eager, it materialises every score); made on first
    use, so importing the model does not import inductor."""
    return torch.compile(flex_attention, dynamic=False)


# Every block of a forward gets the same document ids: their masks are built once per window.
_last_masks: tuple[weakref.ref | None, dict] = (None, {})


def _flex_mask(documents: torch.Tensor | None, window: int | None, batch: int, seq: int,
               device: torch.device) -> BlockMask:
    global _last_masks
    ref, masks = _last_masks
    if (documents is None) != (ref is None) or (documents is not None and ref() is not documents):
        masks = {}
        _last_masks = (weakref.ref(documents) if documents is not None else None, masks)
    key = (window, batch, seq, device)
    if key not in masks:
        def allowed(b, h, q_idx, kv_idx):
            keep = kv_idx <= q_idx
            if window is not None:
                keep = keep & (kv_idx > q_idx - window)
            if documents is not None:
                keep = keep & (documents[b, q_idx] == documents[b, kv_idx])
            return keep

        build = create_block_mask if device.type == "cpu" or torch.compiler.is_compiling() else _compiled_block_mask()
        masks[key] = build(allowed, batch if documents is not None else None, None, seq, seq, device=device)
    return masks[key]


@functools.cache
def _compiled_block_mask() -> Callable[..., BlockMask]:
    return torch.compile(create_block_mask)


# ---------------------------------------------------------------------------------------------
# The model


class Attention(nn.Module):
    def __init__(self, args: GptOssModelArgs, window: int | None):
        super().__init__()
        self.head_dim = args.head_dim
        self.window = window
        bias = args.attention_bias
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=bias)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=bias)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=bias)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=bias)
        self.sinks = nn.Parameter(torch.empty(args.n_heads))
        # (q, k, v, documents, *, sinks, window) -> out, (batch, heads, seq, head_dim) (module docstring)
        self.kernel = sink_attention

    def init_weights(self, init_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)
        for linear in (self.wq, self.wk, self.wv, self.wo):
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)
        # Zero sinks: with flat scores a head starts giving the sink 1/(keys + 1) of a query's weight;
        # training (or the published weights) moves them.
        nn.init.zeros_(self.sinks)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        rope = rope[:seqlen]
        q = apply_rope_halves(self.wq(x).view(bsz, seqlen, -1, self.head_dim), rope)
        k = apply_rope_halves(self.wk(x).view(bsz, seqlen, -1, self.head_dim), rope)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = self.kernel(q, k, v, documents, sinks=_local(self.sinks), window=self.window)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: GptOssModelArgs):
        super().__init__()
        self.attention = Attention(args, args.layer_window(layer_id))
        self.attention_norm = build_norm(args.norm_type, args.dim, args.norm_eps)
        self.ffn_norm = build_norm(args.norm_type, args.dim, args.norm_eps)
        self.feed_forward = None  # every block is MoE (the name the shared TP plan looks for)
        self.moe = MoE(args.dim, args.moe_hidden_dim, args.num_experts, args.top_k, True, args.moe_aux_loss_coef,
                       args.moe_bias_update_rate, linear_biases=True, swiglu_limit=args.swiglu_limit,
                       swiglu_alpha=args.swiglu_alpha)
        depth = layer_id + 1 if args.depth_init else args.n_layers
        self.weight_init_std = 0.02 / (2 * depth) ** 0.5

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        reset_norm(self.attention_norm)
        reset_norm(self.ffn_norm)
        self.attention.init_weights(self.weight_init_std)
        self.moe.init_weights(self.weight_init_std, buffer_device)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope, documents=documents)
        return h + self.moe(self.ffn_norm(h))


def _document_ids(ids: torch.Tensor) -> torch.Tensor:
    """The mask seam's default: every block's kernel masks by the ids itself (module docstring)."""
    return ids


class GptOss(nn.Module):
    """gpt-oss: token embedding -> blocks -> norm -> output projection (logits)."""

    def __init__(self, args: GptOssModelArgs):
        super().__init__()
        if args.n_heads % args.n_kv_heads:
            raise ValueError(f"n_heads {args.n_heads} must be a multiple of n_kv_heads {args.n_kv_heads}")
        if args.layer_types and len(args.layer_types) != args.n_layers:
            raise ValueError(f"layer_types names {len(args.layer_types)} blocks, the model has {args.n_layers}")
        self.args = args
        rows = args.vocab_size + args.vocab_padding
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(rows, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm: nn.Module | None = build_norm(args.norm_type, args.dim, args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, rows, bias=False)
        self.vocab_mask: nn.Module | None = PaddedVocabMask(args.vocab_size) if args.vocab_padding else None
        self.register_buffer("rope_cache", yarn_rope_table(args), persistent=False)
        self.attention_mask: Callable[[torch.Tensor], torch.Tensor] = _document_ids

    @classmethod
    def from_model_args(cls, args: GptOssModelArgs) -> "GptOss":
        return cls(args)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """(Re)initialises every parameter and buffer; call after `to_empty()` on meta-built models."""
        buffer_device = buffer_device or self.rope_cache.device
        self.rope_cache = yarn_rope_table(self.args, buffer_device)
        with torch.no_grad():
            if self.tok_embeddings is not None:
                nn.init.normal_(self.tok_embeddings.weight)
            for layer in self.layers.values():
                layer.init_weights(buffer_device)
            if self.norm is not None:
                reset_norm(self.norm)
            if self.output is not None:
                trunc_normal(self.output.weight, self.args.dim**-0.5)

    def forward(self, tokens: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (batch, seq) -> logits (batch, seq, vocab); a pipeline stage without the
        embedding takes hidden states, one without the output returns them. `document_ids`
        (batch, seq): attention stays inside each document (None: plain causal)."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        documents = self.attention_mask(document_ids) if document_ids is not None else None
        for layer in self.layers.values():
            h = layer(h, self.rope_cache, documents)
        h = self.norm(h) if self.norm is not None else h
        if self.output is None:
            return h
        logits = self.output(h)
        return self.vocab_mask(logits) if self.vocab_mask is not None else logits

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6 per activated non-embedding parameter plus the attention
        scores of each block over the keys it sees (the window on banded blocks)."""
        return flops_per_token(self.args, seq_len)


# ---------------------------------------------------------------------------------------------
# Counts from the shapes alone


def block_params(a: GptOssModelArgs) -> tuple[int, int]:
    """(total, activated per token) parameters of one block: attention (projections, their
    biases, the sinks), the two norms, the router (with bias) and the experts (with biases)."""
    q, kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    attention = a.dim * (q + 2 * kv) + q * a.dim + a.n_heads
    if a.attention_bias:
        attention += q + 2 * kv + a.dim
    expert = 3 * a.dim * a.moe_hidden_dim + 2 * a.moe_hidden_dim + a.dim
    router = a.dim * a.num_experts + a.num_experts
    base = attention + 2 * a.dim + router
    return base + a.num_experts * expert, base + a.top_k * expert


def param_counts(a: GptOssModelArgs) -> tuple[int, int]:
    """(total, activated per token) parameters, embedding and output included (OpenAI's model card
    counts the output projection as activated, the embedding lookup not: see flavors.py)."""
    rows = a.vocab_size + a.vocab_padding
    total, active = block_params(a)
    return a.n_layers * total + 2 * rows * a.dim + a.dim, a.n_layers * active + rows * a.dim + a.dim


def block_flops(a: GptOssModelArgs, layer_id: int, seq_len: int) -> int:
    """Training FLOPs per token of one block: 6 per activated parameter plus the attention scores
    in Llama's convention (12 x heads x head_dim x seq_len: twice the keys a causal query sees on
    average), where a banded block's query sees at most the window, so 2 x window stands for seq_len."""
    window = a.layer_window(layer_id)
    keys = seq_len if window is None else min(seq_len, 2 * window)
    return 6 * block_params(a)[1] + 12 * a.n_heads * a.head_dim * keys


def flops_per_token(a: GptOssModelArgs, seq_len: int) -> int:
    rows = a.vocab_size + a.vocab_padding
    return sum(block_flops(a, i, seq_len) for i in range(a.n_layers)) + 6 * (a.dim + rows * a.dim)
