"""Text generation with a KV cache, for any registered family, without touching the model files.

The models keep two seams for this (torchtitan/models/llama/model.py's docstring): each attention
module's kernel is an attribute, `attention.kernel(q, k, v)` on (batch, heads, seq, head_dim)
tensors already rotated by RoPE, and the model passes its `rope_cache` to every block, which
takes its first `seq` rows. `KVCache` swaps every kernel for a caching one and, for a forward at
position p, hands the model the table's rows from p on, so the new tokens are rotated for their own
positions. The caching kernel stores the keys and values of the new positions and attends over
every cached one, causally, skipping padding; for gpt-oss, within its block's window and with its
heads' sinks, which its attention hands the kernel (`kernel(q, k, v, documents, sinks=, window=)`).

DeepSeek-V3's latent attention (MLA) has a seam of its own, `attention.latent_kernel(q, latent,
k_rope)`, which sees the tensors every head's keys and values are made from: one normalised latent
(kv_lora_rank) and one rotated key part (qk_rope_head_dim) per token, shared by all heads. Its
caching kernel stores those, 576 numbers per token and layer for DeepSeek-V3 instead of 40,960
(docs/generation.md). The prompt attends through every head's keys and values, as the model
computes them; each later token attends in the latent space ("absorb" mode of DeepSeek's
reference): with wkv_b's rows split per head into W_UK (the keys' non-rotated part) and W_UV (the
values), q_nope . (W_UK c) = (W_UK^T q_nope) . c and sum_j p_j W_UV c_j = W_UV sum_j p_j c_j, so
the queries are taken into the latent space, attend over the cached latents, and the result is
taken to each head's values. Equal in exact arithmetic; the sums are ordered otherwise.

Prompts of different lengths are left-padded into one batch: a row's real tokens then sit at
positions shifted by its padding, which RoPE does not notice (attention scores depend on the
distance between positions only), and padding keys are masked out. Tensor parallelism needs no
change here: each rank's kernels see its own heads (a latent kernel takes its heads' rows of
wkv_b, and every rank holds the whole latent, which all heads share).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if hasattr(m, "kernel") and callable(m.kernel)]


def _visible(cache: KVCache, start: int, end: int, device: torch.device, window: int | None = None) -> torch.Tensor:
    """(batch, 1, end - start, end) bools: which cached positions the queries at start..end see,
    within `window` positions of each query for a banded block (gpt-oss; None: every earlier one)."""
    # A query sees the real keys up to its own position, and always itself: a padding query
    # would otherwise see nothing, and its NaN would reach real rows through the values. A banded
    # block's window counts positions, so left padding shifts nothing within it.
    query_pos = torch.arange(start, end, device=device)[:, None]
    key_pos = torch.arange(end, device=device)[None, :]
    allowed = (key_pos <= query_pos) & cache.real[:, None, None, :end]
    if window is not None:
        allowed &= key_pos > query_pos - window
    return allowed | (key_pos == query_pos)


def _compute_dtype(q: torch.Tensor) -> torch.dtype:
    # On CPU in fp32, as the models' causal_attention computes (torchtitan/models/common.py).
    return torch.float32 if q.device.type == "cpu" and q.dtype != torch.float32 else q.dtype


class _CachingKernel:
    """One attention layer's keys and values for every position so far."""

    def __init__(self, cache: KVCache):
        self.cache = cache
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def buffers(self) -> list[torch.Tensor]:
        return [t for t in (self.k, self.v) if t is not None]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor | None = None, *,
                 sinks: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
        """The kernel seam's call; gpt-oss's attention also passes its heads' `sinks` and its block's
        `window` (None: full attention). `documents` is always None here: generation packs no documents."""
        c = self.cache
        start, end = c.position, c.position + q.shape[2]
        if self.k is None:  # sized on first use: under tensor parallelism a rank holds only its heads
            self.k = k.new_zeros((k.shape[0], k.shape[1], c.max_len, k.shape[3]))
            self.v = v.new_zeros((v.shape[0], v.shape[1], c.max_len, v.shape[3]))
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        keys, values = self.k[:, :, :end], self.v[:, :, :end]
        allowed = _visible(c, start, end, q.device, window)
        if sinks is not None:
            return _attention_with_sinks(q, keys, values, allowed, sinks)
        compute = _compute_dtype(q)
        out = F.scaled_dot_product_attention(q.to(compute), keys.to(compute), values.to(compute), attn_mask=allowed,
                                             enable_gqa=q.shape[1] != k.shape[1])
        return out.to(q.dtype)


def _attention_with_sinks(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor,
                          sinks: torch.Tensor) -> torch.Tensor:
    """Attention in float32 where each head's sink logit joins the softmax's denominator and attends to
    nothing: the output without sinks times sigmoid(lse - sink), lse the log-sum-exp of the allowed
    scores (SDPA gives no lse, so the scores are materialised: a few new positions against the cache)."""
    groups = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(groups, dim=1).float(), values.repeat_interleave(groups, dim=1).float()
    scores = torch.matmul(q.float(), keys.transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    out = torch.matmul(torch.softmax(scores, dim=-1), values)
    return (out * torch.sigmoid(lse - sinks.float().view(1, -1, 1, 1))).to(q.dtype)


class _LatentCachingKernel:
    """One latent-attention layer's normalised latents and rotated key parts for every position so
    far (the module docstring): the prompt attends as the model does, later tokens in the latent space."""

    def __init__(self, cache: KVCache, attention: nn.Module):
        self.cache, self.attention = cache, attention
        # (batch, max_len, kv_lora_rank + qk_rope_head_dim): each position's latent, then its rotated
        # key part, so that the keys of the latent space are one slice of it and the values another.
        self.latents: torch.Tensor | None = None
        self.up: tuple[torch.Tensor, torch.Tensor] | None = None  # W_UK, W_UV of this rank's heads

    def buffers(self) -> list[torch.Tensor]:
        return [self.latents] if self.latents is not None else []

    def __call__(self, q: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor) -> torch.Tensor:
        """q (batch, seq, heads, qk head dim), scaled and rotated; latent (batch, seq, kv_lora_rank);
        k_rope (batch, seq, 1, qk_rope_head_dim) -> (batch, seq, heads, v_head_dim)."""
        c, a = self.cache, self.attention
        start, end = c.position, c.position + q.shape[1]
        if self.latents is None:
            self.latents = latent.new_zeros((latent.shape[0], c.max_len, latent.shape[-1] + k_rope.shape[-1]))
        self.latents[:, start:end] = torch.cat([latent, k_rope.squeeze(2)], dim=-1)
        visible = _visible(c, start, end, q.device)
        compute = _compute_dtype(q)
        if start == 0:
            # The prompt: every head's keys and values of these positions, as the model computes them
            # (a long prompt attends over fewer dims per score than in the latent space).
            k, v = a.expand(latent, k_rope)
            q, k, v = (t.transpose(1, 2).to(compute) for t in (q, k, v))
            return F.scaled_dot_product_attention(q, k, v, attn_mask=visible).transpose(1, 2).to(latent.dtype)
        w_uk, w_uv = self._up_projections(compute)
        q_nope, q_rope = q.to(compute).split([a.nope_dim, a.rope_dim], dim=-1)
        query = torch.cat([torch.einsum("bshn,hnr->bhsr", q_nope, w_uk), q_rope.transpose(1, 2)], dim=-1)
        # One key and value "head" that every query head shares: the latent (with the rotated part, for
        # the keys).
        keys = self.latents[:, None, :end].to(compute)
        # The scale the model's kernel applies (1/sqrt of its queries' head size); the rest of MLA's
        # softmax scale is already in q (Attention.query_factor).
        out = F.scaled_dot_product_attention(query, keys, keys[..., :a.kv_lora_rank], attn_mask=visible,
                                             scale=(a.nope_dim + a.rope_dim) ** -0.5, enable_gqa=True)
        return torch.einsum("bhsr,hvr->bshv", out, w_uv).to(latent.dtype)

    def _up_projections(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK (heads, qk_nope_head_dim, kv_lora_rank) and W_UV (heads, v_head_dim, kv_lora_rank):
        wkv_b's rows per head, as Attention.expand splits its output."""
        if self.up is None:
            a = self.attention
            w = a.wkv_b.weight.detach()
            w = w.to_local() if isinstance(w, DTensor) else w  # tensor parallel: this rank's heads' rows
            w = w.to(dtype).view(-1, a.nope_dim + a.v_dim, a.kv_lora_rank)
            self.up = tuple(w.split([a.nope_dim, a.v_dim], dim=1))
        return self.up


class KVCache:
    """Installs caching kernels into a model for one batch; `forward(tokens)` runs the next
    positions. Used as a context manager, which gives the model its own kernels back."""

    def __init__(self, model: nn.Module, real: torch.Tensor, max_len: int):
        """`real`: (batch, max_len) bools, False where a row is padding."""
        self.model, self.real, self.max_len = model, real, max_len
        self.position = 0
        self._full_rope = model.rope_cache
        if max_len > self._full_rope.shape[0]:
            raise ValueError(f"{max_len} positions exceed the model's RoPE table ({self._full_rope.shape[0]})")
        # Latent attention's own seam where it has one (nothing per head is cached), else the kernel.
        self._seams = [(m, "latent_kernel" if hasattr(m, "latent_kernel") else "kernel")
                       for m in _attention_modules(model)]
        self._saved = [getattr(m, seam) for m, seam in self._seams]
        self._kernels: list[_CachingKernel | _LatentCachingKernel] = []

    def __enter__(self) -> KVCache:
        for m, seam in self._seams:
            kernel = _LatentCachingKernel(self, m) if seam == "latent_kernel" else _CachingKernel(self)
            setattr(m, seam, kernel)
            self._kernels.append(kernel)
        return self

    def __exit__(self, *exc) -> None:
        for (m, seam), kernel in zip(self._seams, self._saved):
            setattr(m, seam, kernel)
        self.model.rope_cache = self._full_rope

    def nbytes(self) -> int:
        """Bytes the cache holds: every layer's buffers (allocated at the layer's first forward, for
        `max_len` positions; layers that never run, MTP's in generation, hold none)."""
        return sum(t.nbytes for kernel in self._kernels for t in kernel.buffers())

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, multiple_of: int = 1) -> torch.Tensor:
        """Logits (batch, seq, vocab) of `tokens` (batch, seq), the positions after those run so far.

        `multiple_of`: the model is run on a sequence padded on the right to a multiple of it (a
        tensor-parallel MoE layer computes its rank's slice of the sequence, so one decoding token
        would leave the other ranks none). The padding sits after the real positions, which never
        attend to it, and the next forward writes its own keys and values over the padding's."""
        n = tokens.shape[1]
        pad = -n % multiple_of
        if pad:
            tokens = torch.cat([tokens, tokens[:, -1:].expand(-1, pad)], dim=1)
        end = self.position + tokens.shape[1]
        if end > self.max_len:
            raise ValueError(f"position {end} is past the cache's {self.max_len}")
        self.model.rope_cache = self._full_rope[self.position:]  # attention takes its first rows
        try:
            logits = self.model(tokens)
        finally:
            self.model.rope_cache = self._full_rope
        self.position += n
        return logits[:, :n]


# ---------------------------------------------------------------------------------------------
# Sampling


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no limit
    top_p: float = 1.0  # 1: no limit

    def check(self) -> None:
        if not self.temperature >= 0:  # NaN too
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top-k must be >= 0 (0 keeps every token), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top-p must lie in (0, 1], got {self.top_p}")


def filter_logits(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """(batch, vocab) logits scaled by the temperature, with the tokens top-k and top-p rule out at -inf."""
    # Scaled after subtracting the maximum: the likeliest token stays at 0 whatever the temperature,
    # so a tiny one gives -inf to the others (argmax) instead of inf - inf = NaN, and inf gives 0 to all.
    logits = logits.float()
    logits = (logits - logits.max(-1, keepdim=True).values) / s.temperature
    if s.top_k:
        kth = torch.topk(logits, min(s.top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p < 1:
        ordered, order = torch.sort(logits, descending=True)
        probs = ordered.softmax(-1)
        # Keep the smallest set of most likely tokens whose probability reaches top_p: a token goes
        # when the tokens before it already reach it.
        drop = probs.cumsum(-1) - probs >= s.top_p
        logits = logits.scatter(-1, order, ordered.masked_fill(drop, float("-inf")))
    return logits


def sample(logits: torch.Tensor, s: Sampling, generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token of each row of (batch, vocab) logits."""
    if s.temperature == 0:
        return logits.argmax(-1)
    probs = filter_logits(logits, s).softmax(-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)


# ---------------------------------------------------------------------------------------------
# Generating


def left_pad(prompts: list[list[int]], pad: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, real): prompts right-aligned in one (batch, longest) tensor, and where they are real."""
    longest = max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), longest), pad, dtype=torch.long)
    real = torch.zeros((len(prompts), longest), dtype=torch.bool)
    for i, p in enumerate(prompts):
        tokens[i, longest - len(p):] = torch.tensor(p, dtype=torch.long)
        real[i, longest - len(p):] = True
    return tokens.to(device), real.to(device)


@torch.no_grad()
def generate(model: nn.Module, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling, eos_id: int | None,
             seed: int = 0, kv_cache: bool = True, agree: Callable[[torch.Tensor], torch.Tensor] | None = None,
             vocab_limit: int | None = None, multiple_of: int = 1) -> Iterator[torch.Tensor]:
    """Yields each step's new token per prompt (batch,), until every row has produced `eos_id` or
    `max_new_tokens` tokens; rows that have ended keep yielding `eos_id`. `kv_cache` False re-runs
    the whole sequence at every step (for checking the cache). `agree` makes every rank use the same
    tokens (tensor parallelism: rank 0's). `vocab_limit`: tokens from it on are never drawn (a
    model's vocabulary can be larger than its tokenizer's). `multiple_of`: see KVCache.forward; the
    model's RoPE table must cover `positions_needed(...)`."""
    device = next(model.parameters()).device
    tokens, real = left_pad(prompts, 0, device)
    max_len = positions_needed(tokens.shape[1], max_new_tokens, multiple_of)
    generator = torch.Generator().manual_seed(seed)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    grow = torch.ones((len(prompts), max_len - tokens.shape[1]), dtype=torch.bool, device=device)
    real = torch.cat([real, grow], dim=1)
    with KVCache(model, real, max_len) as cache:
        logits = cache.forward(tokens, multiple_of)[:, -1]
        for _ in range(max_new_tokens):
            if vocab_limit is not None and vocab_limit < logits.shape[-1]:
                logits = logits.clone()
                logits[:, vocab_limit:] = float("-inf")
            new = sample(logits, sampling, generator)
            if agree is not None:
                new = agree(new)
            if eos_id is not None:
                new = torch.where(done, torch.full_like(new, eos_id), new)
                done |= new == eos_id
            yield new
            if bool(done.all()):
                return
            tokens = torch.cat([tokens, new[:, None]], dim=1)
            if kv_cache:
                logits = cache.forward(new[:, None], multiple_of)[:, -1]
            else:
                cache.position = 0  # every kernel's cache is written afresh from position 0
                logits = cache.forward(tokens, multiple_of)[:, -1]


def positions_needed(prompt_len: int, max_new_tokens: int, multiple_of: int = 1) -> int:
    """Positions a generation fills: the padded prompts, the new tokens, and the padding the last
    forward may add (KVCache.forward's multiple_of)."""
    return prompt_len + max_new_tokens + multiple_of - 1


class Continuation:
    """The text a prompt's new tokens add, given out piece by piece as they come.

    Decoded together with the prompt's tokens, so that a tokenizer that spells a word's leading
    space into the word's first piece (sentencepiece) keeps it; and held back while it ends in
    an unfinished character (a multi-byte character spread over several tokens decodes to U+FFFD
    until its last byte arrives), so that a streamed character is never shown broken."""

    def __init__(self, tokenizer: Any, prompt: list[int], eos_id: int | None):
        self.tokenizer, self.prompt, self.eos_id = tokenizer, prompt, eos_id
        self.prefix = tokenizer.decode(prompt)
        self.shown = ""

    def _text(self, row: list[int]) -> str:
        whole = self.tokenizer.decode(self.prompt + [t for t in row if t != self.eos_id])
        if whole.startswith(self.prefix):
            return whole[len(self.prefix):]
        return self.tokenizer.decode([t for t in row if t != self.eos_id])

    def new_text(self, row: list[int], final: bool = False) -> str:
        """What is new since the last call; all of it when `final`."""
        text = self._text(row)
        if not final:
            text = text.rstrip("\ufffd")
        if not text.startswith(self.shown):  # an earlier piece decoded otherwise now: show the rest
            common = os.path.commonprefix([text, self.shown])
            text = self.shown + text[len(common):]
        new, self.shown = text[len(self.shown):], text
        return new


def reference_logits(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The model's own forward (its causal kernel, no cache): what cached generation must equal
    for unpadded prompts."""
    with torch.no_grad():
        return model(tokens)


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    was = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was)
