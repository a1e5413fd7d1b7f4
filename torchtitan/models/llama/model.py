"""Llama 2 / Llama 3 decoder in plain single-device PyTorch.

Parallelism reaches this model only from outside, by module name. A few idioms keep that
possible without any parallel branches here:
- head counts are recovered with `view(..., -1, head_dim)` so tensor parallelism can shard heads;
- blocks live in a ModuleDict keyed by their original index, so names survive pipeline splits;
- embedding, final norm and output may be None, so a pipeline stage can drop them;
- attention slices the RoPE table by the length of the sequence it sees, which under sequence
  parallelism is the gathered length, not the shard's;
- the attention kernel is an attribute (`Attention.kernel`), so context parallelism can swap in
  ring attention, and the RoPE table is an argument of each block, so it can pass each rank the
  rows of the positions it holds;
- document masking takes document ids (a plain (batch, seq) tensor that every pipeline stage
  receives, since only the first sees tokens); the mask is built from them once per forward
  (`Transformer.attention_mask`, a seam like the kernel) and reaches each attention as a keyword,
  which tensor parallelism's input plans pass through untouched;
- a padded vocabulary is masked by its own submodule (`vocab_mask`), which tensor parallelism can
  replace by name with a sharded version;
- `init_weights()` is separate from `__init__`, so the model can be built on the meta device,
  sharded, materialised with `to_empty()` and only then initialised.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from torchtitan.models.common import (  # noqa: F401  (RopeScaling, apply_rope: part of this module's API)
    AttentionMask,
    FeedForward,
    PaddedVocabMask,
    RopeScaling,
    apply_rope,
    build_norm,
    causal_attention,
    document_causal_mask,
    norm_params,
    reset_norm,
    rope_table,
    trunc_normal,
)


@dataclass
class ModelArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None  # None = n_heads (no grouped-query attention)
    vocab_size: int = 32000  # replaced by the tokenizer's size when training
    # Extra embedding/output rows so the vocabulary divides evenly (tensor parallelism); their
    # logits are masked to -inf, so they never change the loss or the predictions.
    vocab_padding: int = 0
    multiple_of: int = 256  # feed-forward hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    norm_type: str = "rmsnorm"
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_seq_len: int = 2048
    tie_word_embeddings: bool = False
    # Scale each block's output-projection init by its depth (else by the total depth).
    depth_init: bool = True


def precompute_rope(args: ModelArgs, device: torch.device | None = None) -> torch.Tensor:
    """Returns (max_seq_len, head_dim // 2, 2): cos and sin of every position's rotation angles."""
    return rope_table(args.dim // args.n_heads, args.rope_theta, args.max_seq_len, args.rope_scaling, device)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads or args.n_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, args.dim, bias=False)
        # (q, k, v) in (batch, heads, seq, head_dim) -> output of the same shape; causal, or as
        # `mask` says when given (document masking).
        self.kernel = causal_attention

    def init_weights(self, init_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: AttentionMask | None = None) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        rope = rope[:seqlen]
        # -1 instead of n_heads: under tensor parallelism each rank holds a slice of the heads.
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (bsz, heads, seq, head_dim)
        # Without a mask the kernel is called as before, so kernels that know no mask (ring attention) still fit.
        out = self.kernel(q, k, v) if mask is None else self.kernel(q, k, v, mask)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


def ffn_hidden_dim(args: ModelArgs) -> int:
    """SwiGLU hidden size: 2/3 of 4*dim (to keep FLOPs of a 4x MLP), scaled, rounded up."""
    hidden = int(2 * 4 * args.dim / 3)
    if args.ffn_dim_multiplier is not None:
        hidden = int(args.ffn_dim_multiplier * hidden)
    return args.multiple_of * ((hidden + args.multiple_of - 1) // args.multiple_of)


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, ffn_hidden_dim(args))
        self.attention_norm = build_norm(args.norm_type, args.dim, args.norm_eps)
        self.ffn_norm = build_norm(args.norm_type, args.dim, args.norm_eps)
        depth = layer_id + 1 if args.depth_init else args.n_layers
        self.weight_init_std = 0.02 / (2 * depth) ** 0.5

    def init_weights(self) -> None:
        reset_norm(self.attention_norm)
        reset_norm(self.ffn_norm)
        self.attention.init_weights(self.weight_init_std)
        self.feed_forward.init_weights(self.weight_init_std)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: AttentionMask | None = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope, mask=mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Llama decoder: token embedding -> blocks -> norm -> output projection (logits)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        if args.dim % args.n_heads:
            raise ValueError(f"dim {args.dim} must be divisible by n_heads {args.n_heads}")
        if args.n_heads % (args.n_kv_heads or args.n_heads):
            raise ValueError(f"n_heads {args.n_heads} must be a multiple of n_kv_heads {args.n_kv_heads}")
        self.args = args
        rows = args.vocab_size + args.vocab_padding
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(rows, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm: nn.Module | None = build_norm(args.norm_type, args.dim, args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, rows, bias=False)
        self.vocab_mask: nn.Module | None = PaddedVocabMask(args.vocab_size) if args.vocab_padding else None
        if args.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Not persistent: derived from args, so checkpoints stay free of it.
        self.register_buffer("rope_cache", precompute_rope(args), persistent=False)
        # document ids (batch, seq) -> the mask every block's attention takes (document masking).
        self.attention_mask: Callable[[torch.Tensor], AttentionMask] = document_causal_mask

    @classmethod
    def from_model_args(cls, args: ModelArgs) -> "Transformer":
        return cls(args)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """(Re)initialises every parameter and buffer; call after `to_empty()` on meta-built models."""
        with torch.device(buffer_device or self.rope_cache.device):
            self.rope_cache = precompute_rope(self.args)
        if self.args.tie_word_embeddings and self.output is not None and self.tok_embeddings is not None:
            # to_empty() gives every parameter its own storage, which unties them.
            self.output.weight = self.tok_embeddings.weight
        tied = self.args.tie_word_embeddings
        # A tied matrix is also the output projection. After the final norm the hidden state is
        # mostly the input token's own embedding scaled to unit RMS, so that token's logit is about
        # init std x dim: the embedding's usual unit std would start the loss in the hundreds, and
        # std 1/dim keeps that logit near 1.
        out_std = 1.0 / self.args.dim if tied else self.args.dim**-0.5
        with torch.no_grad():
            if self.tok_embeddings is not None:
                if tied:
                    trunc_normal(self.tok_embeddings.weight, out_std)
                else:
                    nn.init.normal_(self.tok_embeddings.weight)
            for layer in self.layers.values():
                layer.init_weights()
            if self.norm is not None:
                reset_norm(self.norm)
            if self.output is not None and not (tied and self.tok_embeddings is not None):
                # Untied, or the last pipeline stage's copy of a tied matrix (pipelining then gives
                # it the first stage's values).
                trunc_normal(self.output.weight, out_std)

    def forward(self, tokens: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (batch, seq) ints -> logits (batch, seq, vocab). A pipeline stage without the
        embedding receives hidden states instead, and one without the output returns them.
        `document_ids` (batch, seq), when given, keeps attention inside each document (see
        models/common.py); None is plain causal attention."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        mask = self.attention_mask(document_ids) if document_ids is not None else None
        for layer in self.layers.values():
            h = layer(h, self.rope_cache, mask)
        h = self.norm(h) if self.norm is not None else h
        if self.output is None:
            return h
        logits = self.output(h)
        return self.vocab_mask(logits) if self.vocab_mask is not None else logits

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: every block's (`block_flops`) plus 6 per parameter of the final
        norm and the output projection. An untied embedding is a lookup, not a matmul; a tied one
        counts once, as the output projection."""
        a = self.args
        rows = a.vocab_size + a.vocab_padding
        return a.n_layers * block_flops(a, seq_len) + 6 * (norm_params(a.norm_type, a.dim) + rows * a.dim)


def block_flops(args: ModelArgs, seq_len: int) -> int:
    """Training FLOPs per token of one transformer block, the cost the FLOP count (MFU) and the
    pipeline split share: 6 per parameter (2 forward, 4 backward) plus the attention scores without
    the causal half (the common convention, so MFU figures compare with other stacks)."""
    head_dim = args.dim // args.n_heads
    kv_dim = (args.n_kv_heads or args.n_heads) * head_dim
    attention = args.dim * (2 * args.n_heads * head_dim + 2 * kv_dim)
    params = attention + 3 * args.dim * ffn_hidden_dim(args) + 2 * norm_params(args.norm_type, args.dim)
    return 6 * params + 12 * args.n_heads * head_dim * seq_len
