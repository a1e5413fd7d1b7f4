"""Tests for the Qwen3 model, dense and MoE: published sizes, structure, meta-device init, pipeline
stages and one block against an independent reference of Qwen3's math."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from torchtitan.models.common import rope_table
from torchtitan.models.qwen3 import Qwen3, Qwen3ModelArgs, qwen3_configs
from torchtitan.models.qwen3.model import param_counts

# head_dim 16 with 4 heads: the q projection is 64 wide on a 48-wide residual.
TINY = dict(dim=48, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=64, vocab_size=100, max_seq_len=32)
TINY_MOE = dict(TINY, num_experts=4, top_k=2, moe_hidden_dim=32)


def n_params(model):
    return sum(p.numel() for p in model.parameters())  # a tied matrix is yielded once


def n_non_embedding(model):
    return sum(p.numel() for name, p in model.named_parameters() if not name.startswith(("tok_embeddings.", "output.")))


def build_on_meta(args):
    with torch.device("meta"):
        return Qwen3(args)


def build_tiny(seed=0, **overrides):
    model = build_on_meta(Qwen3ModelArgs(**{**TINY, **overrides}))
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model


# ---------------------------------------------------------------------------------------------
# Published sizes

# Hugging Face config.json of each release: (hidden_size, num_hidden_layers, num_attention_heads,
# num_key_value_heads, intermediate_size or moe_intermediate_size, num_experts, num_experts_per_tok,
# tie_word_embeddings); every one has head_dim 128, vocab 151936, rope_theta 1e6, rms_norm_eps 1e-6.
HF_CONFIGS = {
    "0.6B": (1024, 28, 16, 8, 3072, 0, 0, True),
    "1.7B": (2048, 28, 16, 8, 6144, 0, 0, True),
    "4B": (2560, 36, 32, 8, 9728, 0, 0, True),
    "8B": (4096, 36, 32, 8, 12288, 0, 0, False),
    "14B": (5120, 40, 40, 8, 17408, 0, 0, False),
    "32B": (5120, 64, 64, 8, 25600, 0, 0, False),
    "30B-A3B": (2048, 48, 32, 4, 768, 128, 8, False),
    "235B-A22B": (4096, 94, 64, 4, 1536, 128, 8, False),
}

# Model cards / technical report, in billions, with the unit of the last digit they are stated to:
# (total, non-embedding, activated or None, unit of each).
PUBLISHED = {
    "0.6B": ((0.6, 0.1), (0.44, 0.01), None),
    "1.7B": ((1.7, 0.1), (1.4, 0.1), None),
    "4B": ((4.0, 0.1), (3.6, 0.1), None),
    "8B": ((8.2, 0.1), (6.95, 0.01), None),
    "14B": ((14.8, 0.1), (13.2, 0.1), None),
    "32B": ((32.8, 0.1), (31.2, 0.1), None),
    "30B-A3B": ((30.5, 0.1), (29.9, 0.1), (3.3, 0.1)),
    "235B-A22B": ((235, 1), (234, 1), (22, 1)),
}


def test_every_published_flavor_is_checked():
    assert set(PUBLISHED) == set(HF_CONFIGS) == set(qwen3_configs) - {"debugmodel", "debugmodel_moe", "tiny", "tiny_moe"}


@pytest.mark.parametrize("flavor", list(HF_CONFIGS))
def test_flavors_match_the_published_configs(flavor):
    dim, layers, heads, kv, ffn, experts, top_k, tied = HF_CONFIGS[flavor]
    a = qwen3_configs[flavor]
    assert (a.dim, a.n_layers, a.n_heads, a.n_kv_heads, a.num_experts, a.top_k, a.tie_word_embeddings) == (
        dim, layers, heads, kv, experts, top_k, tied)
    assert (a.moe_hidden_dim if experts else a.hidden_dim) == ffn
    assert (a.head_dim, a.vocab_size, a.rope_theta, a.norm_eps) == (128, 151936, 1e6, 1e-6)
    assert a.norm_topk_prob is True and a.vocab_padding == 0


def within_stated_precision(billions, published, unit):
    """`published` is the count rounded to `unit` (|x - published| <= unit / 2), or cut to it: the
    30B-A3B card's "3.3B activated" is 3.353B cut to one decimal (3.340B without the routers'
    12.6M, which every token uses)."""
    return published - unit / 2 - 1e-9 <= billions < published + unit


@pytest.mark.parametrize("flavor", list(PUBLISHED))
def test_published_parameter_counts(flavor):
    args = qwen3_configs[flavor]
    model = build_on_meta(args)
    (total, total_unit), (non_emb, non_emb_unit), activated = PUBLISHED[flavor]
    count = n_params(model)
    # Totals and non-embedding counts are rounded, to half a unit.
    assert abs(count / 1e9 - total) <= total_unit / 2, count
    assert abs(n_non_embedding(model) / 1e9 - non_emb) <= non_emb_unit / 2, n_non_embedding(model)
    # The shapes' formula agrees with the built model.
    formula_total, formula_active = param_counts(args)
    assert formula_total == count
    if activated is None:
        assert formula_active == count
        return
    # Activated: every expert-independent parameter, and top_k of each layer's experts.
    experts = sum(p.numel() for name, p in model.named_parameters() if ".moe.experts." in name)
    assert experts == args.n_layers * args.num_experts * 3 * args.dim * args.moe_hidden_dim
    active = count - experts + experts * args.top_k // args.num_experts
    assert formula_active == active
    assert within_stated_precision(active / 1e9, *activated), active


def test_within_stated_precision_rejects_a_wrong_count():
    assert within_stated_precision(3.353, 3.3, 0.1) and within_stated_precision(3.26, 3.3, 0.1)
    assert not within_stated_precision(3.24, 3.3, 0.1) and not within_stated_precision(3.41, 3.3, 0.1)


def test_tied_flavors_share_one_tensor():
    for flavor, (*_, tied) in HF_CONFIGS.items():
        model = build_on_meta(qwen3_configs[flavor])
        assert (model.output.weight is model.tok_embeddings.weight) == tied, flavor
    tied, untied = build_on_meta(Qwen3ModelArgs(**TINY, tie_word_embeddings=True)), build_on_meta(Qwen3ModelArgs(**TINY))
    assert n_params(tied) == n_params(untied) - 100 * 48 == param_counts(tied.args)[0]


def test_tied_weights_survive_meta_to_empty_init():
    model = build_tiny(tie_word_embeddings=True)
    assert model.output.weight is model.tok_embeddings.weight
    assert torch.isfinite(model(torch.randint(0, 100, (1, 8)))).all()


# ---------------------------------------------------------------------------------------------
# Structure


def test_q_and_k_norms_over_head_dim():
    model = build_on_meta(Qwen3ModelArgs(**TINY))
    for layer in model.layers.values():
        attn = layer.attention
        for norm in (attn.q_norm, attn.k_norm):
            assert isinstance(norm, torch.nn.RMSNorm)
            assert tuple(norm.normalized_shape) == (16,) and norm.weight.shape == (16,)
            assert norm.eps == 1e-6
    names = {name for name, _ in model.named_parameters()}
    assert {"layers.0.attention.q_norm.weight", "layers.1.attention.k_norm.weight"} <= names


def test_explicit_head_dim_and_grouped_query_attention():
    model = build_tiny()
    attn = model.layers["0"].attention
    assert (attn.wq.in_features, attn.wq.out_features) == (48, 4 * 16)  # != dim
    assert attn.wk.out_features == attn.wv.out_features == 2 * 16  # 2 kv heads for 4 q heads
    assert (attn.wo.in_features, attn.wo.out_features) == (64, 48)
    assert model.rope_cache.shape == (32, 8, 2)  # head_dim / 2 rotation pairs
    logits = model(torch.randint(0, 100, (2, 12)))
    assert logits.shape == (2, 12, 100) and torch.isfinite(logits).all()


def test_heads_must_group_evenly():
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        build_on_meta(Qwen3ModelArgs(**{**TINY, "n_kv_heads": 3}))


def test_dense_and_moe_blocks():
    dense, moe = build_on_meta(Qwen3ModelArgs(**TINY)), build_on_meta(Qwen3ModelArgs(**TINY_MOE))
    for layer in dense.layers.values():
        assert layer.feed_forward is not None and layer.moe is None
    for layer in moe.layers.values():
        assert layer.feed_forward is None and layer.moe is not None
        assert (layer.moe.num_experts, layer.moe.top_k) == (4, 2)
        assert layer.moe.experts.w1.shape == (4, 32, 48) and layer.moe.experts.w2.shape == (4, 48, 32)
    dense_names = {n for n, _ in dense.named_parameters()}
    moe_names = {n for n, _ in moe.named_parameters()}
    assert "layers.0.feed_forward.w1.weight" in dense_names and not any(".moe." in n for n in dense_names)
    assert "layers.0.moe.experts.w1" in moe_names and "layers.0.moe.router.gate.weight" in moe_names
    assert not any(".feed_forward." in n for n in moe_names)


@pytest.mark.parametrize("config", [TINY, TINY_MOE], ids=["dense", "moe"])
def test_meta_init_and_forward(config):
    model = build_on_meta(Qwen3ModelArgs(**config))
    assert model.rope_cache.device.type == "meta"
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert all(b.device.type == "cpu" for b in model.buffers())
    assert model.rope_cache.device.type == "cpu"
    torch.testing.assert_close(model.rope_cache, rope_table(16, 1e6, 32), rtol=0, atol=0)
    for layer in model.layers.values():
        if layer.moe is not None:  # to_empty left garbage in the buffers; init_weights zeroes them
            assert not layer.moe.expert_bias.any() and not layer.moe.tokens_per_expert.any()
    logits = model(torch.randint(0, 100, (2, 16)))
    assert logits.shape == (2, 16, 100) and torch.isfinite(logits).all()
    # Near the uniform loss at init (no huge logits), for the tied and the untied output alike.
    loss = F.cross_entropy(logits.flatten(0, 1), torch.randint(0, 100, (32,)))
    assert abs(loss.item() - math.log(100)) < 1.0


def test_init_is_seeded():
    a, b, c = build_tiny(seed=1).state_dict(), build_tiny(seed=1).state_dict(), build_tiny(seed=2).state_dict()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert not torch.equal(a["layers.0.attention.wq.weight"], c["layers.0.attention.wq.weight"])


@pytest.mark.parametrize("config", [TINY, TINY_MOE], ids=["dense", "moe"])
def test_pipeline_stage_without_embedding_and_output(config):
    """A stage copy without tok_embeddings/output takes hidden states and returns them; a middle
    stage (no norm either) chains with it to the full model's result."""
    model = build_tiny(**{k: v for k, v in config.items() if k not in TINY})
    tokens = torch.randint(0, 100, (2, 10))
    seen = {}
    model.norm.register_forward_hook(lambda mod, inp, out: seen.update(final=out))
    with torch.no_grad():
        embedded = model.tok_embeddings(tokens)
        model(tokens)
        last = copy.deepcopy(model)
        last.tok_embeddings, last.output = None, None
        hidden_out = last(embedded)
        first, second = copy.deepcopy(last), copy.deepcopy(last)
        del first.layers["1"], second.layers["0"]
        first.norm = None
        middle = first(embedded)
        chained = second(middle)
    assert hidden_out.shape == (2, 10, 48)
    torch.testing.assert_close(hidden_out, seen["final"], rtol=0, atol=0)
    torch.testing.assert_close(chained, seen["final"], rtol=0, atol=0)
    assert not torch.allclose(middle, hidden_out)


def test_flops_per_token_count_activated_parameters():
    seq_len = 32
    for config in (TINY, TINY_MOE):
        model = build_on_meta(Qwen3ModelArgs(**config))
        experts = sum(p.numel() for name, p in model.named_parameters() if ".moe.experts." in name)
        active_non_embedding = n_non_embedding(model) - experts // 2 + 100 * 48  # top 2 of 4; output projection
        expected = 6 * active_non_embedding + 12 * 2 * 4 * 16 * seq_len
        assert model.flops_per_token(seq_len) == expected, config


# ---------------------------------------------------------------------------------------------
# One block against an independent reference


def rms_norm(x, weight, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope_reference(x, theta):
    """x (batch, seq, heads, head_dim): adjacent pairs (2i, 2i+1) turned by p * theta^(-2i/d)."""
    seq, head_dim = x.shape[1], x.shape[-1]
    freqs = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(seq, dtype=torch.float64)[:, None] * freqs
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    a, b = x.double()[..., 0::2], x.double()[..., 1::2]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2).float()


def reference_block(block, x, n_heads, n_kv_heads, head_dim, theta):
    attn, ff = block.attention, block.feed_forward
    bsz, seq, _ = x.shape
    h = rms_norm(x, block.attention_norm.weight)
    q = (h @ attn.wq.weight.T).view(bsz, seq, n_heads, head_dim)
    k = (h @ attn.wk.weight.T).view(bsz, seq, n_kv_heads, head_dim)
    v = (h @ attn.wv.weight.T).view(bsz, seq, n_kv_heads, head_dim)
    q, k = rms_norm(q, attn.q_norm.weight), rms_norm(k, attn.k_norm.weight)  # per head, before RoPE
    q, k = rope_reference(q, theta), rope_reference(k, theta)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    k = k.repeat_interleave(n_heads // n_kv_heads, dim=1)  # q head i reads kv head i // group
    v = v.repeat_interleave(n_heads // n_kv_heads, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(head_dim)
    scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
    out = (scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(bsz, seq, n_heads * head_dim)
    x = x + out @ attn.wo.weight.T
    h = rms_norm(x, block.ffn_norm.weight)
    return x + (F.silu(h @ ff.w1.weight.T) * (h @ ff.w3.weight.T)) @ ff.w2.weight.T


def test_block_matches_the_reference_math():
    model = build_tiny()
    block = model.layers["1"]
    torch.manual_seed(3)
    with torch.no_grad():  # norm weights away from one, so each norm's weight matters
        for norm in (block.attention_norm, block.ffn_norm, block.attention.q_norm, block.attention.k_norm):
            norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 16, 48)
    with torch.no_grad():
        expected = reference_block(block, x, n_heads=4, n_kv_heads=2, head_dim=16, theta=1e6)
        got = block(x, model.rope_cache)
        # The reference can fail: without q/k norms, or with RoPE's base at Llama's 1e4, it differs.
        attn = block.attention
        saved = attn.q_norm.weight.clone()
        attn.q_norm.weight.fill_(1.0)
        no_q_norm_weight = block(x, model.rope_cache)
        attn.q_norm.weight.copy_(saved)
        wrong_theta = reference_block(block, x, n_heads=4, n_kv_heads=2, head_dim=16, theta=1e4)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert (no_q_norm_weight - expected).abs().max() > 1e-3
    assert (wrong_theta - expected).abs().max() > 1e-3
