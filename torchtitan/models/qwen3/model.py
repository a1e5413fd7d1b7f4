"""Qwen3 decoder, dense and mixture-of-experts, in plain single-device PyTorch.

Against Llama: every head's q and k go through an RMSNorm over head_dim before RoPE; head_dim is
its own setting (Qwen3-0.6B has 16 heads of 128 dims on a 1024-wide residual); RoPE theta is 1e6;
the small flavors tie the output projection to the embedding. The MoE variant replaces every
block's feed-forward by torchtitan/models/moe.py's layer.

The idioms that let parallelism reach the model by module name are those of the Llama model
(torchtitan/models/llama/model.py): `view(..., -1, head_dim)`, blocks in a ModuleDict keyed by
index, optional embedding/norm/output for pipeline stages, `Attention.kernel`, a RoPE table
passed to each block, document ids turned into one attention mask per forward
(`Qwen3.attention_mask`), `init_weights` separate from construction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from torchtitan.models.common import (
    AttentionMask,
    FeedForward,
    PaddedVocabMask,
    apply_rope,
    build_norm,
    causal_attention,
    document_causal_mask,
    reset_norm,
    rope_table,
    trunc_normal,
)
from torchtitan.models.moe import MoE


@dataclass
class Qwen3ModelArgs:
    dim: int = 1024
    n_layers: int = 28
    n_heads: int = 16
    n_kv_heads: int = 8
    head_dim: int = 128
    hidden_dim: int = 3072  # dense feed-forward size (HF intermediate_size)
    vocab_size: int = 151936  # replaced by the tokenizer's size when training
    vocab_padding: int = 0  # masked extra rows, as in Llama's args
    norm_eps: float = 1e-6
    norm_type: str = "rmsnorm"
    rope_theta: float = 1_000_000.0
    max_seq_len: int = 4096
    tie_word_embeddings: bool = False
    depth_init: bool = True
    # Mixture of experts: 0 experts = dense.
    num_experts: int = 0
    top_k: int = 0
    moe_hidden_dim: int = 0  # each expert's feed-forward size (HF moe_intermediate_size)
    norm_topk_prob: bool = True
    # Load balancing; the trainer sets both from the [moe] options.
    moe_aux_loss_coef: float = 0.0
    moe_bias_update_rate: float = 0.0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


class Attention(nn.Module):
    def __init__(self, args: Qwen3ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.q_norm = build_norm(args.norm_type, args.head_dim, args.norm_eps)
        self.k_norm = build_norm(args.norm_type, args.head_dim, args.norm_eps)
        self.kernel = causal_attention  # (q, k, v) (batch, heads, seq, head_dim), causal or as `mask` says

    def init_weights(self, init_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)
        reset_norm(self.q_norm)
        reset_norm(self.k_norm)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: AttentionMask | None = None) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        rope = rope[:seqlen]
        q = self.q_norm(self.wq(x).view(bsz, seqlen, -1, self.head_dim))
        k = self.k_norm(self.wk(x).view(bsz, seqlen, -1, self.head_dim))
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = self.kernel(q, k, v) if mask is None else self.kernel(q, k, v, mask)  # as Llama's
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: Qwen3ModelArgs):
        super().__init__()
        self.attention = Attention(args)
        self.attention_norm = build_norm(args.norm_type, args.dim, args.norm_eps)
        self.ffn_norm = build_norm(args.norm_type, args.dim, args.norm_eps)
        # Exactly one of the two: dense blocks have `feed_forward`, MoE blocks `moe`.
        self.feed_forward = None if args.is_moe else FeedForward(args.dim, args.hidden_dim)
        self.moe = (MoE(args.dim, args.moe_hidden_dim, args.num_experts, args.top_k, args.norm_topk_prob,
                        args.moe_aux_loss_coef, args.moe_bias_update_rate) if args.is_moe else None)
        depth = layer_id + 1 if args.depth_init else args.n_layers
        self.weight_init_std = 0.02 / (2 * depth) ** 0.5

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        reset_norm(self.attention_norm)
        reset_norm(self.ffn_norm)
        self.attention.init_weights(self.weight_init_std)
        if self.moe is not None:
            self.moe.init_weights(self.weight_init_std, buffer_device)
        else:
            self.feed_forward.init_weights(self.weight_init_std)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: AttentionMask | None = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope, mask=mask)
        ffn = self.moe if self.moe is not None else self.feed_forward
        return h + ffn(self.ffn_norm(h))


class Qwen3(nn.Module):
    """Qwen3 decoder: token embedding -> blocks -> norm -> output projection (logits)."""

    def __init__(self, args: Qwen3ModelArgs):
        super().__init__()
        if args.n_heads % args.n_kv_heads:
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
        self.register_buffer("rope_cache", self._rope(), persistent=False)
        self.attention_mask: Callable[[torch.Tensor], AttentionMask] = document_causal_mask  # as Llama's

    def _rope(self, device: torch.device | None = None) -> torch.Tensor:
        a = self.args
        return rope_table(a.head_dim, a.rope_theta, a.max_seq_len, None, device)

    @classmethod
    def from_model_args(cls, args: Qwen3ModelArgs) -> "Qwen3":
        return cls(args)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """(Re)initialises every parameter and buffer; call after `to_empty()` on meta-built models."""
        buffer_device = buffer_device or self.rope_cache.device
        self.rope_cache = self._rope(buffer_device)
        tied = self.args.tie_word_embeddings
        if tied and self.output is not None and self.tok_embeddings is not None:
            self.output.weight = self.tok_embeddings.weight  # to_empty() unties them
        # As in Llama: a tied matrix is also the output projection, whose logits would start huge
        # at the embedding's usual unit std.
        out_std = 1.0 / self.args.dim if tied else self.args.dim**-0.5
        with torch.no_grad():
            if self.tok_embeddings is not None:
                if tied:
                    trunc_normal(self.tok_embeddings.weight, out_std)
                else:
                    nn.init.normal_(self.tok_embeddings.weight)
            for layer in self.layers.values():
                layer.init_weights(buffer_device)
            if self.norm is not None:
                reset_norm(self.norm)
            if self.output is not None and not (tied and self.tok_embeddings is not None):
                trunc_normal(self.output.weight, out_std)

    def forward(self, tokens: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (batch, seq) -> logits (batch, seq, vocab); a pipeline stage without the
        embedding takes hidden states, one without the output returns them. `document_ids`
        (batch, seq): attention stays inside each document (None: plain causal)."""
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
        """Training FLOPs per token: 6 per *activated* non-embedding parameter (an MoE token runs
        top_k of the experts) plus attention scores; the convention of Llama's count."""
        return flops_per_token(self.args, seq_len)


def block_params(args: Qwen3ModelArgs) -> tuple[int, int]:
    """(total, activated per token) parameters of one block, from the shapes alone. Activated
    counts top_k of the experts (and the router)."""
    a = args
    attention = a.dim * a.head_dim * (2 * a.n_heads + 2 * a.n_kv_heads) + 2 * a.head_dim  # and the q/k norms
    norms = 2 * a.dim
    if a.is_moe:
        expert = 3 * a.dim * a.moe_hidden_dim
        ffn_total = a.num_experts * expert + a.dim * a.num_experts
        ffn_active = a.top_k * expert + a.dim * a.num_experts
    else:
        ffn_total = ffn_active = 3 * a.dim * a.hidden_dim
    return attention + norms + ffn_total, attention + norms + ffn_active


def param_counts(args: Qwen3ModelArgs) -> tuple[int, int]:
    """(total, activated per token) parameters of a whole model, embeddings included, from the
    shapes alone."""
    a = args
    rows = a.vocab_size + a.vocab_padding
    block_total, block_active = block_params(a)
    embeddings = rows * a.dim * (1 if a.tie_word_embeddings else 2)
    return a.n_layers * block_total + a.dim + embeddings, a.n_layers * block_active + a.dim + embeddings


def block_flops(args: Qwen3ModelArgs, seq_len: int) -> int:
    """Training FLOPs per token of one block, the cost the FLOP count (MFU) and the pipeline split
    share: 6 per activated parameter plus the attention scores (Llama's convention)."""
    return 6 * block_params(args)[1] + 12 * args.n_heads * args.head_dim * seq_len


def flops_per_token(args: Qwen3ModelArgs, seq_len: int) -> int:
    """Every block's FLOPs plus 6 per parameter of the final norm and the output projection (an
    untied embedding is a lookup, not a matmul; a tied one counts once, as the output)."""
    rows = args.vocab_size + args.vocab_padding
    return args.n_layers * block_flops(args, seq_len) + 6 * (args.dim + rows * args.dim)
