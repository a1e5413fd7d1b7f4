"""DeepSeek-V3 decoder in plain single-device PyTorch: multi-head latent attention, dense first
blocks, mixture-of-experts blocks with shared experts, and multi-token prediction.

Multi-head latent attention (MLA, DeepSeek-V2): keys and values are computed from one low-rank
latent per token (`wkv_a` compresses to `kv_lora_rank`, `kv_norm` normalises, `wkv_b` expands to
every head's key and value), and queries optionally from another (`q_lora_rank`, 0 = a full
`wq`). RoPE is decoupled: each head's query has `qk_nope_head_dim` dims without position and
`qk_rope_head_dim` rotated ones, and the rotated key part is one per token, shared by all heads
(the `qk_rope_head_dim` tail of `wkv_a`'s output). The softmax scale is 1/sqrt(qk head dim), times
YaRN's mscale squared when the RoPE is YaRN-scaled. Values have their own head size
(`v_head_dim`).

Mixture of experts: blocks from `n_dense_layers` on replace the dense feed-forward by
torchtitan/models/moe.py's layer (sigmoid or softmax scoring, group-limited routing, routed
scaling, the auxiliary-loss-free bias and the sequence-wise balancing loss) plus `shared_experts`,
one SwiGLU of `n_shared_experts` experts' width that every token passes through. The shared part
is a module of the block, beside `moe`, so tensor parallelism splits it like a dense feed-forward
and a token the routed experts drop still gets it.

Multi-token prediction (MTP, DeepSeek-V3): `mtp_depth` extra modules, module k predicting the
token k + 1 positions after the next one: it combines the previous depth's hidden state (the main
model's last block output for k = 1) with the embedding of the token k positions ahead
(`eh_proj` over the two, each RMS-normalised), runs one transformer block and its own final norm,
and reuses the main model's embedding and output projection. It needs the labels, which the
trainer passes in training (`labels`); its loss, `mtp_loss_weight` times the mean over depths of
each depth's cross-entropy (a mean over the forward's valid targets), enters backward through
`AuxLossGrad` like the MoE balancing loss, so the model's output stays the main logits and the
trainer's loss the language-modelling loss; the value is kept (`take_mtp_loss`) for the logs.

MTP's seams, set by the parallelize function where a layout spreads the tokens over ranks (one
process needs neither): `labels_ahead` gives, for each position the forward holds, the labels
1..depth positions further in the sequence (context parallelism fetches those held by the rank of
the next positions); `sum_over_loss_ranks` adds up the valid targets of every rank whose losses the
trainer averages (`loss_ranks` of them), so that each rank's sum of cross-entropies divided by that
count, times `loss_ranks`, averages into the mean over all of them, however unevenly the ignored
targets fall (the last positions of each sequence lie on one context-parallel rank).

The idioms that let parallelism reach the model by module name are the Llama model's
(torchtitan/models/llama/model.py): `view(..., -1, head_dim)`, blocks in a ModuleDict keyed by
index, optional embedding/norm/output for pipeline stages, `Attention.kernel`, a RoPE table
passed to each block, `init_weights` separate from construction. Two more seams are latent attention's
own: `Attention.shared_by_heads`, applied to the rotated key part that every head shares (tensor
parallelism sums its gradient over the ranks that split the heads), and `Attention.latent_kernel`,
which, when set, attends from the latents themselves instead of every head's keys and values
(generation's latent cache, torchtitan/inference/generation.py; `expand` gives the keys and values).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.datasets.text_dataset import IGNORE_INDEX
from torchtitan.models.common import (
    AttentionMask,
    FeedForward,
    PaddedVocabMask,
    apply_rope,
    build_norm,
    causal_attention,
    document_causal_mask,
    reset_norm,
    trunc_normal,
    yarn_blend,
)
from torchtitan.models.moe import AuxLossGrad, MoE, _in_backward


@dataclass
class YarnScaling:
    """YaRN RoPE scaling (DeepSeek-V3 extends 4K pre-training to 128K with factor 40)."""

    factor: float = 40.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0


# The latents' RMSNorms (q_norm, kv_norm) keep this epsilon whatever norm_eps says, as DeepSeek's
# reference and transformers' DeepseekV3Attention do (norm_eps is config.json's rms_norm_eps, for the
# blocks' norms).
LATENT_NORM_EPS = 1e-6


def yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass
class DeepSeekV3ModelArgs:
    dim: int = 2048
    n_layers: int = 27
    n_dense_layers: int = 1  # the first blocks keep a dense feed-forward (HF first_k_dense_replace)
    n_heads: int = 16
    hidden_dim: int = 10944  # the dense blocks' feed-forward size (HF intermediate_size)
    vocab_size: int = 102400  # replaced by the tokenizer's size when training
    vocab_padding: int = 0
    norm_eps: float = 1e-6
    norm_type: str = "rmsnorm"
    max_seq_len: int = 4096
    depth_init: bool = True
    # Multi-head latent attention
    q_lora_rank: int = 0  # 0: queries from one full projection `wq`
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_theta: float = 10000.0
    rope_scaling: YarnScaling | None = None
    # Mixture of experts
    num_experts: int = 64
    n_shared_experts: int = 2
    top_k: int = 6
    moe_hidden_dim: int = 1408  # each expert's feed-forward size (HF moe_intermediate_size)
    score_func: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    route_scale: float = 1.0
    norm_topk_prob: bool = True
    # Load balancing; the trainer sets both from the [moe] options.
    moe_aux_loss_coef: float = 0.0
    moe_bias_update_rate: float = 0.0
    # Multi-token prediction; the trainer sets both from model.mtp_depth / model.mtp_loss_weight.
    mtp_depth: int = 0
    mtp_loss_weight: float = 0.3

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def softmax_scale(self) -> float:
        scale = self.qk_head_dim**-0.5
        if self.rope_scaling is not None and self.rope_scaling.mscale_all_dim:
            m = yarn_mscale(self.rope_scaling.factor, self.rope_scaling.mscale_all_dim)
            scale *= m * m
        return scale


def rope_table(args: DeepSeekV3ModelArgs, device: torch.device | None = None) -> torch.Tensor:
    """(max_seq_len, qk_rope_head_dim // 2, 2): cos and sin of each position's angles, YaRN-scaled
    when `args.rope_scaling` is set (frequencies blended between interpolated and original by a
    linear ramp over the dims, cos and sin times YaRN's attention factor)."""
    dim, theta = args.qk_rope_head_dim, args.rope_theta
    exponents = torch.arange(0, dim, 2, device=device, dtype=torch.float64) / dim
    freqs = 1.0 / theta**exponents
    factor = 1.0
    y = args.rope_scaling
    if y is not None:
        freqs = yarn_blend(freqs, theta, y.factor, y.original_max_position_embeddings, y.beta_fast, y.beta_slow)
        if y.mscale and y.mscale_all_dim:
            factor = yarn_mscale(y.factor, y.mscale) / yarn_mscale(y.factor, y.mscale_all_dim)
        else:
            factor = yarn_mscale(y.factor, 1.0)
    angles = torch.outer(torch.arange(args.max_seq_len, device=device, dtype=torch.float64), freqs)
    return (torch.stack((angles.cos(), angles.sin()), dim=-1) * factor).float()


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def labels_ahead(labels: torch.Tensor, depth: int) -> torch.Tensor:
    """(depth + 1, batch, seq): [k][b, i] is the label k positions after position i of labels (batch,
    seq), IGNORE_INDEX past the sequence's end; [0] the labels themselves. MTP's default seam, for
    a forward that holds whole sequences."""
    seq = labels.shape[1]
    padded = F.pad(labels, (0, depth), value=IGNORE_INDEX)
    return torch.stack([padded[:, k:k + seq] for k in range(depth + 1)])


class Attention(nn.Module):
    """Multi-head latent attention (module docstring)."""

    def __init__(self, args: DeepSeekV3ModelArgs):
        super().__init__()
        self.nope_dim, self.rope_dim, self.v_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        self.kv_lora_rank = args.kv_lora_rank
        qk_out = args.n_heads * args.qk_head_dim
        if args.q_lora_rank:
            self.wq = None
            self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
            self.q_norm = build_norm("rmsnorm", args.q_lora_rank, LATENT_NORM_EPS)
            self.wq_b = nn.Linear(args.q_lora_rank, qk_out, bias=False)
        else:
            self.wq = nn.Linear(args.dim, qk_out, bias=False)
            self.wq_a = self.q_norm = self.wq_b = None
        self.wkv_a = nn.Linear(args.dim, args.kv_lora_rank + args.qk_rope_head_dim, bias=False)
        self.kv_norm = build_norm("rmsnorm", args.kv_lora_rank, LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(args.kv_lora_rank, args.n_heads * (args.qk_nope_head_dim + args.v_head_dim), bias=False)
        self.wo = nn.Linear(args.n_heads * args.v_head_dim, args.dim, bias=False)
        # The kernels scale scores by 1/sqrt(q's head dim); queries are pre-multiplied so that the
        # product is MLA's scale (YaRN's mscale included) whatever the kernel.
        self.query_factor = args.softmax_scale() * args.qk_head_dim**0.5
        self.kernel = causal_attention  # (q, k, v) (batch, heads, seq, head_dim), causal or as `mask` says
        # Values padded to the query/key head size for kernels that need equal sizes (ring attention's
        # block kernels); set by context parallelism. Exact: the padded columns come out zero.
        self.pad_values = False
        # Applied to the rotated key part, which every head shares. Tensor parallelism gives a rank
        # only some heads, whose gradients for it are then a partial sum: it sets this to sum them over
        # the tp ranks in backward (parallelize_deepseek_v3.sum_gradient_over_tp).
        self.shared_by_heads: Callable[[torch.Tensor], torch.Tensor] = _identity
        # None, or (q, latent, k_rope) -> every head's output (batch, seq, heads, v_head_dim), called
        # instead of `expand` and `kernel` with the scaled rotated queries (batch, seq, heads, qk head
        # dim), the normalised latents (batch, seq, kv_lora_rank) and the rotated key part (batch,
        # seq, 1, qk_rope_head_dim): generation caches these per token, not every head's keys and
        # values (torchtitan/inference/generation.py).
        self.latent_kernel: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def init_weights(self, init_std: float) -> None:
        for linear in (self.wq, self.wq_a, self.wq_b, self.wkv_a, self.wkv_b):
            if linear is not None:
                nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)
        for norm in (self.q_norm, self.kv_norm):
            if norm is not None:
                reset_norm(norm)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: AttentionMask | None = None) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        rope = rope[:seqlen]
        q = self.wq(x) if self.wq is not None else self.wq_b(self.q_norm(self.wq_a(x)))
        q = q.view(bsz, seqlen, -1, self.nope_dim + self.rope_dim)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q = torch.cat([q_nope, apply_rope(q_rope, rope)], dim=-1) * self.query_factor
        latent, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = self.kv_norm(latent)
        k_rope = apply_rope(self.shared_by_heads(k_rope).unsqueeze(2), rope)  # one per token, every head's
        if self.latent_kernel is not None:
            out = self.latent_kernel(q, latent, k_rope)
        else:
            k, v = self.expand(latent, k_rope)
            if self.pad_values:
                v = F.pad(v, (0, q.shape[-1] - self.v_dim))
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            out = self.kernel(q, k, v) if mask is None else self.kernel(q, k, v, mask)
            if self.pad_values:
                out = out[..., : self.v_dim]
            out = out.transpose(1, 2)
        return self.wo(out.reshape(bsz, seqlen, -1))

    def expand(self, latent: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every head's keys (batch, seq, heads, qk head dim) and values (batch, seq, heads,
        v_head_dim) from the normalised latents and the rotated key part (as `forward` has them)."""
        kv = self.wkv_b(latent).view(*latent.shape[:2], -1, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        return torch.cat([k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)], dim=-1), v


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: DeepSeekV3ModelArgs):
        super().__init__()
        self.attention = Attention(args)
        self.attention_norm = build_norm(args.norm_type, args.dim, args.norm_eps)
        self.ffn_norm = build_norm(args.norm_type, args.dim, args.norm_eps)
        moe = args.is_moe and layer_id >= args.n_dense_layers
        # Dense blocks have `feed_forward`; MoE blocks `moe` and, with shared experts, `shared_experts`.
        self.feed_forward = None if moe else FeedForward(args.dim, args.hidden_dim)
        self.moe = (MoE(args.dim, args.moe_hidden_dim, args.num_experts, args.top_k, args.norm_topk_prob,
                        args.moe_aux_loss_coef, args.moe_bias_update_rate, args.score_func, args.n_group,
                        args.topk_group, args.route_scale) if moe else None)
        shared = moe and args.n_shared_experts > 0
        self.shared_experts = FeedForward(args.dim, args.moe_hidden_dim * args.n_shared_experts) if shared else None
        depth = layer_id + 1 if args.depth_init else args.n_layers
        self.weight_init_std = 0.02 / (2 * depth) ** 0.5

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        reset_norm(self.attention_norm)
        reset_norm(self.ffn_norm)
        self.attention.init_weights(self.weight_init_std)
        if self.moe is not None:
            self.moe.init_weights(self.weight_init_std, buffer_device)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(self.weight_init_std)
        if self.feed_forward is not None:
            self.feed_forward.init_weights(self.weight_init_std)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: AttentionMask | None = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope, mask=mask)
        normed = self.ffn_norm(h)
        if self.moe is None:
            return h + self.feed_forward(normed)
        out = self.moe(normed)
        if self.shared_experts is not None:
            out = out + self.shared_experts(normed)
        return h + out


class MultiTokenPrediction(nn.Module):
    """One MTP depth (module docstring): [enorm(embedding of the token ahead); hnorm(h)] ->
    eh_proj -> a transformer block -> (hidden state for the next depth, its normalised form for
    the shared output projection)."""

    def __init__(self, layer_id: int, args: DeepSeekV3ModelArgs):
        super().__init__()
        self.enorm = build_norm(args.norm_type, args.dim, args.norm_eps)
        self.hnorm = build_norm(args.norm_type, args.dim, args.norm_eps)
        self.eh_proj = nn.Linear(2 * args.dim, args.dim, bias=False)
        self.block = TransformerBlock(layer_id, args)
        self.norm = build_norm(args.norm_type, args.dim, args.norm_eps)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        for norm in (self.enorm, self.hnorm, self.norm):
            reset_norm(norm)
        nn.init.trunc_normal_(self.eh_proj.weight, mean=0.0, std=0.02)
        self.block.init_weights(buffer_device)

    def forward(self, h: torch.Tensor, embedded: torch.Tensor, rope: torch.Tensor,
                mask: AttentionMask | None) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(h)], dim=-1))
        x = self.block(x, rope, mask)
        return x, self.norm(x)


def _full(t: torch.Tensor) -> torch.Tensor:
    """A loss that tensor parallelism made a (replicated) DTensor as a plain tensor, duck-typed so
    that this file needs no torch.distributed; anything else unchanged."""
    full = getattr(t, "full_tensor", None)
    return full() if full is not None else t


class DeepSeekV3(nn.Module):
    """Token embedding -> blocks -> norm -> output projection (logits), plus MTP in training."""

    def __init__(self, args: DeepSeekV3ModelArgs):
        super().__init__()
        if args.mtp_depth < 0:
            raise ValueError(f"mtp_depth must be >= 0, got {args.mtp_depth}")
        self.args = args
        rows = args.vocab_size + args.vocab_padding
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(rows, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm: nn.Module | None = build_norm(args.norm_type, args.dim, args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, rows, bias=False)
        self.vocab_mask: nn.Module | None = PaddedVocabMask(args.vocab_size) if args.vocab_padding else None
        # Depth k's block counts as layer n_layers + k - 1 (its init depth, and its name in DeepSeek's files).
        self.mtp: nn.ModuleList | None = (nn.ModuleList(MultiTokenPrediction(args.n_layers + k, args)
                                                        for k in range(args.mtp_depth)) if args.mtp_depth else None)
        self.register_buffer("rope_cache", rope_table(args), persistent=False)
        self.attention_mask: Callable[[torch.Tensor], AttentionMask] = document_causal_mask
        # MTP's loss this step (mean over depths, unweighted; this rank's share), for the logs.
        self.register_buffer("mtp_loss", torch.zeros(()), persistent=False)
        self.count_step_stats = True  # off in forwards that must not count (pipeline shape probing)
        self.sequences_per_step: int | None = None  # set by the trainer: batch x accumulation on this rank
        # MTP's seams (module docstring): the labels ahead of each position this forward holds, and a
        # count summed over the `loss_ranks` ranks whose losses the trainer averages.
        self.labels_ahead: Callable[[torch.Tensor, int], torch.Tensor] = labels_ahead
        self.sum_over_loss_ranks: Callable[[torch.Tensor], torch.Tensor] = _identity
        self.loss_ranks = 1

    @classmethod
    def from_model_args(cls, args: DeepSeekV3ModelArgs) -> "DeepSeekV3":
        return cls(args)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """(Re)initialises every parameter and buffer; call after `to_empty()` on meta-built models."""
        buffer_device = buffer_device or self.rope_cache.device
        self.rope_cache = rope_table(self.args, buffer_device)
        self.mtp_loss = torch.zeros((), device=buffer_device)
        with torch.no_grad():
            if self.tok_embeddings is not None:
                nn.init.normal_(self.tok_embeddings.weight)
            for layer in self.layers.values():
                layer.init_weights(buffer_device)
            for module in self.mtp or ():
                module.init_weights(buffer_device)
            if self.norm is not None:
                reset_norm(self.norm)
            if self.output is not None:
                trunc_normal(self.output.weight, self.args.dim**-0.5)

    def forward(self, tokens: torch.Tensor, document_ids: torch.Tensor | None = None,
                labels: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (batch, seq) -> logits (batch, seq, vocab); a pipeline stage without the
        embedding takes hidden states (a last stage that keeps the embedding for MTP too: floats
        are hidden states), one without the output returns them. `document_ids` (batch, seq):
        attention stays inside each document. `labels` (batch, seq), in training only: the
        targets MTP needs (ignored without MTP)."""
        embeds = self.tok_embeddings is not None and not tokens.is_floating_point()
        h = self.tok_embeddings(tokens) if embeds else tokens
        mask = self.attention_mask(document_ids) if document_ids is not None else None
        for layer in self.layers.values():
            h = layer(h, self.rope_cache, mask)
        if self.output is None:
            return h
        logits = self._logits(self.norm(h))
        if self.mtp is not None and labels is not None and self.training:
            logits = AuxLossGrad.apply(logits, self._mtp_loss(h, labels, mask))
        return logits

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.output(h)
        return self.vocab_mask(logits) if self.vocab_mask is not None else logits

    def _mtp_loss(self, h: torch.Tensor, labels: torch.Tensor, mask: AttentionMask | None) -> torch.Tensor:
        """This forward's share of the step's weighted MTP loss. With labels y (y[i] = token i + 1),
        depth k at position i embeds y[i + k - 1] and predicts y[i + k]; the last k positions of a
        sequence have no target and are ignored, as are ignored labels."""
        depth = len(self.mtp)
        ahead = self.labels_ahead(labels, depth)  # (depth + 1, batch, seq): [k] the labels k positions ahead
        # Each depth's valid targets over the ranks whose losses are averaged: the denominator of its mean.
        targets = self.sum_over_loss_ranks((ahead[1:] != IGNORE_INDEX).flatten(1).sum(dim=1))
        total = torch.zeros((), device=h.device)
        for k, module in enumerate(self.mtp, start=1):
            embedded = self.tok_embeddings(torch.where(ahead[k - 1] != IGNORE_INDEX, ahead[k - 1], 0))
            h, normed = module(h, embedded, self.rope_cache, mask)
            logits = self._logits(normed)
            ce = F.cross_entropy(logits.flatten(0, 1).float(), ahead[k].flatten(), reduction="sum",
                                 ignore_index=IGNORE_INDEX)
            total = total + _full(ce) / targets[k - 1].clamp(min=1)
        # The trainer averages the ranks' losses: `loss_ranks` times this rank's part of the sum makes
        # their mean the mean over every rank's targets. And a mean over the step's sequences, as the
        # main loss is (accumulation, pipeline microbatches).
        share = labels.shape[0] / (self.sequences_per_step or labels.shape[0])
        mean_over_depths = total * self.loss_ranks / depth * share
        counting = float(self.count_step_stats and not _in_backward())
        with torch.no_grad():
            # The flag is made on the device: a host tensor would be copied there with a blocking copy.
            self.mtp_loss += torch.where(torch.full((), counting > 0, device=h.device), mean_over_depths.detach(), 0.0)
        return self.args.mtp_loss_weight * mean_over_depths

    def take_mtp_loss(self) -> torch.Tensor:
        """The MTP loss accumulated since the last call (mean over depths and the step's
        sequences, this rank's share), then reset."""
        value = self.mtp_loss.clone()
        self.mtp_loss.zero_()
        return value

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6 per activated non-embedding parameter plus attention scores
        (Llama's convention), MTP depths included."""
        return flops_per_token(self.args, seq_len)


# ---------------------------------------------------------------------------------------------
# Counts from the shapes alone


def attention_params(a: DeepSeekV3ModelArgs) -> int:
    if a.q_lora_rank:
        q = a.dim * a.q_lora_rank + a.q_lora_rank + a.q_lora_rank * a.n_heads * a.qk_head_dim
    else:
        q = a.dim * a.n_heads * a.qk_head_dim
    kv = a.dim * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank
    kv += a.kv_lora_rank * a.n_heads * (a.qk_nope_head_dim + a.v_head_dim)
    return q + kv + a.n_heads * a.v_head_dim * a.dim


def block_params(a: DeepSeekV3ModelArgs, layer_id: int) -> tuple[int, int]:
    """(total, activated per token) parameters of block `layer_id` (dense or MoE)."""
    base = attention_params(a) + 2 * a.dim
    if not a.is_moe or layer_id < a.n_dense_layers:
        ffn = 3 * a.dim * a.hidden_dim
        return base + ffn, base + ffn
    expert = 3 * a.dim * a.moe_hidden_dim
    shared = a.n_shared_experts * expert + a.dim * a.num_experts  # shared experts and the router
    return base + shared + a.num_experts * expert, base + shared + a.top_k * expert


def mtp_params(a: DeepSeekV3ModelArgs) -> tuple[int, int]:
    """(total, activated) parameters of the MTP modules (their own weights; embedding and output are shared)."""
    total, active = block_params(a, max(a.n_layers, a.n_dense_layers))
    extra = 3 * a.dim + 2 * a.dim * a.dim  # three norms and eh_proj
    return a.mtp_depth * (total + extra), a.mtp_depth * (active + extra)


def param_counts(a: DeepSeekV3ModelArgs) -> tuple[int, int]:
    """(total, activated per token) parameters of the main model, embeddings included, MTP not
    (DeepSeek's published counts: 671B total and 37B activated for V3, MTP's 14B separate)."""
    rows = a.vocab_size + a.vocab_padding
    blocks = [block_params(a, i) for i in range(a.n_layers)]
    outer = 2 * rows * a.dim + a.dim  # embedding, output, final norm
    return sum(t for t, _ in blocks) + outer, sum(x for _, x in blocks) + outer


def block_flops(a: DeepSeekV3ModelArgs, layer_id: int, seq_len: int) -> int:
    """Training FLOPs per token of one block: 6 per activated parameter plus the attention scores
    (q.k over the qk head dim, p.v over the v head dim, forward and backward)."""
    scores = 6 * a.n_heads * (a.qk_head_dim + a.v_head_dim) * seq_len
    return 6 * block_params(a, layer_id)[1] + scores


def flops_per_token(a: DeepSeekV3ModelArgs, seq_len: int) -> int:
    rows = a.vocab_size + a.vocab_padding
    main = sum(block_flops(a, i, seq_len) for i in range(a.n_layers)) + 6 * (a.dim + rows * a.dim)
    if not a.mtp_depth:
        return main
    per_depth = block_flops(a, a.n_layers, seq_len) + 6 * (3 * a.dim + 2 * a.dim * a.dim + rows * a.dim)
    return main + a.mtp_depth * per_depth
